"""A conformance suite for reducer plugins, to subclass in a plugin's own tests (like fsspec's abstract suites).

Usage, in a test module of the plugin's project::

    from zerocopy_pickle.testing import ReducerConformance

    class TestMyPluginConformance(ReducerConformance):
        plugin = "myplugin"                       # the entry-point name
        factory = "myplugin.testing:sample"       # "module:function" returning the objects to dump

pytest collects the ``test_*`` methods: a round trip, repeated independent loads, a restricted load that
needs nothing beyond the plugin's declared safe globals, and a load in a fresh interpreter that never built the
objects. Override :meth:`assert_same` to compare objects your way, and :meth:`env` to give the fresh
interpreter what it needs (a ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import torch

from . import snapshot
from .errors import RestrictedLoadError
from .registry import default_registry, resolve_name

__all__ = ["ReducerConformance", "assert_same"]


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

    def test_fresh_interpreter_load(self, tmp_path: Path) -> None:
        path = tmp_path / "fresh.zcp"
        snapshot.dump(self.make_objects(), path)
        code = textwrap.dedent(
            f"""
            import zerocopy_pickle as zp
            from zerocopy_pickle.registry import resolve_name
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
