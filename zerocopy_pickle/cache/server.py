"""Internal: the cache server: holds entries (sealed memfds, and the checkpoint files they reference) and hands them to
clients over a Unix socket.

One thread per client connection, at most :data:`MAX_CONNECTIONS` at a time: a connection beyond them is answered at
once with a refusal (the client then loads directly) and counted (``refused_connections`` in status). A connection
that sends nothing for :data:`IDLE_TIMEOUT` seconds is closed. Every message is read within the limits of its kind
(``protocol.REQUEST``, ``protocol.PUT``); anything malformed is answered with a ``protocol error`` (then the
connection is closed) or a ``malformed request`` (the connection serves on). A hit is answered from memory: the
entry's stream and buffer table, and duplicates of its segments' fds (``SCM_RIGHTS``). A miss of a patched call (a
``get`` with ``fill``) is answered at once: the client loads the call itself, as it would without the cache, and
sends the result afterwards (a ``put``: its stream, buffer table, a sealed memfd and the checkpoint files it
references), which the server files as the entry. A ``get`` without ``fill`` goes to the loader (``loader.py``) on a
miss: concurrent requests for the same key wait for one load (``misses.py``: the loads the server runs itself,
background fills among them). The server imports neither torch nor any model library, so it starts in a fraction of
a second and never holds a CUDA context; the loader's zygote, which pays the imports once, is started when the first
load needs it.

Run with ``zerocopy-pickle serve`` (``--max-bytes``, ``--persist DIR``), or let a patched client start it.
"""

from __future__ import annotations

import _thread
import contextlib
import fcntl
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

from .isolation import SPAWNER_ENV, WORKDIR_ENV, clean_sys_path
from .lru import Entry
from .messages import (
    Clear,
    Cleared,
    Done,
    EntryReply,
    Failure,
    Get,
    Miss,
    Ping,
    Pong,
    Put,
    StatusReply,
    StatusRequest,
    Stop,
    Uncapturable,
    decode_request,
    request_limits,
)
from .misses import FILL_DELAY, LOADER_TIMEOUT, Misses
from .protocol import CLIENT, CacheError, ProtocolError, peer_credentials, receive, runtime_dir, send
from .store import Store

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
"""Client connections served at once, each by a thread of its own (a client holds one per call, for the call's
request and reply): one more is answered with a refusal and closed, and counted."""

IDLE_TIMEOUT = 300.0
"""Seconds a connection may send nothing, between messages or in the middle of one, before it is closed (a
client that stopped must not hold one of the :data:`MAX_CONNECTIONS` for ever)."""


