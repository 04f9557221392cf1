"""Internal: the misses the cache server loads itself, through the loader (``loader.py``): a ``get`` without
``fill`` (the reply waits for the load; concurrent requests for one key wait for one load), and background fills (a
``get`` with ``fill`` and ``background``: claimed, delayed until the callers are quiet, remembered when they fail,
so that the next miss of the key is the client's to file). The loader's zygote, which pays the imports once, is
started by the first load that needs it, taught what its children imported by themselves, and stopped with the
server. Each load is a :class:`~zerocopy_pickle.cache.jobs.Job` sent to the zygote, with duplicates of the segments
its call's arguments reference and a deduplication index; the entry a child sends back is added to the store.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .isolation import WORKDIR_ENV, child_environment
from .jobs import Job, JobRef, JobResult, Preload, Ready
from .lru import Entry
from .messages import Failure, Get, Stop
from .protocol import MAX_FDS, CacheError, ProtocolError, fill_nice, receive, send
from .store import Store

log = logging.getLogger("zerocopy_pickle.cache.server")  # the records keep the logger they always had

LOADER_TIMEOUT = 3600.0


def _nice_loader() -> list[str]:
    """How the zygote of a background fill is started: at nice 19 (:func:`protocol.fill_nice`) before it imports
    anything (the loader module imports torch: 0.9 s of CPU), not only once ``zygote_main`` runs (no
    ``preexec_fn``: the server has threads)."""
    return [
        "-c",
        f"import os, runpy; os.nice({fill_nice()}); "
        "runpy.run_module('zerocopy_pickle.cache.loader', run_name='__main__', alter_sys=True)",
    ]


MAX_FILLING = 64
"""Background fills running or waiting at once; a miss beyond them is the client's to file."""
MAX_UNLOADABLE = 4096
"""Keys whose background fill failed, remembered (the least recently asked for forgotten first)."""

FILL_DELAY = (0.5, 30.0)
"""When a background fill starts: once no call (a hit, a miss or a filing) has reached the server for the first
many seconds, and at the latest the second many seconds after its miss (``serve --fill-delay QUIET MAX``). A
program loads its models one after another: a fill that starts meanwhile, even at nice 19, competes with it for
memory and the page allocator (on the development VM, a fill or a zygote's imports beside a busy neighbour made the
caller's own loads 1.5-1.7x slower; measured in docs/benchmark.md)."""


