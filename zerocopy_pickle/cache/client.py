"""Internal: the client side of the cache: the connection to the server, loading entries, filling misses, and
falling back to a direct load. A call's key and request are :mod:`keys`'.

A hit is loaded from the server's segments, faster than the plain call; a miss costs the caller the key, one
round trip and a fork on top of the plain call (docs/cache.md, "What a miss costs"); the cache never makes a load
fail. On a miss, and when no server runs yet (``patch_all()`` then starts one in the background without
waiting for it), the caller loads the call itself, exactly as the plain call would, and gets the result at once;
what it loaded is captured into an entry right away (pickled, its untouched checkpoint views referenced, any other
storage copied into a sealed memfd: ``entries.capture``) and sent to the server (a ``put``) by a forked child, or,
where CUDA is initialized, captured in the calling thread and sent by a background thread (:class:`_Filer`), so
the next process gets a hit. If the server is dead, slow or broken, or a call cannot be keyed,
:func:`cached_call` calls the original loader directly and warns once per cause.

``ZEROCOPY_PICKLE_CACHE_FILL=background`` has the server's loader load a miss for the next process, at the lowest
CPU priority, while the caller loads it plain and files nothing (no fork: :func:`fill_mode`,
:func:`_fill_in_new_server`); ``=server`` makes misses load in the server's loader instead (the caller waits for it;
the result then never holds the caller's own storages).
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import dataclasses
import gc
import logging
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .. import arena, locate, readahead
from . import checkpoints, entries
from .isolation import SPAWNER_ENV, WORKDIR_ENV, child_environment
from .keys import Request, Uncacheable, cached_key, describe, register_result
from .messages import (
    EntryReply,
    Failure,
    FileCheck,
    Get,
    JobResult,
    Miss,
    Ping,
    Put,
    Uncapturable,
)
from .protocol import CacheError, ProtocolError, receive, runtime_dir, send, socket_path

__all__ = ["CacheWarning", "Client", "cached_call", "cached_key", "register_result"]

TIMEOUT_ENV = "ZEROCOPY_PICKLE_CACHE_TIMEOUT"
PREFAULT_ENV = "ZEROCOPY_PICKLE_CACHE_PREFAULT"
INLINE_PREFAULT_BYTES = 16 << 20  # a hit this small populates its pages in the caller (see _Prefaulter)
FILL_ENV = "ZEROCOPY_PICKLE_CACHE_FILL"
MISS_PREFETCH_ENV = "ZEROCOPY_PICKLE_CACHE_MISS_PREFETCH"
"""=1: a miss prefetches the checkpoint files its call will likely read. Off by default: on the development VM a
cold miss of the seed scenario took 1.39x the plain cold call with it (files one after another; 1.60x all at
once), and about 1.1x without it (docs/benchmark.md, "Cold starts")."""
FILL_WAIT = 60.0
"""Seconds the background thread waits for a server that is starting before it gives up on filing a result."""
HIT_TIMEOUT = 30.0
"""Seconds a client that fills its own misses waits for the server's answer (it never waits for a load)."""

log = logging.getLogger(__name__)


class CacheWarning(UserWarning):
    """The cache could not serve a call, which was loaded directly instead (warned once per cause)."""


