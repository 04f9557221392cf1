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

  ``"auto"`` is ``"staged"``: see docs/devices.md for the measurements that decide it; except for a load
  from a file (``source=``, a :class:`SourceFile`) whose ranges are mostly not in the page cache, where it
  is the *cold read*: a few threads read the file itself (``O_DIRECT`` where aligned, buffered ``preadv``
  otherwise) straight into the same ring of pinned buffers, each copied to the device while the next ones
  fill, instead of faulting the mapping's pages in through one thread (:func:`plan_reads`, :data:`READERS`).
* the one host synchronisation is at the end, so a returned storage is ready on every stream.

Everything that decides what happens (the layout, the chunks, the pieces each chunk is filled from, the ranges
to register, the fallback) is plain data computed here and executed against a :class:`Backend`: the CUDA one,
or a fake in the tests, which run on machines without a GPU.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import errno
import functools
import mmap
import os
import threading
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .._storage import readahead
from ..errors import ArgumentError, DeviceError, SnapshotError
from . import device as devices

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

DIRECT_ALIGNMENT = 4096
"""What an ``O_DIRECT`` read's file offset, length and buffer address are aligned to: the largest logical block
size of common disks (512 or 4096 bytes), so one rule fits them all without asking the device (``statx``'s
``STATX_DIOALIGN`` is not in Python's ``os``). A file system that wants more refuses with ``EINVAL``, and the
read falls back to buffered."""

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

GAP_BYTES = 1 << 20
"""A cold read does not read across a gap between two storages' file ranges larger than this (bytes of other
buffers, or of storages bound elsewhere): it ends the chunk there and starts the next one after the gap."""

STATS: collections.Counter[str] = collections.Counter()
"""What the transfers of this process did, for tests and benchmarks: ``"cold"`` and ``"mapped"`` transfers,
``"direct bytes"`` and ``"buffered bytes"`` read by cold ones."""


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


@dataclasses.dataclass(frozen=True)
class SourceFile:
    """Where the storages of a transfer lie in a file: the open file ``fd`` and, for each storage (in the order
    given to :func:`move`), the file offset of its first byte (its bytes are the file's
    ``[offset, offset + nbytes)``). The fd is the caller's: it must stay open during :func:`move`, which
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
                and last[1] + last[2] <= dev <= _align(last[1] + last[2], device_alignment)
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
        chunk_bytes: bytes per staged copy (and per cold read, rounded down to :data:`DIRECT_ALIGNMENT`).
        source: the file the storages' bytes are in (a snapshot's mapping). With ``method="auto"`` and less
            than :data:`COLD_BELOW` of those ranges in the page cache, the bytes are read from the file
            (:func:`plan_reads`) instead of copied from the storages; the fd is not kept.

    Raises:
        ArgumentError: an unknown ``method``, a storage that is not on the CPU, or a ``source`` with another
            number of offsets than storages.
        DeviceError: the device's allocation or a copy failed (nothing of this transfer stays allocated).
        SnapshotError: a cold read found the file shorter than the storages (truncated while it was loaded),
            or could not read it (nothing of this transfer stays allocated).
    """
    if method not in METHODS:
        raise ArgumentError(f"method must be one of {', '.join(map(repr, METHODS))}, not {method!r:.40}")
    for storage in storages:
        if storage.device.type != "cpu":
            raise ArgumentError(f"a transfer moves CPU storages, not one on {storage.device}")
    if source is not None and len(source.offsets) != len(storages):
        raise ArgumentError(f"the source file gives {len(source.offsets)} offsets for {len(storages)} storages")
    if backend is None and method != "per-storage":
        backend = backend_for(device)
    if backend is None or method == "per-storage" or not storages:
        return [_copy_one(storage, device) for storage in storages]
    layout = plan([storage.nbytes() for storage in storages], chunk_bytes=chunk_bytes)
    base: torch.Tensor | None = None
    try:
        base = backend.allocate(layout.total) if layout.total else None
        if base is not None:
            if method == "auto" and source is not None and _mostly_cold(source, layout.sizes):
                STATS["cold"] += 1
                _cold(backend, source, layout, base, chunk_bytes)
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


# ---------------------------------------------------------------------------------------------------------
# Cold reads: from the file, not the mapping
# ---------------------------------------------------------------------------------------------------------


def _file_spans(source: SourceFile, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """The storages' file ranges, merged where they are at most :data:`GAP_BYTES` apart."""
    spans: list[list[int]] = []
    for start, nbytes in sorted((o, n) for o, n in zip(source.offsets, sizes, strict=True) if n):
        if spans and start - spans[-1][1] <= GAP_BYTES:
            spans[-1][1] = max(spans[-1][1], start + nbytes)
        else:
            spans.append([start, start + nbytes])
    return [(a, b) for a, b in spans]


def _mostly_cold(source: SourceFile, sizes: Sequence[int]) -> bool:
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
    step = _align(-(-read.nbytes // count), DIRECT_ALIGNMENT)
    parts = []
    for start in range(0, read.nbytes, step):
        need = min(step, read.nbytes - start)
        parts.append((start, need, min(_align(need, DIRECT_ALIGNMENT), slot_bytes - start)))
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


def _cold(backend: Backend, source: SourceFile, layout: Plan, base: torch.Tensor, chunk_bytes: int) -> None:
    """The transfer from the file: reads of :func:`plan_reads` by :data:`READERS` threads into a ring of
    :data:`SLOTS` pinned slots; each slot, once read, copied to the device in its runs; a slot refilled only
    after the wait for its last copy's event. Every thread and fd it started is gone when it returns or
    raises."""
    capacity = max(DIRECT_ALIGNMENT, chunk_bytes - chunk_bytes % DIRECT_ALIGNMENT)
    reads = plan_reads(layout.sizes, source.offsets, layout.offsets, capacity=capacity)
    slot_bytes = min(capacity, max(_align(read.nbytes, DIRECT_ALIGNMENT) for read in reads))
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
        STATS["direct bytes"] += reader.read[True]
        STATS["buffered bytes"] += reader.read[False]


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
