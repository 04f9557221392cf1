"""Internal: the messages between the server and its loader (``loader.py``): the zygote's :class:`Ready`, the
modules it should import ahead (:class:`Preload`), a miss for it to load (:class:`Job`, with the cached entries
its call references: :class:`JobRef`), and a loader child's entry (:class:`JobResult`, also the entry of a client's
``messages.Put``). The server stops the zygote with ``messages.Stop``; a child that fails sends
``messages.Failure``. Each kind has ``encode`` and a validating ``decode``, as in ``messages.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .fields import (
    PLACES,
    BufferRow,
    Call,
    decode_buffer_table,
    decode_plugins,
    directory_field,
    encode_buffer_table,
    int_list,
    string_list,
    typed_field,
)
from .protocol import MAX_BUFFERS, MAX_FDS, ProtocolError


@dataclass(frozen=True)
class Ready:
    """The zygote imported what it preloads and waits for jobs."""

    OP: ClassVar[str] = "ready"
    pid: int

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP, "pid": self.pid}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Ready:
        return cls(typed_field(header, "pid", int, "a ready message"))


@dataclass(frozen=True)
class Preload:
    """Modules the zygote should import now (what children imported by themselves)."""

    OP: ClassVar[str] = "preload"
    modules: list[str]

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP, "modules": list(self.modules)}

    @classmethod
    def decode(cls, header: dict[str, Any]) -> Preload:
        return cls(string_list(header.get("modules", []), "modules", "a preload message"))


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
        sizes = [typed_field(value, name, int, what) for name in ("args_nbytes", "stream_nbytes")]
        if min(sizes) < 0:
            raise ProtocolError(f"{what} has a negative size")
        return cls(
            typed_field(value, "key", str, what),
            sizes[0],
            sizes[1],
            decode_buffer_table(value.get("buffers"), what),
            string_list(value.get("refs", []), "refs", what),
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
            int_list(header.get("segments"), "segments", what, MAX_FDS),
            rows,
            bool(header.get("file_segments", True)),
            directory_field(header.get("workdir"), "workdir", what),
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
        files = typed_field(header, "files", int, what)
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
            string_list(header.get("imported", []), "imported", what),
            {str(k): float(v) for k, v in timings.items()},
            new_segment,
            files,
        )
