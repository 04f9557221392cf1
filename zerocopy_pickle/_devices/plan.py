"""Internal: the layout of a bulk transfer, as plain data.

Where each storage goes in the one device allocation (:func:`plan`: each at a :data:`DEVICE_ALIGNMENT` boundary,
as the caching allocator would place them one by one), the chunks of at most :data:`CHUNK_BYTES` it travels in
and the pieces each chunk is filled from, the page-aligned host ranges a registered copy locks
(:func:`register_ranges`), and for a load from a file (:class:`SourceFile`), the reads of a cold transfer
(:func:`plan_reads`). Nothing here touches a device or a file: the transfer executes these plans against a
backend.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Sequence

from .._storage.format import align_up
from ..errors import ArgumentError

DEVICE_ALIGNMENT = 512
"""Where each storage starts in the device allocation: the caching allocator's own granularity, so a carved
storage is as aligned as one allocated alone (vectorised kernels and cuBLAS rely on it)."""

CHUNK_BYTES = 64 << 20
"""Bytes per staged copy: large enough that a copy runs at the link's rate, small enough that the first copy
starts early and the pinned buffers stay small (:data:`SLOTS` of them)."""

SLOTS = 3
"""Pinned staging buffers: one being copied to the device, one being filled, one spare so that a slow fill
never waits for a copy."""

PAGE = mmap.PAGESIZE

DIRECT_ALIGNMENT = 4096
"""What an ``O_DIRECT`` read's file offset, length and buffer address are aligned to: the largest logical block
size of common disks (512 or 4096 bytes), so one rule fits them all without asking the device (``statx``'s
``STATX_DIOALIGN`` is not in Python's ``os``). A file system that wants more refuses with ``EINVAL``, and the
read falls back to buffered."""

GAP_BYTES = 1 << 20
"""A cold read does not read across a gap between two storages' file ranges larger than this (bytes of other
buffers, or of storages bound elsewhere): it ends the chunk there and starts the next one after the gap."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """``nbytes`` of source ``source`` from ``source_offset``, to ``offset`` of the device allocation."""

    source: int
    source_offset: int
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One staged copy: ``[offset, offset + nbytes)`` of the device allocation, filled from ``pieces`` (gaps
    between them are alignment padding that nothing reads)."""

    offset: int
    nbytes: int
    pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The layout of one device allocation: ``offsets[i]`` is where source ``i`` (``sizes[i]`` bytes) starts."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    chunks: tuple[Chunk, ...]


def plan(sizes: Sequence[int], *, chunk_bytes: int = CHUNK_BYTES, alignment: int = DEVICE_ALIGNMENT) -> Plan:
    """Lay out storages of ``sizes`` bytes in one allocation and cut it into chunks of at most ``chunk_bytes``.

    Storages keep their order; each starts at a multiple of ``alignment``; a storage larger than a chunk spans
    several. Empty storages take no room (they are carved as empty storages).

    Raises:
        ArgumentError: a negative size, or a chunk size or alignment that is not positive.
    """
    if chunk_bytes <= 0 or alignment <= 0:
        raise ArgumentError(f"chunk_bytes and alignment must be positive, not {chunk_bytes} and {alignment}")
    offsets: list[int] = []
    end = 0
    for nbytes in sizes:
        if type(nbytes) is not int or nbytes < 0:
            raise ArgumentError(f"a storage size must be a non-negative int, not {nbytes!r}")
        start = align_up(end, alignment)
        offsets.append(start if nbytes else end)
        if nbytes:
            end = start + nbytes
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    chunk_start = 0
    for index, (nbytes, start) in enumerate(zip(sizes, offsets, strict=True)):
        done = 0
        while done < nbytes:
            chunk_end = chunk_start + chunk_bytes
            if start + done >= chunk_end:  # the current chunk is full: close it
                if pieces:
                    chunks.append(_close(chunk_start, pieces))
                pieces, chunk_start = [], start + done
                continue
            take = min(nbytes - done, chunk_end - (start + done))
            pieces.append(Piece(index, done, start + done, take))
            done += take
    if pieces:
        chunks.append(_close(chunk_start, pieces))
    return Plan(tuple(sizes), tuple(offsets), end, tuple(chunks))