class Client:
    """A connection to the cache server."""

    def __init__(self, path: Path | None = None, timeout: float = 5.0) -> None:
        self.path = path or socket_path(create=False)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(self.path))
        except OSError as e:
            self.sock.close()
            raise CacheError(f"no cache server at {self.path} ({e.strerror or e})") from e

    def request(
        self, message: Any, payload: bytes = b"", timeout: float | None = None, fds: Sequence[int] = ()
    ) -> tuple[dict[str, Any], bytes, list[int]]:
        """Send a request (a message of :mod:`messages`, or its encoded header) and return the successful reply's
        header (decode it with its message class), payload and fds (the caller closes them).

        Raises:
            CacheError: the server is gone, out of step, or refused the request (a :class:`messages.Failure`).
        """
        header = message.encode() if hasattr(message, "encode") else message
        if timeout is not None:
            self.sock.settimeout(timeout)
        try:
            send(self.sock, header, payload, fds)
            reply, data, received = receive(self.sock)
        except (OSError, ProtocolError) as e:
            raise CacheError(f"the cache server did not answer ({type(e).__name__}: {e})") from e
        if not reply.get("ok"):
            for fd in received:
                os.close(fd)
            raise CacheError(Failure.decode(reply).error)
        return reply, data, received

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Prefaulter:
    """Maps the pages of each entry a hit received into this process's page tables, on a background thread.

    A zero-copy load defers page faults to first use: a forward pass over an SD1.5 pipeline takes about
    900,000 of them. Populating the page tables (``MADV_POPULATE_READ``, no copy: writes still copy on write)
    while the caller unpickles and goes on overlaps that work with the caller's, on another core. One worker
    thread, segments in the order the hits came; ``ZEROCOPY_PICKLE_CACHE_PREFAULT=0`` turns it off.

    A hit of at most :data:`INLINE_PREFAULT_BYTES` is populated in the caller's thread instead (50-100 us per MiB
    on the development VM): on a busy machine the worker thread waited for a core while the caller faulted the
    same pages itself (the small models' touch beside a busy neighbour: 2.83x Overmind's before, 1.20x after).
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._started = False
        self._supported = True

    def submit(self, mappings: Iterable[Any]) -> None:
        if not self._supported or os.environ.get(PREFAULT_ENV, "1") == "0":
            return
        mappings = list(mappings)
        if sum(len(memory) for memory in mappings) <= INLINE_PREFAULT_BYTES:
            for memory in mappings:
                if not arena.prefault(memory):
                    self._supported = False
                    return
            return
        for memory in mappings:
            self._queue.put(memory)
        with self._lock:
            if not self._started:  # a thread of its own, never joined; started without waiting for it to run
                self._started = True  # (threading.Thread.start waits: milliseconds of a hit on a busy machine)
                _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        while True:
            memory = self._queue.get()
            if self._supported and not arena.prefault(memory):
                self._supported = False  # an older kernel: faults stay where they fall
            del memory


_prefaulter = _Prefaulter()

_WARNED: set[str] = set()
_state = threading.local()


def _warn_once(cause: str, message: str, then: str = "; loading directly") -> None:
    if cause not in _WARNED:
        _WARNED.add(cause)
        warnings.warn(f"zerocopy_pickle cache: {message}{then}", CacheWarning, stacklevel=4)


def _send_put(put: Put, payload: bytes, fds: Sequence[int]) -> None:
    """Send a put, waiting up to :data:`FILL_WAIT` seconds for a server that is still starting."""
    _send_until_up(put, payload, fds)


def _send_until_up(message: Put | Uncapturable, payload: bytes = b"", fds: Sequence[int] = ()) -> None:
    """Send ``message``, waiting up to :data:`FILL_WAIT` seconds for a server that is still starting."""
    deadline = time.monotonic() + FILL_WAIT
    while True:
        try:
            client = Client(timeout=HIT_TIMEOUT)
            break
        except CacheError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    with client:
        client.request(message, payload, fds=fds)


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


def _timeout() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, "3600"))
    except ValueError:
        return 3600.0


_spawned: list[float] = []  # when this process last started a server without waiting for it
_UNREAPED: list[subprocess.Popen[bytes]] = []
_NO_SERVER = Miss(True)
"""What :func:`_fetch` answers when no server runs and the caller is to start one once its call has returned."""


def _reap_server(process: subprocess.Popen[bytes]) -> None:
    """Wait for a server this process started (a daemon thread: it holds the ``Popen`` while the server runs, so
    that it is never collected running, which warns ``ResourceWarning: subprocess N is still running``; a server
    that outlives this process is then adopted by init)."""
    with contextlib.suppress(Exception):
        process.wait()


def start_server_in_background(wait: float = 10.0) -> None:
    """Start ``zerocopy-pickle serve`` as a detached process and wait until it answers (``wait=0``: do not wait;
    a second call within ``FILL_WAIT`` seconds then starts nothing, as the first server is still coming up)."""
    if not _claim_spawn(wait):
        return
    log = _spawn_server(reap=True)
    if wait <= 0:
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with Client(timeout=1.0) as client:
                client.request(Ping())
            return
        except CacheError:
            time.sleep(0.05)
    raise CacheError(f"the cache server did not start within {wait:.0f} s (see {log})")


def _claim_spawn(wait: float = 0.0) -> bool:
    """Whether this process is to start a server now (not when it started one without waiting for it less than
    ``FILL_WAIT`` seconds ago: that one is still coming up); records the start."""
    if wait <= 0 and _spawned and time.monotonic() - _spawned[-1] < FILL_WAIT:
        return False
    _spawned[:] = [time.monotonic()]
    return True


def _spawn_server(*, reap: bool, spawner: socket.socket | None = None) -> Path:
    """Start ``zerocopy-pickle serve`` in its own session; return its log's path. ``reap``: a daemon thread of
    this process waits for it (a filing child, which ends with ``os._exit``, leaves it to init instead).
    ``spawner``: a socket the server serves as its first connection (see :func:`_fill_in_new_server`)."""
    directory = runtime_dir()
    log = directory / "server.log"
    env = dict(os.environ)
    with contextlib.suppress(OSError):  # relative paths of requests resolve here, as if it ran here
        env[WORKDIR_ENV] = os.getcwd()
    if spawner is not None:
        env[SPAWNER_ENV] = str(spawner.fileno())
    with open(log, "ab") as out:
        # Started in the private runtime directory, not here: Python puts its start directory first on sys.path,
        # and this one may hold anybody's modules (see isolation.py).
        process = subprocess.Popen(
            [sys.executable, "-m", "zerocopy_pickle.cache", "serve"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            cwd=directory,
            env=child_environment(env, cleaned=False),
            pass_fds=() if spawner is None else (spawner.fileno(),),
        )
    if reap:  # not threading.Thread, whose start() waits until the thread has run (milliseconds when busy)
        try:
            _thread.start_new_thread(_reap_server, (process,))
        except RuntimeError:  # at interpreter shutdown (an exit's hand-over): left to init, as below
            _UNREAPED.append(process)
    else:  # a filing child: held until its os._exit (a collected running Popen warns), then init's to reap
        _UNREAPED.append(process)
    return log


def fill_mode() -> str:
    """How misses are filled (:data:`FILL_ENV`): ``caller`` (the default: the caller's result is filed by a
    forked child), ``background`` (the server's loader loads the call itself for the next process, at the lowest
    CPU priority, and the caller files nothing) or ``server`` (the server's loader loads it and the caller
    waits). Anything else means the default."""
    mode = os.environ.get(FILL_ENV, "").strip().lower()
    return mode if mode in ("background", "server") else "caller"


SPAWN_DELAY = 1.0
"""Seconds after its first miss with no server running that a process filling in the background starts one
(or at its exit, if sooner). A server's start costs 0.1-0.2 s of CPU, which beside a busy neighbour comes out of
the caller's loads: a program that loads for longer than 2 s pays at most a tenth, one that is done sooner
nothing."""

_spawner: list[socket.socket] = []
"""This process's end of the socket to the server it started for background fills, until a server answers."""
_handover: list[tuple[dict[str, Any], bytes]] = []
"""The misses to be handed to the server this process is about to start (:func:`_fill_in_new_server`)."""
_handover_lock = threading.Lock()


