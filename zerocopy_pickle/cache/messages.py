"""Internal: every message of the cache, typed: one class per kind, each with ``encode`` (to the JSON header
:func:`protocol.send` writes) and ``decode`` (from the header :func:`protocol.receive` returns, validated: a field of
the wrong type or out of range is a :class:`protocol.ProtocolError`, never a ``KeyError`` deep in a handler).

Who sends what::

    client -> server      Ping | Get | StatusRequest | Clear | Stop   (limits: protocol.REQUEST)
                          Put                                         (limits: protocol.PUT; see request_limits)
    server -> client      Pong | EntryReply | Miss | StatusReply | Cleared | Done | Failure
    server -> zygote      Job | Preload | Stop
    zygote -> server      Ready
    loader child -> server  JobResult | Failure                              (limits: protocol.ENTRY)

A request names its kind in ``"op"``; a reply says ``"ok"`` (false: a :class:`Failure` with the reason). The
payload and the file descriptors that travel with a message are described by its fields (an entry's pickle stream
is the payload of :class:`EntryReply` and :class:`JobResult`; its segments are the fds).

An entry's buffers are :class:`BufferRow` s, the persisted index's too (``persistence.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar

from .protocol import MAX_BUFFERS, MAX_FDS, PUT, REQUEST, Limits, ProtocolError

MAX_PLUGINS = 1000
"""Plugins one stream may name."""

PLACES = ("segment", "new", "file")
"""Where a buffer row's bytes are: ``segment``: a segment of the store (``segment`` is its id, > 0); ``new``: the
memfd a loader sent with the entry (``segment`` is 0); ``file``: the ``segment``-th checkpoint file a loader sent
with the entry. Only a :class:`JobResult` (a loader's, or the one in a client's :class:`Put`) has ``new`` and
``file`` rows; the store turns them into ``segment`` rows when it adopts the entry."""


class BufferRow(NamedTuple):
    """One out-of-band buffer of an entry: ``nbytes`` at ``offset`` of a segment (see :data:`PLACES`), the device
    it was on (``location``) and its sample digest (for deduplication; None for file rows, never read)."""

    segment: int
    offset: int
    nbytes: int
    location: str
    digest: str | None
    place: str = "segment"

    def encode(self) -> list[Any]:
        return [self.place, self.segment, self.offset, self.nbytes, self.location, self.digest]

    @classmethod
    def decode(cls, value: Any, what: str = "an entry") -> BufferRow:
        if not (
            isinstance(value, list)
            and len(value) == 6
            and value[0] in PLACES
            and all(type(v) is int and v >= 0 for v in value[1:4])
            and isinstance(value[4], str)
            and (value[5] is None or isinstance(value[5], str))
        ):
            raise ProtocolError(f"{what} has a malformed buffer table row: {str(value)[:200]}")
        place, segment, offset, nbytes, location, digest = value
        if (place == "segment" and segment == 0) or (place == "new" and segment != 0):
            raise ProtocolError(f"{what} has a buffer row whose segment does not fit its place: {str(value)[:200]}")
        return cls(segment, offset, nbytes, location, digest, place)


def encode_buffer_table(rows: Sequence[BufferRow]) -> list[list[Any]]:
    return [row.encode() for row in rows]


def decode_buffer_table(value: Any, what: str = "an entry", *, places: Sequence[str] = ("segment",)) -> list[BufferRow]:
    """A buffer table (at most :data:`MAX_BUFFERS` rows, each a :class:`BufferRow` whose place is in ``places``).

    Raises:
        ProtocolError: it is not.
    """
    if not isinstance(value, list) or len(value) > MAX_BUFFERS:
        raise ProtocolError(f"{what} has a buffer table that is not a list of at most {MAX_BUFFERS} rows")
    rows = [BufferRow.decode(row, what) for row in value]
    for row in rows:
        if row.place not in places:
            raise ProtocolError(f"{what} has a buffer row in a {row.place!r} place, which it may not have")
    return rows


MAX_FILE_CHECKS = 4096
"""Files one request (and its entry) may name for the server to check on every hit."""


class FileCheck(NamedTuple):
    """A file a key was computed from, as the client saw it: its path as the loader opens it (absolute, through
    symlinks) and the identity :func:`os.stat` gave (size, mtime and ctime in nanoseconds, inode, device)."""

    path: str
    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int
    dev: int

    @classmethod
    def of(cls, path: str, info: Any) -> FileCheck:
        return cls(path, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev)


def decode_file_checks(value: Any, what: str) -> list[FileCheck]:
    """``[[path, size, mtime_ns, ctime_ns, ino, dev], ...]``: the files a key was computed from."""
    if not isinstance(value, list) or len(value) > MAX_FILE_CHECKS:
        raise ProtocolError(f"{what}: its file list is not a list of at most {MAX_FILE_CHECKS} rows")
    checks = []
    for row in value:
        if not (
            isinstance(row, list)
            and len(row) == 6
            and isinstance(row[0], str)
            and all(type(v) is int for v in row[1:])
            and min(row[1], row[4], row[5]) >= 0
        ):
            raise ProtocolError(f"{what} has a malformed file row: {str(row)[:200]}")
        _directory(row[0], "files", what)  # an absolute path of bounded length
        checks.append(FileCheck(*row))
    return checks


def decode_plugins(value: Any, what: str = "an entry") -> list[tuple[str, str]]:
    """``[[name, package], ...]``: the plugins a stream needs."""
    if (
        not isinstance(value, list)
        or len(value) > MAX_PLUGINS
        or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) for s in p) for p in value)
    ):
        raise ProtocolError(f"{what} has a malformed plugin list: {str(value)[:200]}")
    return [(name, package) for name, package in value]


def _field(header: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or (kind is int and type(value) is bool):
        raise ProtocolError(f"{what}: field {name!r} is missing or of the wrong type ({type(value).__name__})")
    return value


def _strings(value: Any, name: str, what: str, limit: int = MAX_BUFFERS) -> list[str]:
    if not isinstance(value, list) or len(value) > limit or not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"{what}: field {name!r} is not a list of strings")
    return list(value)


def _ints(value: Any, name: str, what: str, limit: int) -> list[int]:
    if not isinstance(value, list) or len(value) > limit or not all(type(v) is int for v in value):
        raise ProtocolError(f"{what}: field {name!r} is not a list of at most {limit} integers")
    return list(value)


def _directory(value: Any, name: str, what: str) -> str | None:
    """An absolute path of a directory (or None): where a call's relative paths resolve."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/") or len(value) > 4096 or "\0" in value:
        raise ProtocolError(f"{what}: field {name!r} is not an absolute path")
    return value


