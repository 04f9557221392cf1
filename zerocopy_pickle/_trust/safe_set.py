"""Internal: the built-in safe set: what a restricted load may resolve without ``allow=``, and what it may do with each.

Every entry maps a ``(module, qualname)`` a stream names to a :class:`SafeGlobal`: the object pushed on the
unpickler's stack, whether REDUCE may call it, and which of pickle's mutating opcodes (BUILD, SETITEM(S),
APPEND(S), ADDITEMS) may act on what the call returns.

Callables here are never torch's or the standard library's functions themselves: each is a function of this
module that checks the exact type, size and range of every argument (:mod:`zerocopy_pickle.validate`) and only
then calls the real one. A stream controls every argument, so nothing here:

* resolves a name it was given (a dtype or layout comes from a fixed table, never ``getattr(torch, name)``);
* calls a function it was given (``_rebuild_from_type_v2`` accepts only the tensor rebuilders of this table);
* iterates anything but a list, tuple or dict the stream built with pickle's own opcodes;
* builds a tensor whose view is out of proportion to its storage (:data:`MAX_VIEW_RATIO`), or allocates memory
  from a size alone (``torch.Tensor(n)``, ``bytes(n)``, ``bytearray(n)`` are not here);
* installs hooks (every ``backward_hooks`` argument must be empty).

Classes that are only *values* (``torch.Tensor`` as the ``new_type`` of ``_rebuild_from_type_v2``, dtypes,
layouts, memory formats, qschemes) are pushed as themselves and cannot be called.
"""

from __future__ import annotations

import collections
import functools
import math
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import rebuild
from ..safeglobals import rebuild_ndarray, rebuild_numpy_dtype, rebuild_numpy_scalar
from ..validate import (
    charge,
    expect,
    expect_int,
    expect_int_tuple,
    expect_optional,
    expect_str,
    fail,
)
from .safe_composite import safe_rebuild_nested_tensor, safe_rebuild_qtensor, safe_rebuild_sparse_tensor
from .safe_parameters import (
    safe_parameter,
    safe_rebuild_from_type_v2,
    safe_rebuild_parameter,
    safe_rebuild_parameter_with_state,
)
from .safe_tensors import (
    safe_rebuild_memory_format,
    safe_rebuild_meta_storage,
    safe_rebuild_meta_tensor_no_storage,
    safe_rebuild_tensor,
    safe_rebuild_tensor_v1,
    safe_rebuild_tensor_v2,
    safe_rebuild_tensor_v3,
    safe_rebuild_typed_storage,
    safe_rebuild_wrapper_subclass,
)

BUILD, SETITEM, APPEND, ADD = "build", "setitem", "append", "add"
"""What pickle's mutating opcodes do to an object: BUILD, SETITEM(S), APPEND(S), ADDITEMS."""
MUTATIONS = frozenset({BUILD, SETITEM, APPEND, ADD})


@dataclass(frozen=True)
class SafeGlobal:
    """One entry of the safe set.

    Attributes:
        value: what the stream's GLOBAL pushes.
        callable: whether REDUCE may call ``value``.
        result_ops: the mutating opcodes allowed on what calling ``value`` returns (a fresh container).
    """

    value: object
    callable: bool = False
    result_ops: frozenset[str] = frozenset()


