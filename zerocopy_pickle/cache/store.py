"""The server's memory: segments (sealed memfds of storage bytes, or checkpoint files) and the entries that
reference them.

An *entry* is one cached call: its pickle stream (small, kept in the server's memory) and a table of buffers,
each a range of a *segment*. A loader writes each new storage once into a new sealed memfd; a storage that is
already in the cache (the ``vae`` of a pipeline loaded with ``vae=vae``, the same checkpoint loaded twice) is
referenced where it is, after the loader compared its bytes. So segments are shared between entries and
counted: a segment is freed when the last entry using it is evicted.

Entries are kept in LRU order; :meth:`Store.add` evicts the least recently used ones until the segments fit
in ``max_bytes``. Sharing makes that subtle: an entry that survives may use a few buffers of a large segment
whose other users were evicted (the LayerNorm weights two checkpoints have in common), which would keep the
whole segment alive. So before evicting anything more, the store *compacts*: it copies the ranges still in use
into a new, smaller sealed memfd and repoints the entries. Clients that mapped the old segment keep their
mapping; a load in flight that references the old ranges is repointed when its entry arrives.

With a persistence directory, each segment is also written to a file and the entries to an index, so a
restarted server starts warm. This module needs only the standard library (and ``zerocopy_pickle.format`` and
``arena``, which need nothing else): the server never imports torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import arena
from ..format import align_up, buffer_alignment
from .protocol import CacheError

__all__ = ["Entry", "Segment", "Store"]

_INDEX = "index.json"


@dataclass
class Segment:
    """A sealed memfd the cache owns (``kind="memfd"``), or a user's file whose pages entries reference
    (``kind="file"``: a checkpoint a loader mapped and left untouched; see ``filebacked.py``)."""

    id: int
    fd: int
    nbytes: int
    users: int = 0
    path: str | None = None  # the persisted copy of a memfd segment (deleted with the segment)
    kind: str = "memfd"
    source: str | None = None  # a file segment's path when it was adopted (for persistence and status)
    identity: tuple[int, ...] | None = None  # a file segment's device, inode, size, mtime and ctime (ns)

    def changed(self) -> bool:
        """Whether a file segment's file was modified since it was adopted (rewritten in place, truncated)."""
        return self.identity is not None and _identity(os.fstat(self.fd)) != self.identity


@dataclass
class Entry:
    """One cached call. ``buffers`` rows are ``[segment id, offset, nbytes, location, digest]``."""

    key: str
    call: str
    stream: bytes
    buffers: list[list[Any]]
    refs: list[str]
    args: bytes = b""  # the call's pickled arguments, to rebuild this entry's result when it is an argument
    created: float = field(default_factory=time.time)
    hits: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # where the loader's time went (seconds)

    @property
    def segment_ids(self) -> list[int]:
        return sorted({row[0] for row in self.buffers})

    @property
    def nbytes(self) -> int:
        return sum(row[2] for row in self.buffers)


