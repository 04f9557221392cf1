"""Internal: the copy backends a bulk transfer runs against.

:class:`Backend` is what a transfer needs from a device: one allocation, storages carved out of it, pinned host
buffers, copies enqueued on a stream of its own, events, the final synchronisation, and host pages locked in
place. :class:`CudaBackend` is the CUDA one (``cudaHostRegister`` through the runtime library torch loaded);
the tests run the same transfers against a fake, on machines without a GPU. :func:`backend_for` picks the
backend of a device type; a type without one (mps, xpu, ...) is copied storage by storage.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Backend(Protocol):
    """What a transfer needs from a device: :class:`CudaBackend`, or a fake in the tests."""

    device: torch.device

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 tensor of ``nbytes`` on the device: the load's one allocation."""

    def carve(self, base: torch.Tensor, offset: int, nbytes: int) -> torch.UntypedStorage:
        """A storage of ``nbytes`` at ``offset`` of ``base`` that keeps ``base`` alive."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 host tensor in page-locked memory, page-aligned (``cudaHostAlloc``'s are; a cold read
        reads with direct I/O only into an aligned one, and buffered into any other)."""

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