# -- torch values --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _layouts() -> dict[str, torch.layout]:
    return {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def safe_get_layout(name: Any) -> torch.layout:
    """``torch.serialization._get_layout``: a layout by its name, from a fixed table."""
    where = "torch.serialization:_get_layout"
    charge(len(expect_str(name, where, "name", max_len=64)), where)
    try:
        return _layouts()[name]
    except KeyError:
        fail(where, f"{name!r} is not a torch layout")


def safe_size(dims: Any = ()) -> torch.Size:
    """``torch.Size(dims)``: a tuple of non-negative ints."""
    return torch.Size(expect_int_tuple(dims, "torch:Size", "dims"))


def safe_device(kind: Any, index: Any = None) -> torch.device:
    """``torch.device(kind[, index])``: a device string and an optional index."""
    where = "torch:device"
    charge(len(expect_str(kind, where, "type", max_len=64)), where)
    if index is not None:
        expect_int(index, where, "index", hi=1 << 16)
    try:
        return torch.device(kind) if index is None else torch.device(kind, index)
    except (RuntimeError, ValueError, TypeError) as e:
        fail(where, f"{kind!r:.60} is not a device: {e}")


# -- containers and primitives -------------------------------------------------------------------------------------


_CONSTANT = (type(None), bool, float, complex)
"""Plain data whose hashing and comparing cost a constant; ``int``, ``str`` and ``bytes`` cost their length."""
MAX_PLAIN_DEPTH = 8
"""How deep tuples may nest in the plain data the container constructors take."""


def _plain(items: Iterable[Any], where: str, what: str, depth: int = 0) -> None:
    """Refuse anything among ``items`` but plain data: None, bools, numbers, strings, bytes and tuples of them nested
    at most :data:`MAX_PLAIN_DEPTH` deep. What these constructors receive in a real stream is that; anything else
    would have its ``__hash__`` or ``__eq__`` run (set members, dict keys) or would sit in a container pickle fills
    with its own opcodes anyway.

    ``items`` is a list or tuple (or a dict's keys) whose own length the caller has charged; this charges the rest of
    what reading, hashing and comparing them costs, before anything hashes them: every element of every nested tuple
    as it is reached (a memo DAG of wide tuples, ``t2 = (t1,) * 1000`` over ``t1 = (x,) * 1000``, costs a few bytes
    of stream per level but a walk or a hash visits every path: the budget runs out long before the walk gets far),
    and the length of every ``str``, ``bytes`` and ``int`` (hashing an int reads all its digits, nothing caches it,
    and two distinct but equal strings are compared byte by byte)."""
    size = 0
    for item in items:
        kind = type(item)
        if kind is str or kind is bytes:
            size += len(item)
        elif kind is int:
            size += item.bit_length() >> 3
        elif kind is tuple and depth < MAX_PLAIN_DEPTH:
            charge(size + len(item), where)
            size = 0
            _plain(item, where, what, depth + 1)
        elif kind not in _CONSTANT:
            fail(
                where,
                f"{what} must be plain data (None, numbers, strings, bytes, tuples of them nested at most "
                f"{MAX_PLAIN_DEPTH} deep), not {kind.__qualname__}",
            )
    if size:
        charge(size, where)


def _items(value: Any, where: str) -> list[Any] | tuple[Any, ...]:
    items: list[Any] | tuple[Any, ...] = expect(value, (list, tuple), where, "iterable")
    charge(len(items), where)
    _plain(items, where, "an item")
    return items


def safe_ordered_dict(items: Any = ()) -> collections.OrderedDict[Any, Any]:
    """``collections.OrderedDict([(key, value), ...])``: pairs of plain data, or nothing (pickle fills an
    OrderedDict with SETITEMS)."""
    if type(items) is tuple and not items:  # how pickle writes every OrderedDict (a module has a dozen): fast
        return collections.OrderedDict()
    return collections.OrderedDict(_pairs(items, "collections:OrderedDict"))


def _pairs(items: Any, where: str) -> list[tuple[Any, Any]]:
    items = expect(items, (list, tuple), where, "items")
    charge(len(items), where)
    for pair in items:
        if type(pair) is not tuple or len(pair) != 2:
            fail(where, "items must be (key, value) tuples")
    _plain(items, where, "an item")
    return list(items)


_FACTORIES: dict[int, object] = {}


def safe_defaultdict(default_factory: Any = None, items: Any = ()) -> collections.defaultdict[Any, Any]:
    """``collections.defaultdict(factory)``: the factory must be one of the safe set's container or number
    constructors (it runs whenever a missing key is read); pickle fills it with SETITEMS."""
    where = "collections:defaultdict"
    factory = None if default_factory is None else _FACTORIES.get(id(default_factory))
    if default_factory is not None and factory is None:
        fail(where, f"default_factory must be None or a safe container type, not {type(default_factory).__qualname__}")
    result: collections.defaultdict[Any, Any] = collections.defaultdict(factory)  # type: ignore[call-overload]
    if type(items) is not tuple or items:  # anything but the default () must be a dict
        expect(items, (dict, collections.OrderedDict), where, "items")
        charge(len(items), where)  # before the pairs are listed
        result.update(_pairs(list(items.items()), where))
    return result


def safe_deque(iterable: Any = (), maxlen: Any = None) -> collections.deque[Any]:
    """``collections.deque(items, maxlen)``: plain data (pickle fills a deque with APPENDS)."""
    where = "collections:deque"
    if maxlen is not None:
        expect_int(maxlen, where, "maxlen")
    return collections.deque(_items(iterable, where), maxlen)


def safe_counter(counts: Any = None) -> collections.Counter[Any]:
    """``collections.Counter(dict)``: plain keys, int counts."""
    where = "collections:Counter"
    if counts is None:
        return collections.Counter()
    expect(counts, dict, where, "counts")
    charge(len(counts), where)
    _plain(counts.keys(), where, "a key")
    for count in counts.values():
        expect(count, int, where, "a count")
    return collections.Counter(counts)


def safe_set(items: Any = ()) -> set[Any]:
    """``set(items)`` (protocols below 4 pickle sets this way): plain data."""
    return set(_items(items, "builtins:set"))


def safe_frozenset(items: Any = ()) -> frozenset[Any]:
    """``frozenset(items)``: plain data."""
    return frozenset(_items(items, "builtins:frozenset"))


_NUMBER = (int, float, bool)
MAX_INT_DIGITS = 4300
"""Most characters ``int(str)`` and digits ``str(int)`` may have here: CPython's default limit
(``sys.int_info.default_max_str_digits``), enforced whatever this process set (both conversions cost more than
linear time in the length)."""
_MAX_INT_BITS = int(MAX_INT_DIGITS * math.log2(10))  # an int of at most this many bits has at most 4300 digits


def _convert(convert: Callable[..., Any], where: str, *values: Any) -> Any:
    try:
        return convert(*values)
    except (ValueError, OverflowError) as e:
        shown = ", ".join(
            f"{type(v).__qualname__} of {len(v)} characters"
            if type(v) is str
            else f"int of {v.bit_length()} bits"
            if type(v) is int
            else repr(v)
            for v in values
        )
        fail(where, f"cannot convert {shown}: {str(e)[:200]}")


def _parsed(value: Any, where: str, types: tuple[type, ...], max_len: int | None = None) -> Any:
    """``value`` of one of ``types``; a string is charged its length (parsing reads all of it, and the stream can
    hand the same long string to every call for a few bytes each) and refused beyond ``max_len``."""
    expect(value, types, where, "value")
    if type(value) is str:
        charge(len(value), where)
        if max_len is not None and len(value) > max_len:
            fail(where, f"value is {len(value)} characters long (at most {max_len})")
    return value


def safe_int(value: Any = 0) -> int:
    """``int(x)`` for an int, float, bool or a decimal string of at most :data:`MAX_INT_DIGITS` characters."""
    where = "builtins:int"
    return int(_convert(int, where, _parsed(value, where, (*_NUMBER, str), MAX_INT_DIGITS)))


def safe_float(value: Any = 0.0) -> float:
    """``float(x)`` for an int, float, bool or string (charged its length)."""
    where = "builtins:float"
    return float(_convert(float, where, _parsed(value, where, (*_NUMBER, str))))


def safe_complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    """``complex(real, imag)`` (how complex numbers pickle at every protocol): numbers only, never strings."""
    where = "builtins:complex"
    real = expect(real, _NUMBER, where, "real")
    imag = expect(imag, _NUMBER, where, "imag")
    return complex(_convert(complex, where, real, imag))


def safe_bool(value: Any = False) -> bool:
    """``bool(x)`` for an int or bool."""
    return bool(expect(value, (int, bool), "builtins:bool", "value"))


def safe_str(value: Any = "") -> str:
    """``str(x)`` for a str, an int of at most :data:`MAX_INT_DIGITS` digits (charged its size), or a float."""
    where = "builtins:str"
    expect(value, (str, int, float), where, "value")
    if type(value) is int:
        bits = value.bit_length()
        charge(bits >> 3, where)
        if bits > _MAX_INT_BITS:
            fail(where, f"value is an int of {bits} bits (at most {_MAX_INT_BITS}: {MAX_INT_DIGITS} digits)")
    return str(_convert(str, where, value))


def safe_slice(start: Any = None, stop: Any = None, step: Any = None) -> slice:
    """``slice(start, stop, step)`` of ints or None."""
    where = "builtins:slice"
    return slice(*(expect_optional(v, int, where, "bound") for v in (start, stop, step)))


# -- the table ---------------------------------------------------------------------------------------------------

_CALLS: dict[tuple[str, str], tuple[Callable[..., Any], frozenset[str]]] = {
    ("zerocopy_pickle.rebuild", "rebuild_tensor"): (safe_rebuild_tensor, frozenset()),
    ("zerocopy_pickle.rebuild", "rebuild_typed_storage"): (safe_rebuild_typed_storage, frozenset()),
    ("zerocopy_pickle.rebuild", "rebuild_meta_storage"): (safe_rebuild_meta_storage, frozenset()),
    ("torch._utils", "_rebuild_tensor"): (safe_rebuild_tensor_v1, frozenset()),
    ("torch._utils", "_rebuild_tensor_v2"): (safe_rebuild_tensor_v2, frozenset()),
    ("torch._utils", "_rebuild_tensor_v3"): (safe_rebuild_tensor_v3, frozenset()),
    ("torch._utils", "_rebuild_parameter"): (safe_rebuild_parameter, frozenset()),
    ("torch._utils", "_rebuild_parameter_with_state"): (safe_rebuild_parameter_with_state, frozenset()),
    ("torch._utils", "_rebuild_qtensor"): (safe_rebuild_qtensor, frozenset()),
    ("torch._utils", "_rebuild_sparse_tensor"): (safe_rebuild_sparse_tensor, frozenset()),
    ("torch._utils", "_rebuild_nested_tensor"): (safe_rebuild_nested_tensor, frozenset()),
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): (safe_rebuild_meta_tensor_no_storage, frozenset()),
    ("torch._utils", "_rebuild_wrapper_subclass"): (safe_rebuild_wrapper_subclass, frozenset()),
    ("zerocopy_pickle.rebuild", "rebuild_memory_format"): (safe_rebuild_memory_format, frozenset()),
    ("torch._tensor", "_rebuild_from_type_v2"): (safe_rebuild_from_type_v2, frozenset()),
    ("torch.serialization", "_get_layout"): (safe_get_layout, frozenset()),
    ("torch.nn.parameter", "Parameter"): (safe_parameter, frozenset()),
    ("torch", "Size"): (safe_size, frozenset()),
    ("torch", "device"): (safe_device, frozenset()),
    ("collections", "OrderedDict"): (safe_ordered_dict, frozenset({SETITEM, BUILD})),
    ("collections", "defaultdict"): (safe_defaultdict, frozenset({SETITEM})),
    ("collections", "deque"): (safe_deque, frozenset({APPEND})),
    ("collections", "Counter"): (safe_counter, frozenset({SETITEM})),
    ("builtins", "set"): (safe_set, frozenset({ADD})),
    ("builtins", "frozenset"): (safe_frozenset, frozenset()),
    ("builtins", "int"): (safe_int, frozenset()),
    ("builtins", "float"): (safe_float, frozenset()),
    ("builtins", "complex"): (safe_complex, frozenset()),
    ("builtins", "bool"): (safe_bool, frozenset()),
    ("builtins", "str"): (safe_str, frozenset()),
    ("builtins", "slice"): (safe_slice, frozenset()),
    ("zerocopy_pickle.safeglobals", "rebuild_ndarray"): (rebuild_ndarray, frozenset()),
    ("zerocopy_pickle.safeglobals", "rebuild_numpy_scalar"): (rebuild_numpy_scalar, frozenset()),
    ("zerocopy_pickle.safeglobals", "rebuild_numpy_dtype"): (rebuild_numpy_dtype, frozenset()),
}
_FACTORIES.update({id(cls): cls for cls in (list, dict, tuple, set, frozenset, int, float, complex, bool, str)})
_FACTORIES.update(
    {
        id(safe_set): set,
        id(safe_frozenset): frozenset,
        id(safe_int): int,
        id(safe_float): float,
        id(safe_complex): complex,
        id(safe_bool): bool,
        id(safe_str): str,
        id(safe_ordered_dict): collections.OrderedDict,
        id(safe_counter): collections.Counter,
        id(safe_deque): collections.deque,
    }
)