# -- requests (client -> server) ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """The patched function a request runs (``"module:qualname"``), the class it was called on (or None), and
    the keys of the cached entries its arguments reference (in reference order)."""

    function: str
    cls: str | None = None
    refs: list[str] = field(default_factory=list)

    def encode(self) -> dict[str, Any]:
        return {"function": self.function, "cls": self.cls, "refs": list(self.refs)}

    @classmethod
    def decode(cls, value: Any, what: str) -> Call:
        if not isinstance(value, dict):
            raise ProtocolError(f"{what}: 'call' is not an object")
        function = _field(value, "function", str, what)
        owner = value.get("cls")
        if owner is not None and not isinstance(owner, str):
            raise ProtocolError(f"{what}: 'cls' is not a string")
        return cls(function, owner, _strings(value.get("refs", []), "refs", what))


@dataclass(frozen=True)
class Ping:
    OP: ClassVar[str] = "ping"

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Ping:
        return cls()


@dataclass(frozen=True)
class StatusRequest(Ping):
    OP: ClassVar[str] = "status"


@dataclass(frozen=True)
class Clear(Ping):
    OP: ClassVar[str] = "clear"


@dataclass(frozen=True)
class Stop(Ping):
    """To the server (from a client), or to the zygote (from the server)."""

    OP: ClassVar[str] = "stop"


@dataclass(frozen=True)
class Get:
    """Serve a call: its key, what to run on a miss, a description for status, the plugins its pickled
    arguments (the payload) need, the caller's working directory (absolute: relative paths among the arguments
    mean what they mean there), and the files the key was computed from (re-checked on every hit). With
    ``fill``, a miss is answered at once (:class:`Miss`): the client loads the call itself and sends the result
    (:class:`Put`); without, the server's loader loads it and the reply waits. With ``fill`` and ``background``
    too, the miss is answered at once and the server's loader loads the call for the next process, at the lowest
    CPU priority (unless that load failed before: :attr:`Miss.filling` says which), and the client files nothing."""

    OP: ClassVar[str] = "get"
    key: str
    call: Call
    describe: str = ""
    plugins: list[tuple[str, str]] = field(default_factory=list)
    cwd: str | None = None
    files: list[FileCheck] = field(default_factory=list)  # what the key was computed from: checked on every hit
    fill: bool = False
    background: bool = False

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP, "key": self.key, "call": self.call.encode(), "describe": self.describe,
                "plugins": [list(p) for p in self.plugins], "cwd": self.cwd,
                "files": [list(f) for f in self.files], "fill": self.fill,
                "background": self.background}  # fmt: skip

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Get:
        what = "a get request"
        key = _field(header, "key", str, what)
        if not 0 < len(key) <= 200:
            raise ProtocolError(f"{what}: the key is empty or too long")
        describe = header.get("describe", "")
        return cls(
            key,
            Call.decode(header.get("call"), what),
            describe if isinstance(describe, str) else "",
            decode_plugins(header.get("plugins", []), what),
            _directory(header.get("cwd"), "cwd", what),
            decode_file_checks(header.get("files", []), what),
            header.get("fill", False) is True,
            header.get("background", False) is True,
        )


@dataclass(frozen=True)
class Put:
    """A client's own load of a call that missed, for the cache: the call as its :class:`Get` named it, and the
    entry as a loader's :class:`JobResult` describes one (rows in ``new`` and ``file`` places, the fds: the new
    sealed memfd if any, then the checkpoint files). The payload is the call's pickled arguments
    (``args_nbytes``), then the result's stream."""

    OP: ClassVar[str] = "put"
    request: Get
    result: JobResult
    args_nbytes: int

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP, "request": self.request.encode(), "result": self.result.encode(),
                "args_nbytes": self.args_nbytes}  # fmt: skip

    @classmethod
    def decode(cls, header: dict[str, Any], fds: int = 0) -> Put:
        what = "a put request"
        request, result = header.get("request"), header.get("result")
        if not isinstance(request, dict) or not isinstance(result, dict):
            raise ProtocolError(f"{what}: 'request' or 'result' is not an object")
        args_nbytes = _field(header, "args_nbytes", int, what)
        if args_nbytes < 0:
            raise ProtocolError(f"{what}: negative 'args_nbytes'")
        return cls(Get.decode(request), JobResult.decode(result, fds), args_nbytes)


