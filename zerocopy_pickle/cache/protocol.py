"""Internal: the wire between cache clients, the server and its loaders: a Unix socket in a private directory.

Messages are a JSON header, an optional binary payload, and file descriptors passed with ``SCM_RIGHTS``::

    u32 header length | u32 payload length | header (UTF-8 JSON) | payload

The file descriptors travel with the first ``sendmsg`` of a message, so the receiver's first ``recvmsg`` of
that message collects them. Each kind of message has limits (:data:`REQUEST`, :data:`PUT`, :data:`ENTRY`): the
receiver checks the declared lengths and the number of fds against them before it allocates anything, and reads a
body into a buffer that grows only as its bytes arrive. A header is decoded by :func:`decode_header`, in time and
memory linear in its length: strict UTF-8, nested at most :data:`MAX_JSON_DEPTH` deep (counted before the parser
runs, so no header makes it recurse), numbers of at most :data:`MAX_NUMBER_CHARS` characters, no key twice in one
object, an object at the top.

Who may talk to the server: the socket lives in a directory owned by the user, mode 0700 (other users cannot
even reach it), and the server checks every connecting peer's credentials (``SO_PEERCRED``) against its own
uid as a second wall. :func:`runtime_dir` refuses a directory that another user owns or that is open to others,
so nobody can prepare a trap directory in advance.
"""

from __future__ import annotations

import array
import json
import os
import re
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._storage.remote import private_directory
from ..errors import ZeroCopyPickleError

DIR_ENV = "ZEROCOPY_PICKLE_CACHE_DIR"
FILL_NICE_ENV = "ZEROCOPY_PICKLE_CACHE_FILL_NICE"
"""The CPU priority (nice value, 0-19) a server's background fills run at, read by the server when it starts a
loader for them and by the loader's children; unset or anything else: 19, the lowest."""
MAX_FDS = 250  # the kernel accepts at most 253 per SCM_RIGHTS message


def fill_nice() -> int:
    """The nice value background fills run at (:data:`FILL_NICE_ENV`, default 19)."""
    value = os.environ.get(FILL_NICE_ENV, "").strip()
    return int(value) if value.isdigit() and 0 <= int(value) <= 19 else 19


@dataclass(frozen=True)
class Limits:
    """What one kind of message may carry: header bytes, payload bytes, file descriptors. A message over a
    limit is refused before anything is allocated for it (a :class:`ProtocolError`; the connection is closed).
    """

    header: int
    payload: int
    fds: int


REQUEST = Limits(header=1 << 20, payload=64 << 20, fds=0)
"""A client's request (``ping``, ``get``, ``status``, ``clear``, ``stop``): a key, the call's name, the keys it
references and the files its key was computed from (header: 1 MiB holds the 4096 files a request may name) and the
call's arguments, pickled with cached objects as references (payload: 64 MiB); no file descriptors."""

PUT = Limits(header=16 << 20, payload=1 << 30, fds=MAX_FDS)
"""A client's ``put`` (a result it loaded itself, for the cache: an entry in the making): its request as the
``get`` named it and its buffer table (header: 16 MiB holds about 250,000 rows, more storages than the largest
mixture-of-experts checkpoints have), the call's arguments and the result's stream (payload: 1 GiB), its segments
(fds)."""

CLIENT = Limits(
    header=max(REQUEST.header, PUT.header), payload=max(REQUEST.payload, PUT.payload), fds=max(REQUEST.fds, PUT.fds)
)
"""What the server admits on a client message's length prefix, before it knows the message's kind: the widest of
:data:`REQUEST` and :data:`PUT`. Once the header is decoded, the message's own kind's limits apply (checked
before its payload is read): see :func:`receive`'s ``limits_of``."""

ENTRY = Limits(header=256 << 20, payload=4 << 30, fds=MAX_FDS)
"""An entry and its kin (server to client, loader to server, server to loader): a buffer table of at most
:data:`MAX_BUFFERS` rows, or a loader job with its deduplication index (header); pickle streams, which hold a
model's Python objects but none of its tensor bytes (payload); segment fds."""

MAX_BUFFERS = 1 << 20
"""Rows (tensor storages) one entry may have; an entry also uses at most :data:`MAX_FDS` segments."""

MAX_JSON_DEPTH = 32
"""Arrays and objects one message header may nest (this protocol's own messages nest at most 6 deep)."""

MAX_NUMBER_CHARS = 40
"""Characters of one number in a message header (sign, digits, point, exponent): this protocol's numbers are
sizes, offsets, ids and times, under 2**64; Python's conversion of long digit strings is quadratic."""

