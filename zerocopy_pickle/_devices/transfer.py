"""Internal: moving many host storages to one device as one bulk transfer, and :func:`to_device`.

What a load to a GPU (``map_location="cuda"``) and :func:`zerocopy_pickle.to_device` share. For every storage
bound to one device:

* **one device allocation** holds them all (laid out by :func:`~zerocopy_pickle._devices.plan.plan`), and each
  storage is *carved* out of it as its own ``UntypedStorage`` (its own size, so ``torch.save`` of a tensor saves
  its bytes only) that keeps the allocation alive: freeing every tensor of a load frees the allocation;
* the bytes travel in large chunks, not one copy per storage. Two ways (:data:`METHODS`):

  - ``"staged"``: the host copies each chunk's pieces into one of ``SLOTS`` pinned staging buffers, and the
    copy of that buffer to the device runs on a side stream while the host fills the next one. The host waits
    only before it refills a slot, for that slot's own copy (an event), and once at the end;
  - ``"registered"``: the mapped host ranges are page-locked where they are (``cudaHostRegister``, read-only, so
    a copy-on-write mapping is not broken) and copied straight from them, then unregistered. When the driver
    refuses (locked-memory limits, a file system that cannot pin) it falls back to ``"staged"``.

  ``"auto"`` is ``"staged"``: see docs/devices.md for the measurements that decide it; except for a load
  from a file (``source=``, a ``SourceFile``) whose ranges are mostly not in the page cache, where it is the
  *cold read* (:mod:`zerocopy_pickle._devices.coldread`).
* the one host synchronisation is at the end, so a returned storage is ready on every stream.

The layout, the chunks, the pieces and the ranges to register are plain data (``plan.py``), executed here
against a ``Backend`` (``backend.py``): the CUDA one, or a fake in the tests, which run on machines without a
GPU. :func:`to_device` walks a graph already in memory for the storages it moves this way.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import traceback
import types
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ArgumentError, DeviceError
from . import coldread
from . import device as devices
from .backend import Backend, backend_for
from .plan import CHUNK_BYTES, SLOTS, Plan, SourceFile, plan, register_ranges

METHODS = ("auto", "staged", "registered", "per-storage")
"""``method=`` values: ``"per-storage"`` is one ``UntypedStorage.copy_`` per storage (the reference)."""


STATS: collections.Counter[str] = collections.Counter()
"""What the transfers of this process did, for tests and benchmarks: ``"cold"`` and ``"mapped"`` transfers,
``"direct bytes"`` and ``"buffered bytes"`` read by cold ones."""


def _host_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def move(
    storages: Sequence[torch.UntypedStorage],
    device: torch.device,
    *,
    method: str = "auto",
    backend: Backend | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    source: SourceFile | None = None,
) -> list[torch.UntypedStorage]:
    """Copy CPU ``storages`` to ``device``: the same storages, in order, carved out of one allocation there.

    Args:
        storages: CPU storages (views of a mapping, or any others); distinct storages, each moved once.
        device: the target, a device with an index (``cuda:0``, not ``cuda``).
        method: one of :data:`METHODS`.
        backend: the device backend (default: :func:`backend_for`); a device type without one, or
            ``method="per-storage"``, copies storage by storage.
        chunk_bytes: bytes per staged copy (and per cold read, rounded down to ``DIRECT_ALIGNMENT``).
        source: the file the storages' bytes are in (a snapshot's mapping). With ``method="auto"`` and less
            than ``coldread.COLD_BELOW`` of those ranges in the page cache, the bytes are read from the file
            (``coldread.read_to_device``) instead of copied from the storages; the fd is not kept.

    Raises:
        ArgumentError: an unknown ``method``, a storage that is not on the CPU, or a ``source`` with another
            number of offsets than storages.
        DeviceError: the device's allocation or a copy failed (nothing of this transfer stays allocated).
        SnapshotError: a cold read found the file shorter than the storages (truncated while it was loaded),
            or could not read it (nothing of this transfer stays allocated).
    """
    _check_arguments(storages, method, source)
    if backend is None and method != "per-storage":
        backend = backend_for(device)
    if backend is None or method == "per-storage" or not storages:
        return [_copy_one(storage, device) for storage in storages]
    layout = plan([storage.nbytes() for storage in storages], chunk_bytes=chunk_bytes)
    base: torch.Tensor | None = None
    try:
        base = backend.allocate(layout.total) if layout.total else None
        if base is not None:
            if method == "auto" and source is not None and coldread.mostly_cold(source, layout.sizes):
                STATS["cold"] += 1
                coldread.read_to_device(backend, source, layout, base, chunk_bytes, STATS)
            elif method == "registered" and _registered(backend, storages, layout, base):
                STATS["mapped"] += 1
            else:
                STATS["mapped"] += 1
                _staged(backend, storages, layout, base, chunk_bytes)
    except BaseException as e:
        # Nothing of the transfer may outlive the failure: not through this frame, nor through the frames of
        # the traceback, which the caller may keep (their locals hold the allocation and the pinned slots).
        base = None
        traceback.clear_frames(e.__traceback__)
        if isinstance(e, torch.OutOfMemoryError):
            raise DeviceError(
                f"cannot allocate {layout.total} bytes on {device} for {len(storages)} storages: {e}"
            ) from e
        if isinstance(e, RuntimeError) and not isinstance(e, DeviceError):
            raise DeviceError(f"the transfer of {layout.total} bytes to {device} failed: {e}") from e
        raise
    return _carve(backend, base, storages, layout)


def _check_arguments(storages: Sequence[torch.UntypedStorage], method: str, source: SourceFile | None) -> None:
    """Raise :class:`ArgumentError` for what :func:`move` refuses, before anything is allocated."""
    if method not in METHODS:
        raise ArgumentError(f"method must be one of {', '.join(map(repr, METHODS))}, not {method!r:.40}")
    for storage in storages:
        if storage.device.type != "cpu":
            raise ArgumentError(f"a transfer moves CPU storages, not one on {storage.device}")
    if source is not None and len(source.offsets) != len(storages):
        raise ArgumentError(f"the source file gives {len(source.offsets)} offsets for {len(storages)} storages")


def _carve(
    backend: Backend, base: torch.Tensor | None, storages: Sequence[torch.UntypedStorage], layout: Plan
) -> list[torch.UntypedStorage]:
    """Each storage's own storage out of the filled allocation ``base`` (an empty one for an empty storage)."""
    moved = []
    for storage, offset in zip(storages, layout.offsets, strict=True):
        nbytes = storage.nbytes()
        if nbytes and base is not None:
            moved.append(backend.carve(base, offset, nbytes))
        else:
            moved.append(torch.UntypedStorage(0, device=backend.device))
    return moved


