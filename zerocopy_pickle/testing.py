"""A conformance suite for reducer plugins, to subclass in a plugin's own tests (like fsspec's abstract suites).

Usage, in a test module of the plugin's project::

    from zerocopy_pickle.testing import ReducerConformance

    class TestMyPluginConformance(ReducerConformance):
        plugin = "myplugin"                       # the entry-point name
        factory = "myplugin.testing:sample"       # "module:function" returning the objects to dump

pytest collects the ``test_*`` methods: a round trip, repeated independent loads, a restricted load that
needs nothing beyond the plugin's declared safe globals, a load in a fresh interpreter that never built the
objects, :func:`check_hostile_arguments` applied to every safe global the plugin declares, and
:func:`check_native_tensor_arguments` applied to every case :meth:`ReducerConformance.native_tensor_cases`
returns. Override :meth:`assert_same` to compare objects your way, :meth:`env` to give the fresh interpreter what
it needs (a ``PYTHONPATH``), and :attr:`ReducerConformance.fresh_imports` to name the modules a program imports
before it loads (a plugin that never imports its library on a header's say-so needs it imported).

:func:`check_hostile_arguments` and :func:`check_native_tensor_arguments` are public and independent of plugins:
apply them to any function a restricted load may call.
"""

from __future__ import annotations

import enum
import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ._core import snapshot
from ._hostile_arguments import (
    _DUNDER_RESULTS,
    _arities,
    _describe_args,
    _everything_class,
    _generator,
    _hostile_function,
    _HostileTensor,
    _LyingClass,
    _one_dunder_class,
    _outcome,
    _RecordingStream,
)
from ._registry.discovery import resolve_name
from ._registry.registry import default_registry
from .errors import RestrictedLoadError, UnsafeArgumentError

__all__ = [
    "NativeTensorCase",
    "ReducerConformance",
    "assert_same",
    "check_hostile_arguments",
    "check_native_tensor_arguments",
    "hostile_values",
    "tensor_variants",
]


def assert_same(expected: Any, actual: Any, where: str = "obj") -> None:
    """Deep equality for object graphs of tensors, containers and objects with ``__dict__`` or ``__eq__``.

    Classes compare by module and qualified name, Enum members by class, name and value (their ``__dict__``
    leads back to the class and to every other member), and an object met again (a cycle, a shared object) is
    not walked twice."""
    _assert_same(expected, actual, where, set())


def _assert_same(expected: Any, actual: Any, where: str, seen: set[int]) -> None:
    if id(expected) in seen:
        return
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__} is not a tensor"
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, f"{where}: dtype or shape differ"
        # torch.Tensor.cpu, not the subclass's: some (bitsandbytes' parameters) quantize themselves in .cpu().
        assert torch.equal(torch.Tensor.cpu(expected), torch.Tensor.cpu(actual)), f"{where}: values differ"
        return
    if isinstance(expected, type):
        assert isinstance(actual, type) and (expected.__module__, expected.__qualname__) == (
            actual.__module__,
            actual.__qualname__,
        ), f"{where}: class {expected.__qualname__} is not {getattr(actual, '__qualname__', actual)!r}"
        return
    if isinstance(expected, enum.Enum):
        assert type(actual).__qualname__ == type(expected).__qualname__, f"{where}: types differ"
        assert (expected.name, expected.value) == (actual.name, actual.value), f"{where}: {expected} != {actual}"
        return
    seen.add(id(expected))
    if isinstance(expected, dict) and where.endswith("hooks"):
        # Hook handles are numbered by a process-wide counter: compare the hooks, not their numbers.
        assert isinstance(actual, dict) and len(expected) == len(actual), f"{where}: hooks differ"
        for i, (a, b) in enumerate(zip(expected.values(), actual.values(), strict=True)):
            _assert_same(a, b, f"{where}[{i}]", seen)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and expected.keys() == actual.keys(), f"{where}: keys differ"
        for key in expected:
            _assert_same(expected[key], actual[key], f"{where}[{key!r}]", seen)
    elif isinstance(expected, (list, tuple)):
        assert type(expected) is type(actual) and len(expected) == len(actual), f"{where}: sequences differ"
        for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
            _assert_same(a, b, f"{where}[{i}]", seen)
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
                _assert_same(value, vars(actual)[name], f"{where}.{name}", seen)


