"""Internal: writing a snapshot's pieces: each storage byte copied exactly once, from the tensor's memory into the
page cache (or a memfd), in as few system calls as the kernel allows.

Writers produce a snapshot either as a list of pieces (header, stream, padding, storage bytes) for
:func:`write_pieces` (``writev``, for memfds and small files) or :func:`write_pieces_to_file` (a file object), or,
for a snapshot file, as pieces placed at their offsets for :func:`write_placed` after :func:`preallocate`: the
file gets its final size first (its blocks too, where the file system can), then each piece is written where it
belongs in chunks of :data:`WRITE_CHUNK`, and padding is left to read as zeros. :func:`split_placed` divides those
writes between threads at window boundaries, and :func:`write_shares` runs them, making the same calls.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import errno
import itertools
import os
import threading
from collections.abc import Callable, Sequence
from typing import BinaryIO

from .format import align_up

Piece = bytes | bytearray | memoryview

_libc = ctypes.CDLL(None, use_errno=True)
_fallocate = _libc.fallocate64 if hasattr(_libc, "fallocate64") else _libc.fallocate
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_fallocate.restype = ctypes.c_int
_fstatfs = _libc.fstatfs
_fstatfs.argtypes = [ctypes.c_int, ctypes.c_char_p]
_fstatfs.restype = ctypes.c_int

_IOV_MAX = 1024  # the Linux limit on iovecs per writev call
_MAX_WRITE = 0x7FFFF000  # Linux transfers at most this much per write/writev call


PROGRESS_STEP = 16 << 20
"""With a ``progress`` callback, the most bytes :func:`write_pieces` and :func:`write_pieces_to_file` hand the
kernel per call (without one, a ``writev`` takes up to 2 GiB): a bar then moves in steps of this size."""


def write_pieces(fd: int, pieces: Sequence[Piece], *, progress: Callable[[int], object] | None = None) -> int:
    """Write every piece, in order, to ``fd`` at its current position.

    ``progress(n)``, if given, is told the bytes of each ``writev`` once it returned.

    Returns:
        The number of bytes written.

    Raises:
        OSError: from the kernel (a full disk, a file size limit); what was written stays written.
    """
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    limit = _MAX_WRITE
    if progress is not None:  # calls of at most PROGRESS_STEP bytes: a bar that moves
        limit = PROGRESS_STEP
        views = [v[at : at + limit] for v in views for at in range(0, v.nbytes, limit)]
    total = 0
    i = 0
    while i < len(views):
        batch: list[memoryview] = []
        batch_bytes = 0
        j = i
        while j < len(views) and len(batch) < _IOV_MAX and batch_bytes < limit:
            batch.append(views[j])
            batch_bytes += views[j].nbytes
            j += 1
        written = os.writev(fd, batch)
        total += written
        if progress is not None:
            progress(written)
        # Advance past what was written; a partial write leaves the rest of a view for the next call.
        while written and i < len(views):
            n = views[i].nbytes
            if written >= n:
                written -= n
                i += 1
            else:
                views[i] = views[i][written:]
                written = 0
    return total


WRITE_CHUNK = 1 << 20
"""Bytes per ``pwrite``/``pwritev`` of :func:`write_placed`, and the alignment of the windows they fill: small
enough that a chunk an observer just read is still in the CPU cache when the kernel copies it, large enough that
system calls cost nothing next to the copy, and the size of the page-cache folios the writes leave behind (a load
maps each with one fault). 1 MiB, not a 2 MiB huge page: on the development VM, 2 MiB folios made the writes
erratic (a 2000 MiB dump 0.4-8 s, median about 1.1 s, against 0.42-0.45 s in 1 MiB windows; the host backs
fresh huge blocks of guest memory slowly), for a touch of the loaded pages that 1 MiB folios make only 12 ms per
2000 MiB slower. See docs/benchmark.md."""

_FALLOC_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV})
_TMPFS_MAGIC = 0x01021994


def preallocate(fd: int, nbytes: int) -> None:
    """Give an empty regular file (or memfd) its final size before it is written.

    On disk file systems the blocks are allocated too (``fallocate``, one call): ext4 then skips the delayed-
    allocation bookkeeping it otherwise does page by page during the writes, and a full disk fails here, before
    anything is copied. On tmpfs (and memfds) ``fallocate`` would clear every page only to have it overwritten,
    and where the file system has no ``fallocate``, the size alone is set (``ftruncate``). Bytes never written
    read as zeros either way.

    Raises:
        OSError: from the kernel (``ENOSPC``, ``EFBIG`` over a file size limit).
    """
    if nbytes <= 0:
        return
    if not _on_tmpfs(fd):
        if _fallocate(fd, 0, 0, nbytes) == 0:
            return
        err = ctypes.get_errno()
        if err not in _FALLOC_UNSUPPORTED:
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, nbytes)


def _on_tmpfs(fd: int) -> bool:
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if _fstatfs(fd, buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value == _TMPFS_MAGIC


def write_placed(
    fd: int,
    placed: Sequence[tuple[int, Piece]],
    *,
    observe: Callable[[int, memoryview], object] | None = None,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Write each ``(offset, piece)`` at its offset of ``fd`` (``pwrite``; the file position is not used).

    Pieces are written in chunks of at most :data:`WRITE_CHUNK` bytes that end at file offsets which are multiples
    of it (so that each aligned window of the file is filled by one call), in order; small neighbours share one
    ``pwritev`` (with the zero padding between them, when the gap is shorter than a page), and larger gaps are
    skipped: after :func:`preallocate` they read as zeros. ``observe(i, chunk)``, if given, sees every chunk of
    piece ``i`` (in order, an empty piece as one empty chunk) just before it is written, while it is still in
    the CPU cache: a checksum computed there costs no second pass over memory. ``progress(n)``, if given, is told
    the bytes of each chunk as it joins the writes (padding not counted): one call per window at most.

    Raises:
        OSError: from the kernel (a full disk, a file size limit); what was written stays written.
    """
    items = [(offset, memoryview(piece).cast("B"), index, True) for index, (offset, piece) in enumerate(placed)]
    _write_items(fd, items, observe, progress)


