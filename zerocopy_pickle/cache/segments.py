"""Internal: the segments the cache holds (sealed memfds of storage bytes, or checkpoint files) and what is done
with them: adopting what a loader sends, placing its rows in them, the dedup index, compaction, freeing.

A loader writes each new storage once into a new sealed memfd; a storage that is already in the cache (the
``vae`` of a pipeline loaded with ``vae=vae``, the same checkpoint loaded twice) is referenced where it is, after
the loader compared its bytes. So segments are shared between entries and counted (``users``): a segment is
freed when the last entry using it is evicted.

Sharing makes eviction subtle: an entry that survives may use a few buffers of a large segment whose other users
were evicted (the LayerNorm weights two checkpoints have in common), which would keep the whole segment alive.
So before evicting anything more, the store *compacts*: :meth:`Segments.compact` copies the ranges still in use
into a new, smaller sealed memfd and the entries are repointed. Clients that mapped the old segment keep their
mapping; a load in flight that references the old ranges is repointed when its entry arrives
(:meth:`Segments.place`). This module needs only the standard library (and ``zerocopy_pickle._storage``'s
``arena``, ``fileid``, ``format`` and ``writes``, which need nothing else): the server never imports torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .._storage import arena, writes
from .._storage.fileid import FileIdentity
from .._storage.format import align_up, padded_pieces, place_buffers
from .fields import BufferRow
from .protocol import CacheError


@dataclass
class Segment:
    """A sealed memfd the cache owns (``kind="memfd"``), or a user's file whose pages entries reference
    (``kind="file"``: a checkpoint a loader mapped and left untouched; see ``filebacked.py``)."""

    id: int
    fd: int
    nbytes: int
    users: int = 0
    path: str | None = None  # the persisted copy of a memfd segment, in the persistence directory (deleted with it)
    kind: str = "memfd"
    source: str | None = None  # a file segment's path when it was adopted (for persistence and status)
    identity: FileIdentity | None = None  # a file segment's file, as it was when adopted
    sha256: str | None = None  # a persisted memfd segment's digest (covered by the index's authentication code)

    def changed(self) -> bool:
        """Whether a file segment's file was modified since it was adopted (rewritten in place, truncated)."""
        return self.identity is not None and FileIdentity.of_fd(self.fd) != self.identity


