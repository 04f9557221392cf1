"""Internal: every function a snapshot's pickle stream calls at load time.

The module path and name of each function here are part of the file format: a stream names them as
``zerocopy_pickle.rebuild:<name>``. Never rename or move one without leaving an alias behind, and never change
the meaning of its arguments; add a new function instead.

These are plain functions that work without this library's unpickler (``pickle.loads(stream,
buffers=...)`` gives the same objects, placed on their saved devices). :class:`StorageBuilder` is what the
library's unpickler substitutes for :func:`rebuild_storage`, to apply one load's ``map_location``.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch

from . import native, validate
from ._devices import device
from ._devices.device import MapLocation
from .errors import SnapshotError, UnsafeArgumentError

# Note [Safe globals]
# ~~~~~~~~~~~~~~~~~~~
# A restricted load calls rebuild functions with arguments a hostile stream chose. It never calls the functions
# of this module directly (except StorageBuilder, which checks its own arguments): zerocopy_pickle._trust.safe_set
# wraps each in a function that checks exact types, sizes and ranges first. Trusted loads call these directly.

# Note [Arena lifetime]
# ~~~~~~~~~~~~~~~~~~~~~
# A loaded storage points into a mapping of the snapshot. The mapping must outlive every storage in it, and
# nothing may unmap it under a live tensor: that is a segfault, not an exception. Two builders keep that
# promise (zerocopy_pickle.native chooses):
# * Python: torch.frombuffer keeps a reference to the object it is given and drops its own buffer export at
#   once; so it is given a memoryview slice, whose export of the mmap object lives as long as the slice. The
#   storage's deleter holds the slice.
# * Native (csrc/zerocopy_native.cpp): the storage's DataPtr owns a Py_buffer export of the slice itself,
#   released (GIL taken) by its deleter. About ten times cheaper, and the slice cannot even be release()d
#   while the storage lives.
# Either way, while any storage is alive the mmap cannot be closed (mmap.close() raises BufferError) nor
# collected. The library never calls close() on a load's mapping: it is unmapped when its last storage dies.


def storage_from_buffer(buffer: Any) -> torch.UntypedStorage:
    """Build a CPU ``UntypedStorage`` over ``buffer`` without copying it, when that is safe.

    A writable buffer is aliased: the storage is a view into it and keeps it alive (Note [Arena lifetime]),
    built by the native helper when that backend is active (:mod:`zerocopy_pickle.native`), else by
    ``torch.frombuffer``.
    A read-only buffer is copied, because torch has no read-only storages and a writable tensor over
    immutable memory (``bytes``) would be undefined behaviour.
    """
    view = memoryview(buffer)
    if view.ndim != 1 or view.format not in ("B", "b", "c"):
        view = view.cast("B")
    if view.nbytes == 0:
        return torch.UntypedStorage(0)
    if view.readonly:
        return torch.UntypedStorage.from_buffer(view, byte_order="native", dtype=torch.uint8)
    build = native.storage_builder()
    if build is not None:
        return build(view)
    return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()


def rebuild_storage(buffer: Any, location: str) -> torch.UntypedStorage:
    """Rebuild an ``UntypedStorage`` saved on ``location`` from its out-of-band buffer."""
    return device.default_restore(storage_from_buffer(buffer), location)


_PROTOTYPES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def empty_tensor(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor of ``dtype`` on ``device``, to ``set_`` onto a storage: ``prototype.new()`` of a cached
    prototype is cheaper than ``torch.empty()`` (and ignores the default device); the hot path of a load with
    thousands of tensors."""
    try:
        prototype = _PROTOTYPES[dtype, device]
    except KeyError:
        prototype = _PROTOTYPES[dtype, device] = torch.empty(0, dtype=dtype, device=device)
    return prototype.new()