def _copy_one(storage: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    moved: torch.UntypedStorage = torch.empty(storage.nbytes(), dtype=torch.uint8, device=device).untyped_storage()
    moved.copy_(storage)
    return moved


def _staged(
    backend: Backend, storages: Sequence[torch.UntypedStorage], layout: Plan, base: torch.Tensor, chunk_bytes: int
) -> None:
    hosts = [_host_bytes(storage) for storage in storages]
    count = min(SLOTS, len(layout.chunks))
    size = min(chunk_bytes, max(chunk.nbytes for chunk in layout.chunks))
    slots = [backend.pinned(size) for _ in range(count)]
    events: list[Any] = [None] * count
    for number, chunk in enumerate(layout.chunks):
        slot = number % count
        if events[slot] is not None:
            backend.wait(events[slot])  # its previous copy must be done before it is overwritten
        staging = slots[slot]
        for piece in chunk.pieces:
            at = piece.offset - chunk.offset
            staging[at : at + piece.nbytes].copy_(
                hosts[piece.source][piece.source_offset : piece.source_offset + piece.nbytes]
            )
        backend.copy(base[chunk.offset : chunk.offset + chunk.nbytes], staging[: chunk.nbytes])
        events[slot] = backend.record()
    backend.finish()


def _registered(backend: Backend, storages: Sequence[torch.UntypedStorage], layout: Plan, base: torch.Tensor) -> bool:
    """Copy straight from the host pages, locked in place; False (nothing copied) when registration fails."""
    ranges = register_ranges([(storage.data_ptr(), storage.nbytes()) for storage in storages])
    done: list[int] = []
    in_flight = False
    try:
        for address, nbytes in ranges:
            if not backend.register(address, nbytes):
                return False
            done.append(address)
        for storage, offset in zip(storages, layout.offsets, strict=True):
            nbytes = storage.nbytes()
            if nbytes:
                in_flight = True
                backend.copy(base[offset : offset + nbytes], _host_bytes(storage))
        backend.finish()  # before the pages are unlocked
        in_flight = False
        return True
    finally:
        if in_flight:  # a copy failed to enqueue: the ones before it must end before their pages are unlocked
            with contextlib.suppress(Exception):
                backend.finish()
        for address in done:
            backend.unregister(address)


def device_of(target: str | torch.device) -> torch.device:
    """``target`` as a device with an index (``cuda`` is the current CUDA device), for grouping storages.

    Raises:
        DeviceError: not a device name.
    """
    try:
        device = torch.device(target)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(f"{target!r:.80} is not a device name") from e
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# ---------------------------------------------------------------------------------------------------------
# to_device: a graph already in memory
# ---------------------------------------------------------------------------------------------------------

_LEAVES = (
    str, bytes, bytearray, memoryview, int, float, complex, type(None), range, type, types.ModuleType,
    types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype, torch.device, torch.Size,
    torch.layout, torch.memory_format, torch.UntypedStorage, torch.storage.TypedStorage,
)  # fmt: skip
"""Objects :func:`to_device` never looks into."""


def rebuildable(tensor: torch.Tensor) -> bool:
    """Whether a tensor can be rebuilt on a moved storage with ``set_``: a plain dense CPU tensor. Everything
    else (subclasses such as bitsandbytes' parameters, sparse, quantized, nested, lazily conjugated or negated
    tensors) moves with its own ``.to()``, as ``Module.to`` moves it."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout is torch.strided
        and tensor.device.type == "cpu"
        and not tensor.is_quantized
        and not tensor.is_nested
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


@dataclasses.dataclass
class _Found:
    """What :func:`to_device` found in a graph."""

    target: torch.device
    tensors: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # id -> tensor moved in bulk
    loose: list[tuple[Any, Any, torch.Tensor]] = dataclasses.field(default_factory=list)  # (holder, key, tensor)
    modules: dict[int, torch.nn.Module] = dataclasses.field(default_factory=dict)

    def _bulk(self, tensor: torch.Tensor) -> bool:
        return self.target.type != "cpu" and rebuildable(tensor)

    def tensor(self, holder: Any, key: Any, tensor: torch.Tensor, where: str) -> None:
        if tensor.device == self.target:
            return
        if self._bulk(tensor):
            self.tensors[id(tensor)] = tensor
        elif holder is None:
            raise DeviceError(
                f"to_device cannot move the {type(tensor).__name__} at {where}: it needs its own .to(), whose "
                f"result cannot be put back into an immutable container; move it with .to() yourself"
            )
        else:
            self.loose.append((holder, key, tensor))

    def module(self, module: torch.nn.Module) -> None:
        self.modules[id(module)] = module
        for parameter in module.parameters():
            if self._bulk(parameter):
                self.tensors[id(parameter)] = parameter
            if parameter.grad is not None and self._bulk(parameter.grad):
                self.tensors[id(parameter.grad)] = parameter.grad
        for buffer in module.buffers():
            if self._bulk(buffer):
                self.tensors[id(buffer)] = buffer


def _walk(root: Any, target: torch.device) -> _Found:
    """Every module reachable from ``root``, and every tensor reachable through containers alone.

    Containers are dicts, lists, tuples and sets. Plain objects (a diffusers pipeline, a scheduler, a config)
    are looked into for the modules they hold, as their own ``.to()`` would move those; the tensors they hold
    outside modules stay where they are, as ``pipe.to`` leaves a scheduler's tables on the CPU (schedulers
    turn them into NumPy arrays). A module's own attributes are not looked into: ``Module.to`` moves its
    parameters and buffers only.
    """
    found = _Found(target)
    seen: set[int] = set()
    stack: list[tuple[Any, Any, Any, str, bool]] = [(None, None, root, "the root", True)]
    while stack:
        holder, key, obj, where, contained = stack.pop()
        if isinstance(obj, torch.Tensor):
            if contained:
                found.tensor(holder, key, obj, where)
            continue
        if isinstance(obj, _LEAVES) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found.module(obj)
        elif isinstance(obj, dict):
            stack.extend((obj, k, v, f"{where}[{k!r:.40}]", contained) for k, v in obj.items())
        elif isinstance(obj, list):
            stack.extend((obj, i, v, f"{where}[{i}]", contained) for i, v in enumerate(obj))
        elif isinstance(obj, (tuple, set, frozenset)):
            stack.extend((None, None, v, f"an item of {where}", contained) for v in obj)
        else:
            attributes = getattr(obj, "__dict__", None)
            if type(attributes) is dict:
                stack.extend((None, None, v, f"{where}.{k}", False) for k, v in attributes.items())
    return found


def to_device(obj: Any, device: str | torch.device, *, method: str = "auto") -> Any:
    """Move every tensor of a graph to ``device`` in one bulk transfer per device; returns the graph.

    Moves what ``.to(device)`` would, in place as ``Module.to`` does: the parameters, gradients and buffers of
    every module reachable from ``obj`` (through ``Module._apply``, so a module's own ``_apply`` still runs),
    also through plain objects' attributes (a diffusers pipeline's components), and every tensor reachable
    through dicts, lists, tuples and sets alone (a state dict). Tensors a plain object holds outside a module
    stay where they are, as with ``pipe.to`` (a scheduler's tables). Tensors that share a storage still share
    one afterwards. Dtypes, hooks, ``requires_grad``
    and object identities are kept; tensors already on ``device`` stay. A tensor that needs its own ``.to()``
    (a subclass such as bitsandbytes' ``Params4bit``, a sparse tensor) gets it, as with ``Module.to``.

    Args:
        obj: the graph: a module, a pipeline, a dict of tensors, a tensor, any object holding them.
        device: the target (``"cuda"``, ``"cuda:1"``, a ``torch.device``).
        method: how the bytes travel (``"auto"``, ``"staged"``, ``"registered"``, ``"per-storage"``; see
            docs/devices.md).

    Returns:
        ``obj``, moved (a tensor that needs its own ``.to()`` passed as ``obj`` is returned moved instead).

    Raises:
        DeviceError: the device does not exist here, or a tensor that needs its own ``.to()`` sits in a
            tuple or set (nothing was moved in either case); an allocation or copy failed.
        ArgumentError: an unknown ``method``.

    Examples:
        >>> import torch, zerocopy_pickle as zp
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> pipe = {"unet": torch.nn.Linear(4, 2), "scale": torch.ones(2)}
        >>> pipe = zp.to_device(pipe, device)  # one bulk transfer, not one copy per tensor
        >>> pipe["unet"].weight.device.type == pipe["scale"].device.type == device
        True
    """
    if method not in METHODS:
        raise ArgumentError(f"method must be one of {', '.join(map(repr, METHODS))}, not {method!r:.40}")
    target = device_of(device)
    devices.check_device(target, f"to_device(..., {str(device)!r})")
    if isinstance(obj, torch.Tensor) and (target.type == "cpu" or not rebuildable(obj)):
        return obj.to(target)
    found = _walk(obj, target)
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in found.tensors.values():
        storage = tensor.untyped_storage()
        storages.setdefault(storage._cdata, storage)
    keys = list(storages)
    moved = dict(zip(keys, move([storages[k] for k in keys], target, method=method), strict=True))
    table: dict[int, torch.Tensor] = {}
    for tensor in found.tensors.values():
        storage = moved[tensor.untyped_storage()._cdata]
        new = torch.empty(0, dtype=tensor.dtype, device=storage.device)
        new.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
        table[id(tensor)] = new
    roots = _roots(list(found.modules.values()))

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        new = table.get(id(tensor))
        if new is None:
            return tensor.to(target)  # what Module.to does with it
        if tensor.requires_grad and not isinstance(tensor, torch.nn.Parameter):
            new.requires_grad_(True)  # a buffer that requires grad; a parameter keeps its flag through .data
        return new

    for module in roots:
        module._apply(convert)
    for tensor_id, tensor in found.tensors.items():
        if tensor.device != target:  # outside every module: moved in place, as Module.to moves a parameter
            tensor.data = table[tensor_id]
    for holder, key, tensor in found.loose:
        holder[key] = tensor.to(target)
    return obj


def _roots(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules that are not a submodule of another one in ``modules``."""
    inner = {id(sub) for module in modules for sub in module.modules() if sub is not module}
    return [module for module in modules if id(module) not in inner]