# -- hostile arguments -------------------------------------------------------------------------------------------
# The hostile objects, the recording stand-in for the streams and one call's verdict are in _hostile_arguments.py.


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
    failures: list[str] = []
    count = 0
    for labelled in _hostile_tuples(fn, where, random_tuples, seed):
        count += 1
        outcome = _outcome(fn, tuple(value for _, value in labelled))
        if outcome is not None:
            failures.append(f"{where}{_describe_args(tuple(label for label, _ in labelled))}: {outcome}")
    if failures:
        shown = "\n  ".join(failures[:20])
        more = f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""
        raise AssertionError(f"{len(failures)} of {count} hostile calls were mishandled:\n  {shown}{more}")


def _hostile_tuples(
    fn: Callable[..., Any], where: str, random_tuples: int, seed: int
) -> Iterator[list[tuple[str, Any]]]:
    """The labelled argument tuples :func:`check_hostile_arguments` tries: for every arity ``fn`` can bind, each
    position holding each hostile value (the others a filler), then ``random_tuples`` random ones."""
    signature, arities = _arities(fn)

    def bindable(n: int) -> bool:
        if signature is None:
            return True
        try:
            signature.bind(*([None] * n))
        except TypeError:
            return False
        return True

    usable = [n for n in arities if bindable(n)]
    assert usable, f"{where}: no argument tuple binds to {signature}"
    for n in usable:
        if n == 0:
            yield []
            continue
        for position in range(n):
            for filler in (None, 0, ""):
                for label, value in hostile_values():
                    labelled = [(repr(filler), filler)] * n
                    labelled[position] = (label, value)
                    yield labelled
    rng = random.Random(seed)
    sized = [n for n in usable if n]
    for _ in range(random_tuples if sized else 0):
        values = hostile_values()
        yield [rng.choice(values) for _ in range(rng.choice(sized))]


# -- tensors handed to native code -------------------------------------------------------------------------------

TensorPath = tuple[int | str, ...]
"""Where a tensor sits in an argument tuple: an index into the arguments, then dict keys or sequence indices
(``(2, "absmax")`` is ``args[2]["absmax"]``)."""

NativeTensorCase = tuple[Callable[..., Any], Sequence[Any], Iterable[TensorPath]]
"""``(function, known-good arguments, paths of the tensors it hands to native code)``: what
:meth:`ReducerConformance.native_tensor_cases` returns, and :func:`check_native_tensor_arguments` takes."""

_SAME_SIZE_DTYPES = {
    1: (torch.uint8, torch.int8),
    2: (torch.float16, torch.bfloat16, torch.int16),
    4: (torch.float32, torch.int32),
    8: (torch.float64, torch.int64),
}