def rebuild_tensor(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
) -> torch.Tensor:
    """A dense tensor as a view of ``storage`` (``Tensor.set_`` checks the view fits in it)."""
    tensor = empty_tensor(dtype, storage.device)
    tensor.set_(storage, storage_offset, size, stride)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def rebuild_sparse_tensor_checked(layout: torch.layout, data: tuple[Any, ...]) -> torch.Tensor:
    """``torch._utils._rebuild_sparse_tensor`` with its invariants checked at once (restricted loads use this
    in its place: torch checks them only after ``torch.load``, and bad indices read out of bounds)."""
    if layout == torch.sparse_coo:
        indices, values, size, *rest = data
        coalesced = rest[0] if rest else None
        return torch.sparse_coo_tensor(indices, values, size, check_invariants=True, is_coalesced=coalesced)
    if layout in (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        compressed, plain, values, size = data
        return torch.sparse_compressed_tensor(compressed, plain, values, size, layout=layout, check_invariants=True)
    raise ValueError(f"unknown sparse layout {layout!r}")


def rebuild_typed_storage(storage: torch.UntypedStorage, dtype: torch.dtype) -> torch.storage.TypedStorage:
    """Wrap an untyped storage as the ``TypedStorage`` that ``Tensor.__reduce_ex__`` expects."""
    return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def rebuild_meta_storage(nbytes: int) -> torch.UntypedStorage:
    """A meta storage holds no data: only its size travels."""
    return torch.UntypedStorage(nbytes, device="meta")


MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}
"""Every memory format by the name :func:`rebuild_memory_format` takes (``str(fmt)`` without ``torch.``)."""


def rebuild_memory_format(name: str) -> torch.memory_format:
    """``torch.<name>``, a memory format, from a fixed table. Pickle writes a memory format as a global found by
    searching ``sys.modules`` for a module that reaches it (``torch._utils:torch.channels_last``, or any module that
    imported torch first): this library's pickler writes this call instead, whose name never varies."""
    try:
        return MEMORY_FORMATS[name]
    except (KeyError, TypeError):
        raise UnsafeArgumentError(
            f"zerocopy_pickle.rebuild:rebuild_memory_format: {name!r:.60} is not a torch memory format"
        ) from None


class Placement(dict[int, torch.UntypedStorage]):
    """One load's own out-of-band buffers, where each goes, and the storage each became.

    As a dict: buffer index -> its storage, filled by the load core's bulk transfer (a storage already moved to its
    device) or by the first ``rebuild_storage`` of the buffer. A buffer is one storage however often the stream
    references it: placement is keyed by the buffer's identity (its index in the load's list), so K references to
    one buffer cost one host storage and at most one device copy, never K.

    Args:
        buffers: the load's buffers, in the order the stream consumes them (held here, so their identities stay
            theirs for the load's life).
        locations: the device each buffer was recorded on (the header's buffer rows), which decides, with the load's
            ``map_location``, where its storage goes; None when the caller has no rows (then the first
            ``rebuild_storage`` of a buffer records the stream's location for it).

    Raises:
        SnapshotError: ``locations`` does not have one entry per buffer.
    """

    __slots__ = ("_buffers", "_index", "_locations")

    def __init__(self, buffers: Sequence[Any] = (), locations: Sequence[str] | None = None) -> None:
        super().__init__()
        self._buffers = tuple(buffers)
        if locations is not None and len(locations) != len(self._buffers):
            raise SnapshotError(f"{len(locations)} buffer location(s) for {len(self._buffers)} buffer(s)")
        self._locations: list[str | None] = list(locations) if locations is not None else [None] * len(self._buffers)
        self._index: dict[int, int] = {}
        for index, buffer in enumerate(self._buffers):
            self._index.setdefault(id(buffer), index)

    def index_of(self, buffer: object) -> int | None:
        """The index of ``buffer`` if it is one of the load's own buffers (by identity), else None."""
        index = self._index.get(id(buffer))
        if index is None or self._buffers[index] is not buffer:
            return None
        return index

    def location(self, index: int, stream_location: str) -> str:
        """Where buffer ``index`` was recorded: its header row's location (``stream_location``, what the stream
        passed, is then ignored), or without rows the location of the stream's first ``rebuild_storage`` of it."""
        recorded = self._locations[index]
        if recorded is None:
            recorded = self._locations[index] = stream_location
        return recorded


