"""Object graphs in Ray's object store: one copy per node, rebuilt copy-on-write by every worker of the node.

Ray pickles a torch object into the object store with its tensors' bytes in band, and ``ray.get`` copies them
into every worker's heap. Here a graph travels as one snapshot, placed in the object store as one out-of-band
buffer, and each worker maps that buffer's pages again, privately (copy-on-write):

* :class:`Frozen` (``ray.put(Frozen(pipe))``) snapshots any graph; ``ray.get`` (in any task or actor, and in
  the driver) returns the graph itself;
* :func:`register` makes every ``torch.nn.Module`` that Ray serializes travel that way without a wrapper (also
  a module passed as a task's or an actor's argument), and every other tensor's storage travel as an
  out-of-band buffer of its own, once per storage: ``ray.put`` of any graph (a pipeline, a state dict) then
  places every storage in the object store.

Writes: Ray's object store is shared, writable memory, and torch has no read-only tensors, so the tensors are
never views of Ray's own mapping. They are views of a private mapping of the same pages of the store's file
(``MAP_PRIVATE``, through ``/proc/self/map_files``): a write copies the page it touches, for that worker
alone, and the pages nobody wrote stay one physical copy per node. The object stays pinned in the store as
long as any of its tensors lives. Where that mapping cannot be made (opening ``/proc/self/map_files`` needs
``CAP_SYS_ADMIN`` or ``CAP_CHECKPOINT_RESTORE``), the graph is loaded from a private copy instead, with one
:class:`RayCopyWarning` per process: correct, but one copy per worker. See docs/distributed.md.

Receivers load trusted: Ray unpickles whatever its object store holds (it is pickle), as for every Ray object.
"""

from __future__ import annotations

import mmap
import os
import pickle
import threading
import warnings
from typing import Any

import torch

from ._core.snapshot import freeze, loads
from ._devices.transfer import rebuildable
from ._storage.fileid import FileIdentity
from .errors import ZeroCopyPickleError
from .rebuild import rebuild_tensor, storage_from_buffer

__all__ = ["Frozen", "RayCopyWarning", "register", "registered", "unregister"]


_lock = threading.Lock()


class RayCopyWarning(UserWarning):
    """A graph from Ray's object store was loaded from a private copy: this process cannot map the store's
    pages copy-on-write."""


class _Pinned(mmap.mmap):
    """A private mapping of object-store pages that keeps the Ray buffer it was made from (and so the object,
    pinned in the store) alive as long as the mapping: storages are views of it."""

    pin: Any


def _mapping_of(address: int) -> tuple[int, int, int, str] | None:
    """``(start, end, file offset, path)`` of the mapping of this process that holds ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return start, end, int(fields[2], 16), fields[5].strip() if len(fields) > 5 else ""
    return None


_store: list[tuple[int, int, int, FileIdentity]] = []  # [(start, end, file offset, file)] of the last store mapping


def _store_fd(address: int) -> tuple[int, int, int] | None:
    """``(fd, start, file offset)`` for the file mapping that holds ``address``: its file opened again through
    ``/proc/self/map_files`` (the caller closes the fd); None when the address is not in a file mapping, or the
    file cannot be opened (then with one warning). The last mapping found is remembered, so the many buffers
    of one graph do not each read ``/proc/self/maps``; that it is the same file (device and inode) is checked every
    time (a store unmapped and another mapped at the same addresses is found again)."""
    for start, end, file_offset, known in _store:
        if start <= address < end:
            try:
                fd = os.open(f"/proc/self/map_files/{start:x}-{end:x}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                break
            if known.same_file(os.fstat(fd)):
                return fd, start, file_offset
            os.close(fd)
    found = _mapping_of(address)
    if found is None or not found[3].startswith("/"):
        return None
    start, end, file_offset, _ = found
    try:
        fd = os.open(f"/proc/self/map_files/{start:x}-{end:x}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        if not _warned:
            _warned.append(True)
            warnings.warn(
                "zerocopy_pickle.ray: this process cannot map Ray's object store copy-on-write (opening "
                "/proc/self/map_files needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE); graphs are loaded from "
                "private copies",
                RayCopyWarning,
                stacklevel=4,
            )
        return None
    _store[:] = [(start, end, file_offset, FileIdentity.of_fd(fd))]
    return fd, start, file_offset


def _copy_on_write(buffer: memoryview) -> memoryview | None:
    """A writable, private view of the same pages as ``buffer`` when it is a slice of a file mapping (Ray's
    object store); None when it is not (bytes from a socket), or this process cannot open the mapping's file."""
    import numpy  # Ray's own dependency

    if not buffer.nbytes:
        return None
    address = int(numpy.frombuffer(buffer, dtype=numpy.uint8).ctypes.data)
    with _lock:
        found = _store_fd(address)
        if found is None:
            return None
        fd, start, file_offset = found
        at = file_offset + (address - start)
        page = at - at % mmap.ALLOCATIONGRANULARITY
        try:
            private = _Pinned(
                fd, at - page + buffer.nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=page,
            )  # fmt: skip
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)  # the mapping holds the file; no fd is kept
    private.pin = buffer  # the Ray buffer pins the object in the store as long as the mapping lives
    return memoryview(private)[at - page :]


_warned: list[bool] = []


def _rebuild(buffer: Any) -> Any:
    """The receiving side: the graph in the snapshot ``buffer`` holds, as copy-on-write views of the store's
    pages where possible, else from a private copy."""
    view = memoryview(buffer).cast("B")
    private = _copy_on_write(view) if view.readonly else view
    if private is None:
        return loads(view, trusted=True, copy=True)
    return loads(private, trusted=True, copy=False)


