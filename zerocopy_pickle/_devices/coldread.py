"""Internal: the cold read: a transfer's bytes read from the file itself, not through its mapping.

For a load from a file (a :class:`~zerocopy_pickle._devices.plan.SourceFile`) whose storages are mostly not in
the page cache (:func:`mostly_cold`), :func:`read_to_device` has a few threads read the file (``O_DIRECT``
where aligned, buffered ``preadv`` otherwise) straight into a ring of pinned buffers, each copied to the device
while the next ones fill, instead of faulting the mapping's pages in through one thread. The reads are those
of :func:`~zerocopy_pickle._devices.plan.plan_reads`, cut into parts of :data:`READERS` threads.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import errno
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from .._storage import readahead
from .._storage.format import align_up
from ..errors import SnapshotError
from .backend import Backend
from .plan import DIRECT_ALIGNMENT, GAP_BYTES, SLOTS, Plan, Read, SourceFile, plan_reads

READERS = 4
"""Threads reading the file in a cold read: each chunk is cut into up to this many contiguous parts (of at least
:data:`PART_MIN_BYTES`), read in parallel, front first."""

PART_MIN_BYTES = 4 << 20
"""The smallest part of a chunk one reader reads: smaller parts cost more in calls than they gain."""

COLD_BELOW = 0.5
"""A transfer with a source file takes the cold read when less than this share of its file ranges is in the
page cache (``readahead.cached_bytes``); otherwise, and where residency is unknown, it copies from the mapping
(pages already in memory are copied fastest from there). 0 never reads cold, above 1 always does (benchmarks)."""

DIRECT_BELOW = 0.5
"""Within a cold read, a chunk is read with direct I/O when less than this share of it is in the page cache, and
buffered (copied from the cache, no disk read) otherwise: a partly cached file reads only what is missing."""


def _file_spans(source: SourceFile, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """The storages' file ranges, merged where they are at most :data:`GAP_BYTES` apart."""
    spans: list[list[int]] = []
    for start, nbytes in sorted((o, n) for o, n in zip(source.offsets, sizes, strict=True) if n):
        if spans and start - spans[-1][1] <= GAP_BYTES:
            spans[-1][1] = max(spans[-1][1], start + nbytes)
        else:
            spans.append([start, start + nbytes])
    return [(a, b) for a, b in spans]


def mostly_cold(source: SourceFile, sizes: Sequence[int]) -> bool:
    """Whether less than :data:`COLD_BELOW` of the storages' file ranges is in the page cache (False where
    that cannot be told: the mapping is the safe default)."""
    total = cached = 0
    for start, stop in _file_spans(source, sizes):
        got = readahead.cached_bytes(source.fd, start, stop)
        if got is None:
            return False
        total += stop - start
        cached += got
    return cached < total * COLD_BELOW


def _open_direct(fd: int) -> int | None:
    """A new open file description of ``fd``'s file with ``O_DIRECT``; None where the file system refuses it
    (``EINVAL``: tmpfs on older kernels, some FUSE and network file systems) or ``/proc`` is not mounted."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | flag)
    except OSError:
        return None


def _preadv(fd: int, view: memoryview, offset: int) -> int:
    """One read into ``view`` (the tests spy on it)."""
    return os.preadv(fd, [view], offset)


class _Reader:
    """What the reader threads of one cold read share: the fds, whether direct reads still work, counters."""

    def __init__(self, fd: int, direct_fd: int | None) -> None:
        self.fd = fd
        self.direct_fd = direct_fd
        self.lock = threading.Lock()
        self.read = {True: 0, False: 0}

    def part(self, address: int, file_offset: int, need: int, want: int, direct: bool) -> None:
        """Fill ``need`` bytes at host ``address`` with the file's bytes from ``file_offset``; a direct read
        asks for ``want`` (``need`` rounded up to :data:`DIRECT_ALIGNMENT`: the slot has room for it)."""
        view = memoryview((ctypes.c_char * want).from_address(address)).cast("B")
        direct = direct and self.direct_fd is not None and not (address | file_offset | want) % DIRECT_ALIGNMENT
        got = 0
        while got < need:
            fd = self.direct_fd if direct and self.direct_fd is not None else self.fd
            try:
                n = _preadv(fd, view[got : want if direct else need], file_offset + got)
            except OSError as e:
                if direct and e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.EFAULT):
                    # Refused here: an alignment this file system does not take, or memory it cannot read
                    # into directly. Buffered reads take anything (and report a real fault again).
                    direct = False
                    continue
                raise SnapshotError(
                    f"cannot read {need - got} bytes at offset {file_offset + got} of the snapshot file: {e}"
                ) from e
            if n == 0:
                break
            with self.lock:
                self.read[direct] += n
            got += n
            if direct and n % DIRECT_ALIGNMENT:
                direct = False  # only at the end of the file; what follows (nothing, normally) is read buffered
        if got < need:
            raise SnapshotError(
                f"the snapshot file ends {need - got} bytes short of the storages at offset {file_offset + got}: "
                f"it was truncated while it was loaded (nothing of the transfer was kept)"
            )


def _parts(read: Read, slot_bytes: int) -> list[tuple[int, int, int]]:
    """``(slot_offset, need, want)`` of the contiguous parts :data:`READERS` threads read of ``read``."""
    count = max(1, min(READERS, read.nbytes // PART_MIN_BYTES))
    step = align_up(-(-read.nbytes // count), DIRECT_ALIGNMENT)
    parts = []
    for start in range(0, read.nbytes, step):
        need = min(step, read.nbytes - start)
        parts.append((start, need, min(align_up(need, DIRECT_ALIGNMENT), slot_bytes - start)))
    return parts


def _land(
    backend: Backend,
    base: torch.Tensor,
    read: Read,
    staging: torch.Tensor,
    parts: list[concurrent.futures.Future[None]],
) -> Any:
    """Once every part of ``read`` is in ``staging``, enqueue its runs' copies; the event that marks them."""
    for part in parts:
        part.result()  # a failed or short read raises here, before anything of it is copied
    for run in read.runs:
        backend.copy(
            base[run.offset : run.offset + run.nbytes], staging[run.slot_offset : run.slot_offset + run.nbytes]
        )
    return backend.record()