DECODE_BYTES_PER_BYTE = 48
"""What decoding a header may cost in memory, per byte of header, at most: the parsed value (the worst case,
arrays nested in arrays, takes about 41 bytes per byte: two characters make a list), with the copies made before
it. A 1 MiB request costs at most 48 MiB to decode, a 16 MiB put 768 MiB."""

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
    what gets used: open what is inside relative to the fd (``dir_fd=``). They are
    :func:`zerocopy_pickle._storage.remote.private_directory`'s (URL loads' download directory gets the same ones).

    Raises:
        CacheError: the directory is missing (``create=False``), is a symlink or not a directory, belongs to
            another user, or is accessible to others; the message says how to fix it.
    """
    return private_directory(path, create=create, what=what, error=CacheError)


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


def receive(
    sock: socket.socket, limits: Limits = ENTRY, limits_of: Callable[[dict[str, Any]], Limits] | None = None
) -> tuple[dict[str, Any], bytes, list[int]]:
    """Receive one message: ``(header, payload, fds)``. The caller owns (and must close) the fds.

    The declared lengths are checked against ``limits`` before anything is allocated, and the body is read in
    pieces, so memory grows only with the bytes that actually arrive: a peer cannot make the receiver reserve
    gigabytes with a 12-byte message. With ``limits_of`` (the limits of the kind of message a header is), the decoded
    header's kind's limits are checked too, against the declared lengths and the fds that came, before the payload
    is read. The header is decoded by :func:`decode_header`.

    Raises:
        ProtocolError: the peer hung up mid-message, sent something malformed, or declared a message (or sent
            more file descriptors) beyond ``limits`` or its kind's. The connection is then out of step: close it.
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
                raise ProtocolError(
                    f"the peer sent more file descriptors than the {limits.fds} a message may carry: refused"
                )
            if not data:
                if prefix or fds:
                    raise ProtocolError("the peer hung up in the middle of a message")
                raise ConnectionError("the peer closed the connection")
            prefix += data
        header_nbytes, payload_nbytes = _PREFIX.unpack(prefix)
        _check_limits(header_nbytes, payload_nbytes, len(fds), limits, "this kind of message")
        header = decode_header(_receive_exactly(sock, header_nbytes))
        if limits_of is not None:
            what = f"a {str(header.get('op'))[:40]!r} message"
            _check_limits(header_nbytes, payload_nbytes, len(fds), limits_of(header), what)
        payload = _receive_exactly(sock, payload_nbytes)
        return header, payload, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _check_limits(header_nbytes: int, payload_nbytes: int, fds: int, limits: Limits, what: str) -> None:
    if header_nbytes > limits.header or payload_nbytes > limits.payload:
        raise ProtocolError(
            f"the peer declared a message of {header_nbytes} header and {payload_nbytes} payload bytes; {what} "
            f"may have at most {limits.header} and {limits.payload}: refused"
        )
    if fds > limits.fds:
        raise ProtocolError(f"the peer sent {fds} file descriptors; {what} may carry at most {limits.fds}: refused")


_STRING_OR_OTHER = re.compile(r'"[^"]*"|[^\[\]{}"]+')  # a string (escapes removed first), or what is not a bracket
_BRACKETS = str.maketrans("{}", "[]", '"')


def decode_header(blob: bytes) -> dict[str, Any]:
    """A message header: a JSON object in strict UTF-8, nested at most :data:`MAX_JSON_DEPTH` deep, numbers of at
    most :data:`MAX_NUMBER_CHARS` characters, no key twice in one object.

    Time and memory are linear in ``len(blob)``: the nesting is counted before the parser runs (so no header makes
    it recurse), in at most :data:`MAX_JSON_DEPTH` passes over the header's brackets; no number is converted that
    is longer than the bound; memory: at most :data:`DECODE_BYTES_PER_BYTE` bytes per byte of header.

    Raises:
        ProtocolError: it is not such a header (the message says why).
    """
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError(f"the message header is not UTF-8 ({e.reason} at byte {e.start})") from None
    _check_nesting(text)
    try:
        header = json.loads(text, parse_int=_int, parse_float=_float, object_pairs_hook=_object)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ProtocolError(f"the message header is not JSON: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"the message header is not a JSON object (a {type(header).__name__})")
    return header


def _check_nesting(text: str) -> None:
    """Refuse a header whose arrays and objects nest deeper than :data:`MAX_JSON_DEPTH` (or whose brackets do not
    pair up), counting only brackets outside strings, without recursion."""
    # Escaped backslashes, then escaped quotes: every quote left delimits a string (in any header the parser
    # reads that far; outside a string a backslash stops it).
    bare = text.replace("\\\\", "").replace('\\"', "")
    brackets = _STRING_OR_OTHER.sub("", bare).translate(_BRACKETS)
    for _ in range(MAX_JSON_DEPTH):  # each pass takes away the innermost pairs: one level
        if not brackets:
            return
        shorter = brackets.replace("[]", "")
        if len(shorter) == len(brackets):
            break
        brackets = shorter
    if not brackets:
        return
    if "[]" in brackets:
        raise ProtocolError(f"the message header nests arrays or objects more than {MAX_JSON_DEPTH} deep: refused")
    raise ProtocolError("the message header's brackets do not pair up: it is not JSON")


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise ProtocolError(f"the message header has a number of {len(text)} digits (at most {MAX_NUMBER_CHARS})")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ProtocolError(f"the message header has a number of {len(text)} characters (at most {MAX_NUMBER_CHARS})")
    return float(text)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                break
            seen.add(key)
        raise ProtocolError(f"the message header has the key {key[:100]!r} twice in one object")
    return value


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