@functools.lru_cache(maxsize=1)
def safe_table() -> Mapping[tuple[str, str], SafeGlobal]:
    """The built-in safe set, computed once and read-only.

    ``zerocopy_pickle.rebuild:rebuild_storage`` is not in it: the unpickler substitutes the load's own
    :class:`~zerocopy_pickle.rebuild.StorageBuilder`, which checks its arguments.
    """
    table: dict[tuple[str, str], SafeGlobal] = {
        pair: SafeGlobal(fn, callable=True, result_ops=ops) for pair, (fn, ops) in _CALLS.items()
    }
    # Values a stream names but never calls: tensor classes (as _rebuild_from_type_v2's new_type), dtypes,
    # layouts, memory formats, qschemes.
    table["torch", "Tensor"] = SafeGlobal(torch.Tensor)
    # Container types as values (``defaultdict(list)``); their constructors are not callable here.
    for cls in (list, dict, tuple):
        table["builtins", cls.__name__] = SafeGlobal(cls)
    table["torch._tensor", "Tensor"] = SafeGlobal(torch.Tensor)
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.qscheme, torch.memory_format, torch.layout)):
            table["torch", name] = SafeGlobal(value)
    # Memory formats as plain pickle writes them: the global "torch.<name>" in the first module of sys.modules
    # that reaches torch, which is torch._utils in a process that imported torch first (torch.save's files).
    # This library's pickler writes rebuild_memory_format(name) instead (see zerocopy_pickle.rebuild).
    for name, value in rebuild.MEMORY_FORMATS.items():
        table["torch._utils", f"torch.{name}"] = SafeGlobal(value)
    # torch.nn.functional's functions that are torch._C._nn builtins, as modules hold them (transformers'
    # GELUActivation keeps F.gelu, which pickles as torch._C._nn:gelu). Values only, never called by the stream:
    # the blocklist's torch._C stays closed to every other name.
    nn_builtins = getattr(torch._C, "_nn", None)
    for name in NN_BUILTIN_VALUES:
        value = getattr(nn_builtins, name, None)
        if isinstance(value, types.BuiltinFunctionType) and getattr(torch.nn.functional, name, None) is value:
            table["torch._C._nn", name] = SafeGlobal(value)
    return types.MappingProxyType(table)


NN_BUILTIN_VALUES = (
    "gelu", "softplus", "logsigmoid", "elu_", "hardtanh_", "leaky_relu_", "softshrink", "linear",
    "scaled_dot_product_attention", "avg_pool2d", "avg_pool3d", "one_hot",
)  # fmt: skip
"""The ``torch._C._nn`` builtins that ``torch.nn.functional`` exports under the same name: pure tensor
operations, admitted as values (what a module stores as its activation), never as calls."""