MAX_REASON = 4000
"""Characters of an :class:`Uncapturable`'s reason the server keeps (the rest is cut)."""


@dataclass(frozen=True)
class Uncapturable:
    """A client's report that the result of a call that missed cannot be captured (pickled) as an entry: the call
    as its :class:`Get` named it (the key, and the files the key was computed from) and why. The server remembers
    it, and answers later misses of the key with :class:`Miss` ``uncacheable`` while those files are what they
    were, so no other process tries (forks, captures) again."""

    OP: ClassVar[str] = "uncapturable"
    request: Get
    reason: str

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP, "request": self.request.encode(), "reason": self.reason[:MAX_REASON]}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Uncapturable:
        what = "an uncapturable report"
        request = header.get("request")
        if not isinstance(request, dict):
            raise ProtocolError(f"{what}: 'request' is not an object")
        return cls(Get.decode(request), _field(header, "reason", str, what)[:MAX_REASON])


_REQUESTS: dict[str, Any] = {c.OP: c for c in (Ping, StatusRequest, Clear, Stop, Get, Put, Uncapturable)}
Request = Ping | Get | Put | Uncapturable


def request_limits(header: dict[str, Any]) -> Limits:
    """The limits of the kind of client message ``header`` is: :data:`protocol.PUT` for a put, else
    :data:`protocol.REQUEST` (the server receives with ``protocol.receive(conn, protocol.CLIENT, request_limits)``)."""
    return PUT if header.get("op") == Put.OP else REQUEST


def decode_request(header: dict[str, Any], fds: int = 0) -> Request:
    """The request a client sent, with ``fds`` file descriptors (only a :class:`Put` may carry any).

    Raises:
        ProtocolError: an unknown kind, or a malformed one.
    """
    kind = _REQUESTS.get(header.get("op"))  # type: ignore[arg-type]
    if kind is None:
        raise ProtocolError(f"unknown request {str(header.get('op'))[:100]!r}")
    if kind is Put:
        return Put.decode(header, fds)
    if fds:
        raise ProtocolError(f"a {kind.OP!r} request carries no file descriptors")
    request: Request = kind.decode(header)
    return request


# -- replies (server -> client) ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """A refused request, or a failed job: why (and, from a loader, where)."""

    error: str
    traceback: str = ""

    def encode(self) -> dict[str, Any]:
        return {"ok": False, "error": self.error, "traceback": self.traceback}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Failure:
        error, trace = header.get("error"), header.get("traceback", "")
        return cls(str(error)[:20000] if error is not None else "the request was refused", str(trace)[:20000])


@dataclass(frozen=True)
class Pong:
    pid: int

    def encode(self) -> dict[str, Any]:
        return {"ok": True, "pid": self.pid}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Pong:
        return cls(_field(header, "pid", int, "a ping reply"))


