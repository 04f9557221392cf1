"""Internal: the wire between cache clients, the server and its loaders: a Unix socket in a private directory.

Messages are a JSON header, an optional binary payload, and file descriptors passed with ``SCM_RIGHTS``::

    u32 header length | u32 payload length | header (UTF-8 JSON) | payload

The file descriptors travel with the first ``sendmsg`` of a message, so the receiver's first ``recvmsg`` of
that message collects them. Each kind of message has limits (:data:`REQUEST`, :data:`ENTRY`): the receiver
checks the declared lengths and the number of fds against them before it allocates anything, and reads a body
into a buffer that grows only as its bytes arrive.

Who may talk to the server: the socket lives in a directory owned by the user, mode 0700 (other users cannot
even reach it), and the server checks every connecting peer's credentials (``SO_PEERCRED``) against its own
uid as a second wall. :func:`runtime_dir` refuses a directory that another user owns or that is open to others,
so nobody can prepare a trap directory in advance.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ZeroCopyPickleError

__all__ = [
    "ENTRY",
    "MAX_BUFFERS",
    "MAX_FDS",
    "REQUEST",
    "CacheError",
    "Limits",
    "ProtocolError",
    "open_private_directory",
    "peer_credentials",
    "receive",
    "runtime_dir",
    "send",
    "socket_path",
]

DIR_ENV = "ZEROCOPY_PICKLE_CACHE_DIR"
MAX_FDS = 250  # the kernel accepts at most 253 per SCM_RIGHTS message


@dataclass(frozen=True)
class Limits:
    """What one kind of message may carry: header bytes, payload bytes, file descriptors. A message over a
    limit is refused before anything is allocated for it (a :class:`ProtocolError`; the connection is closed).
    """

    header: int
    payload: int
    fds: int


REQUEST = Limits(header=64 << 20, payload=1 << 30, fds=MAX_FDS)
"""A client's request: a key, the call's name, the keys it references (header) and the call's arguments,
pickled with cached objects as references (payload); or a ``put`` (a result the client loaded itself: its buffer
table in the header, the arguments and the result's stream as the payload, its segments as fds). Only a put may
carry file descriptors (``messages.decode_request``)."""

ENTRY = Limits(header=256 << 20, payload=4 << 30, fds=MAX_FDS)
"""An entry and its kin (server to client, loader to server, server to loader): a buffer table of at most
:data:`MAX_BUFFERS` rows, or a loader job with its deduplication index (header); pickle streams, which hold a
model's Python objects but none of its tensor bytes (payload); segment fds."""

MAX_BUFFERS = 1 << 20
"""Rows (tensor storages) one entry may have; an entry also uses at most :data:`MAX_FDS` segments."""

_CHUNK = 1 << 20  # a message body is read in pieces: memory grows with what arrived, never with what is claimed
_PREFIX = struct.Struct("<II")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class CacheError(ZeroCopyPickleError, RuntimeError):
    """The model cache cannot serve a request (the client then loads directly)."""


class ProtocolError(CacheError):
    """A peer sent something that is not a message of this protocol, or hung up mid-message."""


def runtime_dir(create: bool = True) -> Path:
    """The per-user directory holding the server's socket (and its lock, log and persistence key).

    ``$ZEROCOPY_PICKLE_CACHE_DIR`` if set, else ``$XDG_RUNTIME_DIR/zerocopy_pickle``, else
    ``/tmp/zerocopy_pickle-<uid>``. Created with mode 0700; checked by :func:`open_private_directory`.

    Raises:
        CacheError: the directory is a symlink, belongs to another user, or is accessible to others.
    """
    configured = os.environ.get(DIR_ENV)
    if configured:
        path = Path(configured)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "zerocopy_pickle"
    else:
        path = Path(f"/tmp/zerocopy_pickle-{os.getuid()}")
    os.close(open_private_directory(path, create=create, what="cache directory"))
    return path


def open_private_directory(path: Path, *, create: bool = True, what: str = "cache directory") -> int:
    """An ``O_DIRECTORY`` fd of ``path`` (the caller closes it), after checking that nobody else can have
    prepared or can change what is in it: a plain directory (not a symlink), owned by this user, without any
    access for group or others. Created with mode 0700 (and missing parents) when ``create``.

    The checks are made on the opened directory (``O_NOFOLLOW``), so a name swapped after the check is not
    what gets used: open what is inside relative to the fd (``dir_fd=``).

    Raises:
        CacheError: the directory is missing (``create=False``), is a symlink or not a directory, belongs to
            another user, or is accessible to others; the message says how to fix it.
    """
    if create:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700, parents=True)
    try:
        info = os.lstat(path)
    except FileNotFoundError as e:
        raise CacheError(f"the {what} {path} does not exist") from e
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise CacheError(
            f"the {what} {path} is not a plain directory (a symlink or a file): refusing to use it; "
            "name a directory of your own instead"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise CacheError(f"the {what} {path} cannot be opened as a plain directory ({e.strerror})") from e
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise CacheError(f"the {what} {path} was replaced while it was being checked: refusing to use it")
        if opened.st_uid != os.getuid():
            raise CacheError(
                f"the {what} {path} belongs to uid {opened.st_uid}, not to you (uid {os.getuid()}): refusing to "
                "use it, since whoever owns it controls what is in it; name a directory of your own instead"
            )
        if opened.st_mode & 0o077:
            raise CacheError(
                f"the {what} {path} is accessible to other users (mode {stat.S_IMODE(opened.st_mode):o}); "
                f"it must be 0700: chmod 700 {path}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def socket_path(create: bool = True) -> Path:
    """Where the server listens."""
    return runtime_dir(create) / "server.sock"


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    pid, uid, gid = _CREDENTIALS.unpack(raw)
    return pid, uid, gid


def send(
    sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"", fds: Sequence[int] = ()
) -> None:
    """Send one message (the fds are duplicated into the receiver; the sender keeps its own).

    Raises:
        ProtocolError: too many fds.
        OSError: the peer is gone.
    """
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"{len(fds)} file descriptors in one message; the limit is {MAX_FDS}")
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    payload = memoryview(payload).cast("B")
    first = _PREFIX.pack(len(blob), payload.nbytes) + blob
    if fds:
        sent = sock.sendmsg([first], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        if sent < len(first):
            sock.sendall(first[sent:])
    else:
        sock.sendall(first)
    if payload.nbytes:
        sock.sendall(payload)


def receive(sock: socket.socket, limits: Limits = ENTRY) -> tuple[dict[str, Any], bytes, list[int]]:
    """Receive one message: ``(header, payload, fds)``. The caller owns (and must close) the fds.

    The declared lengths are checked against ``limits`` before anything is allocated, and the body is read in
    pieces, so memory grows only with the bytes that actually arrive: a peer cannot make the receiver reserve
    gigabytes with a 12-byte message.

    Raises:
        ProtocolError: the peer hung up mid-message, sent something malformed, or declared a message (or sent
            more file descriptors) beyond ``limits``. The connection is then out of step: close it.
        ConnectionError: the peer hung up before a message started (EOF).
    """
    fds: list[int] = []
    prefix = bytearray()
    ancillary_size = socket.CMSG_SPACE(max(limits.fds, 1) * array.array("i").itemsize)
    try:
        while len(prefix) < _PREFIX.size:
            data, ancillary, flags, _ = sock.recvmsg(_PREFIX.size - len(prefix), ancillary_size)
            for level, kind, cmsg in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(cmsg[: len(cmsg) - len(cmsg) % received.itemsize])
                    fds.extend(received)
            if flags & socket.MSG_CTRUNC or len(fds) > limits.fds:
                raise ProtocolError(f"the peer sent more file descriptors than the {limits.fds} a message may carry")
            if not data:
                if prefix or fds:
                    raise ProtocolError("the peer hung up in the middle of a message")
                raise ConnectionError("the peer closed the connection")
            prefix += data
        header_nbytes, payload_nbytes = _PREFIX.unpack(prefix)
        if header_nbytes > limits.header or payload_nbytes > limits.payload:
            raise ProtocolError(
                f"the peer declared a message of {header_nbytes} header and {payload_nbytes} payload bytes; this "
                f"kind of message may have at most {limits.header} and {limits.payload}: refused"
            )
        blob = _receive_exactly(sock, header_nbytes)
        payload = _receive_exactly(sock, payload_nbytes)
        try:
            header = json.loads(blob)
        except ValueError as e:
            raise ProtocolError(f"the message header is not JSON: {e}") from e
        if not isinstance(header, dict):
            raise ProtocolError("the message header is not a JSON object")
        return header, payload, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _receive_exactly(sock: socket.socket, nbytes: int) -> bytes:
    """Read ``nbytes`` into a buffer that grows (geometrically) with what has arrived, not with ``nbytes``."""
    buffer = bytearray(min(nbytes, _CHUNK))
    got = 0
    while got < nbytes:
        if got == len(buffer):
            buffer.extend(bytes(min(len(buffer), nbytes - len(buffer))))
        with memoryview(buffer) as view:
            n = sock.recv_into(view[got:], len(buffer) - got)
        if n == 0:
            raise ProtocolError(f"the peer hung up {nbytes - got} bytes before the end of a message")
        got += n
    return bytes(buffer)
