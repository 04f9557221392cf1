"""Internal: filing what a caller loaded itself after a miss: the result captured by a forked child (or, where
forking is not safe, in the calling thread) and sent to the server in load order (:class:`_Filer`); the collector
kept off the frozen heap meanwhile (:class:`_GcFreeze`); and a result that cannot be captured, said once in the
caller and told to the server (:func:`_warn_uncapturable`, :func:`_report_uncapturable`). The warnings the cache
gives a caller are issued here (:class:`CacheWarning`, once per cause).
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import dataclasses
import gc
import io
import logging
import os
import select
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from .._core import locate
from . import entries
from .jobs import JobResult
from .keys import Request
from .messages import Get, Put, Uncapturable
from .protocol import CacheError, runtime_dir
from .transport import FILL_WAIT, HIT_TIMEOUT, Client, _send_until_up, _spawn_server

log = logging.getLogger("zerocopy_pickle.cache.client")  # the records keep the logger they always had


class CacheWarning(UserWarning):
    """The cache could not serve a call, which was loaded directly instead (warned once per cause)."""


_WARNED: set[str] = set()


def _warn_once(cause: str, message: str, then: str = "; loading directly") -> None:
    if cause not in _WARNED:
        _WARNED.add(cause)
        warnings.warn(f"zerocopy_pickle cache: {message}{then}", CacheWarning, stacklevel=4)


def _send_put(put: Put, payload: bytes, fds: Sequence[int]) -> None:
    """Send a put, waiting up to :data:`FILL_WAIT` seconds for a server that is still starting."""
    _send_until_up(put, payload, fds)


def _wait_eof(fd: int, timeout: float) -> bool:
    """Wait until every writer of the pipe ``fd`` reads from has closed it; False if ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([fd], [], [], left)
        if ready and not os.read(fd, 4096):
            return True


