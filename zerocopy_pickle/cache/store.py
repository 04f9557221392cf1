"""Internal: the server's memory: segments (sealed memfds of storage bytes, or checkpoint files) and the entries that
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
restarted server starts warm. The directory must be private (:func:`protocol.open_private_directory`), its
files are opened relative to it without following links, and the index is authenticated: an HMAC-SHA256, with
a per-user key kept in the private runtime directory, over the index, which lists every segment's SHA-256. A
restart verifies the code, then copies each segment into a new sealed memfd and checks its digest there, so what
clients map is exactly what was persisted and can no longer change; a segment that is missing or not what was
persisted drops only the entries using it (and those that took them as arguments); anything else amiss and the
server starts cold, having unpickled nothing (nothing in the directory is ever unpickled by the server: entries'
streams are bytes it hands to the user's own clients). This module needs only the standard library (and
``zerocopy_pickle._storage.format`` and ``arena``, which need nothing else): the server never imports torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import mmap
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._storage import arena, atomic, readahead
from .._storage.format import align_up, padded_pieces, place_buffers
from .messages import (
    BufferRow,
    FileCheck,
    Get,
    decode_buffer_table,
    decode_file_checks,
    decode_plugins,
    encode_buffer_table,
)
from .protocol import CacheError, ProtocolError, open_private_directory, runtime_dir

_INDEX = "index.json"
_INDEX_VERSION = 4  # 3: typed buffer rows and the plugins entries need; 4: the files each key was computed from
# (an older index is dropped: cold start)
KEY_FILE = "persist.key"
"""The persistence key's name in the runtime directory: 32 random bytes, mode 0600, one per user."""
_KEY_BYTES = 32
MAX_UNCACHEABLE = 4096
"""Calls the store remembers as uncacheable (the least recently asked for are forgotten first: they are tried
again)."""
MAX_UNCACHEABLE_FILES = 65_536
"""File checks the store keeps for them in all (a peer's reports bound what they make the server hold)."""

log = logging.getLogger(__name__)


class _ColdStart(Exception):
    """The persistence directory cannot be trusted or read: start cold (the reason is logged)."""


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
    identity: tuple[int, ...] | None = None  # a file segment's device, inode, size, mtime and ctime (ns)
    sha256: str | None = None  # a persisted memfd segment's digest (covered by the index's authentication code)

    def changed(self) -> bool:
        """Whether a file segment's file was modified since it was adopted (rewritten in place, truncated)."""
        return self.identity is not None and _identity(os.fstat(self.fd)) != self.identity


