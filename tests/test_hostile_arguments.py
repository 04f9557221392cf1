"""zerocopy_pickle.testing.check_hostile_arguments: it passes validating functions and catches each way a function
can mishandle what a hostile stream gives it."""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import safe_table
from zerocopy_pickle import validate
from zerocopy_pickle.plugin import default_registry
from zerocopy_pickle.rebuild import Placement, StorageBuilder
from zerocopy_pickle.testing import check_hostile_arguments, hostile_values

from .hostile_streams import as_snapshot


def checked(name: Any, shape: Any, values: Any = None) -> torch.Tensor:
    where = "checked"
    dtype = validate.dtype_from_name(name, where)
    dims = validate.expect_int_tuple(shape, where, "shape", hi=64)
    validate.expect_optional_tensor(values, where, "values")
    return torch.zeros(dims, dtype=dtype)


def no_arguments() -> list[int]:
    return []


def resolves_names(name: Any) -> Any:
    if type(name) is not str:
        validate.fail("resolves_names", "name must be str")
    return getattr(torch, name)  # the hole the bitsandbytes quirk had


def uses_isinstance(value: Any) -> Any:
    if not isinstance(value, int):
        validate.fail("uses_isinstance", "value must be int")
    return value + 1  # an int subclass gets through, and its __add__... of the attacker's choosing


def iterates(values: Any) -> int:
    return sum(1 for _ in values)


def calls(fn: Any) -> None:
    if type(fn) is str:
        validate.fail("calls", "fn must be callable")
    fn()


def compares_first(value: Any) -> None:
    if value == "float16":  # __eq__ of a hostile object runs before any check
        return
    validate.fail("compares_first", "no")


def returns_stdin(name: Any) -> Any:
    validate.expect_choice(name, ("stdin",), "returns_stdin", "name")
    return sys.stdin


def test_validating_functions_pass() -> None:
    check_hostile_arguments(checked, "checked")
    check_hostile_arguments(no_arguments, "no_arguments")


@pytest.mark.parametrize(
    ("fn", "finding"),
    [
        (resolves_names, "not a ZeroCopyPickleError|shared object"),
        (uses_isinstance, "not plain data|ran hostile methods"),
        (iterates, "not a ZeroCopyPickleError|ran hostile methods|not plain data"),
        (calls, "function called|ran hostile methods|not a ZeroCopyPickleError"),
        (compares_first, "ran hostile methods"),
        (returns_stdin, "shared object"),
    ],
)
def test_mishandled_arguments_are_reported(fn: Any, finding: str) -> None:
    with pytest.raises(AssertionError, match=finding):
        check_hostile_arguments(fn, fn.__name__)


def test_the_process_streams_are_restored_and_untouched() -> None:
    streams = sys.stdin, sys.stdout, sys.stderr
    with pytest.raises(AssertionError):
        check_hostile_arguments(returns_stdin, "returns_stdin")
    assert (sys.stdin, sys.stdout, sys.stderr) == streams


def test_the_values_cover_the_attacks_of_the_review() -> None:
    labels = [label for label, _ in hostile_values()]
    for needed in ("'system'", "'__class__'", "'torch.float16'", "'os.system'", "int 2**63", "generator"):
        assert any(needed.replace("2**63", str(2**63)) in label for label in labels), needed
    values = [value for _, value in hostile_values()]
    assert os.getcwd in values and sys.stdin in values
    assert any(type(v) is not torch.Tensor and isinstance(v, torch.Tensor) for v in values)  # a tensor subclass


def test_builtin_callables_without_a_signature_are_tried_at_every_arity() -> None:
    with pytest.raises(AssertionError, match="hostile calls were mishandled"):
        check_hostile_arguments(dict, "dict")  # dict(generator) iterates it, dict(x=...) ...


# -- the quirks' safe globals, called by hostile streams through restricted loads ----------------------------------


class Reduce:
    """Pickles as ``func(*args)``: a stream that calls ``func`` with arguments of its choosing."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def _quirk_safe_globals() -> list[tuple[str, Any, str]]:
    registry = default_registry()
    found = []
    for plugin in ("bitsandbytes", "runtime-objects", "torchscript", "stable-fast", "dynamic-modules", "parametrize"):
        info = registry.plugins().get(plugin)
        if info is None or info.state != "loaded":
            continue
        for module, name in registry.safe_globals(plugins=[plugin]):
            if module.startswith("zerocopy_pickle_quirks."):
                fn = registry.resolve_safe_global(module, name, plugins=[plugin])
                found.append((f"{module}:{name}", fn, plugin))
    return found


def _naming(plugin: str, obj: object) -> bytes:
    """A snapshot of ``obj`` (plain data and one call) whose header names ``plugin``, as the plugin's own
    snapshots do: only the plugins a header names contribute safe globals to a restricted load."""
    return as_snapshot(pickle.dumps(obj, protocol=5), plugins=[(plugin, "zerocopy-pickle")])


def test_a_plugin_safe_global_needs_its_plugin_in_the_header() -> None:
    """The same call is refused when the header does not name the plugin that declares the function."""
    _where, fn, plugin = _quirk_safe_globals()[0]
    with pytest.raises(zp.RestrictedLoadError, match="not on this load's allow-list"):
        zp.loads(as_snapshot(pickle.dumps(Reduce(fn), protocol=5)))
    with contextlib.suppress(zp.SnapshotError):  # arity or arguments: refused by the function itself
        zp.loads(_naming(plugin, Reduce(fn)))


def test_a_plugin_safe_global_named_in_allow_too_stays_callable() -> None:
    """allow= admits functions as values only; a plugin's declared safe global that allow= also names (as a
    scan of the snapshot would list it) is still the plugin's callable, checked function."""
    where, fn, plugin = _quirk_safe_globals()[0]
    data = _naming(plugin, Reduce(fn))
    with contextlib.suppress(zp.UnsafeArgumentError, zp.SnapshotError):  # its own checks may refuse no arguments
        zp.loads(data, allow=[where])  # never "admits as a value only"
    with pytest.raises(zp.RestrictedLoadError, match="as a value only"):
        zp.loads(as_snapshot(pickle.dumps(Reduce(fn), protocol=5)), allow=[where])  # header without the plugin