def _close(chunk_start: int, pieces: list[Piece]) -> Chunk:
    last = pieces[-1]
    return Chunk(chunk_start, last.offset + last.nbytes - chunk_start, tuple(pieces))


def register_ranges(spans: Sequence[tuple[int, int]], page: int = PAGE) -> list[tuple[int, int]]:
    """The page-aligned ``(address, length)`` ranges that cover host ``spans`` of ``(address, nbytes)``, merged
    where they touch or overlap (``cudaHostRegister`` locks whole pages and refuses a range registered twice)."""
    ranges: list[list[int]] = []
    for address, nbytes in sorted(span for span in spans if span[1]):
        start, stop = address - address % page, align_up(address + nbytes, page)
        if ranges and start <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], stop)
        else:
            ranges.append([start, stop])
    return [(start, stop - start) for start, stop in ranges]


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """Where the storages of a transfer lie in a file: the open file ``fd`` and, for each storage (in the order
    given to ``transfer.move``), the file offset of its first byte (its bytes are the file's
    ``[offset, offset + nbytes)``). The fd is the caller's: it must stay open during the move, which
    reads through it and a direct-I/O description of its own, and keeps neither."""

    fd: int
    offsets: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Run:
    """``nbytes`` at ``slot_offset`` of a staging slot, copied to ``offset`` of the device allocation."""

    slot_offset: int
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Read:
    """One cold read: the file's ``[file_offset, file_offset + nbytes)`` into a slot (``file_offset`` is aligned
    for direct I/O, so the slot may start with a few bytes before the first storage), then ``runs`` copied from
    the slot to the device."""

    file_offset: int
    nbytes: int
    runs: tuple[Run, ...]


def plan_reads(
    sizes: Sequence[int],
    file_offsets: Sequence[int],
    device_offsets: Sequence[int],
    *,
    capacity: int,
    gap: int = GAP_BYTES,
    alignment: int = DIRECT_ALIGNMENT,
    device_alignment: int = DEVICE_ALIGNMENT,
) -> tuple[Read, ...]:
    """Cut the file ranges of storages (``sizes[i]`` bytes at ``file_offsets[i]``, bound for ``device_offsets[i]``
    of the allocation :func:`plan` laid out) into reads of at most ``capacity`` bytes, in file order.

    Each read starts at a multiple of ``alignment`` and, rounded up to one, ends within ``capacity``, so a
    direct read of it fits its slot. It covers the storages' bytes and what lies between them in the file (at
    most ``gap`` bytes at a time: a larger gap starts a new read). Two storages whose bytes lie as far apart in
    the file as on the device, with nothing but alignment padding between them on the device, are one run (one
    copy); others are a run each. A storage larger than what is left of a read continues in the next one.

    Raises:
        ArgumentError: a capacity that is not a positive multiple of ``alignment``, or mismatched lengths.
    """
    if alignment <= 0 or capacity <= 0 or capacity % alignment:
        raise ArgumentError(f"capacity must be a positive multiple of {alignment}, not {capacity}")
    if not len(sizes) == len(file_offsets) == len(device_offsets):
        raise ArgumentError("sizes, file offsets and device offsets must be as many")
    items = sorted((f, n, d) for f, n, d in zip(file_offsets, sizes, device_offsets, strict=True) if n)
    reads: list[Read] = []
    start: int | None = None
    end = 0
    runs: list[list[int]] = []  # [slot_offset, offset, nbytes]
    for file_offset, nbytes, device_offset in items:
        done = 0
        while done < nbytes:
            at = file_offset + done
            if start is not None and (at >= start + capacity or at - end > gap):
                reads.append(Read(start, end - start, tuple(Run(*r) for r in runs)))
                start = None
            if start is None:
                start, end, runs = at - at % alignment, at, []
            take = min(nbytes - done, start + capacity - at)
            slot, dev = at - start, device_offset + done
            last = runs[-1] if runs else None
            if (
                last is not None
                and last[1] + last[2] <= dev <= align_up(last[1] + last[2], device_alignment)
                and dev - last[1] == slot - last[0]
            ):
                last[2] = dev + take - last[1]
            else:
                runs.append([slot, dev, take])
            end = max(end, at + take)
            done += take
    if start is not None:
        reads.append(Read(start, end - start, tuple(Run(*r) for r in runs)))
    return tuple(reads)
