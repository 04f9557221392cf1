"""Internal: the hostile objects :func:`zerocopy_pickle.testing.check_hostile_arguments` passes, and the calls it
makes with them.

The hostile objects (their methods record in ``_RAN`` when anything runs them, and raise ``_Runaway`` past
``_MAX_RECORDS``), the recording stand-in for the standard streams, the argument counts a function is tried with,
and one call's verdict: the function must raise a ``ZeroCopyPickleError`` or return plain data, running no
hostile method and touching no standard stream. ``testing.py`` makes the corpus of these objects and plain
values (``hostile_values``) and the argument tuples, and reports the findings.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .errors import ZeroCopyPickleError

_RAN: list[str] = []
"""What the hostile objects' methods append to when anything runs them: must stay empty."""


class _Runaway(BaseException):
    """Raised by a hostile method that ran too often (a function looping over an object's ``__getitem__``): a
    BaseException, so that the function's own ``except Exception`` cannot swallow it."""


_MAX_RECORDS = 100


def _record(what: str) -> None:
    _RAN.append(what)
    if len(_RAN) > _MAX_RECORDS:
        raise _Runaway(what)


def _recording(name: str, result: Callable[[], Any]) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        _record(f"{type(self).__name__}.{name}")
        return result()

    method.__name__ = name
    return method


_DUNDER_RESULTS: dict[str, Callable[[], Any]] = {
    "__index__": lambda: 1,
    "__int__": lambda: 1,
    "__float__": lambda: 1.0,
    "__len__": lambda: 1,
    "__getattr__": lambda: "float16",
    "__eq__": lambda: True,
    "__ne__": lambda: False,
    "__lt__": lambda: False,
    "__le__": lambda: True,
    "__gt__": lambda: False,
    "__ge__": lambda: True,
    "__hash__": lambda: 1,
    "__iter__": lambda: iter(("float16",)),
    "__call__": lambda: None,
    "__getitem__": lambda: "float16",
    "__contains__": lambda: True,
    "__bool__": lambda: True,
    "__str__": lambda: "float16",
    "__fspath__": lambda: "/dev/null",
    "__reduce_ex__": lambda: (str, ("x",)),
}


@functools.cache
def _one_dunder_class(name: str) -> type:
    return type(f"Hostile{name.strip('_').title()}", (), {name: _recording(name, _DUNDER_RESULTS[name])})


@functools.cache
def _everything_class(base: type, label: str) -> type:
    namespace = {name: _recording(name, result) for name, result in _DUNDER_RESULTS.items()}
    if base is not object:  # keep what the base needs to exist
        namespace.pop("__getattr__")
    return type(f"Hostile{label}", (base,), namespace)


class _LyingClass:
    """``isinstance(x, torch.Tensor)`` says yes: ``__class__`` is a property (exact type checks see through it)."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        _record("_LyingClass.__class__")
        return torch.Tensor


class _HostileTensor(torch.Tensor):
    """A tensor subclass: ``__torch_function__`` runs on every torch operation on it."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _record(f"_HostileTensor.__torch_function__({getattr(func, '__name__', func)})")
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]


class _RecordingStream:
    """Stands for ``sys.stdin``/``stdout``: reading, writing or iterating it records."""

    def __getattr__(self, name: str) -> Any:
        _record(f"stream.{name}")
        raise AttributeError(name)

    def __iter__(self) -> Iterator[str]:
        _record("stream.__iter__")
        return iter(())


def _hostile_function() -> None:
    _record("function called")


def _generator() -> Iterator[str]:
    _record("generator advanced")
    yield "float16"


def _is_plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is data a genuine stream could hold (so a normal return is acceptable)."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return True
    if depth < 8 and type(value) in (tuple, list):
        return all(_is_plain(item, depth + 1) for item in value)
    if depth < 8 and type(value) is dict:
        return all(type(k) is str and _is_plain(v, depth + 1) for k, v in value.items())
    return False


def _describe_args(labels: tuple[str, ...]) -> str:
    return "(" + ", ".join(labels) + ")"


def _arities(fn: Callable[..., Any]) -> tuple[inspect.Signature | None, range]:
    """``fn``'s signature and the argument counts to try; a callable without a signature (a builtin, a class
    implemented in C) gets every count from 0 to 8."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, range(9)
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values())
    return signature, range(9 if variadic else min(len(positional), 8) + 1)


def _outcome(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
    """What was wrong with calling ``fn(*args)`` (None: nothing), with the standard streams replaced by recording
    stand-ins and every hostile method that ran recorded."""
    _RAN.clear()
    saved = sys.stdin, sys.stdout, sys.stderr
    sys.stdin = sys.stdout = sys.stderr = _RecordingStream()
    try:
        with warnings.catch_warnings():  # a warning is not a finding, and must not reach the stand-ins
            warnings.simplefilter("ignore")
            result = fn(*args)
    except _Runaway:
        outcome: str | None = f"kept running hostile methods (stopped after {_MAX_RECORDS})"
    except ZeroCopyPickleError:
        outcome = None
    except Exception as e:  # the point: anything but this library's error is a finding
        outcome = f"raised {type(e).__name__}: {str(e)[:200]} (not a ZeroCopyPickleError)"
    else:
        outcome = _judge_result(result, args, saved)
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved
    ran, _RAN[:] = list(_RAN), []
    if ran:
        outcome = f"ran hostile methods {ran[:5]}" + (f"; {outcome}" if outcome else "")
    return outcome


def _judge_result(result: object, args: tuple[Any, ...], streams: tuple[Any, ...]) -> str | None:
    if not all(_is_plain(arg) for arg in args):
        return f"returned {type(result).__qualname__} for arguments that are not plain data (it must refuse them)"
    shared = (*streams, sys.__stdin__, sys.__stdout__, sys.__stderr__)
    if (
        any(result is s for s in shared)
        or type(result) is _RecordingStream
        or isinstance(result, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType))
    ):
        return f"returned a shared object {result!r:.80}"
    return None
