"""Internal: the server's memory, one facade over its parts: the segments (``segments.py``: sealed memfds of
storage bytes, or checkpoint files), the entries that reference them (``lru.py``: one cached call each, in LRU
order, and the calls that cannot be captured) and, optionally, the persistence directory (``persistence.py``).

Every method takes the store's one lock, and nothing outside the store sees its tables: what the server needs
under the lock (an entry's segments with their fds duplicated, say) is a method here. :meth:`Store.add` evicts
the least recently used entries until the memfd segments fit in ``max_bytes``, compacting partly used segments
first. This module needs only the standard library (and ``zerocopy_pickle._storage``'s modules, which need
nothing else): the server never imports torch.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .fields import BufferRow
from .lru import Entries, Entry, files_changed
from .messages import Get
from .persistence import Persistence
from .protocol import CacheError
from .segments import Segment, Segments

log = logging.getLogger(__name__)  # the persistence directory's records (docs/usage.md)


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
        self._lock = threading.RLock()
        self._max_bytes = max_bytes
        self._persist = persist
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._stale = 0
        self._entries = Entries()
        self._persistence = Persistence(persist, key_dir, log=log) if persist is not None else None
        if self._persistence is None:
            self._segments = Segments()
        else:
            self._segments = Segments(persist=self._persistence.write_segment, forget=self._persistence.remove_segment)
        self._cold_start: str | None = None  # why a persistence directory was not used to start warm
        if self._persistence is not None:
            self._cold_start = self._persistence.restore(self._segments, self._entries)

    # -- read-only views, for status and tests ----------------------------------------------------------------------

    @property
    def entries(self) -> Mapping[str, Entry]:
        """The entries by key, least recently used first (read-only)."""
        return self._entries.view()

    @property
    def segments(self) -> Mapping[int, Segment]:
        """The segments by id (read-only)."""
        return self._segments.view()

    @property
    def max_bytes(self) -> int | None:
        return self._max_bytes

    @property
    def cold_start(self) -> str | None:
        """Why the persistence directory was not used to start warm, if it was not."""
        return self._cold_start

    @property
    def hits(self) -> int:
        return self._hits

    @property
    def misses(self) -> int:
        return self._misses

    @property
    def evictions(self) -> int:
        return self._evictions

    @property
    def stale(self) -> int:
        return self._stale

    # -- lookups ------------------------------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The entry for ``key`` (marked most recently used, counted as a hit), or None (a miss). An entry whose
        files changed since it was made is dropped: its key was computed from files that are not the same any
        more (each file its key fingerprinted is checked again here, as is each checkpoint file it references)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and (files_changed(entry.files) or self._segments.changed(entry.segment_ids)):
                self._segments.release(self._entries.pop(key).segment_ids)
                self._stale += 1
                self._segments.collect_unused()
                self._save_index()
                entry = None
            if entry is None:
                self._misses += 1
                return None
            self._entries.touch(entry)
            self._hits += 1
            return entry

    def mark_uncacheable(self, request: Get, reason: str) -> None:
        """Remember that the result of ``request``'s call cannot be captured (a client reported why), while the
        files its key was computed from stay what they were: :meth:`uncacheable` answers for it until then."""
        with self._lock:
            self._entries.mark_uncacheable(request, reason)

    def uncacheable(self, key: str) -> str | None:
        """Why the result of ``key``'s call cannot be captured, if a client reported it and the files its key was
        computed from are unchanged since (a changed file forgets the report: the next miss tries again)."""
        with self._lock:
            return self._entries.uncacheable(key)

    def peek(self, key: str) -> Entry | None:
        with self._lock:
            return self._entries.get(key)

    def closure(self, keys: list[str]) -> list[Entry] | None:
        """The entries for ``keys`` and, transitively, the entries they reference, dependencies first; None if
        any is missing (evicted)."""
        with self._lock:
            return self._entries.closure(keys)

    def segments_for(self, entry: Entry) -> tuple[list[int], list[BufferRow], list[int]]:
        """The ids of the segments ``entry`` uses, its rows in them and duplicates of the segments' fds (the caller
        closes them), taken together under the lock: an eviction may close the store's own fds, and a compaction
        repoint the rows, at any moment.

        Raises:
            KeyError: a segment is gone (the entry was evicted).
        """
        with self._lock:
            ids = entry.segment_ids
            return ids, entry.buffers, self._segments.duplicate_fds(ids)

    def duplicate_fds(self, ids: Sequence[int]) -> list[int]:
        """Duplicates of the fds of the segments ``ids`` (the caller closes them), taken under the lock.

        Raises:
            KeyError: a segment is gone.
        """
        with self._lock:
            return self._segments.duplicate_fds(ids)

    def dedup_index(self, limit: int) -> tuple[list[int], list[tuple[str, int, int, int]]]:
        """Segments a loader may reference (at most ``limit``, most recent first) and ``[digest, segment,
        offset, nbytes]`` for every buffer in them."""
        with self._lock:
            return self._segments.dedup_index(limit, self._entries.rows())

    def total_bytes(self) -> int:
        """The bytes of the cache's own segments (memfds): what ``max_bytes`` bounds. File segments are the
        user's files; their pages are ordinary page cache, which the kernel reclaims by itself."""
        with self._lock:
            return self._segments.memfd_bytes()

    # -- changes ------------------------------------------------------------------------------------------------

    def add(self, entry: Entry, new_segment_fd: int | None, file_fds: Sequence[int] = ()) -> Entry:
        """Register an entry whose buffers refer to existing segments, to the new memfd (place ``new``) or to the
        i-th of ``file_fds`` (place ``file``, segment ``i``).

        Takes ownership of ``new_segment_fd`` and ``file_fds``.

        Raises:
            CacheError: the new segment is not a sealed memfd, a file is not a regular file, or the entry refers
                to unknown segments.
        """
        with self._lock:
            pending = [fd for fd in (new_segment_fd, *file_fds) if fd is not None]
            try:
                file_ids = [self._segments.adopt_file(pending.pop()) for _ in file_fds][::-1]
                segment = self._segments.adopt_memfd(pending.pop()) if new_segment_fd is not None else None
            except BaseException:
                for fd in pending:
                    os.close(fd)
                self._segments.collect_unused()  # file segments adopted for this entry and used by no other
                raise
            try:
                entry.buffers = self._segments.place(entry.buffers, segment, file_ids)
            except CacheError:
                self._segments.collect_unused()  # what was adopted for this entry alone
                raise
            missing = self._segments.missing(entry.segment_ids)
            if missing:
                self._segments.collect_unused()
                raise CacheError(f"the entry refers to segments {sorted(missing)}, which are gone")
            old = self._entries.put(entry)
            if old is not None:
                self._segments.release(old.segment_ids)
            self._segments.hold(entry.segment_ids)
            self._segments.collect_unused()
            self._evict(keep=entry.key)
            self._save_index()
            return entry

    def _evict(self, keep: str | None = None) -> None:
        if self._max_bytes is None:
            return
        while self._segments.memfd_bytes() > self._max_bytes:
            if self._segments.compact(self._entries.used_ranges(), self._entries.repoint):
                continue
            victim = self._entries.oldest(keep)
            if victim is None:
                return  # only the newest entry is left: it stays, even above the budget
            self._segments.release(self._entries.pop(victim).segment_ids)
            self._evictions += 1
            self._segments.collect_unused()

    def clear(self) -> int:
        """Drop every entry and segment; return how many entries there were."""
        with self._lock:
            count = len(self._entries)
            for entry in self._entries.values():
                self._segments.release(entry.segment_ids)
            self._entries.clear()
            self._entries.forget_uncacheable()
            self._segments.collect_unused()
            self._save_index()
            return count

    def close(self) -> None:
        with self._lock:
            self._segments.forget_all()
            self._entries.clear()
            if self._persistence is not None:
                self._persistence.close()

    def status(self) -> dict[str, Any]:
        with self._lock:
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
                    for e in self._entries.values()
                ],
                "segments": len(self._segments),
                "total_bytes": self._segments.memfd_bytes(),
                "file_bytes": self._segments.file_bytes(),
                "files": self._segments.files(),
                "logical_bytes": sum(e.nbytes for e in self._entries.values()),
                "max_bytes": self._max_bytes,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "stale": self._stale,
                "uncacheable": self._entries.uncacheable_rows(),
                "persist": str(self._persist) if self._persist else None,
                "persist_cold_start": self._cold_start,
            }

    def _save_index(self) -> None:
        if self._persistence is not None:
            self._persistence.save_index(self._segments.values(), self._entries.values())