@dataclass(frozen=True)
class Done:
    """A request that has nothing to answer but that it was done (``stop``)."""

    def encode(self) -> dict[str, Any]:
        return {"ok": True}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Done:
        return cls()


@dataclass(frozen=True)
class Cleared:
    cleared: int

    def encode(self) -> dict[str, Any]:
        return {"ok": True, "cleared": self.cleared}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Cleared:
        return cls(_field(header, "cleared", int, "a clear reply"))


@dataclass(frozen=True)
class StatusReply:
    """What ``zerocopy-pickle status`` shows (informational: a JSON object)."""

    status: dict[str, Any]

    def encode(self) -> dict[str, Any]:
        return {"ok": True, "status": self.status}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> StatusReply:
        return cls(_field(header, "status", dict, "a status reply"))


@dataclass(frozen=True)
class EntryReply:
    """An entry, for a ``get``: its stream is the payload, its segments the fds (``segments`` are their ids, in
    the order of the fds)."""

    hit: bool
    key: str
    buffers: list[BufferRow]
    segments: list[int]
    plugins: list[tuple[str, str]]

    def encode(self) -> dict[str, Any]:
        return {"ok": True, "hit": self.hit, "key": self.key, "buffers": encode_buffer_table(self.buffers),
                "segments": list(self.segments), "plugins": [list(p) for p in self.plugins]}  # fmt: skip

    @classmethod
    def decode(cls, header: dict[str, Any], fds: int) -> EntryReply:
        what = "the server's entry"
        segments = _ints(header.get("segments"), "segments", what, MAX_FDS)
        if len(segments) != fds:
            raise ProtocolError(f"{what} does not match the file descriptors it sent")
        buffers = decode_buffer_table(header.get("buffers"), what)
        if not {row.segment for row in buffers} <= set(segments):
            raise ProtocolError(f"{what} refers to segments it did not send")
        return cls(
            bool(header.get("hit")),
            _field(header, "key", str, what),
            buffers,
            segments,
            decode_plugins(header.get("plugins", []), what),
        )


@dataclass(frozen=True)
class Miss:
    """The answer to a ``get`` with ``fill`` that missed: the client loads the call itself. ``files``: whether
    the server keeps entries' untouched checkpoint views as references to the files (else it wants every byte
    in a memfd: ``serve --copy-files``). ``uncacheable``: why a process found the call's result could not be
    captured (:class:`Uncapturable`), its files unchanged since: the client loads it and files nothing.
    ``filling``: the server's loader is loading the call itself, in the background (a ``get`` with
    ``background``): the client loads it and files nothing."""

    files: bool = True
    uncacheable: str | None = None
    filling: bool = False

    def encode(self) -> dict[str, Any]:
        header = {"ok": True, "miss": True, "files": self.files, "uncacheable": self.uncacheable}
        return {**header, "filling": True} if self.filling else header

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Miss:
        reason = header.get("uncacheable")
        return cls(header.get("files", True) is True, reason[:MAX_REASON] if isinstance(reason, str) else None,
                   header.get("filling", False) is True)  # fmt: skip


Reply = Failure | Pong | Done | Cleared | StatusReply | EntryReply | Miss
_ReplyT = TypeVar("_ReplyT", Pong, Done, Cleared, StatusReply)


def decode_reply(header: dict[str, Any], kind: type[_ReplyT]) -> _ReplyT:
    """A successful reply of ``kind`` (a :class:`Failure` is raised by the caller first: see ``transport.Client``).

    Raises:
        ProtocolError: it is malformed.
    """
    return kind.decode(header)


# -- the server and its loader -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The zygote imported what it preloads and waits for jobs."""

    OP: ClassVar[str] = "ready"
    pid: int

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP, "pid": self.pid}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Ready:
        return cls(_field(header, "pid", int, "a ready message"))


@dataclass(frozen=True)
class Preload:
    """Modules the zygote should import now (what children imported by themselves)."""

    OP: ClassVar[str] = "preload"
    modules: list[str]

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP, "modules": list(self.modules)}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Preload:
        return cls(_strings(header.get("modules", []), "modules", "a preload message"))


