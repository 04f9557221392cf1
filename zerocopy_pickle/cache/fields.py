"""Internal: the parts the cache's messages are made of, each validated when it is decoded (a field of the wrong
type or out of range is a :class:`protocol.ProtocolError`): an entry's buffer rows (:class:`BufferRow`, the
persisted index's too: ``persistence.py``), the files a key was computed from (:class:`FileCheck`), the call a
request runs (:class:`Call`), plugin lists, and the typed field checks every ``decode`` of ``messages.py`` and
``jobs.py`` starts from.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .._storage.fileid import FileIdentity
from .protocol import MAX_BUFFERS, ProtocolError

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
    symlinks) and the identity :func:`os.stat` gave. Sent and persisted as one flat row, ``[path, size,
    mtime_ns, ctime_ns, ino, dev]`` (:meth:`encode`, :func:`decode_file_checks`)."""

    path: str
    identity: FileIdentity

    @classmethod
    def of(cls, path: str, info: os.stat_result) -> FileCheck:
        return cls(path, FileIdentity.of(info))

    def encode(self) -> list[Any]:
        return [self.path, *self.identity]


def decode_file_checks(value: Any, what: str) -> list[FileCheck]:
    """``[[path, size, mtime_ns, ctime_ns, ino, dev], ...]`` (:meth:`FileCheck.encode`): the files a key was
    computed from."""
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
        directory_field(row[0], "files", what)  # an absolute path of bounded length
        checks.append(FileCheck(row[0], FileIdentity(*row[1:])))
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


def typed_field(header: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or (kind is int and type(value) is bool):
        raise ProtocolError(f"{what}: field {name!r} is missing or of the wrong type ({type(value).__name__})")
    return value


def string_list(value: Any, name: str, what: str, limit: int = MAX_BUFFERS) -> list[str]:
    if not isinstance(value, list) or len(value) > limit or not all(isinstance(v, str) for v in value):
        raise ProtocolError(f"{what}: field {name!r} is not a list of strings")
    return list(value)


def int_list(value: Any, name: str, what: str, limit: int) -> list[int]:
    if not isinstance(value, list) or len(value) > limit or not all(type(v) is int for v in value):
        raise ProtocolError(f"{what}: field {name!r} is not a list of at most {limit} integers")
    return list(value)


def directory_field(value: Any, name: str, what: str) -> str | None:
    """An absolute path of a directory (or None): where a call's relative paths resolve."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/") or len(value) > 4096 or "\0" in value:
        raise ProtocolError(f"{what}: field {name!r} is not an absolute path")
    return value


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
        function = typed_field(value, "function", str, what)
        owner = value.get("cls")
        if owner is not None and not isinstance(owner, str):
            raise ProtocolError(f"{what}: 'cls' is not a string")
        return cls(function, owner, string_list(value.get("refs", []), "refs", what))
