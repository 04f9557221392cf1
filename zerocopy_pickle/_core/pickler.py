"""Internal: ``ZeroCopyPickler`` and the unpickler's mechanism: the C pickler and unpickler, storages out of band.

The pickler is ``pickle.Pickler`` (the C implementation) at protocol 5 with a private dispatch table chained
over copyreg's. Plain ``Tensor.__reduce_ex__`` and ``Parameter.__reduce_ex__`` are left as they are: they
reach a ``TypedStorage`` (or, for the newer dtypes, an ``UntypedStorage``), and those two types are reduced
here to ``rebuild_storage(PickleBuffer(bytes of the storage), location)``. The buffer goes to
``buffer_callback`` (out of band) and only its index enters the stream, so a stream holds no tensor bytes.
A storage shared by several tensors is one Python object (torch preserves storage identity), so the pickle
memo stores it once and tied weights stay tied.

The unpickler (``_Unpickler``) is ``pickle.Unpickler`` (C), mechanism only: the load core
(:mod:`zerocopy_pickle._core.loadcore`, where the public ``ZeroCopyUnpickler`` lives too) decides everything
and hands it what it decided: in a restricted load, the table of what each global of the admitted stream
resolves to, which its ``find_class`` answers from; in a trusted one, none (globals are imported). It returns the
load's own :class:`~zerocopy_pickle.rebuild.StorageBuilder` for ``rebuild_storage``, so that one load's
``map_location`` never leaks into another.
"""

from __future__ import annotations

import copyreg
import ctypes
import functools
import importlib
import io
import pickle
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from .. import rebuild, safeglobals, validate
from .._names import GlobalName
from .._registry.registry import Registry, default_registry
from .._storage.format import BufferSpec, PluginRef
from ..errors import ArgumentError, RestrictedLoadError, Unpicklable
from .guards import gc_paused, sparse_tensors_checked

PROTOCOL = 5
"""Out-of-band buffers need pickle protocol 5 (PEP 574)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"``."""
    return str(dtype).removeprefix("torch.")


def storage_bytes(storage: torch.UntypedStorage) -> Any:
    """A writable, 1-D byte buffer over a CPU storage's memory, without a copy, that keeps the storage alive.

    Note [Storage buffers and the garbage collector]: the exporter is a NumPy array (via a uint8 tensor over
    the storage) when NumPy is importable, else a ctypes array whose type is cached for good. Never a chain of
    memoryviews, and never a ctypes array type that can die with its instance: when a pickler sits in a
    reference cycle, the garbage collector may clear its buffers in any order, and clearing a ctypes array
    type before its instance, or a memoryview that still has an export, crashes or complains at exit.
    """
    nbytes = storage.nbytes()
    if nbytes == 0:
        return bytearray()
    if _numpy_available():
        return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    array_type = _BYTE_ARRAY_TYPES.get(nbytes)
    if array_type is None:
        array_type = _BYTE_ARRAY_TYPES.setdefault(nbytes, ctypes.c_ubyte * nbytes)
    array = array_type.from_address(storage.data_ptr())
    array._storage = storage  # type: ignore[attr-defined]  # the memory's owner lives as long as the buffer
    return array


_BYTE_ARRAY_TYPES: dict[int, type[ctypes.Array[ctypes.c_ubyte]]] = {}


@functools.lru_cache(maxsize=1)
def _numpy_available() -> bool:
    try:
        torch.empty(1, dtype=torch.uint8).numpy()
    except (ImportError, RuntimeError):
        return False
    return True


@dataclass
class _DumpState:
    """What the reducers of one pickler share. Kept apart from the pickler so that no reference cycle runs
    through the C pickler (its dispatch table and buffer callback point here, not back to it)."""

    # Out-of-band buffers' specs, in stream order: the header's buffer table.
    specs: list[BufferSpec] = field(default_factory=list)
    # id(PickleBuffer) -> (the buffer, its spec), until the pickler hands the buffer to the callback.
    pending: dict[int, tuple[pickle.PickleBuffer, BufferSpec]] = field(default_factory=dict)
    # id(UntypedStorage) -> (storage, dtype name) seen through a tensor, for the header's dtype column.
    dtypes: dict[int, tuple[torch.UntypedStorage, str]] = field(default_factory=dict)
    # Plugins whose reducers were applied, by name: the header's plugin list.
    plugins: dict[str, PluginRef] = field(default_factory=dict)
    # Functions and classes pickled by value (the first MAX_BY_VALUE_RECORDED), and how many there were: a
    # restricted load refuses them, and zerocopy_pickle.dump says where they are.
    by_value: list[object] = field(default_factory=list)
    by_value_count: int = 0


