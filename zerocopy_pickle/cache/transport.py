"""Internal: reaching the cache server: a connection (:class:`Client`, one request and its reply at a time), sending
a message to a server that may still be starting (:func:`_send_until_up`), and starting one (:func:`_spawn_server`,
:func:`start_server_in_background`).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .isolation import SPAWNER_ENV, WORKDIR_ENV, child_environment
from .messages import Failure, Ping, Put, Uncapturable
from .protocol import CacheError, ProtocolError, receive, runtime_dir, send, socket_path

TIMEOUT_ENV = "ZEROCOPY_PICKLE_CACHE_TIMEOUT"


FILL_WAIT = 60.0
"""Seconds the background thread waits for a server that is starting before it gives up on filing a result."""


HIT_TIMEOUT = 30.0
"""Seconds a client that fills its own misses waits for the server's answer (it never waits for a load)."""


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
        unsent: OSError | None = None
        try:
            try:
                send(self.sock, header, payload, fds)
            except (BrokenPipeError, ConnectionResetError) as e:
                # A server that refuses a connection (another user's, one too many) answers at once and hangs up,
                # possibly before this request went out: its reason is waiting to be read all the same.
                unsent = e
            reply, data, received = receive(self.sock)
        except (OSError, ProtocolError) as e:
            cause = unsent or e
            raise CacheError(f"the cache server did not answer ({type(cause).__name__}: {cause})") from cause
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


def _timeout() -> float:
    try:
        return float(os.environ.get(TIMEOUT_ENV, "3600"))
    except ValueError:
        return 3600.0


_spawned: list[float] = []  # when this process last started a server without waiting for it


_UNREAPED: list[subprocess.Popen[bytes]] = []


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