class Store:
    """Entries and segments, with LRU eviction to ``max_bytes`` and optional persistence. Thread-safe."""

    def __init__(self, max_bytes: int | None = None, persist: Path | None = None) -> None:
        self.lock = threading.RLock()
        self.max_bytes = max_bytes
        self.persist = persist
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.segments: dict[int, Segment] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.stale = 0
        self._next_segment = 1
        self._moved: dict[tuple[int, int], tuple[int, int]] = {}  # (segment, offset) -> where compaction put it
        if persist is not None:
            persist.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._load_persisted()

    # -- lookups ------------------------------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The entry for ``key`` (marked most recently used, counted as a hit), or None (a miss). An entry whose
        files changed since it was made is dropped: its key fingerprinted files that are not the same any more."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None and any(self.segments[i].changed() for i in entry.segment_ids):
                self._release(self.entries.pop(key))
                self.stale += 1
                self._collect_unused()
                self._save_index()
                entry = None
            if entry is None:
                self.misses += 1
                return None
            self.entries.move_to_end(key)
            entry.hits += 1
            self.hits += 1
            return entry

    def peek(self, key: str) -> Entry | None:
        with self.lock:
            return self.entries.get(key)

    def closure(self, keys: list[str]) -> list[Entry] | None:
        """The entries for ``keys`` and, transitively, the entries they reference, dependencies first; None if
        any is missing (evicted)."""
        with self.lock:
            ordered: list[Entry] = []
            seen: set[str] = set()

            def visit(key: str) -> bool:
                if key in seen:
                    return True
                entry = self.entries.get(key)
                if entry is None:
                    return False
                seen.add(key)
                if not all(visit(ref) for ref in entry.refs):
                    return False
                ordered.append(entry)
                return True

            return ordered if all(visit(key) for key in keys) else None

    def segment_fds(self, ids: list[int]) -> list[int]:
        with self.lock:
            return [self.segments[i].fd for i in ids]

    def dedup_index(self, limit: int) -> tuple[list[int], list[list[Any]]]:
        """Segments a loader may reference (at most ``limit``, most recent first) and ``[digest, segment,
        offset, nbytes]`` for every buffer in them."""
        with self.lock:
            ids = sorted(self.segments, reverse=True)[:limit]
            chosen = set(ids)
            index = []
            seen: set[tuple[int, int]] = set()
            for entry in self.entries.values():
                for segment, offset, nbytes, _location, digest in entry.buffers:
                    if digest is not None and segment in chosen and (segment, offset) not in seen:
                        seen.add((segment, offset))
                        index.append([digest, segment, offset, nbytes])
            return ids, index

    # -- changes ------------------------------------------------------------------------------------------------

    def add(self, entry: Entry, new_segment_fd: int | None, file_fds: Sequence[int] = ()) -> Entry:
        """Register an entry whose buffers refer to existing segments, to the new memfd (segment 0) or to the
        i-th of ``file_fds`` (segment ``-(i + 1)``).

        Takes ownership of ``new_segment_fd`` and ``file_fds``.

        Raises:
            CacheError: the new segment is not a sealed memfd, a file is not a regular file, or the entry refers
                to unknown segments.
        """
        with self.lock:
            pending = [fd for fd in (new_segment_fd, *file_fds) if fd is not None]
            try:
                file_ids = [self._adopt_file(pending.pop()) for _ in file_fds][::-1]
                segment = self._adopt_segment(pending.pop()) if new_segment_fd is not None else None
            except BaseException:
                for fd in pending:
                    os.close(fd)
                self._collect_unused()  # file segments adopted for this entry and used by no other
                raise
            for row in entry.buffers:
                if row[0] == 0 and segment is not None:
                    row[0] = segment.id
                elif row[0] < 0 and -row[0] <= len(file_ids):
                    row[0] = file_ids[-row[0] - 1]
            for row in entry.buffers:  # ranges the loader found in segments compacted since
                if (row[0], row[1]) in self._moved:
                    row[0], row[1] = self._moved[row[0], row[1]]
            missing = {row[0] for row in entry.buffers} - self.segments.keys()
            if missing:
                raise CacheError(f"the entry refers to segments {sorted(missing)}, which are gone")
            old = self.entries.pop(entry.key, None)
            if old is not None:
                self._release(old)
            for segment_id in entry.segment_ids:
                self.segments[segment_id].users += 1
            self.entries[entry.key] = entry
            self._collect_unused()
            self._evict(keep=entry.key)
            self._save_index()
            return entry

    def _adopt_segment(self, fd: int) -> Segment:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as e:
            os.close(fd)
            raise CacheError("a loader sent a segment that is not a memfd") from e
        if seals & arena.SEALS != arena.SEALS:
            os.close(fd)
            raise CacheError("a loader sent a segment that is not sealed")
        segment = Segment(self._next_segment, fd, os.fstat(fd).st_size)
        self._next_segment += 1
        if self.persist is not None:
            segment.path = str(self.persist / f"segment-{segment.id}.bin")
            _copy_to_file(fd, segment.path, segment.nbytes)
        self.segments[segment.id] = segment
        return segment

    def _adopt_file(self, fd: int) -> int:
        """A file segment for ``fd`` (the existing one if this file, unchanged, is one already)."""
        try:
            info = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            raise CacheError("a loader sent a file that cannot be examined") from e
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise CacheError("a loader sent a file segment that is not a regular file")
        identity = _identity(info)
        for segment in self.segments.values():
            if segment.identity == identity:
                os.close(fd)
                return segment.id
        source = None
        with contextlib.suppress(OSError):
            source = os.readlink(f"/proc/self/fd/{fd}")
        segment = Segment(self._next_segment, fd, info.st_size, kind="file", source=source, identity=identity)
        self._next_segment += 1
        self.segments[segment.id] = segment
        return segment.id

    def _release(self, entry: Entry) -> None:
        for segment_id in entry.segment_ids:
            segment = self.segments.get(segment_id)
            if segment is not None:
                segment.users -= 1

    def _collect_unused(self) -> None:
        for segment_id in [i for i, s in self.segments.items() if s.users <= 0]:
            self._moved = {k: v for k, v in self._moved.items() if v[0] != segment_id}
            segment = self.segments.pop(segment_id)
            os.close(segment.fd)
            if segment.path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(segment.path)

    def total_bytes(self) -> int:
        """The bytes of the cache's own segments (memfds): what ``max_bytes`` bounds. File segments are the
        user's files; their pages are ordinary page cache, which the kernel reclaims by itself."""
        with self.lock:
            return sum(s.nbytes for s in self.segments.values() if s.kind == "memfd")

    def _evict(self, keep: str | None = None) -> None:
        if self.max_bytes is None:
            return
        while self.total_bytes() > self.max_bytes:
            if self._compact():
                continue
            victim = next((k for k in self.entries if k != keep), None)
            if victim is None:
                return  # only the newest entry is left: it stays, even above the budget
            self._release(self.entries.pop(victim))
            self.evictions += 1
            self._collect_unused()

    def _compact(self) -> bool:
        """Copy the ranges still in use of every segment that holds unused bytes into new segments; return
        whether that freed anything."""
        used: dict[int, dict[int, int]] = {}  # segment -> {offset: nbytes} of the ranges entries use
        for entry in self.entries.values():
            for segment_id, offset, nbytes, *_ in entry.buffers:
                used.setdefault(segment_id, {})[offset] = nbytes
        freed = False
        for segment_id, ranges in used.items():
            segment = self.segments[segment_id]
            if segment.kind == "file":
                continue
            layout, size = {}, 0
            for offset in sorted(ranges):
                size = align_up(size, buffer_alignment(ranges[offset]))
                layout[offset] = size
                size += ranges[offset]
            if align_up(size, mmap.PAGESIZE) >= segment.nbytes:
                continue
            new = self._adopt_segment(_copy_ranges(segment.fd, ranges, layout, size))
            for entry in self.entries.values():
                for row in entry.buffers:
                    if row[0] == segment_id:
                        row[0], row[1] = new.id, layout[row[1]]
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
            self._collect_unused()
        return freed

    def clear(self) -> int:
        """Drop every entry and segment; return how many entries there were."""
        with self.lock:
            count = len(self.entries)
            for entry in self.entries.values():
                self._release(entry)
            self.entries.clear()
            self._collect_unused()
            self._save_index()
            return count

    def close(self) -> None:
        with self.lock:
            for segment in self.segments.values():
                os.close(segment.fd)
            self.segments.clear()
            self.entries.clear()

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {
                "entries": [
                    {
                        "key": e.key,
                        "call": e.call,
                        "nbytes": e.nbytes,
                        "hits": e.hits,
                        "refs": e.refs,
                        "timings": e.timings,
                    }
                    for e in self.entries.values()
                ],
                "segments": len(self.segments),
                "total_bytes": self.total_bytes(),
                "file_bytes": sum(s.nbytes for s in self.segments.values() if s.kind == "file"),
                "files": sorted(s.source or "?" for s in self.segments.values() if s.kind == "file"),
                "logical_bytes": sum(e.nbytes for e in self.entries.values()),
                "max_bytes": self.max_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "evictions": self.evictions,
                "stale": self.stale,
                "persist": str(self.persist) if self.persist else None,
            }

    # -- persistence ----------------------------------------------------------------------------------------------

    def _save_index(self) -> None:
        if self.persist is None:
            return
        index = {
            "version": 1,
            "segments": [
                {"id": s.id, "nbytes": s.nbytes, "kind": s.kind, "source": s.source, "identity": s.identity}
                for s in self.segments.values()
            ],
            "entries": [{**asdict(e), "stream": e.stream.hex(), "args": e.args.hex()} for e in self.entries.values()],
        }
        with arena.atomic_output(self.persist / _INDEX) as fd:
            os.fchmod(fd, 0o600)
            arena.write_pieces(fd, [json.dumps(index).encode()])

    def _load_persisted(self) -> None:
        assert self.persist is not None
        path = self.persist / _INDEX
        if not path.exists():
            return
        try:
            index = json.loads(path.read_text())
            for row in index["segments"]:
                self._next_segment = max(self._next_segment, row["id"] + 1)
                if row.get("kind") == "file":  # the user's file: usable if it is still the same file
                    reopened = _reopen_file(row)
                    if reopened is not None:
                        self.segments[reopened.id] = reopened
                    continue
                file = self.persist / f"segment-{int(row['id'])}.bin"
                fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
                if os.fstat(fd).st_size != row["nbytes"]:
                    os.close(fd)
                    raise CacheError(f"persisted segment {file} has the wrong size")
                self.segments[row["id"]] = Segment(row["id"], fd, row["nbytes"], path=str(file))
            for row in index["entries"]:
                entry = Entry(**{**row, "stream": bytes.fromhex(row["stream"]), "args": bytes.fromhex(row["args"])})
                if all(segment in self.segments for segment in entry.segment_ids):
                    self.entries[entry.key] = entry
                    for segment_id in entry.segment_ids:
                        self.segments[segment_id].users += 1
            self._collect_unused()
        except (OSError, ValueError, KeyError, TypeError, CacheError):
            # A damaged persistence directory must never stop the server: start cold, keep nothing.
            self.close()
            self.entries.clear()