@dataclass
class Entry:
    """One cached call: its stream, its buffers (:class:`~zerocopy_pickle.cache.messages.BufferRow`), the keys of
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
                "files": [list(f) for f in self.files]}  # fmt: skip

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


class Store:
    """Entries and segments, with LRU eviction to ``max_bytes`` and optional persistence. Thread-safe."""

    def __init__(
        self, max_bytes: int | None = None, persist: Path | None = None, *, key_dir: Path | None = None
    ) -> None:
        """
        Args:
            max_bytes: evict least recently used entries to keep the memfd segments within this many bytes.
            persist: keep segments and an index in this directory (private: see
                :func:`protocol.open_private_directory`; created 0700), and start warm from it.
            key_dir: where the persistence key lives (default: :func:`protocol.runtime_dir`).

        Raises:
            CacheError: the persistence directory, the runtime directory or the key in it is not private.
        """
        self.lock = threading.RLock()
        self.max_bytes = max_bytes
        self.persist = persist
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.segments: dict[int, Segment] = {}
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.stale = 0
        # Calls whose results a client could not capture: key -> (call, reason, the files its key was computed
        # from, how many times it was reported), oldest first, at most MAX_UNCACHEABLE.
        self._uncacheable: OrderedDict[str, tuple[str, str, list[FileCheck], int]] = OrderedDict()
        self._next_segment = 1
        self._moved: dict[tuple[int, int], tuple[int, int]] = {}  # (segment, offset) -> where compaction put it
        self._dir_fd = -1
        self._key = b""
        self.cold_start: str | None = None  # why a persistence directory was not used to start warm
        if persist is not None:
            key, created = persistence_key(key_dir)
            self._dir_fd = open_private_directory(persist, what="persistence directory")
            self._key = key
            self._load_persisted(key_is_new=created)

    # -- lookups ------------------------------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The entry for ``key`` (marked most recently used, counted as a hit), or None (a miss). An entry whose
        files changed since it was made is dropped: its key was computed from files that are not the same any
        more (each file its key fingerprinted is checked again here, as is each checkpoint file it references)."""
        with self.lock:
            entry = self.entries.get(key)
            if entry is not None and (
                _files_changed(entry.files) or any(self.segments[i].changed() for i in entry.segment_ids)
            ):
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

    def mark_uncacheable(self, request: Get, reason: str) -> None:
        """Remember that the result of ``request``'s call cannot be captured (a client reported why), while the
        files its key was computed from stay what they were: :meth:`uncacheable` answers for it until then."""
        with self.lock:
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
        with self.lock:
            known = self._uncacheable.get(key)
            if known is None:
                return None
            if _files_changed(known[2]):
                del self._uncacheable[key]
                return None
            self._uncacheable.move_to_end(key)
            return known[1]

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

    def dedup_index(self, limit: int) -> tuple[list[int], list[tuple[str, int, int, int]]]:
        """Segments a loader may reference (at most ``limit``, most recent first) and ``[digest, segment,
        offset, nbytes]`` for every buffer in them."""
        with self.lock:
            ids = sorted(self.segments, reverse=True)[:limit]
            chosen = set(ids)
            index = []
            seen: set[tuple[int, int]] = set()
            for entry in self.entries.values():
                for row in entry.buffers:
                    place = (row.segment, row.offset)
                    if row.digest is not None and row.segment in chosen and place not in seen:
                        seen.add(place)
                        index.append((row.digest, row.segment, row.offset, row.nbytes))
            return ids, index

    # -- changes ------------------------------------------------------------------------------------------------

    def add(self, entry: Entry, new_segment_fd: int | None, file_fds: Sequence[int] = ()) -> Entry:
        """Register an entry whose buffers refer to existing segments, to the new memfd (place ``new``) or to the
        i-th of ``file_fds`` (place ``file``, segment ``i``).

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
            try:
                entry.buffers = self._place(entry.buffers, segment, file_ids)
            except CacheError:
                self._collect_unused()  # what was adopted for this entry alone
                raise
            missing = {row.segment for row in entry.buffers} - self.segments.keys()
            if missing:
                self._collect_unused()
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

    def _place(self, sent_rows: list[BufferRow], segment: Segment | None, file_ids: list[int]) -> list[BufferRow]:
        """A loader's rows as rows of the store: ``new`` and ``file`` places become the segments adopted for
        them, and ranges of segments compacted since the loader saw them move with them."""
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
        if self._dir_fd >= 0:
            name = f"segment-{segment.id}.bin"
            try:
                segment.sha256 = _digest(fd, segment.nbytes)
                with atomic.replacing(self._dir_fd, name) as out:
                    _send_all(out, fd, segment.nbytes)
                segment.path = name
            except OSError as e:  # the entry is served, just not persisted; the index on disk stays valid
                segment.sha256 = None
                log.warning("could not persist segment %d (%s)", segment.id, e)
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
            if segment.path is not None and self._dir_fd >= 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(segment.path, dir_fd=self._dir_fd)

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
            for row in entry.buffers:
                used.setdefault(row.segment, {})[row.offset] = row.nbytes
        freed = False
        for segment_id, ranges in used.items():
            segment = self.segments[segment_id]
            if segment.kind == "file":
                continue
            kept = sorted(ranges)
            offsets, size = place_buffers(ranges[offset] for offset in kept)
            layout = dict(zip(kept, offsets, strict=True))
            if align_up(size, mmap.PAGESIZE) >= segment.nbytes:
                continue
            new = self._adopt_segment(_copy_ranges(segment.fd, ranges, layout, size))
            for entry in self.entries.values():
                entry.buffers = [
                    row._replace(segment=new.id, offset=layout[row.offset]) if row.segment == segment_id else row
                    for row in entry.buffers
                ]
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
            self._uncacheable.clear()
            self._collect_unused()
            self._save_index()
            return count

    def close(self) -> None:
        with self.lock:
            self._forget_all()
            if self._dir_fd >= 0:
                os.close(self._dir_fd)
                self._dir_fd = -1

    def _forget_all(self) -> None:
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
                        "plugins": [name for name, _ in e.plugins],
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
                "uncacheable": [
                    {"key": key, "call": call, "reason": reason, "reports": reports}
                    for key, (call, reason, _, reports) in self._uncacheable.items()
                ],
                "persist": str(self.persist) if self.persist else None,
                "persist_cold_start": self.cold_start,
            }

    # -- persistence ----------------------------------------------------------------------------------------------

    def _save_index(self) -> None:
        """Write the index (authenticated) of the entries whose segments are all persisted. A failed write
        leaves the previous index as it was, and the server goes on serving from memory."""
        if self._dir_fd < 0:
            return
        saved = {
            s.id: {
                "id": s.id,
                "nbytes": s.nbytes,
                "kind": s.kind,
                "source": s.source,
                "identity": s.identity,
                "sha256": s.sha256,
            }
            for s in self.segments.values()
            if s.kind == "file" or s.sha256 is not None
        }
        body = json.dumps(
            {
                "segments": list(saved.values()),
                "entries": [e.encode() for e in self.entries.values() if all(i in saved for i in e.segment_ids)],
            }
        )
        mac = hmac.new(self._key, body.encode(), hashlib.sha256).hexdigest()
        blob = json.dumps({"version": _INDEX_VERSION, "body": body, "hmac_sha256": mac}).encode()
        try:
            with atomic.replacing(self._dir_fd, _INDEX) as out:
                arena.write_pieces(out, [blob])
        except OSError as e:
            log.warning("could not write the persistence index (%s); the previous one stays", e)

    def _load_persisted(self, *, key_is_new: bool) -> None:
        """Start warm from the persistence directory, or cold (saying why) if anything in it is not exactly what
        this user's server wrote with this user's key."""
        try:
            fd = _open_private_file(self._dir_fd, _INDEX)
        except FileNotFoundError:
            return
        except (OSError, _ColdStart) as e:
            self._start_cold(str(e))
            return
        reading: dict[str, readahead.Prefetch] = {}
        try:
            try:
                with os.fdopen(fd, "rb") as file:
                    raw = file.read()
                if key_is_new:
                    raise _ColdStart(f"the persistence key ({KEY_FILE}) was missing: the index cannot be verified")
                index = _verified_index(raw, self._key)
                rows = index["segments"]
                if not isinstance(rows, list):
                    raise _ColdStart("the index's segment list is malformed")
                reading = self._prefetch_persisted(rows)
                for row in rows:
                    segment_id = row["id"]
                    if type(segment_id) is not int or segment_id <= 0 or segment_id in self.segments:
                        raise _ColdStart(f"the index has a malformed segment id {segment_id!r}")
                    self._next_segment = max(self._next_segment, segment_id + 1)
                    if row["kind"] == "file":  # the user's file: usable if it is still the same file
                        reopened = _reopen_file(row)
                        if reopened is not None:
                            self.segments[reopened.id] = reopened
                        continue
                    restored = self._restore_segment(row)
                    if restored is not None:
                        self.segments[restored.id] = restored
                listed = [Entry.decode(row) for row in index["entries"]]
                kept = {e.key: e for e in listed if all(segment in self.segments for segment in e.segment_ids)}
                while True:  # and whatever references a dropped entry (its arguments), transitively
                    orphans = [key for key, e in kept.items() if not all(ref in kept for ref in e.refs)]
                    if not orphans:
                        break
                    for key in orphans:
                        del kept[key]
                for entry in kept.values():
                    self.entries[entry.key] = entry
                    for segment_id in entry.segment_ids:
                        self.segments[segment_id].users += 1
                self._collect_unused()
                if len(kept) < len(listed):
                    log.warning("%d persisted entries dropped (a segment missing or changed)",
                                len(listed) - len(kept))  # fmt: skip
                    self._save_index()
            except (OSError, ValueError, KeyError, TypeError, AttributeError, CacheError) as e:
                raise _ColdStart(f"the index or a segment is damaged ({type(e).__name__}: {e})") from e
            finally:
                for job in reading.values():  # the copied segments are read; adopted files go on reading
                    job.cancel()
        except _ColdStart as e:
            self._start_cold(str(e))

    def _prefetch_persisted(self, rows: list[Any]) -> dict[str, readahead.Prefetch]:
        """Start reading every persisted segment file and every adopted checkpoint file of the index into the page
        cache, a few sequential streams each (:mod:`zerocopy_pickle._storage.readahead`): the restore's copies and the
        first hits' touches then read at the disk's parallel rate. Returns the prefetches of the segment files, by name
        (the restore has read them once it is done); the checkpoint files' go on in the background. A row that does
        not name a regular file here is left to the checks of the restore."""
        segments: dict[str, readahead.Prefetch] = {}
        for row in rows:
            try:
                if row["kind"] == "file":
                    name, fd = str(row["source"]), os.open(row["source"], _READ_QUIETLY)
                else:
                    name = f"segment-{int(row['id'])}.bin"
                    fd = os.open(name, _READ_QUIETLY | os.O_NOFOLLOW, dir_fd=self._dir_fd)
            except (OSError, KeyError, TypeError, ValueError):
                continue
            try:
                job = readahead.start_file(fd, name=name)
            except OSError:
                continue
            finally:
                os.close(fd)
            if job is not None and row["kind"] != "file":
                segments[name] = job
        return segments

    def _restore_segment(self, row: dict[str, Any]) -> Segment | None:
        """A persisted segment copied into a new sealed memfd and checked against its digest there (what clients
        will map); None if its file is gone, or is not what was persisted (another size, other bytes: the file is
        removed): the entries using it are dropped, nothing else.

        Raises:
            _ColdStart: the file is not a private regular file of this user.
        """
        name = f"segment-{row['id']}.bin"
        nbytes, expected = row["nbytes"], row["sha256"]
        if type(nbytes) is not int or nbytes < 0 or not isinstance(expected, str):
            raise _ColdStart(f"the index describes segment {row['id']} wrongly")
        try:
            fd = _open_private_file(self._dir_fd, name)
        except FileNotFoundError:
            return None
        try:
            if os.fstat(fd).st_size != nbytes:
                self._drop_persisted(name, "has the wrong size")
                return None
            memfd = arena.create_memfd(f"zerocopy_pickle-cache-{row['id']}")
            try:
                _send_all(memfd, fd, nbytes)
                arena.seal(memfd)
                matches = hmac.compare_digest(_digest(memfd, nbytes), expected)
            except BaseException:
                os.close(memfd)
                raise
            if not matches:
                os.close(memfd)
                self._drop_persisted(name, "does not match its digest in the index")
                return None
        finally:
            os.close(fd)
        return Segment(row["id"], memfd, nbytes, path=name, sha256=expected)

    def _drop_persisted(self, name: str, why: str) -> None:
        log.warning("persisted segment %s %s: the entries using it are dropped", name, why)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=self._dir_fd)

    def _start_cold(self, reason: str) -> None:
        self._forget_all()
        self._next_segment = 1
        self.cold_start = reason
        log.warning("starting cold, not from %s: %s", self.persist, reason)


def persistence_key(directory: Path | None = None) -> tuple[bytes, bool]:
    """This user's persistence key and whether it was just created: :data:`KEY_FILE` in the private
    ``directory`` (default: :func:`protocol.runtime_dir`), created with 32 random bytes, mode 0600, without
    following links, published whole (linked into place) or not at all.

    Raises:
        CacheError: the directory is not private, or the key file is not a private regular file of 32 bytes.
    """
    dir_fd = open_private_directory(directory) if directory is not None else None
    if dir_fd is None:
        directory = runtime_dir()
        dir_fd = open_private_directory(directory)
    try:
        for _ in range(3):
            try:
                fd = _open_private_file(dir_fd, KEY_FILE)
            except FileNotFoundError:
                pass
            except _ColdStart as e:
                raise CacheError(f"{e}; remove it ({directory}/{KEY_FILE}): a new key is then made") from e
            else:
                with os.fdopen(fd, "rb") as file:
                    key = file.read(_KEY_BYTES + 1)
                if len(key) != _KEY_BYTES:
                    raise CacheError(
                        f"the persistence key {directory}/{KEY_FILE} is not {_KEY_BYTES} bytes long; remove it: a "
                        "new key is then made (persisted entries are then not used)"
                    )
                return key, False
            key = secrets.token_bytes(_KEY_BYTES)
            try:
                # Flushed: losing the key after a crash would cost every persisted entry (an index or segment
                # lost that way only means a cold start). Linked, not renamed: another server's key is kept.
                with atomic.replacing(dir_fd, KEY_FILE, fsync=True, replace=False) as out:
                    arena.write_pieces(out, [key])
            except FileExistsError:
                continue  # another server made one meanwhile: use that
            return key, True
        raise CacheError(f"cannot create the persistence key in {directory}")
    finally:
        os.close(dir_fd)


def _verified_index(raw: bytes, key: bytes) -> dict[str, Any]:
    outer = json.loads(raw)
    if not isinstance(outer, dict) or outer.get("version") != _INDEX_VERSION:
        raise _ColdStart("the index is not of this version's format")
    body, mac = outer.get("body"), outer.get("hmac_sha256")
    if not isinstance(body, str) or not isinstance(mac, str):
        raise _ColdStart("the index is malformed")
    if not hmac.compare_digest(hmac.new(key, body.encode(), hashlib.sha256).hexdigest(), mac):
        raise _ColdStart("the index's authentication code does not match (it was changed, or written with another key)")
    index = json.loads(body)
    if not isinstance(index, dict):
        raise _ColdStart("the index is malformed")
    return index


def _open_private_file(dir_fd: int, name: str) -> int:
    """``name`` in the directory ``dir_fd``, opened read-only without following a link, if it is a regular
    file of this user that nobody else may access.

    Raises:
        FileNotFoundError: there is no such file.
        _ColdStart: it is something else.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise _ColdStart(f"{name} cannot be opened as a plain file ({e.strerror})") from e
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.close(fd)
        raise _ColdStart(f"{name} is not a private regular file of yours (mode {info.st_mode:o}, uid {info.st_uid})")
    return fd