@dataclass(frozen=True)
class JobRef:
    """A cached entry a job's call references, to rebuild in the loader first: its pickled arguments and its
    stream are consecutive parts of the job's payload (``args_nbytes``, then ``stream_nbytes``)."""

    key: str
    args_nbytes: int
    stream_nbytes: int
    buffers: list[BufferRow]
    refs: list[str]
    plugins: list[tuple[str, str]]
    args_plugins: list[tuple[str, str]]

    def encode(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "buffers": encode_buffer_table(self.buffers),
                "plugins": [list(p) for p in self.plugins],
                "args_plugins": [list(p) for p in self.args_plugins]}  # fmt: skip

    @classmethod
    def decode(cls, value: Any) -> JobRef:
        what = "a job's reference"
        if not isinstance(value, dict):
            raise ProtocolError(f"{what} is not an object")
        sizes = [_field(value, name, int, what) for name in ("args_nbytes", "stream_nbytes")]
        if min(sizes) < 0:
            raise ProtocolError(f"{what} has a negative size")
        return cls(
            _field(value, "key", str, what),
            sizes[0],
            sizes[1],
            decode_buffer_table(value.get("buffers"), what),
            _strings(value.get("refs", []), "refs", what),
            decode_plugins(value.get("plugins", []), what),
            decode_plugins(value.get("args_plugins", []), what),
        )


@dataclass(frozen=True)
class Job:
    """A miss for the loader: the call and the plugins its arguments need, the entries it references (their
    parts, then the call's arguments, are the payload), the segments sent with it (fds after the result socket),
    a deduplication index ``(digest, segment, offset, nbytes)``, whether checkpoint files may be referenced, and
    the directory the call runs in (the caller's working directory; None: the server's), and whether nobody waits
    for it (``background``: its child runs at the lowest CPU priority)."""

    OP: ClassVar[str] = "load"
    call: Call
    plugins: list[tuple[str, str]]
    refs: list[JobRef]
    segments: list[int]
    index: list[tuple[str, int, int, int]]
    file_segments: bool = True
    workdir: str | None = None
    background: bool = False

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP, "call": self.call.encode(), "plugins": [list(p) for p in self.plugins],
                "refs": [ref.encode() for ref in self.refs], "segments": list(self.segments),
                "index": [list(row) for row in self.index], "file_segments": self.file_segments,
                "workdir": self.workdir, "background": self.background}  # fmt: skip

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Job:
        what = "a loader job"
        refs = header.get("refs")
        index = header.get("index")
        if not isinstance(refs, list) or not isinstance(index, list) or len(index) > MAX_BUFFERS:
            raise ProtocolError(f"{what} is malformed")
        rows = []
        for row in index:
            if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str)
                    and all(type(v) is int for v in row[1:])):  # fmt: skip
                raise ProtocolError(f"{what} has a malformed index row")
            rows.append((row[0], row[1], row[2], row[3]))
        return cls(
            Call.decode(header.get("call"), what),
            decode_plugins(header.get("plugins", []), what),
            [JobRef.decode(ref) for ref in refs],
            _ints(header.get("segments"), "segments", what, MAX_FDS),
            rows,
            bool(header.get("file_segments", True)),
            _directory(header.get("workdir"), "workdir", what),
            header.get("background", False) is True,
        )


@dataclass(frozen=True)
class JobResult:
    """A loader's entry: the stream is the payload; the fds are the new memfd (if ``new_segment``) then
    ``files`` checkpoint files; rows in ``new`` and ``file`` places refer to those."""

    buffers: list[BufferRow]
    plugins: list[tuple[str, str]]
    imported: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    new_segment: bool = False
    files: int = 0

    def encode(self) -> dict[str, Any]:
        return {"ok": True, "buffers": encode_buffer_table(self.buffers), "plugins": [list(p) for p in self.plugins],
                "imported": list(self.imported), "timings": dict(self.timings), "new_segment": self.new_segment,
                "files": self.files}  # fmt: skip

    @classmethod
    def decode(cls, header: dict[str, Any], fds: int) -> JobResult:
        what = "the loader's entry"
        timings = header.get("timings", {})
        if not isinstance(timings, dict) or not all(isinstance(v, (int, float)) for v in timings.values()):
            raise ProtocolError(f"{what} has malformed timings")
        files = _field(header, "files", int, what)
        new_segment = bool(header.get("new_segment"))
        if files < 0 or fds != int(new_segment) + files:
            raise ProtocolError("the loader's reply does not match the file descriptors it sent")
        buffers = decode_buffer_table(header.get("buffers"), what, places=PLACES)
        for row in buffers:
            if (row.place == "new" and not new_segment) or (row.place == "file" and row.segment >= files):
                raise ProtocolError(f"{what} refers to a segment it did not send")
        return cls(
            buffers,
            decode_plugins(header.get("plugins", []), what),
            _strings(header.get("imported", []), "imported", what),
            {str(k): float(v) for k, v in timings.items()},
            new_segment,
            files,
        )