def tensor_variants(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` for every near miss :func:`check_native_tensor_arguments` tries in place of ``tensor``:
    the same values but **one element short** and **one element long** (of its first dimension; a 0-d tensor becomes
    1-d), of **another dtype of the same element size** (``float32`` -> ``int32``: the same bytes read as another
    type), of **another element size** (``float32`` -> ``float64`` or ``float16``), and **not contiguous** (the same
    shape and values every other element of a larger buffer; only for more than one element). Each is a plain
    ``torch.Tensor`` on the same device, a fresh copy."""
    flat = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    variants: list[tuple[str, torch.Tensor]] = []
    if flat.shape[0] > 0:
        variants.append(("one element short", flat[:-1].clone()))
    extra = flat.new_zeros((1, *flat.shape[1:]))
    variants.append(("one element long", torch.cat([flat, extra])))
    size = tensor.element_size()
    same = [d for d in _SAME_SIZE_DTYPES.get(size, ()) if d is not tensor.dtype]
    if same:
        variants.append((f"dtype {same[0]} (same element size)", tensor.detach().to(same[0])))
    other = torch.float16 if size >= 4 else torch.float64
    variants.append((f"dtype {other} (other element size)", tensor.detach().to(other)))
    if tensor.numel() > 1:
        wide = torch.zeros((*tensor.shape, 2), dtype=tensor.dtype, device=tensor.device)
        wide[..., 0] = tensor.detach()
        variants.append(("not contiguous", wide[..., 0]))
    return variants


def _replace(value: Any, path: Sequence[int | str], new: Any) -> Any:
    """A copy of ``value`` (tuples, lists and dicts along ``path`` copied, nothing else) with ``new`` at ``path``."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(value, dict):
        copied = type(value)(value)
        copied[key] = _replace(value[key], rest, new)
        return copied
    if isinstance(value, (list, tuple)) and type(key) is int:
        items = list(value)
        items[key] = _replace(value[key], rest, new)
        return type(value)(items)
    raise AssertionError(f"path entry {key!r} does not lead into a {type(value).__qualname__}")


def _at(value: Any, path: Sequence[int | str]) -> Any:
    for key in path:
        value = value[key]
    return value


def check_native_tensor_arguments(
    fn: Callable[..., Any], args: Sequence[Any], tensors: Iterable[TensorPath], where: str
) -> None:
    """Check that ``fn`` (a function a restricted load may call) refuses every near miss of the tensors it hands to
    native code; raise AssertionError listing the ones it accepted.

    A native kernel reads a tensor from its data pointer by the size, dtype and layout it expects: a tensor one
    element short, of a narrower dtype or with gaps between its elements has it read past the storage (other
    heap contents flow into the results, or the process crashes). So every such tensor must be checked for
    exactly what the kernel will read. ``args`` is a known-good argument tuple (``fn(*args)`` must succeed: the
    check proves nothing otherwise) and ``tensors`` the paths of the tensors in it that reach native code
    (:data:`TensorPath`: ``(2, "absmax")`` is ``args[2]["absmax"]``). For each path, every variant of
    :func:`tensor_variants` (one element short and long, another dtype of the same and of another element size, not
    contiguous) replaces that tensor alone, and ``fn`` must raise
    :class:`~zerocopy_pickle.errors.UnsafeArgumentError`.

    A variant the function may legitimately accept (a dtype among several it supports) is a finding here all the
    same: pass only the paths whose size, dtype and layout are all fixed by the other arguments, or check such a
    tensor by hand.

    Example::

        check_native_tensor_arguments(rebuild_quant_state, (stats, {}), [(0, "absmax"), (0, "quant_map")],
                                      "myplugin:rebuild_quant_state")
    """
    fn(*args)  # the known-good arguments: must be accepted
    failures: list[str] = []
    count = 0
    for given in tensors:
        path = tuple(given)
        assert path and type(path[0]) is int, f"{where}: a path starts with an argument index, not {path!r}"
        original = _at(args, path)
        assert isinstance(original, torch.Tensor), f"{where}: {path!r} is a {type(original).__qualname__}, not a tensor"
        for label, variant in tensor_variants(original):
            count += 1
            try:
                fn(*_replace(tuple(args), path, variant))
            except UnsafeArgumentError:
                continue
            except Exception as e:  # the point: only this library's own refusal counts
                failures.append(f"{where} with {path!r} {label}: raised {type(e).__name__}: {str(e)[:160]}")
            else:
                failures.append(f"{where} with {path!r} {label} ({tuple(variant.shape)} {variant.dtype}): accepted")
    assert count, f"{where}: no tensor paths given"
    if failures:
        raise AssertionError(
            f"{len(failures)} of {count} near-miss tensors were not refused:\n  " + "\n  ".join(failures)
        )


class ReducerConformance:
    """What every reducer plugin must satisfy. Subclass it (with a ``Test`` prefix) and set the attributes."""

    plugin: str = ""
    """The plugin's entry-point name, which snapshots of its objects must record."""
    trusted_only: bool = False
    """True for plugins whose objects only a trusted load may build (their rebuild runs code: TorchScript). The
    restricted-load test then checks that a restricted load refuses them, and the other tests load trusted."""
    factory: str = ""
    """``"module:function"`` that returns the objects to dump (importable in a fresh interpreter too)."""
    fresh_imports: tuple[str, ...] = ()
    """Modules the fresh interpreter imports before it loads, as a program would (``("bitsandbytes",)``: a plugin
    whose restricted loads refuse to import its library on a header's say-so)."""

    def native_tensor_cases(self) -> list[NativeTensorCase]:
        """The safe globals that hand tensors to native code, each with known-good arguments and the paths of those
        tensors (:func:`check_native_tensor_arguments`). None by default: override it when a rebuild function's
        tensors reach a kernel that reads them by pointer."""
        return []

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
                    tensor[(0,) * tensor.dim()] = 12345.0  # any strides (a view(-1) needs contiguous ones)
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

    def test_native_tensors_are_checked_exactly(self) -> None:
        for fn, args, paths in self.native_tensor_cases():
            check_native_tensor_arguments(fn, args, paths, f"{fn.__module__}:{fn.__qualname__}")

    def test_fresh_interpreter_load(self, tmp_path: Path) -> None:
        path = tmp_path / "fresh.zcp"
        snapshot.dump(self.make_objects(), path)
        imports = "".join(f"import {name}\n" for name in self.fresh_imports)
        code = imports + textwrap.dedent(
            f"""
            import zerocopy_pickle as zp
            from zerocopy_pickle._registry.discovery import resolve_name
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