class Server:
    """A cache server listening on ``path``.

    Args:
        path: the socket path (its directory must be private: see :func:`protocol.runtime_dir`).
        max_bytes: evict least recently used entries to keep segments within this many bytes.
        persist: keep segments and the index in this directory, and start warm from it.
        loader_timeout: give up on a load after this many seconds (the client then loads directly).
        file_segments: let entries reference the checkpoint files a loader mapped and left untouched, instead of
            copying their bytes into memfds (``filebacked.py``).
        workdir: what relative paths in requests resolve against (the loader's children run calls there); the
            zygote itself runs in the socket's (private) directory. Default: the working directory.
        max_connections: connections served at once (:data:`MAX_CONNECTIONS`).
        idle_timeout: seconds a connection may send nothing before it is closed (:data:`IDLE_TIMEOUT`).
        fill_delay: when background fills start (:data:`FILL_DELAY`: the quiet period and the longest wait).
    """

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int | None = None,
        persist: Path | None = None,
        loader_timeout: float = LOADER_TIMEOUT,
        file_segments: bool = True,
        workdir: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout: float = IDLE_TIMEOUT,
        fill_delay: tuple[float, float] = FILL_DELAY,
    ) -> None:
        self.path = path
        self.workdir = workdir if workdir is not None else os.getcwd()
        self.file_segments = file_segments
        self.store = Store(max_bytes, persist, key_dir=path.parent)
        self.stopping = threading.Event()
        # The misses it loads itself, through the loader's zygote (started by the first load that needs it).
        self.misses = Misses(
            self.store,
            self.stopping,
            directory=path.parent,
            workdir=self.workdir,
            loader_timeout=loader_timeout,
            file_segments=file_segments,
            fill_delay=fill_delay,
        )
        self._listener: socket.socket | None = None
        self._lock_fd = -1
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self._connections_lock = threading.Lock()
        self.connections = 0  # connection threads started and not yet ended (at most max_connections)
        self.refused_connections = 0  # connections answered with a refusal: the server served its limit

    # -- lifecycle --------------------------------------------------------------------------------------------

    def bind(self) -> None:
        """Take the server lock and listen. Raises CacheError if another server holds the lock."""
        self._lock_fd = os.open(self.path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            os.close(self._lock_fd)
            raise CacheError(f"another zerocopy_pickle cache server is already running on {self.path}") from e
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket from a server that died: we hold the lock now
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o077)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        listener.listen(128)
        self._listener = listener

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`."""
        if self._listener is None:
            self.bind()
        assert self._listener is not None
        # The loader's zygote is started by the first load that needs it (Misses._submit): clients that load their
        # own misses never do, and its imports would cost seconds of CPU beside a caller's first load.
        self._listener.settimeout(0.5)
        try:
            while not self.stopping.is_set():
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self.stopping.is_set():
                        break
                    raise
                self._start_connection(conn)
        finally:
            self.close()

    def _start_connection(self, conn: socket.socket) -> None:
        """Serve ``conn`` on a thread of its own if fewer than ``max_connections`` are served, else refuse it
        (without waiting for the peer: the accepting thread never blocks on one)."""
        with self._connections_lock:
            full = self.connections >= self.max_connections
            if not full:
                self.connections += 1
        if full:
            self.refused_connections += 1
            with conn, contextlib.suppress(OSError):
                conn.setblocking(False)
                send(conn, Failure(f"the cache server serves {self.max_connections} connections at once, its "
                                   "limit: refused (the call loads directly)").encode())  # fmt: skip
            return
        # Not threading.Thread: its start() waits until the new thread has run, and beside a CPU-bound neighbour
        # that wait was 0.6-4.5 ms of every miss's round trip (busy small-set miss 1.17x -> 1.10x plain).
        try:
            _thread.start_new_thread(self._serve_connection, (conn,))
        except BaseException:
            self._connection_ended()
            conn.close()
            raise

    def _connection_ended(self) -> None:
        with self._connections_lock:
            self.connections -= 1

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.misses.close()
        self.store.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- requests ------------------------------------------------------------------------------------------------

    def _serve_connection(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self.idle_timeout)
                self._serve_requests(conn)
        finally:
            self._connection_ended()

    def _serve_requests(self, conn: socket.socket) -> None:
        _, uid, _ = peer_credentials(conn)
        if uid != os.getuid():
            with contextlib.suppress(OSError):
                send(conn, Failure(f"uid {uid} may not use the cache of uid {os.getuid()}").encode())
            return
        while not self.stopping.is_set():
            try:
                header, payload, fds = receive(conn, CLIENT, request_limits)
            except ProtocolError as e:  # out of step (or a hostile peer): say why, and hang up
                with contextlib.suppress(OSError):
                    send(conn, Failure(f"protocol error: {e}").encode())
                return
            except TimeoutError:
                with contextlib.suppress(OSError):
                    send(conn, Failure(f"protocol error: nothing arrived for {self.idle_timeout:.0f} s").encode())
                return
            except (ConnectionError, OSError):
                return
            try:
                request = decode_request(header, len(fds))
            except Exception as e:  # a malformed request (ProtocolError, or anything a check missed): refuse it
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    send(conn, Failure(f"malformed request ({e})"[:2000]).encode())
                continue
            try:
                if isinstance(request, Put):
                    self._put(conn, request, payload, fds)  # takes the fds
                elif isinstance(request, Uncapturable):
                    self.store.mark_uncacheable(request.request, request.reason)
                    send(conn, Done().encode())
                else:
                    self._dispatch(conn, request, payload)
            except (BrokenPipeError, ConnectionResetError):
                return  # the client went away mid-reply; whatever it was sent dies with the socket
            except CacheError as e:
                with contextlib.suppress(OSError):
                    send(conn, Failure(str(e)).encode())
            except Exception as e:  # a bug, not the peer's doing: say so, log it, hang up; the server serves on
                log.exception("serving a %s request failed", type(request).__name__)
                with contextlib.suppress(OSError):
                    send(conn, Failure(f"the cache server failed ({type(e).__name__}: {e})"[:2000]).encode())
                return

    def _dispatch(self, conn: socket.socket, request: Ping | Get, payload: bytes) -> None:
        if isinstance(request, Get):
            self._get(conn, request, payload)
        elif isinstance(request, StatusRequest):
            status = {**self.store.status(), "pid": os.getpid(), **self.misses.status(),
                      "connections": self.connections, "max_connections": self.max_connections,
                      "refused_connections": self.refused_connections}  # fmt: skip
            send(conn, StatusReply(status).encode())
        elif isinstance(request, Clear):
            send(conn, Cleared(self.store.clear()).encode())
        elif isinstance(request, Stop):
            send(conn, Done().encode())
            self.stop()
        else:
            send(conn, Pong(os.getpid()).encode())

    def _get(self, conn: socket.socket, request: Get, payload: bytes) -> None:
        self.misses.last_call = time.monotonic()
        key = request.key
        entry = self.store.get(key)
        hit = entry is not None
        if entry is None and request.fill:  # the client loads it itself, now, and sends it (a put)
            # unless a process found its result cannot be captured, and the files it depends on are the same
            uncacheable = self.store.uncacheable(key)
            filling = request.background and uncacheable is None and self.misses.claim_fill(key)
            try:
                send(conn, Miss(self.file_segments, uncacheable, bool(filling)).encode())
            finally:  # after the reply, the caller going on first; also when it has gone (a hand-over at exit)
                if filling == "start":
                    self.misses.start_fill(key, request, payload)
            return
        if entry is None:
            entry = self.misses.load(key, request, payload)
        # Duplicates, taken with the ids and rows under the store's lock: an eviction may close the store's own
        # fds, and a compaction repoint the rows, at any moment.
        ids, buffers, fds = self.store.segments_for(entry)
        try:
            send(conn, EntryReply(hit, entry.key, buffers, ids, entry.plugins).encode(), entry.stream, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _put(self, conn: socket.socket, request: Put, payload: bytes, fds: list[int]) -> None:
        """Adopt the entry a client loaded itself after a miss (it goes on at once; this only files the result).

        Takes ownership of ``fds``. An entry for the key that arrived first (another process's fill, or a load)
        is kept. The new segment must be a sealed memfd and the files regular files (``Store.add`` checks), and
        every entry the call's arguments reference must still be cached.
        """
        self.misses.last_call = time.monotonic()
        get, result = request.request, request.result
        try:
            if request.args_nbytes > len(payload):
                raise CacheError("a put's arguments are longer than its payload")
            if self.store.peek(get.key) is not None:  # filed already: keep that one
                for fd in fds:
                    os.close(fd)
                fds = []
                send(conn, Done().encode())
                return
            if result.files and not self.file_segments:
                raise CacheError("this server copies every byte (serve --copy-files): a put may not reference files")
            if self.store.closure(get.call.refs) is None:
                raise CacheError("an entry this call's arguments reference is not in the cache (evicted, or not filed)")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        entry = Entry(get.key, get.describe or get.key, payload[request.args_nbytes :], result.buffers,
                      get.call.refs, args=payload[: request.args_nbytes], timings=result.timings,
                      plugins=result.plugins, args_plugins=get.plugins, files=get.files)  # fmt: skip
        new_fd = fds[0] if result.new_segment else None
        self.store.add(entry, new_fd, fds[int(result.new_segment) :])
        send(conn, Done().encode())


def serve(
    *,
    max_bytes: int | None = None,
    persist: Path | None = None,
    path: Path | None = None,
    quiet: bool = False,
    copy_files: bool = False,
    fill_delay: tuple[float, float] = FILL_DELAY,
) -> None:
    """Run a cache server in this process until it is stopped (``zerocopy-pickle stop`` or SIGTERM).

    The process's ``sys.path`` loses the entries that depend on where it was started, and its working directory
    becomes the socket's private directory (see ``isolation.py``); relative paths in requests (and ``persist``)
    still resolve against the directory it was started for.
    """
    workdir = os.environ.pop(WORKDIR_ENV, None) or os.getcwd()
    spawner = os.environ.pop(SPAWNER_ENV, None)
    clean_sys_path()
    path = Path(os.path.abspath(path or runtime_dir() / "server.sock"))
    if persist is not None:
        persist = Path(workdir, persist)
    os.chdir(path.parent)
    server = Server(path, max_bytes=max_bytes, persist=persist, file_segments=not copy_files, workdir=workdir,
                    fill_delay=fill_delay)  # fmt: skip
    server.bind()
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    # Log records, not prints: `zerocopy-pickle serve` and `python -m zerocopy_pickle.cache serve` send them to
    # stderr (zerocopy_pickle._console); a program that serves in-process decides where they go.
    if not quiet:
        log.info("cache serving on %s (pid %d)", server.path, os.getpid())
    if spawner is not None and spawner.isdigit():  # the client that started us: its misses of the meantime
        with contextlib.suppress(OSError):
            server._start_connection(socket.socket(fileno=int(spawner)))
    started = time.monotonic()
    server.serve_forever()
    if not quiet:
        log.info("cache stopped after %.0f s", time.monotonic() - started)
