"""Internal: the cache's entries, in least-recently-used order, and the calls remembered as uncacheable.

An *entry* is one cached call: its pickle stream (small, kept in the server's memory) and a table of buffers,
each a range of a segment (``segments.py``), with the keys of the entries it references (its arguments). The
table here keeps them by key, least recently used first: the store evicts from the front. Beside them, the calls
whose results a client could not capture, with the files their keys were computed from, so that a miss is not
loaded again for nothing while those files stay what they were. This module needs only the standard library
(and ``zerocopy_pickle._storage.fileid``, which needs nothing else): the server never imports torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any

from .._storage.fileid import FileIdentity
from .fields import BufferRow, FileCheck, decode_buffer_table, decode_file_checks, decode_plugins, encode_buffer_table
from .messages import Get
from .protocol import ProtocolError

MAX_UNCACHEABLE = 4096
"""Calls the store remembers as uncacheable (the least recently asked for are forgotten first: they are tried
again)."""
MAX_UNCACHEABLE_FILES = 65_536
"""File checks the store keeps for them in all (a peer's reports bound what they make the server hold)."""


@dataclass
class Entry:
    """One cached call: its stream, its buffers (:class:`~zerocopy_pickle.cache.fields.BufferRow`), the keys of
    the entries it references, and the plugins its stream (``plugins``) and its pickled arguments
    (``args_plugins``) need, as a snapshot header records them."""

    key: str
    call: str
    stream: bytes
    buffers: list[BufferRow]
    refs: list[str]
    args: bytes = b""  # the call's pickled arguments, to rebuild this entry's result when it is an argument
    created: float = field(default_factory=time.time)
    hits: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # where the loader's time went (seconds)
    plugins: list[tuple[str, str]] = field(default_factory=list)
    args_plugins: list[tuple[str, str]] = field(default_factory=list)
    files: list[FileCheck] = field(default_factory=list)  # the files its key was computed from, as they were

    @property
    def segment_ids(self) -> list[int]:
        return sorted({row.segment for row in self.buffers})

    @property
    def nbytes(self) -> int:
        return sum(row.nbytes for row in self.buffers)

    def encode(self) -> dict[str, Any]:
        """The entry as the persisted index holds it."""
        return {**asdict(self), "buffers": encode_buffer_table(self.buffers), "stream": self.stream.hex(),
                "args": self.args.hex(), "plugins": [list(p) for p in self.plugins],
                "args_plugins": [list(p) for p in self.args_plugins],
                "files": [f.encode() for f in self.files]}  # fmt: skip

    @classmethod
    def decode(cls, row: Any) -> Entry:
        """An entry of the persisted index (already authenticated).

        Raises:
            ProtocolError, KeyError, TypeError, ValueError: it is malformed.
        """
        what = "a persisted entry"
        if not isinstance(row, dict):
            raise ProtocolError(f"{what} is not an object")
        refs = row["refs"]
        if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
            raise ProtocolError(f"{what} has malformed references")
        timings = row.get("timings", {})
        return cls(
            str(row["key"]),
            str(row["call"]),
            bytes.fromhex(row["stream"]),
            decode_buffer_table(row["buffers"], what),
            refs,
            bytes.fromhex(row["args"]),
            float(row["created"]),
            int(row["hits"]),
            {str(k): float(v) for k, v in timings.items()},
            decode_plugins(row["plugins"], what),
            decode_plugins(row["args_plugins"], what),
            decode_file_checks(row["files"], what),
        )


class Entries:
    """The entries by key, least recently used first, and the calls whose results cannot be captured. Not
    thread-safe: the store calls it under its lock."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        # Calls whose results a client could not capture: key -> (call, reason, the files its key was computed
        # from, how many times it was reported), oldest first, at most MAX_UNCACHEABLE.
        self._uncacheable: OrderedDict[str, tuple[str, str, list[FileCheck], int]] = OrderedDict()

    def view(self) -> Mapping[str, Entry]:
        """The entries by key, least recently used first (read-only)."""
        return MappingProxyType(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def rows(self) -> Iterator[BufferRow]:
        """Every buffer row of every entry."""
        for entry in self._entries.values():
            yield from entry.buffers

    def get(self, key: str) -> Entry | None:
        """The entry for ``key``, its place in the LRU order unchanged."""
        return self._entries.get(key)

    def touch(self, entry: Entry) -> None:
        """A hit: ``entry`` becomes the most recently used."""
        self._entries.move_to_end(entry.key)
        entry.hits += 1

    def put(self, entry: Entry) -> Entry | None:
        """Add ``entry`` as the most recently used; return the one it replaces under its key, if any."""
        old = self._entries.pop(entry.key, None)
        self._entries[entry.key] = entry
        return old

    def pop(self, key: str) -> Entry:
        return self._entries.pop(key)

    def oldest(self, keep: str | None = None) -> str | None:
        """The key of the least recently used entry other than ``keep``, or None."""
        return next((k for k in self._entries if k != keep), None)

    def clear(self) -> None:
        """Forget every entry (the uncacheable calls stay: :meth:`forget_uncacheable`)."""
        self._entries.clear()

    def closure(self, keys: list[str]) -> list[Entry] | None:
        """The entries for ``keys`` and, transitively, the entries they reference, dependencies first; None if
        any is missing (evicted)."""
        ordered: list[Entry] = []
        seen: set[str] = set()

        def visit(key: str) -> bool:
            if key in seen:
                return True
            entry = self._entries.get(key)
            if entry is None:
                return False
            seen.add(key)
            if not all(visit(ref) for ref in entry.refs):
                return False
            ordered.append(entry)
            return True

        return ordered if all(visit(key) for key in keys) else None

    def used_ranges(self) -> dict[int, dict[int, int]]:
        """segment -> {offset: nbytes} of the ranges entries use."""
        used: dict[int, dict[int, int]] = {}
        for row in self.rows():
            used.setdefault(row.segment, {})[row.offset] = row.nbytes
        return used

    def repoint(self, segment_id: int, new_id: int, layout: dict[int, int]) -> None:
        """Every row in ``segment_id`` moves to ``new_id``, its offset ``o`` to ``layout[o]`` (a compaction)."""
        for entry in self._entries.values():
            entry.buffers = [
                row._replace(segment=new_id, offset=layout[row.offset]) if row.segment == segment_id else row
                for row in entry.buffers
            ]

    # -- the calls whose results cannot be captured ----------------------------------------------------------------

    def mark_uncacheable(self, request: Get, reason: str) -> None:
        """Remember that the result of ``request``'s call cannot be captured, within :data:`MAX_UNCACHEABLE` calls
        and :data:`MAX_UNCACHEABLE_FILES` file checks (the least recently asked for go first; the newest stays)."""
        known = self._uncacheable.pop(request.key, None)
        count = known[3] + 1 if known is not None else 1
        self._uncacheable[request.key] = (request.describe or request.key, reason, list(request.files), count)
        while len(self._uncacheable) > MAX_UNCACHEABLE or (
            len(self._uncacheable) > 1
            and sum(len(row[2]) for row in self._uncacheable.values()) > MAX_UNCACHEABLE_FILES
        ):
            self._uncacheable.popitem(last=False)

    def uncacheable(self, key: str) -> str | None:
        """Why the result of ``key``'s call cannot be captured, if a client reported it and the files its key was
        computed from are unchanged since (a changed file forgets the report: the next miss tries again)."""
        known = self._uncacheable.get(key)
        if known is None:
            return None
        if files_changed(known[2]):
            del self._uncacheable[key]
            return None
        self._uncacheable.move_to_end(key)
        return known[1]

    def uncacheable_rows(self) -> list[dict[str, Any]]:
        """The uncacheable calls as ``status`` shows them, oldest first."""
        return [
            {"key": key, "call": call, "reason": reason, "reports": reports}
            for key, (call, reason, _, reports) in self._uncacheable.items()
        ]

    def forget_uncacheable(self) -> None:
        self._uncacheable.clear()


def files_changed(files: Sequence[FileCheck]) -> bool:
    """Whether any of ``files`` is not what it was (gone, or another size, mtime, ctime, inode or device: a
    rewrite in place, a replaced file, a re-pointed link, a moved Hub ref)."""
    for check in files:
        try:
            if FileIdentity.of_path(check.path) != check.identity:
                return True
        except OSError:
            return True
    return False