_Item = tuple[int, memoryview, int | None, bool]
"""A piece to write: its file offset, its bytes, the index ``observe`` is told (None: not observed here) and
whether ``progress`` counts it (padding is not counted)."""


class _Stopped(Exception):
    """Raised in a writing thread when another one failed: it stops before its next chunk."""


def _write_items(
    fd: int,
    items: Sequence[_Item],
    observe: Callable[[int, memoryview], object] | None,
    progress: Callable[[int], object] | None,
    stop: threading.Event | None = None,
) -> None:
    """The writes of :func:`write_placed` (see there), for pieces in ascending order of offset; with ``stop``,
    raises :class:`_Stopped` before the next chunk once it is set."""
    batch: list[memoryview] = []
    start = end = 0  # the file range the batch covers
    for offset, view, index, counted in items:
        at = 0
        while True:
            # Chunks end at file offsets that are multiples of WRITE_CHUNK, and a batch is written when it reaches
            # one: each aligned window of a file of contiguous buffers is then filled by one call, and the page
            # cache builds it from folios of that size, which a load maps with one fault each. Chunks cut at the
            # buffers' own (unaligned) offsets left small folios: 6x the page faults on every load.
            if stop is not None and stop.is_set():
                raise _Stopped
            position = offset + at
            chunk = view[at : at + WRITE_CHUNK - position % WRITE_CHUNK]
            if observe is not None and index is not None:
                observe(index, chunk)
            if chunk.nbytes:
                gap = position - end
                if batch and 0 < gap < len(_ZEROS) and end // WRITE_CHUNK != position // WRITE_CHUNK:
                    # The padding crosses a window boundary: close this window with zeros, open the next with zeros.
                    boundary = position - position % WRITE_CHUNK
                    batch.append(_ZEROS[: boundary - end])
                    _pwrite_all(fd, batch, start)
                    batch = [_ZEROS[: position - boundary]] if position > boundary else []
                    start, end, gap = boundary, position, 0
                if batch and (gap < 0 or gap >= len(_ZEROS) or len(batch) >= _IOV_MAX - 1):
                    _pwrite_all(fd, batch, start)
                    batch = []
                if not batch:
                    start = end = position
                elif gap:
                    batch.append(_ZEROS[:gap])
                batch.append(chunk)
                if progress is not None and counted:
                    progress(chunk.nbytes)
                end = position + chunk.nbytes
                if end % WRITE_CHUNK == 0 or end - start >= WRITE_CHUNK:
                    _pwrite_all(fd, batch, start)
                    batch = []
            at += chunk.nbytes
            if at >= view.nbytes:
                break
    if batch:
        _pwrite_all(fd, batch, start)


_ZEROS = memoryview(bytes(4096))


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> None:
    """``pwritev`` every view at ``offset``, retrying after short writes."""
    while views:
        written = os.pwritev(fd, views, offset) if len(views) > 1 else os.pwrite(fd, views[0], offset)
        if written <= 0:
            raise OSError(errno.EIO, f"the kernel wrote nothing at offset {offset}")
        offset += written
        while written:
            n = views[0].nbytes
            if written >= n:
                written -= n
                views = views[1:]
            else:
                views = [views[0][written:], *views[1:]]
                written = 0


