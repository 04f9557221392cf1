"""Internal: turning objects into cache entries and back: pickling with argument references, deduplicating storages
into segments, and loading an entry as views into mapped segments.

A call's arguments that are themselves cached objects (``vae=vae``), and wrappers or containers made of them
(``MultiControlNetModel([a, b])``, lists, dicts), are pickled with each cached object replaced by a reference:
``zerocopy_pickle._core.loadcore:argument(i)``, the i-th referenced entry. The same pickling gives the cache key
(those references are stable: they name the referenced entries' keys) and the arguments' transport to the loader.
The loader pickles the result the same way, so a loaded pipeline's ``vae`` *is* the caller's ``vae``.

Every stream records the plugins its pickler used (as a snapshot header does), and every cache stream is loaded
through the load core (:mod:`zerocopy_pickle._core.loadcore`), trusted, which runs those plugins' load hooks first.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import mmap
import os
import pickle
import time
from collections.abc import Callable, Sequence
from typing import IO, Any, NamedTuple

import torch

from .._core.loadcore import BufferTable, LoadPolicy, argument, load_stream
from .._core.pickler import ZeroCopyPickler
from .._registry.preparation import dump_reductions
from .._storage import arena, progress, writes
from .._storage.format import BufferSpec, PluginRef, padded_pieces, place_buffers
from .._storage.integrity import checksum
from . import filebacked
from .fields import BufferRow
from .filebacked import FileRange
from .jobs import JobResult
from .protocol import MAX_FDS


def argument_slots(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments a result may hold by identity (a module passed as ``vae=vae``), in a fixed order that
    the client and the loader both compute. Immutable primitives are left out: identity means nothing there."""
    values = [*args, *(kwargs[k] for k in sorted(kwargs))]
    return [v for v in values if not isinstance(v, (str, bytes, int, float, complex, bool, type(None)))]


@functools.cache
def by_value() -> bool:
    """Whether cache streams pickle functions and classes plain pickle cannot take (lambdas, local and
    ``__main__`` definitions) by value: when cloudpickle is installed (the ``cache`` extra brings it). Without
    it a graph holding one cannot be cached and its call runs uncached, as for anything else that does not
    pickle; the cache must never make a call fail for want of an optional dependency."""
    return importlib.util.find_spec("cloudpickle") is not None