@pytest.mark.parametrize("pair", sorted(safe_table()), ids=lambda pair: f"{pair[0]}:{pair[1]}")
def test_builtin_safe_globals_refuse_hostile_arguments(pair: tuple[str, str]) -> None:
    """Every callable of the built-in safe set, called with hostile arguments (the conformance suite's checker)."""
    entry = safe_table()[pair]
    if entry.callable:
        check_hostile_arguments(entry.value, f"{pair[0]}:{pair[1]}", random_tuples=100)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "pair",
    [("torch._utils", "_rebuild_wrapper_subclass"), ("zerocopy_pickle.rebuild", "rebuild_memory_format")],
    ids=lambda pair: f"{pair[0]}:{pair[1]}",
)
def test_rebuilders_added_for_weights_only_parity_refuse_hostile_arguments(pair: tuple[str, str]) -> None:
    """Reachable since restricted loads accept wrapper subclasses and memory formats (as torch.load(weights_only=True)
    does); the parametrized test above covers them too, this names them so that losing one fails here."""
    entry = safe_table()[pair]
    assert entry.callable
    check_hostile_arguments(entry.value, f"{pair[0]}:{pair[1]}", random_tuples=300)  # type: ignore[arg-type]


def test_the_loads_storage_builder_refuses_hostile_arguments() -> None:
    """``zerocopy_pickle.rebuild:rebuild_storage`` is not in the safe table: a restricted load resolves it to its own
    StorageBuilder, which a stream calls with arguments of its choosing too."""
    check_hostile_arguments(StorageBuilder(None), "zerocopy_pickle.rebuild:rebuild_storage", random_tuples=100)


def test_the_storage_builder_with_a_load_s_placement_refuses_hostile_arguments() -> None:
    """The builder a load makes knows its buffers and their rows (rebuild.Placement): hostile arguments beside one of
    those buffers, and in its place, are refused the same way."""
    own = memoryview(bytearray(16))
    builder = StorageBuilder(None, Placement([own], ["cpu"]))
    check_hostile_arguments(builder, "zerocopy_pickle.rebuild:rebuild_storage", random_tuples=100)
    assert builder(own, "cpu") is builder(own, "cuda:3")  # one storage per buffer, placed by its row
    with pytest.raises(zp.UnsafeArgumentError, match="location must be a device string"):
        builder(own, 3)


@pytest.mark.parametrize("pair", sorted(pair for pair, entry in safe_table().items() if entry.callable))
def test_the_safe_set_refuses_hostile_arguments_inside_a_load_s_budget(pair: tuple[str, str]) -> None:
    """As a restricted load calls them: with a budget, so every charge runs (it is free outside a load), and a
    hostile value that the budget refuses is refused with this library's error too."""
    entry = safe_table()[pair]
    with validate.budget(0):
        check_hostile_arguments(entry.value, f"{pair[0]}:{pair[1]}", random_tuples=50)  # type: ignore[arg-type]


@pytest.mark.parametrize("pair", _quirk_safe_globals(), ids=lambda pair: pair[0] if isinstance(pair, tuple) else "")
def test_quirk_safe_globals_refuse_hostile_streams(pair: tuple[str, Any, str], tmp_path: Path) -> None:
    """Every safe global a quirk declares, called by a restricted load's stream with each plain hostile value (the
    attack strings, a sentinel path and a shell command naming it, huge ints, wrong types) at each position:
    the load raises a SnapshotError or returns an object, nothing else; no sentinel file appears; stdin is not
    read (it is a stand-in that records)."""
    where, fn, plugin = pair
    sentinel = tmp_path / "sentinel"
    plain = [value for _, value in hostile_values() if _stream_safe(value)]
    plain += [str(sentinel), f"touch {sentinel}", f"import os; os.system('touch {sentinel}')"]
    arities = [n for n in range(7) if _bindable(fn, n)]
    stdin = sys.stdin
    sys.stdin = _ReadRecorder()  # type: ignore[assignment]
    try:
        for n in arities:
            for position in range(n):
                for value in plain:
                    args = [None] * n
                    args[position] = value
                    with contextlib.suppress(zp.SnapshotError):  # or an object: genuine arguments
                        zp.loads(_naming(plugin, Reduce(fn, *args)))
            if n == 0:
                zp.loads(_naming(plugin, Reduce(fn)))
        assert not sentinel.exists(), where
        assert not sys.stdin.reads, where  # type: ignore[attr-defined]
    finally:
        sys.stdin = stdin


class _ReadRecorder:
    def __init__(self) -> None:
        self.reads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.reads.append(name)
        raise AttributeError(name)


def _stream_safe(value: Any) -> bool:
    """Plain data a stream can carry by opcodes alone (no global a restricted load would refuse first)."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return True
    if type(value) in (tuple, list):
        return all(_stream_safe(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _stream_safe(v) for k, v in value.items())
    return False


def _bindable(fn: Any, n: int) -> bool:
    try:
        inspect.signature(fn).bind(*([None] * n))
    except TypeError:
        return False
    return True