class StorageBuilder:
    """:func:`rebuild_storage` for one load: applies that load's ``map_location``.

    The unpickler returns an instance of this class when a stream asks for
    ``zerocopy_pickle.rebuild:rebuild_storage``; the call signature is the same.

    Given the load's :class:`Placement` (as ``placed``), a storage over one of the load's own buffers goes where
    that buffer's header row and ``map_location`` say, and is built (and moved) once per buffer: every
    ``rebuild_storage`` of the same buffer returns the same storage. The stream's ``location`` argument must be a
    device string of at most 64 characters but is otherwise **ignored** for such buffers: the header row, which
    :meth:`zerocopy_pickle._devices.device.Targets.check` checked before anything was built and which the bulk transfer
    used, decides (a stream that disagrees with its header is placed by the header, as the bulk transfer places
    it). Bytes in the stream (a storage copied in band: no row) go where the stream's location and
    ``map_location`` say, each call its own copy, charged to a restricted load's budget. A plain dict as
    ``placed`` (``id(buffer) -> storage``, the interface before :class:`Placement`) is still read.
    """

    __slots__ = ("_legacy", "_native", "_placement", "_targets")

    def __init__(
        self, map_location: MapLocation | device.Targets, placed: dict[int, torch.UntypedStorage] | None = None
    ) -> None:
        self._targets = device.Targets.of(map_location)  # the load's own, or made here once
        self._placement = placed if isinstance(placed, Placement) else None
        # id(buffer) -> a storage already moved, for a caller that passes a plain dict: the buffers of the load's
        # own list, alive for as long as the unpickler is.
        self._legacy = placed if placed is not None and not isinstance(placed, Placement) else None
        self._native = native.storage_builder()  # the backend is chosen once per load

    def __call__(self, buffer: Any, location: str) -> torch.UntypedStorage:
        # A restricted load calls this with arguments the stream chose: exact types first (Note [Safe globals]).
        if type(location) is not str or len(location) > 64:
            raise UnsafeArgumentError(
                f"zerocopy_pickle.rebuild:rebuild_storage: location must be a device string, not "
                f"{type(location).__qualname__}" + (f" of {len(location)} characters" if type(location) is str else "")
            )
        placement = self._placement
        if placement is not None:
            index = placement.index_of(buffer)
            if index is not None:
                storage = placement.get(index)
                if storage is None:
                    saved = placement.location(index, location)
                    storage = placement[index] = self._place(self._host(buffer), saved)
                return storage
        elif self._legacy and type(buffer) is memoryview:
            moved = self._legacy.get(id(buffer))
            if moved is not None:
                return moved
        return self._place(self._host(buffer), location)

    def _host(self, buffer: Any) -> torch.UntypedStorage:
        """A CPU storage over (or, for read-only bytes, a copy of) ``buffer``."""
        if type(buffer) is memoryview and buffer.format == "B" and buffer.nbytes and not buffer.readonly:
            # The load's own slices of its mapping: skip storage_from_buffer's checks (hot path).
            build = self._native
            if build is None:
                return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()
            return build(buffer)
        if type(buffer) in (memoryview, bytes, bytearray, pickle.PickleBuffer):
            # A read-only buffer or bytes in the stream is copied: charged to a restricted load's budget, since a
            # stream could name the same bytes over and over (validate.charge is free outside restricted loads).
            validate.charge(memoryview(buffer).nbytes, "zerocopy_pickle.rebuild:rebuild_storage")
            return storage_from_buffer(buffer)
        raise UnsafeArgumentError(
            f"zerocopy_pickle.rebuild:rebuild_storage: buffer must be an out-of-band buffer or bytes, not "
            f"{type(buffer).__qualname__}"
        )

    def _place(self, storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        """``storage`` (on the CPU), saved on ``location``, where the load's ``map_location`` sends it."""
        return self._targets.restore(storage, location)