@dataclasses.dataclass(frozen=True)
class Share:
    """One thread's part of a parallel :func:`write_shares`: the bytes of the file in ``[lo, hi)`` it writes, and
    the pieces it observes whole (indices ``[first, stop)`` of the placed pieces, each one's chunks in order)."""

    lo: int
    hi: int
    first: int
    stop: int
    head: tuple[tuple[int, memoryview], ...]
    """``(index, bytes)``: the starts of this share's pieces that lie below ``lo``, written by the share before
    (at most one window's worth), observed before anything else."""
    items: tuple[_Item, ...]

    @property
    def nbytes(self) -> int:
        """The piece bytes this share writes."""
        return sum(view.nbytes for _, view, _, counted in self.items if counted)


def split_placed(placed: Sequence[tuple[int, Piece]], parts: int) -> list[Share] | None:
    """Divide the writes of :func:`write_placed` between ``parts`` threads, or None where they cannot be divided
    usefully (fewer than two non-empty pieces, pieces out of order or overlapping, or no cut that gives every
    thread at least ``1 / (parts + 1)`` of the bytes: one huge piece, say).

    The file is cut at :data:`WRITE_CHUNK`-aligned offsets, each the first window boundary at or after the start
    of some piece (balancing the bytes on either side): every byte below a cut is written by the thread before
    it, every byte from it on by the next, so no aligned window is written by two calls, and the calls are the
    ones :func:`write_placed` makes (the zero padding it writes across a cut is split there too). Each piece is
    observed by exactly one thread, in order: the pieces that start at or after the chosen piece's start belong
    to the next thread, which observes the part of them below the cut (less than one window; the thread before
    writes it) before its own writes.
    """
    views = [memoryview(piece).cast("B") for _, piece in placed]
    offsets = [offset for offset, _ in placed]
    filled = [i for i, view in enumerate(views) if view.nbytes]
    if parts < 2 or len(filled) < 2:
        return None
    last_end = _ordered_end(offsets, views, filled)
    if last_end is None:
        return None
    begin, finish = offsets[filled[0]], last_end
    cuts = _choose_cuts(offsets, filled, begin, finish, parts)
    if cuts is None:
        return None
    bounds = [begin, *(cut for _, cut in cuts), finish]
    if min(b - a for a, b in itertools.pairwise(bounds)) * (parts + 1) < finish - begin:
        return None
    firsts = [0, *(index for index, _ in cuts), len(placed)]
    heads, items = _assign(offsets, views, firsts, bounds, finish, parts)
    _split_padding(items, bounds, parts)
    return [
        Share(bounds[j] if j else begin, bounds[j + 1], firsts[j], firsts[j + 1], tuple(heads[j]), tuple(items[j]))
        for j in range(parts)
    ]


def _ordered_end(offsets: list[int], views: list[memoryview], filled: list[int]) -> int | None:
    """The end of the last non-empty piece; None where the pieces are out of order, overlap or start below 0 (a
    step of :func:`split_placed`)."""
    last_end = -1
    for i in filled:
        if offsets[i] < last_end:
            return None
        last_end = offsets[i] + views[i].nbytes
    if any(offset < 0 for offset in offsets) or any(b < a for a, b in itertools.pairwise(offsets)):
        return None
    return last_end


def _choose_cuts(
    offsets: list[int], filled: list[int], begin: int, finish: int, parts: int
) -> list[tuple[int, int]] | None:
    """For each of the ``parts - 1`` cuts of :func:`split_placed`, ``(index of the first piece of the next share,
    aligned file offset)``: the window boundary at or after the start of the piece nearest the cut's share of the
    bytes, each past the one before; None where some cut has no such piece."""
    starts = [offsets[i] for i in filled]
    cuts: list[tuple[int, int]] = []  # (index of the first piece of the next share, aligned file offset)
    for j in range(1, parts):
        target = begin + (finish - begin) * j // parts
        at = bisect.bisect_left(starts, target)
        best: tuple[int, int] | None = None
        for candidate in (at - 1, at):
            if not 1 <= candidate < len(filled):
                continue
            index = filled[candidate]
            cut = align_up(offsets[index], WRITE_CHUNK)
            if cut >= finish or (cuts and (index <= cuts[-1][0] or cut <= cuts[-1][1])):
                continue
            if best is None or abs(cut - target) < abs(best[1] - target):
                best = (index, cut)
        if best is None:
            return None
        cuts.append(best)
    return cuts