class RefPickler(ZeroCopyPickler):
    """A :class:`ZeroCopyPickler` that pickles the objects in ``refs`` as references ``argument(i)``
    (:func:`zerocopy_pickle._core.loadcore.argument`)."""

    def __init__(self, file: Any, refs: Sequence[object], **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._ref_index = {id(obj): i for i, obj in enumerate(refs)}
        self._refs = list(refs)  # keeps the ids valid while pickling

    def reducer_override(self, obj: Any) -> Any:
        index = self._ref_index.get(id(obj))
        if index is not None:
            return argument, (index,)
        return super().reducer_override(obj)


Plugins = Sequence[tuple[str, str]]


def plugin_list(refs: Sequence[PluginRef]) -> list[tuple[str, str]]:
    """``(name, package)`` of each plugin a pickler used: what an entry records, as a snapshot header does."""
    return [(ref.name, ref.package) for ref in refs]


def unpickle(stream: bytes, buffers: Sequence[Any], refs: Sequence[object], plugins: Plugins = ()) -> Any:
    """Unpickle a cache stream through the load core, trusted: it comes from this user's own server, which got it
    from this user's own loader (or from this user's own client). The plugins it needs are prepared and their load
    hooks run first, as for a trusted snapshot load. The bounds check is not run (see ``check_bounds`` in
    :func:`zerocopy_pickle._core.loadcore.load_stream`)."""
    return load_stream(
        stream,
        BufferTable(buffers, name="its buffer table"),
        LoadPolicy(trusted=True, plugins=plugins, arguments=refs, check_bounds=False),
        where="the cached entry's stream",
    )


def load_entry(
    stream: bytes,
    rows: Sequence[BufferRow],
    segments: dict[int, mmap.mmap],
    refs: Sequence[object],
    plugins: Plugins = (),
) -> Any:
    """Rebuild an entry from its stream and buffer table, over private mappings of its segments."""
    views = {segment_id: memoryview(memory) for segment_id, memory in segments.items()}
    buffers = [views[row.segment][row.offset : row.offset + row.nbytes] for row in rows]
    return unpickle(stream, buffers, refs, plugins)


def map_segments(ids: Sequence[int], fds: Sequence[int]) -> dict[int, mmap.mmap]:
    """Map each segment ``MAP_PRIVATE`` (one mapping per load: writes stay private to that load)."""
    sizes = {segment_id: (fd, os.fstat(fd).st_size) for segment_id, fd in zip(ids, fds, strict=True)}
    return {segment_id: arena.map_private(fd, size) for segment_id, (fd, size) in sizes.items() if size}


class Pickled(NamedTuple):
    """An object pickled for the cache: the stream, the out-of-band buffers (empty in band) with what the pickler
    knows of each, and the plugins whose reducers it used."""

    stream: bytes
    views: list[memoryview]
    specs: list[BufferSpec]
    plugins: list[tuple[str, str]]


def ref_pickler(
    out: IO[bytes], refs: Sequence[object], callback: Callable[[pickle.PickleBuffer], bool] | None
) -> RefPickler:
    """The pickler of a cache entry: ``refs`` as references, plugins' reducers, by value where it must."""
    pickler = RefPickler(out, refs, buffer_callback=callback, by_value=by_value())
    # accelerate's disk-offloaded weights read into the entry, as zerocopy_pickle.dump does (offloaded="copy"):
    # an entry that reads a folder breaks when the folder moves
    pickler.dispatch_table.update(dump_reductions("copy"))
    return pickler


def pickle_with_refs(obj: Any, refs: Sequence[object], *, in_band: bool) -> Pickled:
    """Pickle ``obj`` with ``refs`` as references; with ``in_band``, tensor bytes stay in the stream (for small
    argument payloads and keys) and there are no out-of-band buffers.

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

    pickler = ref_pickler(out, refs, callback)
    pickler.dump(obj)
    pickler.clear_memo()
    return Pickled(out.getvalue(), views, pickler.buffer_specs, plugin_list(pickler.plugins_used))


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
) -> tuple[list[BufferRow], int | None]:
    """Place each buffer: where an identical one already is (compared byte for byte), in the file it is an
    untouched view of (``files``, from :func:`filebacked.file_ranges`), else in a new sealed memfd.

    Returns the buffer table and the new segment's fd (or None). Rows are in the ``segment`` place (an existing
    segment), ``new`` (the new memfd) or ``file`` (the i-th file). File rows carry no digest: nothing is read to
    place them.
    """
    rows: list[BufferRow] = []
    new_views: list[memoryview] = []
    new_rows: list[int] = []
    for i, (view, location) in enumerate(zip(views, locations, strict=True)):
        origin = provenance(view) if view.nbytes else None
        if origin is not None:  # a view into a segment this loader mapped (an argument's storage): verify it
            segment = existing.get(origin[0])
            if segment is not None and same_bytes(segment.view[origin[1] : origin[1] + view.nbytes], view):
                rows.append(BufferRow(origin[0], origin[1], view.nbytes, location, sample_digest(view)))
                continue
        file_range = files[i] if files is not None else None
        if file_range is not None:
            rows.append(BufferRow(file_range.file, file_range.offset, view.nbytes, location, None, "file"))
            continue
        digest = sample_digest(view)
        place = _find_existing(view, digest, existing, index)
        if place is not None:
            rows.append(BufferRow(place[0], place[1], view.nbytes, location, digest))
            continue
        new_rows.append(len(rows))
        new_views.append(view)
        rows.append(BufferRow(0, 0, view.nbytes, location, digest, "new"))
    offsets, end = place_buffers(view.nbytes for view in new_views)
    for row_index, offset in zip(new_rows, offsets, strict=True):
        rows[row_index] = rows[row_index]._replace(offset=offset)
    if not end:
        return rows, None
    fd = arena.create_memfd("zerocopy_pickle-cache")
    try:
        # A bar only where this runs with a terminal on stderr: a caller that files in its own thread, or a
        # server started in one (a forked filing child writes its stderr to fill.log).
        with progress.bar(end, "cache fill") as report:
            writes.write_pieces(fd, padded_pieces(new_views, offsets), progress=report)
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


def capture(
    value: Any,
    refs: Sequence[object],
    *,
    file_segments: bool,
    existing: dict[int, SegmentView] | None = None,
    index: dict[str, list[tuple[int, int, int]]] | None = None,
    provenance: Callable[[memoryview], tuple[int, int] | None] | None = None,
) -> tuple[JobResult, bytes, list[int]]:
    """Turn a loaded result into an entry: pickle it with ``refs`` as references, find the storages that are
    untouched views of checkpoint files (with ``file_segments``), and copy every other storage into a new sealed
    memfd (or reference an identical one in ``existing`` segments, found through ``index`` and ``provenance``).

    Everything is read now: once this returns, the caller may change the result in place without changing the
    entry. Used by the loader's children and by clients that load their own misses.

    Returns the entry's description, its stream and its fds (the new memfd, if any, then the files; the caller
    closes them, or sends them and then closes them).
    """
    clock = time.perf_counter
    mark = clock()
    pickled = pickle_with_refs(value, refs, in_band=False)
    timings = {"pickle": clock() - mark}
    mark = clock()
    files, file_fds = filebacked.file_ranges(pickled.views) if file_segments else ([], [])
    if len(file_fds) > MAX_FDS - 1:  # one message carries them all: copy what refers to the files beyond
        for fd in file_fds[MAX_FDS - 1 :]:
            os.close(fd)
        file_fds = file_fds[: MAX_FDS - 1]
        files = [r if r is not None and r.file < len(file_fds) else None for r in files]
    timings["files"] = clock() - mark
    mark = clock()
    try:
        rows, new_fd = build_segment(
            pickled.views,
            [spec.location for spec in pickled.specs],
            existing or {},
            index or {},
            provenance or (lambda view: None),
            files or None,
        )
    except BaseException:
        for fd in file_fds:
            os.close(fd)
        raise
    timings["segment"] = clock() - mark
    fds = ([new_fd] if new_fd is not None else []) + file_fds
    result = JobResult(rows, pickled.plugins, [], timings, new_fd is not None, len(file_fds))
    return result, pickled.stream, fds
