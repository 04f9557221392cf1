"""Argument checks for the functions a restricted load may call.

Every safe global (the built-in set in :mod:`zerocopy_pickle._trust.safe_set`, and every plugin's) is an API exposed to
whoever wrote the stream: its arguments are whatever a hostile stream chose. Such a function checks the *exact*
type of each argument (``type(x) is int``, never ``isinstance``: a subclass can carry an ``__index__``, ``__iter__``
or ``__eq__`` of the attacker's choosing) and every size, before it calls anything; it never calls an argument,
never resolves a name it was given (``getattr(torch, name)``), and never iterates an object that is not a list,
tuple or dict built by the stream itself. These helpers raise :class:`~zerocopy_pickle.errors.UnsafeArgumentError`
(a :class:`~zerocopy_pickle.errors.SnapshotError`) with a message naming the function and the argument.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from typing import Any, NoReturn

import torch

from .errors import UnsafeArgumentError

__all__ = [
    "BUDGET_FLOOR",
    "MAX_DIMS",
    "MAX_ELEMENTS",
    "budget",
    "charge",
    "dtype_from_name",
    "expect",
    "expect_bool",
    "expect_choice",
    "expect_class",
    "expect_float",
    "expect_int",
    "expect_int_tuple",
    "expect_keys",
    "expect_optional",
    "expect_optional_tensor",
    "expect_str",
    "expect_str_dict",
    "expect_tensor",
    "fail",
    "remaining",
]

MAX_DIMS = 64
"""Most dimensions a tensor may have in a restricted load (torch's own limit is 64)."""
MAX_ELEMENTS = 1 << 62
"""Most elements (or bytes) any size may describe: products beyond it overflow torch's int64 arithmetic."""


def fail(where: str, message: str) -> NoReturn:
    """Raise the error a safe global raises for a bad argument: ``"<where>: <message>"``."""
    raise UnsafeArgumentError(f"{where}: {message}")


def _type_name(value: object) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def expect(value: Any, types: type | tuple[type, ...], where: str, what: str) -> Any:
    """``value`` if its exact type is one of ``types`` (subclasses are refused), else raise."""
    allowed = types if isinstance(types, tuple) else (types,)
    if type(value) not in allowed:
        names = " or ".join(t.__qualname__ for t in allowed)
        fail(where, f"{what} must be {names}, not {_type_name(value)}")
    return value


def expect_optional(value: Any, types: type | tuple[type, ...], where: str, what: str) -> Any:
    """Like :func:`expect`, but ``None`` is accepted too."""
    return None if value is None else expect(value, types, where, what)


def expect_int(value: Any, where: str, what: str, lo: int = 0, hi: int = MAX_ELEMENTS) -> int:
    """An exact ``int`` (not ``bool``) in ``[lo, hi]``."""
    if type(value) is not int:
        fail(where, f"{what} must be int, not {_type_name(value)}")
    if not lo <= value <= hi:
        fail(where, f"{what} {value} is out of range [{lo}, {hi}]")
    return value


def expect_bool(value: Any, where: str, what: str) -> bool:
    """An exact ``bool``."""
    if type(value) is not bool:
        fail(where, f"{what} must be bool, not {_type_name(value)}")
    return value


def expect_str(value: Any, where: str, what: str, max_len: int = 4096) -> str:
    """An exact ``str`` of at most ``max_len`` characters."""
    if type(value) is not str:
        fail(where, f"{what} must be str, not {_type_name(value)}")
    if len(value) > max_len:
        fail(where, f"{what} is {len(value)} characters long (at most {max_len})")
    return value


def expect_int_tuple(
    value: Any, where: str, what: str, *, lo: int = 0, hi: int = MAX_ELEMENTS, max_len: int = MAX_DIMS
) -> tuple[int, ...]:
    """A tuple (or ``torch.Size``) of at most ``max_len`` exact ints, each in ``[lo, hi]``."""
    if type(value) not in (tuple, torch.Size):
        fail(where, f"{what} must be a tuple of ints, not {_type_name(value)}")
    if len(value) > max_len:
        fail(where, f"{what} has {len(value)} entries (at most {max_len})")
    for i, item in enumerate(value):
        if type(item) is not int:
            fail(where, f"{what}[{i}] must be int, not {_type_name(item)}")
        if not lo <= item <= hi:
            fail(where, f"{what}[{i}] = {item} is out of range [{lo}, {hi}]")
    return tuple(value)


def expect_str_dict(value: Any, where: str, what: str, *, max_len: int = 1 << 16) -> dict[str, Any]:
    """A ``dict`` or ``OrderedDict`` (exact types) whose keys are all exact ``str``."""
    import collections

    if type(value) not in (dict, collections.OrderedDict):
        fail(where, f"{what} must be a dict, not {_type_name(value)}")
    if len(value) > max_len:
        fail(where, f"{what} has {len(value)} entries (at most {max_len})")
    for key in value:
        if type(key) is not str:
            fail(where, f"{what} has a key of type {_type_name(key)}; keys must be str")
    return value  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1)
def _dtypes() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            table[name] = value
            table[str(value)] = value  # "torch.float16"
    return table