def _reopen_file(row: dict[str, Any]) -> Segment | None:
    try:
        fd = os.open(row["source"], os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    identity = _identity(os.fstat(fd))
    if list(identity) != list(row["identity"]):
        os.close(fd)
        return None
    return Segment(row["id"], fd, row["nbytes"], kind="file", source=row["source"], identity=identity)


def _identity(info: os.stat_result) -> tuple[int, ...]:
    # ctime too: a write changes it, and unlike mtime nobody can set it back.
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _copy_ranges(fd: int, ranges: dict[int, int], layout: dict[int, int], size: int) -> int:
    """A new sealed memfd of ``size`` bytes holding each range ``offset: nbytes`` of ``fd`` at ``layout[offset]``."""
    out = arena.create_memfd("zerocopy_pickle-cache-compacted")
    try:
        os.ftruncate(out, size)
        if size:
            with (
                mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ) as source,
                mmap.mmap(out, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as target,
            ):
                for offset, nbytes in ranges.items():
                    target[layout[offset] : layout[offset] + nbytes] = source[offset : offset + nbytes]
        arena.seal(out)
    except BaseException:
        os.close(out)
        raise
    return out


def _copy_to_file(fd: int, path: str, nbytes: int) -> None:
    """Persist a segment: written whole under ``path`` (private), or not at all."""
    with arena.atomic_output(path) as out:
        os.fchmod(out, 0o600)
        offset = 0
        while offset < nbytes:
            sent = os.sendfile(out, fd, offset, nbytes - offset)
            if sent == 0:
                raise CacheError(f"short copy while persisting a segment to {path}")
            offset += sent