def _fill_in_new_server(request: Request) -> None:
    """No server answered a miss to be filled in the background: hand it to the server this process starts
    :data:`SPAWN_DELAY` seconds after its first such miss, or at its exit (:func:`_hand_over`), over a socket the
    server serves as its first connection, so that the caller waits for nothing and the server's start does not
    compete with the loads that follow. Never raises: without a server, only the cache goes without."""
    get = dataclasses.replace(request.get, fill=True, background=True)
    with _handover_lock:
        _handover.append((get.encode(), request.payload))
        first = len(_handover) == 1 and not _spawner
    if first:
        with contextlib.suppress(RuntimeError):  # no thread at interpreter shutdown: the exit hands them over
            _thread.start_new_thread(_hand_over_later, ())
    elif _spawner:
        _hand_over()


def _hand_over_later() -> None:
    time.sleep(SPAWN_DELAY)
    _hand_over()


def _hand_over() -> None:
    """Start the server (once) and send it the misses waiting to be handed over."""
    with _handover_lock:
        if not _handover:
            return
        try:
            if not _spawner:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    _spawn_server(reap=True, spawner=theirs)
                except BaseException:
                    ours.close()
                    raise
                finally:
                    theirs.close()
                ours.settimeout(1.0)
                _spawner.append(ours)
            while _handover:  # the server answers each with a Miss, never read: the socket is closed unread
                header, payload = _handover.pop(0)
                send(_spawner[0], header, payload)
        except Exception as e:
            _handover.clear()
            _close_spawner()
            log.info("could not hand misses to a new cache server (%s)", e)


