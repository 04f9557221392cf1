"""A conformance suite for reducer plugins, to subclass in a plugin's own tests (like fsspec's abstract suites).

Usage, in a test module of the plugin's project::

    from zerocopy_pickle.testing import ReducerConformance

    class TestMyPluginConformance(ReducerConformance):
        plugin = "myplugin"                       # the entry-point name
        factory = "myplugin.testing:sample"       # "module:function" returning the objects to dump

pytest collects the ``test_*`` methods: a round trip, repeated independent loads, a restricted load that
needs nothing beyond the plugin's declared safe globals, a load in a fresh interpreter that never built the
objects, and :func:`check_hostile_arguments` applied to every safe global the plugin declares. Override
:meth:`assert_same` to compare objects your way, and :meth:`env` to give the fresh interpreter what it needs
(a ``PYTHONPATH``).

:func:`check_hostile_arguments` is public and independent of plugins: apply it to any function a restricted load
may call.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import subprocess
import sys
import textwrap
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import snapshot
from .discovery import resolve_name
from .errors import RestrictedLoadError, ZeroCopyPickleError
from .registry import default_registry

__all__ = ["ReducerConformance", "assert_same", "check_hostile_arguments", "hostile_values"]


def assert_same(expected: Any, actual: Any, where: str = "obj") -> None:
    """Deep equality for object graphs of tensors, containers and objects with ``__dict__`` or ``__eq__``."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__} is not a tensor"
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, f"{where}: dtype or shape differ"
        # torch.Tensor.cpu, not the subclass's: some (bitsandbytes' parameters) quantize themselves in .cpu().
        assert torch.equal(torch.Tensor.cpu(expected), torch.Tensor.cpu(actual)), f"{where}: values differ"
    elif isinstance(expected, dict) and where.endswith("hooks"):
        # Hook handles are numbered by a process-wide counter: compare the hooks, not their numbers.
        assert isinstance(actual, dict) and len(expected) == len(actual), f"{where}: hooks differ"
        for i, (a, b) in enumerate(zip(expected.values(), actual.values(), strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and expected.keys() == actual.keys(), f"{where}: keys differ"
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(expected) is type(actual) and len(expected) == len(actual), f"{where}: sequences differ"
        for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert type(expected).__qualname__ == type(actual).__qualname__, f"{where}: types differ"
        equal: object = NotImplemented
        if getattr(type(expected), "__eq__", None) is not getattr(object, "__eq__", None):
            try:
                equal = bool(expected == actual)
            except (RuntimeError, TypeError, ValueError):  # an __eq__ over tensors: compare the attributes
                equal = NotImplemented
        if equal is not NotImplemented:
            assert equal, f"{where}: {expected!r:.80} != {actual!r:.80}"
        elif hasattr(expected, "__dict__"):
            for name, value in vars(expected).items():
                assert name in vars(actual), f"{where}.{name}: missing"
                assert_same(value, vars(actual)[name], f"{where}.{name}")


# -- hostile arguments -------------------------------------------------------------------------------------------

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


def hostile_values() -> list[tuple[str, Any]]:
    """``(label, value)`` for every hostile argument :func:`check_hostile_arguments` tries (fresh objects each
    call; a generator can be consumed once). Plain values (strings naming attributes, huge ints, wrong types) come
    first; the rest are objects whose methods record in a shared list when anything runs them."""
    plain: list[tuple[str, Any]] = [
        *((f"str {s!r}", s) for s in ("system", "__class__", "float16", "torch.float16", "os.system", "")),
        *((f"str {s!r}", s) for s in ("stdin", "stderr", "__stdin__", "modules", "load", "eval", "__import__")),
        ("str long", "x" * 100_000),
        *((f"int {n}", n) for n in (0, 1, -1, 2**31, 2**63, -(2**63), 10**100)),
        ("float nan", float("nan")),
        ("float inf", float("inf")),
        ("float -1.5", -1.5),
        ("bool True", True),
        ("None", None),
        ("bytes", b"\x00" * 16),
        ("tuple empty", ()),
        ("list empty", []),
        ("dict empty", {}),
        ("tuple nested", ((((1,),),),)),
        ("tuple of huge ints", (2**63, 10**100)),
        ("dict of str", {"dtype": "float16", "shape": (2**40, 2**40)}),
    ]
    objects: list[tuple[str, Any]] = [
        *((f"object with {name}", _one_dunder_class(name)()) for name in _DUNDER_RESULTS),
        ("int subclass", _everything_class(int, "Int")(7)),
        ("str subclass", _everything_class(str, "Str")("float16")),
        ("tuple subclass", _everything_class(tuple, "Tuple")((1, 2))),
        ("list subclass", _everything_class(list, "List")([1, 2])),
        ("dict subclass", _everything_class(dict, "Dict")({"dtype": "float16"})),
        ("generator", _generator()),
        ("object with a __class__ property", _LyingClass()),
        ("tensor subclass", torch.Tensor._make_subclass(_HostileTensor, torch.zeros(4))),
        ("parameter", torch.nn.Parameter(torch.zeros(4))),
        ("stream stand-in", _RecordingStream()),
        ("sys.stdin", sys.stdin),
        ("sys.stderr", sys.stderr),
        ("function", _hostile_function),
        ("builtin function os.getcwd", os.getcwd),
        ("module os", os),
        ("class object", object),
        ("type type", type),
    ]
    wrapped: list[tuple[str, Any]] = []
    for label, value in objects[-12:]:
        wrapped += [
            (f"({label},)", (value,)),
            (f"[{label}]", [value]),
            (f"{{'x': {label}}}", {"x": value}),
        ]
    return plain + objects + wrapped


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


def check_hostile_arguments(fn: Callable[..., Any], where: str, *, random_tuples: int = 300, seed: int = 0) -> None:
    """Call ``fn`` (a function a restricted load may call) with hostile argument tuples; raise AssertionError if it
    mishandles one.

    The tuples are every position times every value of :func:`hostile_values` (the other positions filled with
    ``None``, ``0`` or ``""``) for every arity from 0 to 8 that ``inspect.signature(fn)`` can bind (a tuple it
    cannot bind is refused by arity anyway), plus ``random_tuples`` random combinations (fixed ``seed``). For each:

    * ``fn`` raises a :class:`~zerocopy_pickle.errors.ZeroCopyPickleError` (any other exception means it used an
      argument before checking it), or returns normally, which is accepted only when every argument is plain data
      (``None``, bools, ints, floats, strings, bytes, and exact tuples/lists/dicts of them) and the result is none
      of the arguments, no standard stream, module, class or function;
    * no method of a hostile object ran (``__index__``, ``__eq__``, ``__iter__``, ``__torch_function__``, ``__call__``
      of a function argument, reads of a stream stand-in...), and the process's ``sys.stdin``/``stdout``/``stderr``
      were not used: they are replaced by recording stand-ins during the calls.

    Args:
        fn: the function.
        where: names it in failure messages (``"zerocopy_pickle_quirks.bnb:rebuild_quant_state"``).
    """
    signature, arities = _arities(fn)
    fillers = (None, 0, "")
    failures: list[str] = []

    def bindable(n: int) -> bool:
        if signature is None:
            return True
        try:
            signature.bind(*([None] * n))
        except TypeError:
            return False
        return True

    def attempt(labelled: list[tuple[str, Any]]) -> None:
        labels = tuple(label for label, _ in labelled)
        args = tuple(value for _, value in labelled)
        _RAN.clear()
        saved = sys.stdin, sys.stdout, sys.stderr
        sys.stdin = sys.stdout = sys.stderr = _RecordingStream()
        try:
            with warnings.catch_warnings():  # a warning is not a finding, and must not reach the stand-ins
                warnings.simplefilter("ignore")
                result = fn(*args)
        except _Runaway:
            outcome = f"kept running hostile methods (stopped after {_MAX_RECORDS})"
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
        if outcome is not None:
            failures.append(f"{where}{_describe_args(labels)}: {outcome}")

    count = 0
    for n in arities:
        if not bindable(n):
            continue
        if n == 0:
            attempt([])
            count += 1
            continue
        for position in range(n):
            for filler in fillers:
                for label, value in hostile_values():
                    labelled = [(repr(filler), filler)] * n
                    labelled[position] = (label, value)
                    attempt(labelled)
                    count += 1
    usable = [n for n in arities if n and bindable(n)]
    rng = random.Random(seed)
    for _ in range(random_tuples if usable else 0):
        values = hostile_values()
        attempt([rng.choice(values) for _ in range(rng.choice(usable))])
        count += 1
    assert count, f"{where}: no argument tuple binds to {signature}"
    if failures:
        shown = "\n  ".join(failures[:20])
        more = f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""
        raise AssertionError(f"{len(failures)} of {count} hostile calls were mishandled:\n  {shown}{more}")


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


class ReducerConformance:
    """What every reducer plugin must satisfy. Subclass it (with a ``Test`` prefix) and set the attributes."""

    plugin: str = ""
    """The plugin's entry-point name, which snapshots of its objects must record."""
    trusted_only: bool = False
    """True for plugins whose objects only a trusted load may build (their rebuild runs code: TorchScript). The
    restricted-load test then checks that a restricted load refuses them, and the other tests load trusted."""
    factory: str = ""
    """``"module:function"`` that returns the objects to dump (importable in a fresh interpreter too)."""

    def make_objects(self) -> Any:
        return resolve_name(self.factory)()

    def assert_same(self, expected: Any, actual: Any) -> None:
        assert_same(expected, actual)

    def env(self) -> dict[str, str]:
        """Environment variables the fresh interpreter needs (for example a ``PYTHONPATH``)."""
        return {}

    def test_round_trip_records_the_plugin(self) -> None:
        objects = self.make_objects()
        data = snapshot.dumps(objects)
        loaded = snapshot.loads(data, trusted=True)
        self.assert_same(objects, loaded)
        names = [plugin.name for plugin in snapshot.read_header(data).plugins]
        assert self.plugin in names, f"the snapshot's header lists plugins {names}, not {self.plugin!r}"

    def test_repeated_loads_are_independent(self, tmp_path: Path) -> None:
        objects = self.make_objects()
        path = tmp_path / "conformance.zcp"
        snapshot.dump(objects, path)
        first, second = snapshot.load(path, trusted=True), snapshot.load(path, trusted=True)
        self.assert_same(objects, first)
        self.assert_same(objects, second)
        with torch.no_grad():  # parameters that require grad may only be written this way
            for tensor in _tensors(first):
                if tensor.numel() and tensor.is_floating_point():
                    tensor.view(-1)[0] = 12345.0
        self.assert_same(objects, second)  # the first load's writes are private to it
        self.assert_same(objects, snapshot.load(path, trusted=True))

    def test_restricted_load_needs_only_declared_safe_globals(self) -> None:
        objects = self.make_objects()
        data = snapshot.dumps(objects)
        if self.trusted_only:
            try:
                snapshot.loads(data)
            except RestrictedLoadError:
                return
            raise AssertionError(f"a restricted load accepted a snapshot of trusted-only plugin {self.plugin!r}")
        loaded = snapshot.loads(data)  # no allow=: the plugin's safe globals must do
        self.assert_same(objects, loaded)

    def test_safe_globals_refuse_hostile_arguments(self) -> None:
        registry = default_registry()
        info = registry.plugins()[self.plugin]
        own = dict.fromkeys(info.safe_globals)
        for reducer in registry.reducers().values():
            if reducer.plugin == self.plugin:
                own.update(dict.fromkeys(reducer.safe_globals))
        for module, qualname in own:
            fn = registry.resolve_safe_global(module, qualname, plugins=[self.plugin])
            check_hostile_arguments(fn, f"{module}:{qualname}")

    def test_fresh_interpreter_load(self, tmp_path: Path) -> None:
        path = tmp_path / "fresh.zcp"
        snapshot.dump(self.make_objects(), path)
        code = textwrap.dedent(
            f"""
            import zerocopy_pickle as zp
            from zerocopy_pickle.discovery import resolve_name
            from zerocopy_pickle.testing import assert_same
            loaded = zp.load({str(path)!r}, trusted={self.trusted_only!r} or None)
            assert_same(resolve_name({self.factory!r})(), loaded)
            print("ok")
            """
        )
        env = dict(os.environ, **self.env())
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
        assert self.plugin in default_registry().plugins(), f"plugin {self.plugin!r} is not discovered here"


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    stack = [obj]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dict__"):
            stack.extend(vars(item).values())
    return found