def _assign(
    offsets: list[int], views: list[memoryview], firsts: list[int], bounds: list[int], finish: int, parts: int
) -> tuple[list[list[tuple[int, memoryview]]], list[list[_Item]]]:
    """Each share's head (what it observes of its pieces below its ``lo``) and items (what it writes in ``[lo,
    hi)``: its own pieces from ``lo`` on, and the next share's pieces below the cut), a step of
    :func:`split_placed`."""
    items: list[list[_Item]] = []
    heads: list[list[tuple[int, memoryview]]] = []
    for j in range(parts):
        lo, hi = bounds[j] if j else 0, bounds[j + 1] if j + 1 < parts else finish
        head: list[tuple[int, memoryview]] = []
        share: list[_Item] = []
        for i in range(firsts[j], firsts[j + 1]):
            offset, view = offsets[i], views[i]
            if offset < lo:  # begins in the window the share before fills: observe that part now
                head.append((i, view[: lo - offset]))
                if offset + view.nbytes > lo:
                    share.append((lo, view[lo - offset :], i, True))
            else:
                share.append((offset, view, i, True))
        for i in range(firsts[j + 1], len(offsets)):  # the next share's pieces below the cut: written here
            offset, view = offsets[i], views[i]
            if offset >= hi:
                break
            if view.nbytes:
                share.append((offset, view[: hi - offset], None, True))
        heads.append(head)
        items.append(share)
    return heads, items


def _split_padding(items: list[list[_Item]], bounds: list[int], parts: int) -> None:
    """Add to the shares' items the zero padding :func:`write_placed` writes across each cut, split at the cut (a
    step of :func:`split_placed`)."""
    for j in range(parts - 1):  # zero padding across a cut, as write_placed writes it: split at the cut
        cut = bounds[j + 1]
        before = [item for item in items[j] if item[1].nbytes]
        after = [item for item in items[j + 1] if item[1].nbytes]
        if not before or not after:
            continue
        a, b = before[-1][0] + before[-1][1].nbytes, after[0][0]
        if 0 < b - a < len(_ZEROS) and a // WRITE_CHUNK != b // WRITE_CHUNK:
            if a < cut:
                items[j].append((a, _ZEROS[: cut - a], None, False))
            if b > cut:
                items[j + 1].insert(0, (cut, _ZEROS[: b - cut], None, False))


def write_shares(
    fd: int,
    shares: Sequence[Share],
    *,
    observe: Callable[[int, memoryview], object] | None = None,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Write the shares of :func:`split_placed` in parallel: the first in the calling thread, each other one in a
    thread of its own (``pwrite`` releases the GIL), with what :func:`write_placed` promises: ``observe(i,
    chunk)`` sees every chunk of piece ``i`` in order, from the one thread that writes most of it, just before
    that chunk is written; ``progress(n)`` is told every piece byte exactly once (serialised by a lock).

    If any thread fails, the others stop before their next chunk, and the first error is raised once every
    thread has stopped.

    Raises:
        OSError: from the kernel (a full disk, a file size limit); what was written stays written.
    """
    stop = threading.Event()
    failures: list[BaseException] = []
    report = progress
    if progress is not None:
        lock = threading.Lock()

        def report(n: int) -> None:
            with lock:
                progress(n)

    def run(share: Share) -> None:
        try:
            if observe is not None:
                for index, view in share.head:
                    observe(index, view)
            _write_items(fd, share.items, observe, report, stop)
        except _Stopped:
            pass
        except BaseException as e:  # re-raised in the calling thread
            failures.append(e)
            stop.set()

    started: list[threading.Thread] = []
    try:
        for n, share in enumerate(shares[1:], 1):
            worker = threading.Thread(target=run, args=(share,), name=f"zerocopy_pickle-write-{n}", daemon=True)
            worker.start()
            started.append(worker)
        run(shares[0])
    except BaseException:  # a thread that could not start: stop the others
        stop.set()
        raise
    finally:
        for worker in started:
            worker.join()
    if failures:
        raise failures[0]


def write_pieces_to_file(
    f: BinaryIO, pieces: Sequence[Piece], *, progress: Callable[[int], object] | None = None
) -> int:
    """Write every piece to a binary file object (any object with ``write``); ``progress(n)``, if given, is told
    the bytes of each ``write`` (of at most :data:`PROGRESS_STEP` bytes then)."""
    total = 0
    for piece in pieces:
        view = memoryview(piece).cast("B")
        while view.nbytes:
            n = f.write(view if progress is None else view[:PROGRESS_STEP])
            if n is None:  # non-blocking raw stream that could not take anything now
                raise BlockingIOError(errno.EAGAIN, "the output stream is non-blocking and would block")
            total += n
            view = view[n:]
            if progress is not None:
                progress(n)
    return total