def read_to_device(
    backend: Backend,
    source: SourceFile,
    layout: Plan,
    base: torch.Tensor,
    chunk_bytes: int,
    stats: collections.Counter[str],
) -> None:
    """The transfer from the file: reads of :func:`plan_reads` by :data:`READERS` threads into a ring of
    :data:`SLOTS` pinned slots; each slot, once read, copied to the device in its runs; a slot refilled only
    after the wait for its last copy's event. Every thread and fd it started is gone when it returns or
    raises. The bytes read, direct and buffered, are added to ``stats`` (the transfer's counters) either
    way."""
    capacity = max(DIRECT_ALIGNMENT, chunk_bytes - chunk_bytes % DIRECT_ALIGNMENT)
    reads = plan_reads(layout.sizes, source.offsets, layout.offsets, capacity=capacity)
    slot_bytes = min(capacity, max(align_up(read.nbytes, DIRECT_ALIGNMENT) for read in reads))
    count = min(SLOTS, len(reads))
    direct_fd = _open_direct(source.fd)
    reader = _Reader(source.fd, direct_fd)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="zerocopy-pickle-read")
    futures: list[concurrent.futures.Future[None]] = []
    in_flight: collections.deque[tuple[Read, int, list[concurrent.futures.Future[None]]]] = collections.deque()
    finished = False
    try:
        slots = [backend.pinned(slot_bytes) for _ in range(count)]
        events: list[Any] = [None] * count
        for number, read in enumerate(reads):
            slot = number % count
            if len(in_flight) == count:
                done, done_slot, parts = in_flight.popleft()  # the oldest read, in this very slot
                events[done_slot] = _land(backend, base, done, slots[done_slot], parts)
            if events[slot] is not None:
                backend.wait(events[slot])  # its last copy must be done before it is overwritten
                events[slot] = None
            address = slots[slot].data_ptr()
            cached = readahead.cached_bytes(source.fd, read.file_offset, read.file_offset + read.nbytes)
            direct = cached is not None and cached < read.nbytes * DIRECT_BELOW  # else: copy from the cache
            parts = [
                pool.submit(reader.part, address + at, read.file_offset + at, need, want, direct)
                for at, need, want in _parts(read, slot_bytes)
            ]
            futures.extend(parts)
            in_flight.append((read, slot, parts))
        while in_flight:
            done, done_slot, parts = in_flight.popleft()
            events[done_slot] = _land(backend, base, done, slots[done_slot], parts)
        backend.finish()
        finished = True
    finally:
        for future in futures:
            future.cancel()
        pool.shutdown(wait=True)  # no thread writes into a slot once this returns
        if not finished:  # a failure: the copies already enqueued end before their slots are released
            with contextlib.suppress(Exception):
                backend.finish()
        if direct_fd is not None:
            os.close(direct_fd)
        stats["direct bytes"] += reader.read[True]
        stats["buffered bytes"] += reader.read[False]