_READ_QUIETLY = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO planted in a row's place cannot block the open


def _send_all(out: int, fd: int, nbytes: int) -> None:
    offset = 0
    while offset < nbytes:
        sent = os.sendfile(out, fd, offset, nbytes - offset)
        if sent == 0:
            raise OSError(f"short copy: {nbytes - offset} bytes missing")
        offset += sent


def _digest(fd: int, nbytes: int) -> str:
    """SHA-256 of the first ``nbytes`` of ``fd`` (a sealed memfd: the bytes cannot change meanwhile)."""
    if not nbytes:
        return hashlib.sha256().hexdigest()
    with mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ) as memory:
        return hashlib.sha256(memory).hexdigest()


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


def _files_changed(files: Sequence[FileCheck]) -> bool:
    """Whether any of ``files`` is not what it was (gone, or another size, mtime, ctime, inode or device: a
    rewrite in place, a replaced file, a re-pointed link, a moved Hub ref)."""
    for check in files:
        try:
            info = os.stat(check.path)
        except OSError:
            return True
        if FileCheck.of(check.path, info) != check:
            return True
    return False


def _identity(info: os.stat_result) -> tuple[int, ...]:
    # ctime too: a write changes it, and unlike mtime nobody can set it back.
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


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
        written = arena.write_pieces(out, pieces)
        del pieces
    if written != size:
        raise OSError(f"short write while compacting a segment: {written} of {size} bytes")
