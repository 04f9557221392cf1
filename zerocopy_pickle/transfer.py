"""Internal: moving many host storages to one device as one bulk transfer.

What a load to a GPU (``map_location="cuda"``) and :func:`zerocopy_pickle.to_device` share. For every storage
bound to one device:

* **one device allocation** holds them all (:func:`plan` lays them out, each at a :data:`DEVICE_ALIGNMENT`
  boundary, as the caching allocator would place them one by one), and each storage is *carved* out of it as its
  own ``UntypedStorage`` (its own size, so ``torch.save`` of a tensor saves its bytes only) that keeps the
  allocation alive: freeing every tensor of a load frees the allocation;
* the bytes travel in large chunks, not one copy per storage. Two ways (:data:`METHODS`):

  - ``"staged"``: the host copies each chunk's pieces into one of :data:`SLOTS` pinned staging buffers, and the
    copy of that buffer to the device runs on a side stream while the host fills the next one. The host waits
    only before it refills a slot, for that slot's own copy (an event), and once at the end;
  - ``"registered"``: the mapped host ranges are page-locked where they are (``cudaHostRegister``, read-only, so
    a copy-on-write mapping is not broken) and copied straight from them, then unregistered. When the driver
    refuses (locked-memory limits, a file system that cannot pin) it falls back to ``"staged"``.

  ``"auto"`` is ``"staged"``: see docs/devices.md for the measurements that decide it.
* the one host synchronisation is at the end, so a returned storage is ready on every stream.

Everything that decides what happens (the layout, the chunks, the pieces each chunk is filled from, the ranges
to register, the fallback) is plain data computed here and executed against a :class:`Backend`: the CUDA one,
or a fake in the tests, which run on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import mmap
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from . import device as devices
from .errors import ArgumentError, DeviceError

__all__ = [
    "CHUNK_BYTES",
    "DEVICE_ALIGNMENT",
    "METHODS",
    "SLOTS",
    "Backend",
    "Chunk",
    "CudaBackend",
    "Piece",
    "Plan",
    "backend_for",
    "device_of",
    "has_backend",
    "move",
    "plan",
    "rebuildable",
    "register_ranges",
    "to_device",
]

DEVICE_ALIGNMENT = 512
"""Where each storage starts in the device allocation: the caching allocator's own granularity, so a carved
storage is as aligned as one allocated alone (vectorised kernels and cuBLAS rely on it)."""

CHUNK_BYTES = 64 << 20
"""Bytes per staged copy: large enough that a copy runs at the link's rate, small enough that the first copy
starts early and the pinned buffers stay small (:data:`SLOTS` of them)."""

SLOTS = 3
"""Pinned staging buffers: one being copied to the device, one being filled, one spare so that a slow fill
never waits for a copy."""

METHODS = ("auto", "staged", "registered", "per-storage")
"""``method=`` values: ``"per-storage"`` is one ``UntypedStorage.copy_`` per storage (the reference)."""

PAGE = mmap.PAGESIZE


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


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


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
        start = _align(end, alignment)
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
        start, stop = address - address % page, _align(address + nbytes, page)
        if ranges and start <= ranges[-1][1]:
            ranges[-1][1] = max(ranges[-1][1], stop)
        else:
            ranges.append([start, stop])
    return [(start, stop - start) for start, stop in ranges]


class Backend(Protocol):
    """What a transfer needs from a device: :class:`CudaBackend`, or a fake in the tests."""

    device: torch.device

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of ``nbytes`` on the device: the load's one allocation."""

    def carve(self, base: torch.Tensor, offset: int, nbytes: int) -> torch.UntypedStorage:
        """A storage of ``nbytes`` at ``offset`` of ``base`` that keeps ``base`` alive."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host tensor in page-locked memory."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` (host to device) on the transfer's stream, without waiting for it."""

    def record(self) -> Any:
        """An event marking every copy enqueued so far."""

    def wait(self, event: Any) -> None:
        """Block the host until ``event`` has happened."""

    def finish(self) -> None:
        """Block the host until every copy is done; order the current stream after them."""

    def register(self, address: int, nbytes: int) -> bool:
        """Page-lock host memory in place for direct copies; False when the driver refuses."""

    def unregister(self, address: int) -> None:
        """Undo :meth:`register`."""