@dataclass
class _Inflight:
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class Misses:
    """The loads of one server (:class:`~zerocopy_pickle.cache.server.Server`), into its ``store``, until
    ``stopping`` is set.

    Args:
        store: where the entries go.
        stopping: the server's; set, background fills waiting for quiet give up.
        directory: where the zygote runs (the socket's private directory: what Python puts first on its
            ``sys.path`` is only ours).
        workdir: what relative paths in requests resolve against (the loader's children run calls there).
        loader_timeout: give up on a load after this many seconds (the client then loads directly).
        file_segments: let entries reference the checkpoint files a loader mapped and left untouched.
        fill_delay: when background fills start (:data:`FILL_DELAY`: the quiet period and the longest wait).
    """

    def __init__(
        self,
        store: Store,
        stopping: threading.Event,
        *,
        directory: Path,
        workdir: str,
        loader_timeout: float = LOADER_TIMEOUT,
        file_segments: bool = True,
        fill_delay: tuple[float, float] = FILL_DELAY,
    ) -> None:
        self.store = store
        self.stopping = stopping
        self.directory = directory
        self.workdir = workdir
        self.loader_timeout = loader_timeout
        self.file_segments = file_segments
        self.fill_delay = fill_delay
        self._inflight: dict[str, _Inflight] = {}
        self._inflight_lock = threading.Lock()
        self._filling = 0  # background fills running or waiting (status: "filling")
        self._fills: dict[str, threading.Event] = {}  # their keys, each set when its fill is over
        self._unloadable: collections.OrderedDict[str, str] = collections.OrderedDict()  # failed background fills
        self.last_call = time.monotonic()  # when a hit, miss or filing last arrived (background fills wait)
        self._zygote: subprocess.Popen[bytes] | None = None
        self._zygote_socket: socket.socket | None = None
        self._zygote_lock = threading.Lock()
        self._zygote_ready = threading.Event()
        self._learned: set[str] = set()  # modules loader children imported: preloaded into every new zygote

    def status(self) -> dict[str, Any]:
        """The loader's part of the server's status: the zygote's pid (None: not running), whether it is ready, and
        the background fills running or waiting."""
        zygote = self._zygote.pid if self._zygote is not None and self._zygote.poll() is None else None
        ready = zygote is not None and self._zygote_ready.is_set()
        return {"loader_pid": zygote, "loader_ready": ready, "filling": self._filling}

    def close(self) -> None:
        self._stop_zygote()

    # -- the zygote ---------------------------------------------------------------------------------------------

    def _start_zygote(self, background: bool = False) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = child_environment(
            dict(os.environ, ZEROCOPY_PICKLE_CACHE_LOADER="1", **{WORKDIR_ENV: self.workdir}), cleaned=False
        )
        # Started in the private runtime directory: what Python puts first on its sys.path is only ours.
        self._zygote = subprocess.Popen(
            [
                sys.executable,
                *(_nice_loader() if background else ["-m", "zerocopy_pickle.cache.loader"]),
                str(child.fileno()),
                *(["background"] if background else []),
            ],
            pass_fds=[child.fileno()],
            env=env,
            cwd=self.directory,
        )
        child.close()
        self._zygote_socket = parent
        self._zygote_ready = threading.Event()
        if self._learned:  # a restarted zygote: queued behind its imports, before any job
            send(parent, Preload(sorted(self._learned)).encode())

        def wait_ready() -> None:
            with contextlib.suppress(ConnectionError, CacheError, OSError):
                header, _, fds = receive(parent)
                for fd in fds:
                    os.close(fd)
                if header.get("op") == Ready.OP:
                    self._zygote_ready.set()

        threading.Thread(target=wait_ready, daemon=True).start()

    def _stop_zygote(self) -> None:
        if self._zygote_socket is not None:
            with contextlib.suppress(OSError):
                send(self._zygote_socket, Stop().encode())
            self._zygote_socket.close()
            self._zygote_socket = None
        if self._zygote is not None:
            try:
                self._zygote.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()
            self._zygote = None

    def _submit(self, job: Job, payload: bytes, fds: list[int]) -> None:
        with self._zygote_lock:
            if self._zygote is None or self._zygote.poll() is not None:
                self._stop_zygote()
                self._start_zygote(job.background)  # started by a background fill: at the lowest priority
            if not self._zygote_ready.wait(timeout=300):
                raise CacheError("the cache's loader process did not start")
            assert self._zygote_socket is not None
            send(self._zygote_socket, job.encode(), payload, fds)

    def _teach_zygote(self, modules: list[str]) -> None:
        """Have the zygote import what the last child imported by itself, so the next child starts with it."""
        new = sorted(set(modules) - self._learned)
        if not new:
            return
        with self._zygote_lock:
            self._learned.update(new)
            if self._zygote_socket is not None:
                with contextlib.suppress(OSError):
                    send(self._zygote_socket, Preload(new).encode())

    # -- background fills ---------------------------------------------------------------------------------------

    def claim_fill(self, key: str) -> bool | str:
        """Whether the loader will load ``key`` for the next process, without anybody waiting (a background
        fill): ``"start"`` when the caller is to start it (:meth:`_fill`, counted from now), True when another
        process's miss is loading it already, False when it is the client's to file (its load failed before:
        ``_unloadable``; or :data:`MAX_FILLING` fills are under way)."""
        with self._inflight_lock:
            if key in self._unloadable:
                self._unloadable.move_to_end(key)
                return False
            if key in self._inflight or key in self._fills:
                return True
            if self._filling >= MAX_FILLING:
                return False
            self._filling += 1
            self._fills[key] = threading.Event()
            return "start"

    def start_fill(self, key: str, request: Get, payload: bytes) -> None:
        try:  # not threading.Thread, whose start() waits until the thread has run (milliseconds when busy)
            _thread.start_new_thread(self._fill, (key, request, payload))
        except BaseException:
            with self._inflight_lock:
                self._filling -= 1
                self._fills.pop(key).set()
            raise

    def _wait_until_quiet(self) -> bool:
        """Wait until no call has reached the server for ``fill_delay[0]`` seconds, or ``fill_delay[1]`` seconds
        have passed; False if the server stops meanwhile."""
        quiet, longest = self.fill_delay
        deadline = time.monotonic() + longest
        while not self.stopping.is_set():
            now = time.monotonic()
            until = min(self.last_call + quiet, deadline)
            if now >= until:
                return True
            self.stopping.wait(until - now)
        return False

    def _fill(self, key: str, request: Get, payload: bytes) -> None:
        """A background fill's thread: wait until the callers are quiet (:data:`FILL_DELAY`) and for the fills of
        the entries the call's arguments reference (a pipeline's ``vae=vae`` is filed after the ``vae``), then load
        the call. A failure is logged and remembered (at most :data:`MAX_UNLOADABLE` keys): the next miss of the
        key is the client's to file."""
        try:
            if not self._wait_until_quiet():
                return
            for ref in request.call.refs:  # a fill of its own (waiting, as this one did) or a load under way
                with self._inflight_lock:
                    fill = self._fills.get(ref)
                    waiting = self._inflight.get(ref)
                if fill is not None:
                    fill.wait(self.loader_timeout)
                elif waiting is not None:
                    waiting.done.wait(self.loader_timeout)
            self.load(key, request, payload, background=True)
        except Exception as e:
            log.warning("filing %s in the background failed: %s", request.describe or key, e)
            with self._inflight_lock:
                self._unloadable[key] = str(e)[:2000]
                while len(self._unloadable) > MAX_UNLOADABLE:
                    self._unloadable.popitem(last=False)
        finally:
            with self._inflight_lock:
                self._filling -= 1
                self._fills.pop(key).set()

    # -- loads --------------------------------------------------------------------------------------------------

    def load(self, key: str, request: Get, payload: bytes, *, background: bool = False) -> Entry:
        with self._inflight_lock:
            inflight = self._inflight.get(key)
            owner = inflight is None
            if owner:
                inflight = self._inflight[key] = _Inflight()
        assert inflight is not None
        if not owner:
            inflight.done.wait(self.loader_timeout)
            entry = self.store.peek(key)
            if entry is None:
                raise CacheError(inflight.error or "the load this request waited for did not produce an entry")
            return entry
        try:
            return self._run_loader(key, request, payload, background=background)
        except CacheError as e:
            inflight.error = str(e)
            raise
        finally:
            with self._inflight_lock:
                del self._inflight[key]
            inflight.done.set()

    def _run_loader(self, key: str, request: Get, payload: bytes, *, background: bool = False) -> Entry:
        started = time.monotonic()
        refs = request.call.refs
        closure = self.store.closure(refs)
        if closure is None:
            raise CacheError("an argument of this call was evicted from the cache; loading directly")
        needed = sorted({i for entry in closure for i in entry.segment_ids})
        index_ids, index = self.store.dedup_index(MAX_FDS - 1 - len(needed))
        ids = sorted(set(needed) | set(index_ids))
        job_refs = [
            JobRef(e.key, len(e.args), len(e.stream), e.buffers, e.refs, e.plugins, e.args_plugins) for e in closure
        ]
        blob = b"".join(part for e in closure for part in (e.args, e.stream)) + payload
        job = Job(request.call, request.plugins, job_refs, ids, [row for row in index if row[1] in ids],
                  self.file_segments, request.cwd, background)  # fmt: skip
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours:
            segment_fds = self.store.duplicate_fds(ids)
            try:
                self._submit(job, blob, [theirs.fileno(), *segment_fds])
            finally:
                theirs.close()
                for fd in segment_fds:
                    os.close(fd)
            ours.settimeout(self.loader_timeout)
            try:
                header, stream, fds = receive(ours)
            except (ConnectionError, ProtocolError) as e:
                raise CacheError("the loader process died before it produced the result") from e
            except TimeoutError as e:
                raise CacheError(f"the loader took longer than {self.loader_timeout:.0f} s") from e
        try:
            if not header.get("ok"):
                raise CacheError(f"loading failed in the cache's loader: {Failure.decode(header).error}")
            reply = JobResult.decode(header, len(fds))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._teach_zygote(reply.imported)
        timings = {**reply.timings, "server": time.monotonic() - started}
        entry = Entry(key, request.describe or key, stream, reply.buffers, refs, args=payload, timings=timings,
                      plugins=reply.plugins, args_plugins=request.plugins, files=request.files)  # fmt: skip
        new_fd = fds[0] if reply.new_segment else None
        return self.store.add(entry, new_fd, fds[int(reply.new_segment) :])