MAX_BY_VALUE_RECORDED = 16
"""How many of the objects pickled by value a dump keeps to name them (it counts them all)."""


def _recorded_by_value(state: _DumpState, reduce: Callable[[Any], Any], obj: Any) -> Any:
    """cloudpickle's by-value reduction of a function or class (NotImplemented when it is importable by name),
    recorded in ``state`` when it is one."""
    reduced = reduce(obj)
    if reduced is not NotImplemented and getattr(obj, "__module__", None) != "builtins":  # not CodeType & co.
        state.by_value_count += 1
        if len(state.by_value) < MAX_BY_VALUE_RECORDED:
            state.by_value.append(obj)
    return reduced


def _reduce_untyped_storage(state: _DumpState, storage: torch.UntypedStorage) -> tuple[Any, ...]:
    dev = storage.device
    if dev.type == "meta":
        return rebuild.rebuild_meta_storage, (storage.nbytes(),)
    location = str(dev)
    host = storage if dev.type == "cpu" else storage.cpu()
    buffer = pickle.PickleBuffer(storage_bytes(host))
    hint = state.dtypes.get(id(storage))
    spec = BufferSpec(nbytes=host.nbytes(), location=location, dtype=hint[1] if hint else None)
    state.pending[id(buffer)] = (buffer, spec)
    return rebuild.rebuild_storage, (buffer, location)


def _reduce_typed_storage(state: _DumpState, storage: torch.storage.TypedStorage) -> tuple[Any, ...]:
    untyped = storage._untyped_storage
    state.dtypes.setdefault(id(untyped), (untyped, dtype_name(storage.dtype)))
    return rebuild.rebuild_typed_storage, (untyped, storage.dtype)


def _reduce_tensor(state: _DumpState, tensor: torch.Tensor) -> tuple[Any, ...]:
    # A plain dense tensor (the overwhelming majority) reduces to one call over its untyped storage: cheaper
    # to write and to load than Tensor.__reduce_ex__'s TypedStorage wrapper, and it records the dtype for
    # the header. Everything else (quantized, sparse, nested, meta, conj/neg views, tensors carrying Python
    # state or hooks) takes torch's own path, whose storages reach the storage reducers below.
    if tensor._is_zerotensor():
        # A ZeroTensor's "storage" is whatever memory it was made over, not its (all-zero) value: torch.save
        # refuses it too.
        raise Unpicklable(
            f"cannot pickle a ZeroTensor (torch._efficientzerotensor, shape {tuple(tensor.shape)}, {tensor.dtype}): "
            f"it holds no data of its own; save torch.zeros_like(tensor) instead, as torch.save would require"
        )
    if (
        tensor.layout is not torch.strided
        or tensor.is_quantized
        or tensor.is_nested
        or tensor.device.type == "meta"
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor._backward_hooks
        or tensor.__dict__
        or not torch._C._has_storage(tensor)
    ):
        return _torch_reduce(tensor)
    storage = tensor.untyped_storage()
    state.dtypes.setdefault(id(storage), (storage, dtype_name(tensor.dtype)))
    return rebuild.rebuild_tensor, (
        storage,
        tensor.dtype,
        tensor.storage_offset(),
        tuple(tensor.size()),
        tensor.stride(),
        tensor.requires_grad,
    )


def _torch_reduce(tensor: torch.Tensor) -> tuple[Any, ...]:
    func, args = tensor.__reduce_ex__(PROTOCOL)[:2]
    return _wrap_v3_storage(func, args)