class _CudaView:
    """A range of a device tensor in the CUDA array interface, for ``torch.as_tensor``: the tensor it makes
    has a storage of exactly this range whose deleter drops this object, and with it the allocation."""

    __slots__ = ("__cuda_array_interface__", "base")

    def __init__(self, base: torch.Tensor, offset: int, nbytes: int) -> None:
        self.base = base
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (base.data_ptr() + offset, False),
            "version": 2,
        }


class CudaBackend:
    """Transfers to one CUDA device, on a side stream of its own."""

    _HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: no write access asked, no copy-on-write broken

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device)
        self._base: torch.Tensor | None = None

    def allocate(self, nbytes: int) -> torch.Tensor:
        self._base = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        # The copies run on the side stream: the allocator must not hand the block out again before they end.
        self._base.record_stream(self._stream)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._base

    def carve(self, base: torch.Tensor, offset: int, nbytes: int) -> torch.UntypedStorage:
        tensor = torch.as_tensor(_CudaView(base, offset, nbytes), device=self.device)
        return tensor.untyped_storage()

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()

    def finish(self) -> None:
        self._stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def register(self, address: int, nbytes: int) -> bool:
        library = _cudart()
        if library is None:
            return False  # no runtime library to call: stage instead
        code = library.cudaHostRegister(
            ctypes.c_void_p(address), ctypes.c_size_t(nbytes), self._HOST_REGISTER_READ_ONLY
        )
        if code != 0:
            library.cudaGetLastError()  # clear the error, or the next kernel launch check would report it
            return False
        return True

    def unregister(self, address: int) -> None:
        library = _cudart()
        assert library is not None  # register succeeded through it
        library.cudaHostUnregister(ctypes.c_void_p(address))


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded (found in this process's mappings), for the calls torch does not
    bind (``cudaGetLastError``); None when torch links it statically or it cannot be found."""
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(p for p in paths if p.startswith("/")):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        library.cudaHostRegister.restype = ctypes.c_int
        library.cudaHostUnregister.restype = ctypes.c_int
        library.cudaGetLastError.restype = ctypes.c_int
        return library
    return None


_BACKENDS: dict[str, Callable[[torch.device], Backend]] = {"cuda": CudaBackend}
"""Device types with a bulk transfer; others (mps, xpu, ...) take one copy per storage."""


def has_backend(device: torch.device) -> bool:
    """Whether storages bound to ``device`` travel in one bulk transfer."""
    return device.type in _BACKENDS


def backend_for(device: torch.device) -> Backend | None:
    """The bulk-transfer backend for ``device``, or None when its type has none."""
    factory = _BACKENDS.get(device.type)
    return factory(device) if factory is not None else None


def _host_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def move(
    storages: Sequence[torch.UntypedStorage],
    device: torch.device,
    *,
    method: str = "auto",
    backend: Backend | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> list[torch.UntypedStorage]:
    """Copy CPU ``storages`` to ``device``: the same storages, in order, carved out of one allocation there.

    Args:
        storages: CPU storages (views of a mapping, or any others); distinct storages, each moved once.
        device: the target, a device with an index (``cuda:0``, not ``cuda``).
        method: one of :data:`METHODS`.
        backend: the device backend (default: :func:`backend_for`); a device type without one, or
            ``method="per-storage"``, copies storage by storage.
        chunk_bytes: bytes per staged copy.

    Raises:
        ArgumentError: an unknown ``method``, or a storage that is not on the CPU.
        DeviceError: the device's allocation or a copy failed (nothing of this transfer stays allocated).
    """
    if method not in METHODS:
        raise ArgumentError(f"method must be one of {', '.join(map(repr, METHODS))}, not {method!r:.40}")
    for storage in storages:
        if storage.device.type != "cpu":
            raise ArgumentError(f"a transfer moves CPU storages, not one on {storage.device}")
    if backend is None and method != "per-storage":
        backend = backend_for(device)
    if backend is None or method == "per-storage" or not storages:
        return [_copy_one(storage, device) for storage in storages]
    layout = plan([storage.nbytes() for storage in storages], chunk_bytes=chunk_bytes)
    try:
        base = backend.allocate(layout.total) if layout.total else None
        if base is not None:
            if method == "registered" and _registered(backend, storages, layout, base):
                pass
            else:
                _staged(backend, storages, layout, base, chunk_bytes)
    except torch.OutOfMemoryError as e:
        raise DeviceError(f"cannot allocate {layout.total} bytes on {device} for {len(storages)} storages: {e}") from e
    except RuntimeError as e:
        raise DeviceError(f"the transfer of {layout.total} bytes to {device} failed: {e}") from e
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
