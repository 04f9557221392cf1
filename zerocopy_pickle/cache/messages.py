"""Internal: the messages of the cache, typed: one class per kind, each with ``encode`` (to the JSON header
:func:`protocol.send` writes) and ``decode`` (from the header :func:`protocol.receive` returns, validated: a field of
the wrong type or out of range is a :class:`protocol.ProtocolError`, never a ``KeyError`` deep in a handler). Here
the requests of clients and the server's replies; the kinds only the server and its loader exchange (``Job``,
``Preload``, ``Ready``, ``JobResult``) are in ``jobs.py``, and the parts messages are made of (buffer rows, file
checks, the call, the field checks) in ``fields.py``.

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

An entry's buffers are :class:`~zerocopy_pickle.cache.fields.BufferRow` s, the persisted index's too
(``persistence.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from .fields import (
    BufferRow,
    Call,
    FileCheck,
    decode_buffer_table,
    decode_file_checks,
    decode_plugins,
    directory_field,
    encode_buffer_table,
    int_list,
    typed_field,
)
from .jobs import JobResult
from .protocol import MAX_FDS, PUT, REQUEST, Limits, ProtocolError

# -- requests (client -> server) ---------------------------------------------------------------------------------


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
                "files": [f.encode() for f in self.files], "fill": self.fill,
                "background": self.background}  # fmt: skip

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Get:
        what = "a get request"
        key = typed_field(header, "key", str, what)
        if not 0 < len(key) <= 200:
            raise ProtocolError(f"{what}: the key is empty or too long")
        describe = header.get("describe", "")
        return cls(
            key,
            Call.decode(header.get("call"), what),
            describe if isinstance(describe, str) else "",
            decode_plugins(header.get("plugins", []), what),
            directory_field(header.get("cwd"), "cwd", what),
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
        args_nbytes = typed_field(header, "args_nbytes", int, what)
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
        return cls(Get.decode(request), typed_field(header, "reason", str, what)[:MAX_REASON])


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
        return cls(typed_field(header, "pid", int, "a ping reply"))


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
        return cls(typed_field(header, "cleared", int, "a clear reply"))


@dataclass(frozen=True)
class StatusReply:
    """What ``zerocopy-pickle status`` shows (informational: a JSON object)."""

    status: dict[str, Any]

    def encode(self) -> dict[str, Any]:
        return {"ok": True, "status": self.status}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> StatusReply:
        return cls(typed_field(header, "status", dict, "a status reply"))


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
        segments = int_list(header.get("segments"), "segments", what, MAX_FDS)
        if len(segments) != fds:
            raise ProtocolError(f"{what} does not match the file descriptors it sent")
        buffers = decode_buffer_table(header.get("buffers"), what)
        if not {row.segment for row in buffers} <= set(segments):
            raise ProtocolError(f"{what} refers to segments it did not send")
        return cls(
            bool(header.get("hit")),
            typed_field(header, "key", str, what),
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