def _rebuild_storage(buffer: Any) -> torch.UntypedStorage:
    """The receiving side of a tensor's storage: copy-on-write pages of the store where possible, else a copy."""
    view = memoryview(buffer).cast("B")
    private = _copy_on_write(view) if view.readonly else view
    return storage_from_buffer(private if private is not None else bytearray(view))


def _rebuild_tensor(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    parameter: bool,
) -> torch.Tensor:
    if parameter:
        return torch.nn.Parameter(rebuild_tensor(storage, dtype, offset, size, stride, False), requires_grad)
    return rebuild_tensor(storage, dtype, offset, size, stride, requires_grad)


class _Storage:
    """One storage of a registered ``ray.put``: every tensor over it refers to this one object, which the
    pickler memoizes, so the storage's bytes travel once however many tensors (views, tied weights) share it."""

    __slots__ = ("storage",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        from ._core.pickler import storage_bytes

        data = storage_bytes(self.storage)
        return _rebuild_storage, (pickle.PickleBuffer(data) if protocol >= 5 else bytes(memoryview(data)),)


def _plain(tensor: torch.Tensor) -> bool:
    """A tensor :mod:`zerocopy_pickle._devices.transfer` could rebuild over a storage, and a leaf (or one that needs no
    grad): anything else goes Ray's own way."""
    return rebuildable(tensor) and (tensor.is_leaf or not tensor.requires_grad)


def _reduce_tensor(pickler: Any, tensor: torch.Tensor) -> tuple[Any, ...]:
    storages = pickler.__dict__.setdefault("_zerocopy_pickle_storages", {})
    storage = tensor.untyped_storage()
    token = storages.get(storage._cdata)
    if token is None:
        token = storages[storage._cdata] = _Storage(storage)
    arguments = (token, tensor.dtype, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()),
                 tensor.requires_grad, type(tensor) is torch.nn.Parameter)  # fmt: skip
    return _rebuild_tensor, arguments


class Frozen:
    """An object graph snapshotted for Ray's object store: ``ray.put(Frozen(obj))``; ``ray.get`` returns the graph.

    The snapshot is written once, into a sealed memfd of this process, and Ray copies it into the store as one
    out-of-band buffer (pickle protocol 5).

    Raises:
        DumpError: part of the graph cannot be pickled.

    Examples:
        ```python
        import ray
        import torch
        from zerocopy_pickle.ray import Frozen

        ray.init()
        ref = ray.put(Frozen(torch.nn.Linear(512, 512)))  # one snapshot in the object store, one copy per node


        @ray.remote
        def work(model, x):  # Ray passes the graph: copy-on-write views of the store's pages
            with torch.no_grad():
                return model(x).shape


        print(ray.get([work.remote(ref, torch.randn(1, 512)) for _ in range(4)]))
        ```
    """

    __slots__ = ("_snapshot",)

    def __init__(self, obj: object, *, backend: str = "auto") -> None:
        self._snapshot = freeze(obj, backend=backend, name="zerocopy_pickle.ray")

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        if self._snapshot.closed:
            raise ZeroCopyPickleError("this Frozen graph was closed")
        mapping = mmap.mmap(self._snapshot.fd, self._snapshot.nbytes, prot=mmap.PROT_READ)
        if protocol < 5:
            with mapping:
                return _rebuild, (bytes(mapping),)
        return _rebuild, (pickle.PickleBuffer(mapping),)

    def close(self) -> None:
        """Close the memfd (what Ray already copied into its store stays there)."""
        self._snapshot.close()


_previous: list[Any] = []  # [the CloudPickler's own reducer_override] while registered


def register() -> None:
    """Make Ray put every ``torch.nn.Module`` as a :class:`Frozen` snapshot, and every other tensor's storage
    as an out-of-band buffer of its own (idempotent; in the driver, before ``ray.put`` or the calls that pass
    modules or tensors; workers need nothing: they only rebuild).

    So ``ray.put`` of any graph (a module, a pipeline, a state dict, a list of tensors) places every storage in
    the object store out of band, once per storage (views and tied tensors keep sharing theirs), and
    ``ray.get`` rebuilds each as copy-on-write pages of the store. Tensors that cannot be rebuilt over a storage
    (CUDA, sparse, quantized, nested, subclasses, non-leaf tensors that require grad) go Ray's own way.

    Wraps the ``reducer_override`` of Ray's pickler (``ray.cloudpickle.CloudPickler``) in this process.

    Raises:
        ArgumentError: Ray is not installed (``pip install 'zerocopy-pickle[ray]'``).
    """
    pickler = _pickler()
    with _lock:
        if _previous:
            return
        previous = pickler.reducer_override

        def reducer_override(self: Any, obj: Any) -> Any:
            if isinstance(obj, torch.nn.Module):
                return Frozen(obj).__reduce_ex__(5)
            if isinstance(obj, torch.Tensor) and _plain(obj):
                return _reduce_tensor(self, obj)
            return previous(self, obj)

        _previous.append(previous)
        pickler.reducer_override = reducer_override


def unregister() -> None:
    """Undo :func:`register`."""
    with _lock:
        if _previous:
            _pickler().reducer_override = _previous.pop()


def registered() -> bool:
    """Whether :func:`register` is in effect."""
    return bool(_previous)


def _pickler() -> Any:
    try:
        from ray import cloudpickle
    except ImportError:
        from .errors import ArgumentError

        raise ArgumentError("zerocopy_pickle.ray needs Ray: pip install 'zerocopy-pickle[ray]'") from None
    return cloudpickle.CloudPickler