def _close_spawner() -> None:
    while _spawner:
        with contextlib.suppress(OSError):
            _spawner.pop().close()


atexit.register(_close_spawner)  # closed, not collected open (which warns ResourceWarning)
atexit.register(_hand_over)  # before the socket is closed (atexit runs the last registered first)


def cached_call(
    point: str,
    cls: type | None,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    autostart: bool = False,
) -> Any:
    """Serve ``original(*args, **kwargs)`` (called as ``cls.<method>`` when ``cls`` is given) from the cache.

    Calls made while another cached call is running in this thread (a pipeline's own component loads, or a
    direct load after a fallback) go straight to ``original``.
    """
    if getattr(_state, "depth", 0) or os.environ.get("ZEROCOPY_PICKLE_CACHE_LOADER"):
        return original(*args, **kwargs)
    _state.depth = 1
    try:
        _filer.report()  # what earlier filings found they could not capture
        try:
            request = describe(point, cls, args, kwargs)
        except Uncacheable as e:
            _warn_once(f"uncacheable:{point}", str(e))
            return original(*args, **kwargs)
        mode = fill_mode()
        if request.key in _UNCAPTURABLE:  # said once already; nothing to capture, nothing to ask
            return original(*args, **request.kwargs)
        try:
            result = _fetch(request, args, kwargs, autostart=autostart, fill=mode != "server",
                            background=mode == "background")  # fmt: skip
        except CacheError as e:
            _warn_once(f"error:{type(e).__name__}", str(e))
            return original(*args, **kwargs)
        if isinstance(result, Miss) and result.uncacheable is not None:  # a process found it cannot be captured
            _warn_uncapturable(request.get, result.uncacheable)
            return original(*args, **request.kwargs)
        if isinstance(result, Miss):  # load it here, as without the cache; the server gets it afterwards
            log.info("cache miss: %s (loading it here, then filing it)", request.get.describe)
            # With MISS_PREFETCH_ENV, the checkpoints the call will read come in from the disk while the library
            # imports and builds its modules (measured slower than without on the development VM: off by default).
            reading = checkpoints.start(_checkpoints_of(request))
            try:
                value = original(*args, **request.kwargs)
            finally:
                checkpoints.stop(reading)
            if result.filling:  # the server loads the call itself, for the next process: nothing to file here
                register_result(value, request.key)
            elif result is _NO_SERVER and mode == "background":
                _fill_in_new_server(request)
                register_result(value, request.key)
            else:
                _file(request, value, args, kwargs, files=result.files, start=result is _NO_SERVER)
            return value
        log.info("cache hit: %s", request.get.describe)
        register_result(result, request.key)
        return result
    finally:
        _state.depth = 0