def _wrap_v3_storage(func: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    # torch's _rebuild_tensor_v3 (the newer dtypes) is given an UntypedStorage when pickled, but reads
    # `storage._untyped_storage` when loaded: torch.load's persistent_load hands it a TypedStorage. Give it a
    # byte-typed TypedStorage, so the storage still travels once through the storage reducers.
    if func is torch._utils._rebuild_tensor_v3 and isinstance(args[0], torch.UntypedStorage):
        typed = torch.storage.TypedStorage(wrap_storage=args[0], dtype=torch.uint8, _internal=True)
        return func, (typed, *args[1:])
    if func is torch._tensor._rebuild_from_type_v2:
        inner_func, new_type, inner_args, obj_state = args
        inner_func, inner_args = _wrap_v3_storage(inner_func, inner_args)
        return func, (inner_func, new_type, inner_args, obj_state)
    return func, args


def _reduce_memory_format(fmt: torch.memory_format) -> tuple[Any, ...]:
    # pickle would write a global in whichever module of sys.modules first reaches torch (torch._utils, or the
    # caller's own module): a name no safe table can list. One fixed rebuild function instead.
    return rebuild.rebuild_memory_format, (str(fmt).removeprefix("torch."),)


def _reduce_ndarray(array: Any) -> Any:
    # Note [NumPy values] (safeglobals): an exact ndarray of a table dtype reduces to the library's own validating
    # rebuild over a PickleBuffer (out of band, as NumPy's own protocol-5 reduction), C or Fortran order kept; a
    # non-contiguous array is written as a C-ordered copy (as NumPy's own pickle does). Anything else (object,
    # structured, string dtypes) keeps NumPy's reduction, which only trusted=True loads.
    dtype = array.dtype
    if not safeglobals.numpy_dtype_known(dtype):
        return array.__reduce_ex__(PROTOCOL)
    if array.flags.c_contiguous:
        order = "C"
    elif array.flags.f_contiguous:
        order = "F"
    else:
        array, order = array.copy(order="C"), "C"
    # datetime64/timedelta64 arrays export no buffer: their bytes travel as the same-sized integers.
    data = array.view(dtype.str[0] + "i8") if dtype.kind in "Mm" else array
    return safeglobals.rebuild_ndarray, (pickle.PickleBuffer(data), dtype.str, array.shape, order)


def _reduce_numpy_scalar(scalar: Any) -> Any:
    dtype = scalar.dtype
    if dtype.itemsize == 0 and dtype.kind in "US":  # the empty str_ / bytes_: width 1 (NumPy strips the NUL)
        return safeglobals.rebuild_numpy_scalar, ("|S1", b"\0") if dtype.kind == "S" else ("<U1", bytes(4))
    if not safeglobals.numpy_dtype_known(dtype):
        return scalar.__reduce_ex__(PROTOCOL)
    return safeglobals.rebuild_numpy_scalar, (dtype.str, scalar.tobytes())


def _reduce_numpy_dtype(dtype: Any) -> Any:
    if not safeglobals.numpy_dtype_known(dtype):
        return dtype.__reduce_ex__(PROTOCOL)
    return safeglobals.rebuild_numpy_dtype, (dtype.str,)


def _numpy_reductions() -> dict[type, Callable[[Any], Any]]:
    """The dispatch-table entries for NumPy arrays, scalars and dtypes: none when NumPy was never imported (then
    nothing in the graph is a NumPy value)."""
    np = sys.modules.get("numpy")
    if np is None:
        return {}
    table: dict[type, Callable[[Any], Any]] = {np.ndarray: _reduce_ndarray}
    for dtype in (*safeglobals.numpy_dtypes().values(), np.dtype("U1"), np.dtype("S1")):
        table[dtype.type] = _reduce_numpy_scalar
        table[type(dtype)] = _reduce_numpy_dtype
    return table


def _on_buffer(state: _DumpState, callback: Callable[[pickle.PickleBuffer], Any], buffer: pickle.PickleBuffer) -> Any:
    entry = state.pending.pop(id(buffer), None)
    if entry is not None:
        spec = entry[1]
    else:  # a PickleBuffer from some other type's __reduce_ex__ (a NumPy array, say)
        raw = buffer.raw()
        spec = BufferSpec(nbytes=raw.nbytes, readonly=raw.readonly)
    in_band = callback(buffer)
    if not in_band:
        state.specs.append(spec)
    return in_band


def _storage_types() -> list[type]:
    # Tensor.__reduce_ex__ produces exactly TypedStorage / UntypedStorage; the legacy typed classes
    # (torch.FloatStorage, ...) are subclasses a user may pickle directly. The dispatch table matches exact
    # types, so list them all.
    found: list[type] = [torch.storage.TypedStorage]
    i = 0
    while i < len(found):
        found.extend(found[i].__subclasses__())
        i += 1
    return found


class _Reductions:
    """What every backend's pickler applies on top of pickle: tensors and storages out of band (through the
    dispatch table), reducers from the registry, and functions and classes by value where they must be
    (through ``reducer_override``). Mixed into the C pickler and into the dill pickler alike."""

    _state: _DumpState
    _registry: Registry
    _reducer_cache: dict[type, Callable[[Any], Any] | None]
    _claims: bool  # whether any plugin claims module prefixes (dynamic module namespaces)
    _numpy: dict[type, Callable[[Any], Any]]  # the reducers of NumPy values (Note [NumPy values], safeglobals)
    _by_value: Any  # a cloudpickle.Pickler whose reducer_override decides by-value reductions, or None

    def _setup(
        self,
        buffer_callback: Callable[[pickle.PickleBuffer], Any] | None,
        by_value: bool,
        registry: Registry | None,
    ) -> Callable[[pickle.PickleBuffer], Any] | None:
        self._state = _DumpState()
        self._registry = registry if registry is not None else default_registry()
        self._registry.ensure_discovered()
        self._reducer_cache = {}
        self._claims = bool(self._registry.module_claims())
        self._by_value = None
        table: dict[Any, Any] = dict(copyreg.dispatch_table)
        if by_value:
            cloudpickle = _import_optional("cloudpickle", "by-value pickling of functions and classes")
            # cloudpickle's own reducers for what by-value functions carry (code objects, cells, modules, ...).
            table.update(cloudpickle.Pickler.dispatch_table.maps[0])
            self._by_value = cloudpickle.Pickler(io.BytesIO(), protocol=PROTOCOL)
        reduce_typed = functools.partial(_reduce_typed_storage, self._state)
        table[torch.Tensor] = functools.partial(_reduce_tensor, self._state)
        table[torch.UntypedStorage] = functools.partial(_reduce_untyped_storage, self._state)
        table.update(dict.fromkeys(_storage_types(), reduce_typed))
        table[torch.memory_format] = _reduce_memory_format
        self._numpy = _numpy_reductions()
        table.update(self._numpy)
        self.dispatch_table = table
        return None if buffer_callback is None else functools.partial(_on_buffer, self._state, buffer_callback)

    def reducer_override(self, obj: Any) -> Any:
        # Called by pickle for nearly every object: one dict lookup per object, the decision cached per type.
        cls = type(obj)
        try:
            reduce = self._reducer_cache[cls]
        except KeyError:
            reduce = self._reducer_cache[cls] = self._reduce_for(cls)
        return NotImplemented if reduce is None else reduce(obj)

    def _claim(self, module: object) -> None:
        """Record the plugin that claims ``module`` (dynamic module namespaces), if one does."""
        if isinstance(module, str) and self._claims:
            info = self._registry.claim_for(module)
            if info is not None:
                self._state.plugins.setdefault(info.name, PluginRef(info.name, info.package))

    def _reduce_for(self, cls: type) -> Callable[[Any], Any] | None:
        self._claim(cls.__module__)
        named = cls is types.FunctionType or issubclass(cls, type)  # pickled by name (or by value)
        if named:
            # By reference when importable, else (with by_value) by value: lambdas, local and __main__ definitions.
            by_value: Callable[[Any], Any] | None = None
            if self._by_value is not None:
                by_value = functools.partial(_recorded_by_value, self._state, self._by_value.reducer_override)
            if not self._claims:
                return by_value

            def claim_then_reduce(obj: Any) -> Any:
                # Loading a function or class from a claimed namespace needs that namespace's plugin.
                self._claim(getattr(obj, "__module__", None))
                return NotImplemented if by_value is None else by_value(obj)

            return claim_then_reduce
        reducer = self._registry.lookup(cls)
        if reducer is None:
            # NumPy values here too, not only in the dispatch table: dill's pickler consults its own dispatch
            # (which reduces arrays with dill._dill:_create_array) before the dispatch table.
            return self._numpy.get(cls)
        plugins = self._state.plugins

        def reduce(obj: Any) -> Any:
            reduced = reducer.reduce(obj)
            if reduced is not NotImplemented and reducer.plugin:
                plugins.setdefault(reducer.plugin, PluginRef(reducer.plugin, reducer.package or reducer.plugin))
            return reduced

        return reduce

    def reduction(self, obj: Any) -> Any:
        """What this pickler reduces ``obj`` to, asked in pickle's order: :meth:`reducer_override` (registered
        reducers, NumPy values, functions and classes by value), then the dispatch table by exact type (tensors,
        storages, memory formats, copyreg's), then ``obj.__reduce_ex__``. The dump's diagnosis walks a graph that
        failed to pickle with it (:mod:`zerocopy_pickle._core.locate`), so there is one reduction, this one. What
        reducing records (buffers, plugins used) lands in this pickler's state: ask a pickler made for asking."""
        reduced = self.reducer_override(obj)
        if reduced is NotImplemented:
            reduce = self.dispatch_table.get(type(obj))
            reduced = reduce(obj) if reduce is not None else obj.__reduce_ex__(PROTOCOL)
        return reduced

    @property
    def pickled_by_value(self) -> tuple[list[object], int]:
        """The functions and classes this pickler pickled by value (the first
        :data:`MAX_BY_VALUE_RECORDED`), and how many there were."""
        return list(self._state.by_value), self._state.by_value_count

    @property
    def buffer_specs(self) -> list[BufferSpec]:
        """Location, dtype and size of each out-of-band buffer, in stream order."""
        return self._state.specs

    @property
    def plugins_used(self) -> list[PluginRef]:
        """The plugins whose reducers this pickler used (what a snapshot's header records)."""
        return list(self._state.plugins.values())


def _import_optional(module: str, purpose: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ArgumentError(f"{purpose} needs {module}: pip install 'zerocopy-pickle[{module}]'") from e


def _check_protocol(protocol: int | None) -> int:
    if protocol is None or protocol < 0:
        return pickle.HIGHEST_PROTOCOL
    if protocol < PROTOCOL:
        raise ArgumentError(f"zerocopy_pickle needs pickle protocol >= {PROTOCOL} (PEP 574), not {protocol}")
    return protocol


class ZeroCopyPickler(_Reductions, pickle.Pickler):  # type: ignore[misc]
    """A ``pickle.Pickler`` (the C one, protocol 5) that sends every tensor storage out of band.

    Args:
        file: where the pickle stream goes (anything with ``write``).
        protocol: must be 5 (the default) or -1.
        buffer_callback: called with each out-of-band ``PickleBuffer``, as for ``pickle.Pickler``; a false
            return keeps it out of band. With None, buffers are written in band (a self-contained stream).
        fix_imports: as for ``pickle.Pickler``.
        by_value: pickle functions and classes that cannot be imported by reference (lambdas, local and
            ``__main__`` definitions) by value, with cloudpickle's reducers. Loading those runs their code:
            only a trusted load accepts them.
        registry: the reducer registry to apply (default: the process's, plugins included).

    After :meth:`dump`, :attr:`buffer_specs` describes the out-of-band buffers in the order the stream
    consumes them, and :attr:`plugins_used` the plugins whose reducers it applied. Each ``PickleBuffer`` is a
    view of a storage's memory (a host copy for device storages) and keeps that storage alive.

    Raises:
        ArgumentError: a protocol below 5; ``by_value`` without cloudpickle installed.

    Examples:
        >>> import io, torch
        >>> from zerocopy_pickle import ZeroCopyPickler, ZeroCopyUnpickler
        >>> stream, buffers = io.BytesIO(), []
        >>> ZeroCopyPickler(stream, buffer_callback=buffers.append).dump({"w": torch.ones(2)})
        >>> len(buffers)  # the storage's bytes, out of band: not in the stream
        1
        >>> _ = stream.seek(0)
        >>> ZeroCopyUnpickler(stream, buffers=buffers).load()
        {'w': tensor([1., 1.])}
    """

    def __init__(
        self,
        file: IO[bytes],
        protocol: int | None = PROTOCOL,
        *,
        buffer_callback: Callable[[pickle.PickleBuffer], Any] | None = None,
        fix_imports: bool = True,
        by_value: bool = False,
        registry: Registry | None = None,
    ) -> None:
        protocol = _check_protocol(protocol)
        # dispatch_table must be set before pickle.Pickler.__init__, which reads it once.
        callback = self._setup(buffer_callback, by_value, registry)
        super().__init__(file, protocol, fix_imports=fix_imports, buffer_callback=callback)

    def dump(self, obj: Any) -> None:
        with gc_paused():  # Note [GC during loads] holds for dumps too: they create a tuple per object
            super().dump(obj)


def dill_pickler(
    file: IO[bytes],
    *,
    buffer_callback: Callable[[pickle.PickleBuffer], Any] | None = None,
    registry: Registry | None = None,
) -> _Reductions:
    """A pickler built on dill (pure Python, slower, takes more kinds of objects) with the same reductions:
    storages out of band, registry reducers. Its streams load with the C unpickler (dill must be installed).

    Raises:
        ArgumentError: dill is not installed.
    """
    dill = _import_optional("dill", "the dill backend")

    class ZeroCopyDillPickler(_Reductions, dill.Pickler):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            callback = self._setup(buffer_callback, False, registry)
            super().__init__(file, protocol=PROTOCOL, buffer_callback=callback)

    return ZeroCopyDillPickler()


class _Unpickler(pickle.Unpickler):
    """The C unpickler as the load core drives it: mechanism only. Everything is decided before it is made (by
    :mod:`zerocopy_pickle._core.loadcore`, the one place that decides): the buffers, the storage builder that
    places them, and, for a restricted load, the table of what each global the admitted stream names resolves
    to; for a trusted one, None. It analyses nothing, admits nothing and converts no error.

    Args:
        file: the pickle stream (anything with ``read``, ``readline``).
        buffers: the out-of-band buffers, as for ``pickle.Unpickler``.
        storage_builder: what ``zerocopy_pickle.rebuild:rebuild_storage`` resolves to in a trusted load (a
            restricted load's table already maps it to the load's builder).
        resolved: ``(module, qualname) -> object`` for every global of the admitted stream (the allow list's
            :meth:`~zerocopy_pickle._trust.restricted.AllowList.admit`), or None: trusted, every global imported.
        budget: a restricted load's allocation budget (:func:`zerocopy_pickle.validate.budget`).
        encoding, errors, fix_imports: as for ``pickle.Unpickler``.
    """

    def __init__(
        self,
        file: IO[bytes],
        *,
        buffers: Any,
        storage_builder: object,
        resolved: Mapping[tuple[str, str], object] | None,
        budget: int = 0,
        encoding: str = "ASCII",
        errors: str = "strict",
        fix_imports: bool = True,
    ) -> None:
        self._storage_builder = storage_builder
        self._resolved = resolved
        self._budget = budget
        super().__init__(file, fix_imports=fix_imports, encoding=encoding, errors=errors, buffers=buffers)

    def load(self) -> Any:
        if self._resolved is None:
            with sparse_tensors_checked(), gc_paused():
                return super().load()
        with sparse_tensors_checked(), gc_paused(), validate.budget(self._budget):
            return super().load()

    def find_class(self, module: str, name: str) -> Any:
        resolved = self._resolved
        if resolved is not None:
            try:
                return resolved[module, name]
            except KeyError:  # the analysis lists every global a stream names: no stream gets here
                raise RestrictedLoadError(
                    f"refusing to load global {module}:{name}: the stream's analysis did not see it",
                    refused=(module, name),
                ) from None
        if module == "zerocopy_pickle.rebuild" and name == "rebuild_storage":
            return self._storage_builder
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError) as e:
            raise GlobalName(module, name).missing(e) from e
