"""Internal: turning objects into cache entries and back: pickling with argument references, deduplicating storages
into segments, and loading an entry as views into mapped segments.

A call's arguments that are themselves cached objects (``vae=vae``), and wrappers or containers made of them
(``MultiControlNetModel([a, b])``, lists, dicts), are pickled with each cached object replaced by a reference:
``zerocopy_pickle.cache.entries:argument(i)``, the i-th referenced entry. The same pickling gives the cache key
(those references are stable: they name the referenced entries' keys) and the arguments' transport to the loader.
The loader pickles the result the same way, so a loaded pipeline's ``vae`` *is* the caller's ``vae``.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import arena
from ..format import align_up, buffer_alignment
from ..integrity import checksum
from ..pickler import ZeroCopyPickler, ZeroCopyUnpickler
from .filebacked import FileRange
from .protocol import CacheError

__all__ = ["RefPickler", "argument", "build_segment", "load_entry"]


def argument(index: int) -> Any:
    """Stands for the caller's ``index``-th referenced cached object in a cache stream.

    Only the cache's unpickler resolves it (to that object); anything else calling it is a mistake.
    """
    raise CacheError("a cache argument reference can only be resolved by the model cache")


class RefPickler(ZeroCopyPickler):
    """A :class:`ZeroCopyPickler` that pickles the objects in ``refs`` as references ``argument(i)``."""

    def __init__(self, file: Any, refs: Sequence[object], **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._ref_index = {id(obj): i for i, obj in enumerate(refs)}
        self._refs = list(refs)  # keeps the ids valid while pickling

    def reducer_override(self, obj: Any) -> Any:
        index = self._ref_index.get(id(obj))
        if index is not None:
            return argument, (index,)
        return super().reducer_override(obj)


class _RefUnpickler(ZeroCopyUnpickler):
    def __init__(self, file: Any, refs: Sequence[object], **kwargs: Any) -> None:
        super().__init__(file, trusted=True, **kwargs)
        self._refs = refs

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "argument":
            return self._refs.__getitem__
        return super().find_class(module, name)


def unpickle(stream: bytes, buffers: Sequence[Any], refs: Sequence[object]) -> Any:
    """Unpickle a cache stream, trusted: it comes from this user's own server, which got it from this user's own
    loader. The snapshot loader's bounds check (``streamcheck``) is not run: it guards restricted loads against
    streams that exploit the unpickler's arithmetic, and a trusted stream can run any code anyway; here it would
    cost every fresh process tens of milliseconds per large entry."""
    return _RefUnpickler(io.BytesIO(stream), refs, buffers=buffers).load()


def load_entry(
    stream: bytes, rows: Sequence[Sequence[Any]], segments: dict[int, mmap.mmap], refs: Sequence[object]
) -> Any:
    """Rebuild an entry from its stream and buffer table, over private mappings of its segments."""
    views = {segment_id: memoryview(memory) for segment_id, memory in segments.items()}
    buffers = [views[row[0]][row[1] : row[1] + row[2]] for row in rows]
    return unpickle(stream, buffers, refs)


def map_segments(ids: Sequence[int], fds: Sequence[int]) -> dict[int, mmap.mmap]:
    """Map each segment ``MAP_PRIVATE`` (one mapping per load: writes stay private to that load)."""
    sizes = {segment_id: (fd, os.fstat(fd).st_size) for segment_id, fd in zip(ids, fds, strict=True)}
    return {segment_id: arena.map_private(fd, size) for segment_id, (fd, size) in sizes.items() if size}


def pickle_with_refs(obj: Any, refs: Sequence[object], *, in_band: bool) -> tuple[bytes, list[memoryview], list[Any]]:
    """Pickle ``obj`` with ``refs`` as references. Returns ``(stream, buffers, specs)``; with ``in_band``, tensor
    bytes stay in the stream (for small argument payloads and keys) and ``buffers`` is empty.

    Raises:
        pickle.PicklingError and friends: ``obj`` cannot be pickled.
    """
    out = io.BytesIO()
    views: list[memoryview] = []
    callback: Callable[[pickle.PickleBuffer], bool] | None = None
    if not in_band:

        def callback(buffer: pickle.PickleBuffer) -> bool:
            views.append(buffer.raw())
            return False

    pickler = RefPickler(out, refs, buffer_callback=callback, by_value=True)
    pickler.dump(obj)
    pickler.clear_memo()
    return out.getvalue(), views, pickler.buffer_specs


class SegmentView:
    """A pristine view of an existing segment, to compare candidate storages with its bytes: a mapping of its
    own, never written (the loader's other mappings may hold pages its code changed)."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        self.memory = arena.map_private(fd, size) if size else None
        self.view = memoryview(self.memory) if self.memory is not None else memoryview(bytearray())


def same_bytes(a: memoryview, b: memoryview) -> bool:
    """Whether two writable byte buffers hold the same bytes (vectorised; memoryview == compares per item)."""
    if a.nbytes != b.nbytes:
        return False
    if not a.nbytes:
        return True
    return bool(torch.equal(torch.frombuffer(a, dtype=torch.uint8), torch.frombuffer(b, dtype=torch.uint8)))


def build_segment(
    views: Sequence[memoryview],
    locations: Sequence[str],
    existing: dict[int, SegmentView],
    index: dict[str, list[tuple[int, int, int]]],
    provenance: Callable[[memoryview], tuple[int, int] | None],
    files: Sequence[FileRange | None] | None = None,
) -> tuple[list[list[Any]], int | None]:
    """Place each buffer: where an identical one already is (compared byte for byte), in the file it is an
    untouched view of (``files``, from :func:`filebacked.file_ranges`), else in a new sealed memfd.

    Returns the buffer table and the new segment's fd (or None). A row's segment is 0 for the new memfd,
    ``-(i + 1)`` for the i-th file, or the id of an existing segment. File rows carry no digest: nothing is read
    to place them.
    """
    rows: list[list[Any]] = []
    pieces: list[arena.Piece] = []
    cursor = 0
    zeros = bytes(4096)
    for i, (view, location) in enumerate(zip(views, locations, strict=True)):
        origin = provenance(view) if view.nbytes else None
        if origin is not None:  # a view into a segment this loader mapped (an argument's storage): verify it
            segment = existing.get(origin[0])
            if segment is not None and same_bytes(segment.view[origin[1] : origin[1] + view.nbytes], view):
                rows.append([origin[0], origin[1], view.nbytes, location, sample_digest(view)])
                continue
        file_range = files[i] if files is not None else None
        if file_range is not None:
            rows.append([-(file_range.file + 1), file_range.offset, view.nbytes, location, None])
            continue
        digest = sample_digest(view)
        place = _find_existing(view, digest, existing, index)
        if place is not None:
            rows.append([place[0], place[1], view.nbytes, location, digest])
            continue
        offset = align_up(cursor, buffer_alignment(view.nbytes))
        pieces.append(memoryview(zeros)[: offset - cursor])
        pieces.append(view)
        cursor = offset + view.nbytes
        rows.append([0, offset, view.nbytes, location, digest])
    if not cursor:
        return rows, None
    fd = arena.create_memfd("zerocopy_pickle-cache")
    try:
        arena.write_pieces(fd, pieces)
        arena.seal(fd)
    except BaseException:
        os.close(fd)
        raise
    return rows, fd


SAMPLE_BLOCK = 4096
SAMPLE_BLOCKS = 16


def sample_digest(view: memoryview) -> str:
    """A digest that finds candidates for deduplication: XXH3 of the size and of 16 blocks of 4 KiB spread
    evenly over the buffer (all of it, when it is smaller than that). Equal buffers have equal digests; unequal
    ones usually differ, and every candidate is compared byte for byte before it is used. Hashing every byte
    instead would cost 0.17 s per GB on the development machine: half a second for an SD1.5 pipeline."""
    nbytes = view.nbytes
    if nbytes <= SAMPLE_BLOCK * SAMPLE_BLOCKS:
        return f"{nbytes:x}-{checksum(view)}"
    step = (nbytes - SAMPLE_BLOCK) // (SAMPLE_BLOCKS - 1)
    sample = b"".join(view[i * step : i * step + SAMPLE_BLOCK] for i in range(SAMPLE_BLOCKS))
    return f"{nbytes:x}-{checksum(sample)}"


def _find_existing(
    view: memoryview, digest: str, existing: dict[int, SegmentView], index: dict[str, list[tuple[int, int, int]]]
) -> tuple[int, int] | None:
    if not view.nbytes:
        return None
    for segment_id, offset, nbytes in index.get(digest, ()):
        segment = existing.get(segment_id)
        if nbytes == view.nbytes and segment is not None and same_bytes(segment.view[offset : offset + nbytes], view):
            return segment_id, offset  # a candidate with the same bytes: stored once
    return None