class _Filer:
    """Files the results this process loaded itself (after a miss) with the server, off the caller's path.

    Each result is captured and sent by a *forked child*: ``fork`` gives it a copy-on-write snapshot of the
    process as the call returned (about 20 ms for a process holding an SD1.5 pipeline), so the caller goes on at
    once, and whatever it changes afterwards (``fuse_lora``, ``.half()``, in-place edits) stays out of the entry.
    The child captures the result (``entries.capture``: pickling, finding the untouched checkpoint views, copying
    the rest into a sealed memfd), sends it, and exits. Where a fork would not be safe (CUDA is initialized in
    this process: the child could not touch it), the result is captured in the calling thread and a background
    thread sends it.

    Results reach the server in the order they were loaded (``pipeline(vae=vae)`` after ``vae``): each filing
    holds the write end of a pipe until it is done, and the next one waits for the previous pipe to close. At
    exit the process waits (up to :data:`FILL_WAIT` seconds) for its last filing, so a short script's loads
    still reach the cache; :func:`zerocopy_pickle.cache.status` waits for them too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: int | None = None  # the read end of the last filing's pipe
        self._writers: set[int] = set()  # write ends this process holds (threaded filings in progress)
        # Read ends of forked filings' report pipes: a child that finds the result cannot be captured writes why.
        self._reports: dict[int, tuple[Get, bytearray]] = {}

    def file(
        self, request: Request, value: Any, refs: list[Any], *, files: bool, fork: bool, start: bool = False
    ) -> None:
        """Start filing ``value`` as the entry of ``request`` (``files``: the server takes references to
        checkpoint files; ``fork``: captured by a forked child, else in this thread; ``start``: the forked child
        starts a server first). Raises what capturing raises, where it happens in this thread."""
        put = Put(request.get, JobResult([], []), len(request.payload))
        with self._lock:
            previous, self._last = self._last, None
            read, write = os.pipe()
            try:
                if fork:
                    try:
                        self._fork(put, request.payload, value, refs, files, previous, write, start)
                    finally:
                        os.close(write)  # the child's copy is the one that counts
                else:
                    try:
                        result, stream, fds = entries.capture(value, refs, file_segments=files)
                    except Exception:
                        os.close(write)
                        raise
                    self._writers.add(write)
                    # Not threading.Thread, whose start() waits until the thread has run (milliseconds when busy).
                    send = (dataclasses.replace(put, result=result), request.payload + stream, fds, previous, write)
                    try:
                        _thread.start_new_thread(self._send_after, send)
                    except BaseException:
                        self._writers.discard(write)
                        os.close(write)
                        for fd in fds:
                            os.close(fd)
                        raise
                    previous = None  # the thread closes it
            finally:
                if previous is not None:
                    os.close(previous)
                self._last = read

    def _fork(
        self,
        put: Put,
        args: bytes,
        value: Any,
        refs: list[Any],
        files: bool,
        previous: int | None,
        write: int,
        start: bool = False,
    ) -> None:
        report_read, report = os.pipe()
        _gc_freeze.before_fork()
        try:
            with warnings.catch_warnings():  # Python 3.12+ warns about fork in a threaded process: the child only
                warnings.simplefilter("ignore", DeprecationWarning)  # pickles, maps files and talks to a socket
                pid = os.fork()
        except BaseException:
            _gc_freeze.child_gone()
            os.close(report_read)
            os.close(report)
            raise
        if pid == 0:  # the child: never returns into the caller's code
            os.close(report_read)
            code = 1
            try:
                gc.disable()  # short-lived, and a collection would write to (copy) every page of the heap
                if start:  # before nice(): the server must not inherit this child's lower priority
                    with contextlib.suppress(Exception):
                        _spawn_server(reap=False)
                with contextlib.suppress(OSError):
                    os.nice(10)  # background work: the caller, loading on, comes first
                for fd in (*self._writers, *self._reports):
                    os.close(fd)  # other filings' write ends (theirs must be able to close), others' reports
                _detach_stdio()
                if previous is not None:
                    _wait_eof(previous, FILL_WAIT)
                try:
                    result, stream, fds = entries.capture(value, refs, file_segments=files)
                except Exception as e:
                    if not _is_uncapturable(e):
                        raise
                    reason = _uncapturable_reason(value, refs, e)
                    # To the caller (it warns), then to the server (it remembers: nobody tries again).
                    with contextlib.suppress(OSError):
                        os.write(report, reason.encode("utf-8", "replace")[: select.PIPE_BUF])
                    os.close(report)
                    log.warning("%s cannot be captured (%s)", put.request.describe or "a call", reason)
                    _send_until_up(Uncapturable(put.request, reason))
                    code = 0
                    return
                try:
                    _send_put(dataclasses.replace(put, result=result), args + stream, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
                code = 0
            except BaseException:
                with contextlib.suppress(BaseException):
                    log.exception("filing %s failed", put.request.describe or "a call")
            finally:
                os._exit(code)
        os.close(report)
        os.set_blocking(report_read, False)
        self._reports[report_read] = (put.request, bytearray())
        try:
            # Not threading.Thread: its start() waits until the new thread has run, which on a busy machine (the
            # child just forked competes for the cores too) kept the caller 2-7 ms.
            _thread.start_new_thread(_reap, (pid,))
        except BaseException:
            _gc_freeze.child_gone()  # no reaper to thaw the heap later: thaw it now
            raise

    def _send_after(self, put: Put, payload: bytes, fds: list[int], previous: int | None, write: int) -> None:
        try:
            if previous is not None:
                _wait_eof(previous, FILL_WAIT)
            _send_put(put, payload, fds)
        except CacheError as e:
            log.warning("%s was not cached (%s)", put.request.describe or "a call", e)
        except Exception:
            log.exception("filing %s failed", put.request.describe or "a call")
        finally:
            for fd in (*fds, *((previous,) if previous is not None else ())):
                with contextlib.suppress(OSError):
                    os.close(fd)
            with self._lock:
                self._writers.discard(write)
                os.close(write)

    def drain(self, timeout: float = FILL_WAIT) -> bool:
        """Wait until every filing started so far is done (or given up on); False if ``timeout`` passed first."""
        with self._lock:
            last = None if self._last is None else os.dup(self._last)
        if last is None:
            return True
        try:
            return _wait_eof(last, timeout)
        finally:
            os.close(last)
            self.report()

    def report(self) -> None:
        """Warn (once per call) of each result a filing child found it could not capture, as far as the children
        have told; the reports of children still at work are read later (the next cached call, a drain, exit)."""
        with self._lock:
            done: list[tuple[Get, bytes]] = []
            for fd, (get, data) in list(self._reports.items()):
                while True:
                    try:
                        chunk = os.read(fd, 4096)
                    except BlockingIOError:
                        break
                    except OSError:
                        chunk = b""
                    if not chunk:
                        del self._reports[fd]
                        os.close(fd)
                        done.append((get, bytes(data)))
                        break
                    data.extend(chunk)
        for get, text in done:
            if text:
                _warn_uncapturable(get, text.decode("utf-8", "replace"))


def _fork_is_safe() -> bool:
    if not hasattr(os, "fork"):
        return False
    torch = sys.modules.get("torch")
    return not (torch is not None and torch.cuda.is_initialized())


def _detach_stdio() -> None:
    """A filing child must not hold the caller's pipes open (a parent reading them to EOF would wait for it):
    stdin and stdout become ``/dev/null``, stderr the runtime directory's ``fill.log``."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    try:
        err = os.open(runtime_dir() / "fill.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except (OSError, CacheError):
        err = null
    os.dup2(err, 2)
    # The child's records are fill.log's content: the library's NullHandler would drop them (and the caller's
    # own handlers, inherited through the fork, write to the caller's streams), so the child logs to its own
    # stderr alone.
    root = logging.getLogger("zerocopy_pickle")
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.propagate = False


def _reap(pid: int) -> None:
    """Wait for a filing child (a thread of its own, like a daemon thread: never joined at exit), then let the
    heap thaw if it was the last."""
    try:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    finally:
        _gc_freeze.child_gone()


class _GcFreeze:
    """Keeps the objects that existed when a filing child was forked out of this process's garbage collections
    until every filing child has exited (``gc.freeze``).

    A fork write-protects every page of the parent; the parent's next write to each page faults (and copies it
    while the child lives). A full collection writes to the header of every tracked object, so one after a fork
    faults on every page of the heap: on the development VM, four filings of the seed scenario cost the caller
    48,000 extra page faults (0.13 s, a fifth of its plain load), two thirds of them from collections. Frozen
    objects are skipped by collections; new ones are collected as usual, and the frozen ones rejoin the oldest
    generation when the last child is gone (cyclic garbage among them is collected late, never lost).

    ``gc.unfreeze`` cannot tell a program's frozen objects from ours, so a program's own freeze is never undone: where
    objects were frozen before the first filing, nothing is frozen for it; where the program freezes while filing
    children live (it called ``gc.freeze``, which this class watches meanwhile), nothing is thawed.

    Nothing here counts the frozen objects: ``gc.get_freeze_count`` walks all of them (45-90 ms for the 380,000
    objects of a process that imported transformers, on the caller's path at every miss), while ``gc.freeze``
    and ``gc.unfreeze`` splice lists. The check before the first freeze counts an empty permanent generation
    (free) unless the program froze objects itself.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._children = 0
        self._frozen = False  # whether this process froze, and so is to unfreeze
        self._program_froze = False  # the program called gc.freeze while ours held
        self._freeze: Callable[[], None] | None = None  # gc.freeze, while it is watched
        self._watch = self._watched_freeze  # one bound method, to tell whether gc.freeze is still it

    def _watched_freeze(self) -> None:
        self._program_froze = True
        if self._freeze is not None:
            self._freeze()

    def before_fork(self) -> None:
        with self._lock:
            if self._children == 0:
                self._frozen = gc.get_freeze_count() == 0  # O(1) when nothing is frozen
                self._program_froze = False
                if self._frozen and gc.freeze is not self._watch:
                    self._freeze, gc.freeze = gc.freeze, self._watch
            if self._frozen and not self._program_froze:
                (self._freeze or gc.freeze)()
            self._children += 1

    def child_gone(self) -> None:
        with self._lock:
            self._children -= 1
            if self._children == 0 and self._frozen:
                self._frozen = False
                if self._freeze is not None and gc.freeze is self._watch:
                    gc.freeze = self._freeze
                self._freeze = None
                if not self._program_froze:  # nobody else froze meanwhile
                    gc.unfreeze()


_gc_freeze = _GcFreeze()


_filer = _Filer()


atexit.register(_filer.drain)


def _is_uncapturable(error: BaseException) -> bool:
    """Whether a capture failed because of what the result is (it cannot be pickled), so that trying again would
    fail again, rather than for want of a resource (memory, a file descriptor, a memfd)."""
    return isinstance(error, Exception) and not isinstance(error, (OSError, MemoryError, CacheError))


def _uncapturable_reason(value: Any, refs: Sequence[object], error: BaseException) -> str:
    """Why ``value`` cannot be captured: the error, and where in its graph the object that cannot be pickled
    sits (``result.transformer.h[1].attn.lock``), where that can be found."""
    reason = f"{type(error).__name__}: {error}"

    def try_dump(candidate: object) -> BaseException | None:
        try:
            entries.pickle_with_refs(candidate, refs, in_band=False)
        except Exception as e:
            return e
        return None

    try:
        # walked with the entry pickler's own reduction (the one that failed), not __reduce_ex__
        reduce = entries.ref_pickler(io.BytesIO(), refs, None).reduction
        failure = locate.locate_failure(value, try_dump, root_name="result", reduce=reduce)
    except Exception:  # the search itself failed: the error stands without a path
        failure = None
    if failure is not None and failure.path != "result":
        what = getattr(failure.obj, "__qualname__", None) or type(failure.obj).__qualname__
        reason += f" (the {what} at {failure.path})"
    return reason


_UNCAPTURABLE: set[str] = set()
"""Keys whose results this process found (or the server said) cannot be captured: loaded directly from then on
(a changed file is another key)."""


def _warn_uncapturable(get: Get, reason: str) -> None:
    _UNCAPTURABLE.add(get.key)
    _warn_once(
        f"uncapturable:{get.key}",
        f"{get.describe or 'a call'} is not cached: its result cannot be captured ({reason}); it is loaded here, "
        "without the cache, until the files it was loaded from change",
        "",
    )


def _report_uncapturable(get: Get, reason: str) -> None:
    """Tell the server that ``get``'s result cannot be captured (it remembers it while the call's files stay the
    same, and answers the next process's miss with it: no process captures it again). Never raises."""
    try:
        with Client(timeout=HIT_TIMEOUT) as client:
            client.request(Uncapturable(get, reason))
    except CacheError as e:
        log.warning("could not tell the cache server that %s cannot be captured (%s)", get.describe or "a call", e)
