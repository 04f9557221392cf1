"""Internal: what an ``allow=`` entry is: its accepted forms and how each is named, resolved and classed.

A class or function (named by its ``__module__`` and ``__qualname__``), a ``"module:qualname"`` string, a
``(module, qualname)`` tuple, or an :func:`allow_function` entry for a function the stream may call; the NumPy
pickle machinery an entry may name and restricted loads ignore (:func:`numpy_machinery`); which classes always
construct a fresh object (:func:`_constructs_fresh`), the only ones whose instances a load may fill.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .._names import GlobalName
from ..errors import ArgumentError, RestrictedLoadError

AllowSpec = Iterable[object]
"""What ``allow=`` accepts: classes or functions, ``"module:qualname"`` strings, or ``(module, qualname)``."""

_STORAGE_PAIR = ("zerocopy_pickle.rebuild", "rebuild_storage")


def format_global(pair: tuple[str, str]) -> str:
    """``("collections", "OrderedDict")`` -> ``"collections:OrderedDict"``, the form ``allow=`` takes."""
    return str(GlobalName(*pair))


def _pair_of(obj: Any) -> tuple[str, str]:
    name = GlobalName.of(obj)
    if name is None:
        raise ArgumentError(
            f"allow= entries must be classes, functions, 'module:qualname' strings or (module, qualname) "
            f"tuples; {obj!r:.80} has no __module__/__qualname__ (pass its 'module:qualname' string instead)"
        )
    return name.pair


@dataclass(frozen=True)
class AllowFunction:
    """An ``allow=`` entry that lets a restricted load *call* a function (see :func:`allow_function`)."""

    target: object


def allow_function(target: object) -> AllowFunction:
    """Mark a function in ``allow=`` as callable by the stream: ``allow=[zp.allow_function(my_rebuild)]``.

    A plain ``allow=`` entry admits a class (which the stream may instantiate and fill) or any object as a
    *value* (a function referenced by a module, say ``activation=F.gelu``). Calling a function is different:
    the stream chooses every argument, so a function the load may call must check them itself (see
    :mod:`zerocopy_pickle.validate`). Blocked functions stay blocked.

    Args:
        target: a function, a ``"module:qualname"`` string or a ``(module, qualname)`` tuple.

    Examples:
        A function the stream calls (a reducer's rebuild function), which checks its own arguments:

        ```python
        import zerocopy_pickle as zp
        from mypkg import Interval, rebuild_interval  # rebuild_interval(lo, hi) validates lo and hi

        interval = zp.load("interval.zcp", allow=[Interval, zp.allow_function(rebuild_interval)])
        interval = zp.load("interval.zcp", allow=[Interval, zp.allow_function("mypkg:rebuild_interval")])
        ```
    """
    return AllowFunction(target)


# __new__ implementations known to return a new object every time: instances created through them (and not
# through a metaclass __call__ of its own, as Enum's) can be filled by BUILD and the container opcodes.
_FRESH_NEW_OWNERS = (object, dict, list, set, bytearray, collections.OrderedDict, collections.deque,
                     collections.defaultdict)  # fmt: skip


def _constructs_fresh(cls: type) -> bool:
    """Whether calling or instantiating ``cls`` always yields a new object (so BUILD on it touches nothing else)."""
    if type(cls).__call__ is not type.__call__:
        return False
    for base in cls.__mro__:
        if "__new__" in vars(base):
            return base in _FRESH_NEW_OWNERS
    return False


_NUMPY_MACHINERY = frozenset(
    (module, name)
    for core in ("numpy._core", "numpy.core")
    for module, name in (
        (f"{core}.multiarray", "_reconstruct"),
        (f"{core}.multiarray", "scalar"),
        (f"{core}.numeric", "_frombuffer"),
    )
) | {("numpy", "ndarray"), ("numpy", "dtype")}


def numpy_machinery(pair: tuple[str, str]) -> bool:
    """Whether ``pair`` is one of the NumPy names a ``torch.serialization.add_safe_globals`` list holds for NumPy
    values (``_reconstruct``, ``scalar``, ``_frombuffer``, ``ndarray``, ``dtype``, the ``numpy.dtypes`` classes).

    An ``allow=`` entry naming one is accepted and ignored (Note [NumPy values] in safeglobals): numeric NumPy
    values load through this library's own rebuilds without it, and admitting it would let a stream call
    ``numpy.ndarray(shape)`` (memory from a size alone) or the unchecked ``_reconstruct``. Only
    :func:`allow_function` admits such a function to be called, on the caller's word."""
    module, name = pair
    return pair in _NUMPY_MACHINERY or (module == "numpy.dtypes" and name.endswith("DType"))


def _entry(item: object) -> tuple[tuple[str, str], object]:
    """An ``allow=`` entry as ``(pair, object or None)``."""
    if isinstance(item, str):
        name = GlobalName.parse(item)
        if name is None:
            raise ArgumentError(
                f"allow= string {item!r} must have the form 'module:qualname', e.g. 'collections:OrderedDict'"
            )
        return name.pair, None
    if isinstance(item, tuple):
        if len(item) != 2 or not all(isinstance(p, str) and p for p in item):
            raise ArgumentError(f"allow= tuple {item!r:.80} must be (module, qualname), two non-empty strings")
        return (item[0], item[1]), None
    return _pair_of(item), item


def _resolve(module: str, qualname: str) -> object:
    """Import an allowed-by-name global. A dotted qualname must lead to a class that names itself so: walking
    attributes never reaches through a module's globals or onto a method."""
    obj = GlobalName(module, qualname).resolve()
    if "." in qualname and not (isinstance(obj, type) and obj.__module__ == module and obj.__qualname__ == qualname):
        raise RestrictedLoadError(
            f"refusing to load global {format_global((module, qualname))!r}: a dotted name must lead to the class "
            f"it names, and this one leads to {type(obj).__name__} {getattr(obj, '__module__', '?')}:"
            f"{getattr(obj, '__qualname__', '?')}",
            refused=(module, qualname),
        )
    return obj