def dtype_from_name(name: Any, where: str, what: str = "dtype") -> torch.dtype:
    """A dtype by its name (``"float16"`` or ``"torch.float16"``), from a fixed table: never ``getattr``."""
    charge(len(expect_str(name, where, what, max_len=64)), where)
    try:
        return _dtypes()[name]
    except KeyError:
        fail(where, f"{what} {name!r} is not a torch dtype")


def expect_choice(value: Any, choices: tuple[str, ...] | frozenset[str], where: str, what: str) -> str:
    """An exact ``str`` that is one of ``choices`` (compared only after the exact-type check)."""
    if type(value) is not str:
        fail(where, f"{what} must be str, not {_type_name(value)}")
    if value not in choices:
        fail(where, f"{what} {value[:80]!r} is not one of {sorted(choices)}")
    return value


def expect_float(value: Any, where: str, what: str, lo: float = float("-inf"), hi: float = float("inf")) -> float:
    """An exact ``float`` or ``int`` (not ``bool``), finite, in ``[lo, hi]``; returned as a float."""
    if type(value) not in (float, int):
        fail(where, f"{what} must be float, not {_type_name(value)}")
    if type(value) is int and abs(value) > MAX_ELEMENTS:
        fail(where, f"{what} {value} is out of range [{lo}, {hi}]")
    number = float(value)
    if not math.isfinite(number) or not lo <= number <= hi:
        fail(where, f"{what} {number} is out of range [{lo}, {hi}]")
    return number


def expect_tensor(
    value: Any,
    where: str,
    what: str,
    *,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    dim: int | None = None,
) -> torch.Tensor:
    """An exact ``torch.Tensor`` (no subclass, no ``Parameter``: a subclass's ``__torch_function__`` would run on
    every operation), optionally of ``dtype`` (one of them) and ``dim`` dimensions."""
    if type(value) is not torch.Tensor:
        fail(where, f"{what} must be a torch.Tensor, not {_type_name(value)}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if dtype is not None and value.dtype not in dtypes:
        fail(where, f"{what} has dtype {value.dtype}, not {' or '.join(map(str, dtypes))}")
    if dim is not None and value.dim() != dim:
        fail(where, f"{what} has {value.dim()} dimensions, not {dim}")
    return value


def expect_optional_tensor(value: Any, where: str, what: str, **kwargs: Any) -> torch.Tensor | None:
    """``None``, or what :func:`expect_tensor` accepts."""
    return None if value is None else expect_tensor(value, where, what, **kwargs)


def expect_class(value: Any, bases: type | tuple[type, ...], where: str, what: str) -> type:
    """A class (its metaclass exactly ``type``, so no custom ``__subclasscheck__``/``__call__`` of a metaclass) that
    has one of ``bases`` in its MRO. Only a class the caller's ``allow=`` (or the built-in safe set) let the stream
    name can reach a safe global at all; this check keeps the function to the family it rebuilds."""
    allowed = bases if isinstance(bases, tuple) else (bases,)
    if type(value) is not type:
        fail(where, f"{what} must be a class, not {_type_name(value)}")
    if not any(base in value.__mro__ for base in allowed):
        names = " or ".join(f"{b.__module__}.{b.__qualname__}" for b in allowed)
        fail(where, f"{what} {value.__module__}.{value.__qualname__} is not a subclass of {names}")
    return value


def expect_keys(value: Any, allowed: frozenset[str] | tuple[str, ...], where: str, what: str) -> dict[str, Any]:
    """An exact ``dict`` (or ``OrderedDict``) whose keys are exact ``str`` from ``allowed``."""
    table = expect_str_dict(value, where, what, max_len=len(allowed))
    unknown = sorted(key[:80] for key in table if key not in allowed)
    if unknown:
        fail(where, f"{what} has unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    return table


# -- the copy budget -------------------------------------------------------------------------------------------
# A stream can reference one container from its memo any number of times for a few bytes each; a safe global that
# copies or walks its argument (OrderedDict(items), set(items), a sparse tensor's indices) would then do work in
# proportion to the container's size for every reference: quadratic in the stream. Each load of a restricted
# unpickler gets a budget of elements its safe globals may copy or walk, proportional to what the stream and its
# buffers hold; a stream that copies every element it contains once stays far inside it.

BUDGET_FLOOR = 1 << 20
"""Elements every restricted load may copy or walk, whatever its size."""

_BUDGET: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("zerocopy_pickle_budget", default=None)


@contextlib.contextmanager
def budget(elements: int) -> Iterator[None]:
    """Give the safe globals called in this context ``max(elements, BUDGET_FLOOR)`` elements to copy or walk."""
    token = _BUDGET.set([max(elements, BUDGET_FLOOR)])
    try:
        yield
    finally:
        _BUDGET.reset(token)


def remaining() -> int | None:
    """What is left of the current load's budget (None outside a restricted load): for tests and diagnostics."""
    left = _BUDGET.get()
    return None if left is None else left[0]


def charge(elements: int, where: str) -> None:
    """Spend ``elements`` of the current load's budget (no budget outside a restricted load: no limit).

    Raises:
        UnsafeArgumentError: the budget is spent: the stream makes its safe globals copy more than it holds.
    """
    remaining = _BUDGET.get()
    if remaining is None:
        return
    remaining[0] -= elements
    if remaining[0] < 0:
        fail(
            where,
            "the stream makes its functions copy or walk far more elements than it holds (one container referenced "
            "over and over): refused as a memory and time amplification",
        )