def _prefetch_file(fd: int) -> None:
    """Read a hit's checkpoint file into the page cache in the background where it is not there (memfds are
    memory, and files already cached are left alone: :func:`readahead.start` checks)."""
    with contextlib.suppress(OSError):
        readahead.start_file(fd, name=f"a cache entry's file (fd {fd})")


def _checkpoints_of(request: Request) -> list[str]:
    """The checkpoint files among those the request's key was computed from that the call will likely read, when
    :data:`MISS_PREFETCH_ENV` asks for their prefetch."""
    if os.environ.get(MISS_PREFETCH_ENV, "").strip().lower() not in ("1", "on", "true", "yes"):
        return []
    variant = request.kwargs.get("variant")
    checks: list[FileCheck] = request.get.files
    return checkpoints.likely_read(((c.path, c.size) for c in checks), variant if isinstance(variant, str) else None)


def _file(
    request: Request,
    value: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    files: bool,
    start: bool = False,
) -> None:
    """File what the caller just loaded as the call's entry, as it is now (changes the caller makes to it later
    stay out of the entry), without making the caller wait (see :class:`_Filer`). ``start``: no server answered
    the call; one is started now (by the filing child where it forks), after the load, which a starting server
    (a Python importing the package, on another core or on this one) would have slowed."""
    refs = request.ref_objects + entries.argument_slots(args, kwargs)
    start = start and _claim_spawn()
    fork = _fork_is_safe()
    if start and not fork:
        start = False
        with contextlib.suppress(Exception):
            _spawn_server(reap=True)
    try:
        _filer.file(request, value, refs, files=files, fork=fork, start=start)
    except Exception as e:  # the caller has its result; only the cache goes without
        if not _is_uncapturable(e):
            _warn_once(f"capture:{type(e).__name__}", f"a result cannot be cached ({type(e).__name__}: {e})", "")
            return
        reason = _uncapturable_reason(value, refs, e)
        _warn_uncapturable(request.get, reason)
        _report_uncapturable(request.get, reason)  # one round trip (rare: where a result cannot be captured)
        return
    register_result(value, request.key)


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
        failure = locate.locate_failure(value, try_dump, root_name="result")
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


def _fetch(
    request: Request,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    autostart: bool,
    fill: bool = False,
    background: bool = False,
) -> Any:
    """The cached result of the call; with ``fill``, a :class:`Miss` when the caller is to load it (the server
    missed, or none runs yet and one was started); with ``background`` too, the server fills the miss itself."""
    try:
        client = Client()
    except CacheError:
        if not autostart:
            raise
        if fill:  # started after the call returns (see _file): a server's start would compete with the load
            return _NO_SERVER
        start_server_in_background()
        client = Client()
    _close_spawner()  # a server answers: what it started with is no longer needed
    get = dataclasses.replace(request.get, fill=fill, background=fill and background)
    with client:
        header, stream, fds = client.request(
            get, request.payload, timeout=min(_timeout(), HIT_TIMEOUT) if fill else _timeout()
        )
    if header.get("miss"):
        for fd in fds:
            os.close(fd)
        return Miss.decode(header)
    try:
        reply = EntryReply.decode(header, len(fds))
        mappings = entries.map_segments(reply.segments, fds)
        if readahead.switch() != "off":  # ZEROCOPY_PICKLE_PREFETCH=0: as for loads
            for fd in fds:  # checkpoint files no longer in the page cache come in from parallel streams
                _prefetch_file(fd)
    finally:
        for fd in fds:
            os.close(fd)
    _prefaulter.submit(mappings.values())
    refs = request.ref_objects + entries.argument_slots(args, kwargs)
    try:
        return entries.load_entry(stream, reply.buffers, mappings, refs, reply.plugins)
    except CacheError:
        raise
    except Exception as e:
        raise CacheError(f"the cached entry does not load here ({type(e).__name__}: {e})") from e