class Segments:
    """The segments by id, each counting the entries that use it. Not thread-safe: the store calls it under its
    lock."""

    def __init__(
        self,
        *,
        persist: Callable[[Segment], None] | None = None,
        forget: Callable[[Segment], None] | None = None,
    ) -> None:
        """
        Args:
            persist: called with each new memfd segment before it is added (to write its persisted copy).
            forget: called with each segment freed, after its fd is closed (to remove its persisted copy).
        """
        self._segments: dict[int, Segment] = {}
        self._next = 1
        self._moved: dict[tuple[int, int], tuple[int, int]] = {}  # (segment, offset) -> where compaction put it
        self._persist = persist
        self._forget = forget

    def view(self) -> Mapping[int, Segment]:
        """The segments by id (read-only)."""
        return MappingProxyType(self._segments)

    def values(self) -> Iterable[Segment]:
        return self._segments.values()

    def __len__(self) -> int:
        return len(self._segments)

    def __contains__(self, segment_id: object) -> bool:
        return segment_id in self._segments

    def missing(self, ids: Iterable[int]) -> set[int]:
        return set(ids) - self._segments.keys()

    def changed(self, ids: Iterable[int]) -> bool:
        """Whether the file of any of the file segments ``ids`` changed since it was adopted."""
        return any(self._segments[i].changed() for i in ids)

    def duplicate_fds(self, ids: Iterable[int]) -> list[int]:
        """Duplicates of the segments' fds, which the caller closes (the segments' own may be closed at any moment
        once the store's lock is released)."""
        fds: list[int] = []
        try:
            for segment_id in ids:
                fds.append(os.dup(self._segments[segment_id].fd))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def memfd_bytes(self) -> int:
        return sum(s.nbytes for s in self._segments.values() if s.kind == "memfd")

    def file_bytes(self) -> int:
        return sum(s.nbytes for s in self._segments.values() if s.kind == "file")

    def files(self) -> list[str]:
        return sorted(s.source or "?" for s in self._segments.values() if s.kind == "file")

    def dedup_index(self, limit: int, rows: Iterable[BufferRow]) -> tuple[list[int], list[tuple[str, int, int, int]]]:
        """Segments a loader may reference (at most ``limit``, most recent first) and ``[digest, segment,
        offset, nbytes]`` for every buffer of ``rows`` (the entries') in them."""
        ids = sorted(self._segments, reverse=True)[:limit]
        chosen = set(ids)
        index = []
        seen: set[tuple[int, int]] = set()
        for row in rows:
            place = (row.segment, row.offset)
            if row.digest is not None and row.segment in chosen and place not in seen:
                seen.add(place)
                index.append((row.digest, row.segment, row.offset, row.nbytes))
        return ids, index

    # -- adopting, placing, freeing ------------------------------------------------------------------------------

    def adopt_memfd(self, fd: int) -> Segment:
        """A new segment for the sealed memfd ``fd`` (taking ownership of it).

        Raises:
            CacheError: ``fd`` is not a sealed memfd (it is closed).
        """
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            os.close(fd)
            raise CacheError("a loader sent a segment that is not a memfd") from e
        if seals & arena.SEALS != arena.SEALS:
            os.close(fd)
            raise CacheError("a loader sent a segment that is not sealed")
        segment = Segment(self._next, fd, os.fstat(fd).st_size)
        self._next += 1
        if self._persist is not None:
            self._persist(segment)
        self._segments[segment.id] = segment
        return segment

    def adopt_file(self, fd: int) -> int:
        """A file segment for ``fd`` (the existing one if this file, unchanged, is one already; taking ownership
        of ``fd``).

        Raises:
            CacheError: ``fd`` is not a regular file (it is closed).
        """
        try:
            info = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise CacheError("a loader sent a file that cannot be examined") from e
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise CacheError("a loader sent a file segment that is not a regular file")
        found = FileIdentity.of(info)
        for segment in self._segments.values():
            if segment.identity == found:
                os.close(fd)
                return segment.id
        source = None
        with contextlib.suppress(OSError):
            source = os.readlink(f"/proc/self/fd/{fd}")
        segment = Segment(self._next, fd, info.st_size, kind="file", source=source, identity=found)
        self._next += 1
        self._segments[segment.id] = segment
        return segment.id

    def restore(self, segment: Segment) -> None:
        """Add a segment restored from the persistence directory (its id reserved with :meth:`reserve`)."""
        self._segments[segment.id] = segment

    def reserve(self, segment_id: int) -> None:
        """New segments get ids above ``segment_id`` (one the persisted index lists)."""
        self._next = max(self._next, segment_id + 1)

    def place(self, sent_rows: list[BufferRow], segment: Segment | None, file_ids: list[int]) -> list[BufferRow]:
        """A loader's rows as rows of the store: ``new`` and ``file`` places become the segments adopted for
        them, and ranges of segments compacted since the loader saw them move with them.

        Raises:
            CacheError: a row refers to a new segment or a file that was not sent.
        """
        rows = []
        for sent in sent_rows:
            row = sent
            if sent.place == "new":
                if segment is None:
                    raise CacheError("the entry refers to a new segment that was not sent")
                row = sent._replace(segment=segment.id, place="segment")
            elif sent.place == "file":
                if sent.segment >= len(file_ids):
                    raise CacheError(f"the entry refers to file {sent.segment}, which was not sent")
                row = sent._replace(segment=file_ids[sent.segment], place="segment")
            elif (sent.segment, sent.offset) in self._moved:  # a range in a segment compacted since
                moved_segment, moved_offset = self._moved[sent.segment, sent.offset]
                row = sent._replace(segment=moved_segment, offset=moved_offset)
            rows.append(row)
        return rows

    def hold(self, ids: Iterable[int]) -> None:
        """One more entry uses each of the segments ``ids``."""
        for segment_id in ids:
            self._segments[segment_id].users += 1

    def release(self, ids: Iterable[int]) -> None:
        """One entry fewer uses each of the segments ``ids`` (freed by :meth:`collect_unused`)."""
        for segment_id in ids:
            segment = self._segments.get(segment_id)
            if segment is not None:
                segment.users -= 1

    def collect_unused(self) -> None:
        """Free every segment no entry uses."""
        for segment_id in [i for i, s in self._segments.items() if s.users <= 0]:
            self._moved = {k: v for k, v in self._moved.items() if v[0] != segment_id}
            segment = self._segments.pop(segment_id)
            os.close(segment.fd)
            if self._forget is not None:
                self._forget(segment)

    def forget_all(self, *, restart_ids: bool = False) -> None:
        """Close every segment (nothing persisted is removed); with ``restart_ids``, new ids start at 1 again."""
        for segment in self._segments.values():
            os.close(segment.fd)
        self._segments.clear()
        if restart_ids:
            self._next = 1

    # -- compaction ------------------------------------------------------------------------------------------------

    def compact(self, used: dict[int, dict[int, int]], repoint: Callable[[int, int, dict[int, int]], None]) -> bool:
        """Copy the ranges still in use (``used``: segment -> {offset: nbytes}) of every memfd segment that holds
        unused bytes into a new segment, calling ``repoint(old, new, layout)`` (offset -> new offset) to move the
        entries' rows at once; return whether that freed anything."""
        freed = False
        for segment_id, ranges in used.items():
            segment = self._segments[segment_id]
            if segment.kind == "file":
                continue
            kept = sorted(ranges)
            offsets, size = place_buffers(ranges[offset] for offset in kept)
            layout = dict(zip(kept, offsets, strict=True))
            if align_up(size, mmap.PAGESIZE) >= segment.nbytes:
                continue
            new = self.adopt_memfd(_copy_ranges(segment.fd, ranges, layout, size))
            repoint(segment_id, new.id, layout)
            for source, (moved_segment, moved_offset) in list(self._moved.items()):  # keep earlier moves current
                if moved_segment == segment_id:
                    if moved_offset in layout:
                        self._moved[source] = (new.id, layout[moved_offset])
                    else:
                        del self._moved[source]
            self._moved.update({(segment_id, offset): (new.id, at) for offset, at in layout.items()})
            new.users, segment.users = segment.users, 0
            freed = True
        if freed:
            self.collect_unused()
        return freed


def _copy_ranges(fd: int, ranges: dict[int, int], layout: dict[int, int], size: int) -> int:
    """A new sealed memfd of ``size`` bytes holding each range ``offset: nbytes`` of ``fd`` at ``layout[offset]``
    (zero bytes between them: the pieces of :func:`format.padded_pieces`, written in one pass)."""
    out = arena.create_memfd("zerocopy_pickle-cache-compacted")
    try:
        if size:
            with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ) as source:
                _write_ranges(out, source, ranges, layout, size)
        arena.seal(out)
    except BaseException:
        os.close(out)
        raise
    return out


def _write_ranges(out: int, source: mmap.mmap, ranges: dict[int, int], layout: dict[int, int], size: int) -> None:
    # Every view of `source` dies when this returns, before the caller closes the mapping.
    with memoryview(source) as view:
        kept = sorted(ranges, key=layout.__getitem__)
        pieces = padded_pieces([view[o : o + ranges[o]] for o in kept], [layout[o] for o in kept], end=size)
        written = writes.write_pieces(out, pieces)
        del pieces
    if written != size:
        raise OSError(f"short write while compacting a segment: {written} of {size} bytes")
