"""The ``stable-fast`` quirk: modules sfast traces on CPU, with dataclass inputs and outputs, through snapshots."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from zerocopy_pickle_quirks import stable_fast

import zerocopy_pickle as zp
from zerocopy_pickle.testing import ReducerConformance

from .conftest import REPO, run_python

trace_helper = pytest.importorskip("sfast.jit.trace_helper", reason="stable-fast is not installed (make setup)")
flat_tensors = pytest.importorskip("sfast.utils.flat_tensors")


@dataclasses.dataclass
class Request:
    x: torch.Tensor
    bias: torch.Tensor


@dataclasses.dataclass
class Result:
    y: torch.Tensor
    total: torch.Tensor


class Model(torch.nn.Module):
    """Takes and returns a dataclass: sfast flattens both, and its flatten_dataclass carries their types."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, request: Request) -> Result:
        y = self.linear(request.x) + request.bias
        return Result(y=y, total=y.sum())


def request() -> Request:
    return Request(torch.linspace(-1, 1, 8).reshape(2, 4), torch.arange(3.0))


def trace(model: torch.nn.Module | None = None) -> Any:
    """What sfast's compilers do on CPU: trace_with_kwargs (check_trace off, as they call it), then wrap."""
    if model is None:
        torch.manual_seed(0)
        model = Model().eval()
    traced, call_helper = trace_helper.trace_with_kwargs(model, (request(),), check_trace=False, strict=False)
    return call_helper(traced)


def sample() -> dict[str, Any]:
    """A stable-fast traced module (its TracedPosArgOnlyModuleWrapper). Patches sfast first, as any process that
    traces modules to dump them must (the plugin does it at its registration, or on import of sfast after it)."""
    stable_fast.ensure_patched()
    return {"wrapper": trace()}


def assert_same_outputs(expected: Any, actual: Any) -> None:
    if isinstance(expected, dict):
        assert expected.keys() == actual.keys()
        for key in expected:
            assert_same_outputs(expected[key], actual[key])
        return
    assert type(actual) is trace_helper.TracedPosArgOnlyModuleWrapper
    want, got = expected(request()), actual(request())
    assert type(got) is Result  # the dataclass type survived
    assert torch.equal(want.y, got.y) and torch.equal(want.total, got.total)


class TestStableFastConformance(ReducerConformance):
    plugin = "stable-fast"
    factory = "tests.test_quirk_stable_fast:sample"

    def assert_same(self, expected: Any, actual: Any) -> None:
        assert_same_outputs(expected, actual)

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(REPO)}

    # The traced module goes through the torchscript quirk, whose archives need trusted loads (see
    # quirks/torchscript.py): a restricted load refuses, and the fresh interpreter loads with trusted=True.
    def test_restricted_load_needs_only_declared_safe_globals(self) -> None:
        with pytest.raises(zp.RestrictedLoadError, match="rebuild_script_module"):
            zp.loads(zp.dumps(self.make_objects()))

    @pytest.mark.slow
    def test_fresh_interpreter_load(self, tmp_path: Path) -> None:
        path = tmp_path / "fresh.zcp"
        zp.dump(self.make_objects(), path)
        code = f"""
            import sys
            import zerocopy_pickle as zp
            assert "sfast" not in sys.modules
            loaded = zp.load({str(path)!r}, trusted=True)
            from zerocopy_pickle_quirks import stable_fast
            assert stable_fast.is_patched()  # the load hook imported and patched sfast
            from tests.test_quirk_stable_fast import assert_same_outputs, sample
            assert_same_outputs(sample(), loaded)
            print("ok")
            """
        proc = run_python(code, env=self.env())
        assert proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.slow
def test_restricted_load_imports_and_patches_nothing(tmp_path: Path) -> None:
    """The load hook (import sfast, patch it) runs only in trusted loads: a restricted load of a snapshot whose
    header names stable-fast (any header may) refuses the TorchScript archive without importing sfast."""
    path = tmp_path / "restricted.zcp"
    zp.dump(sample(), path)
    code = f"""
        import sys
        import zerocopy_pickle as zp
        assert "stable-fast" in [p.name for p in zp.read_header({str(path)!r}).plugins]
        try:
            zp.load({str(path)!r})
        except zp.RestrictedLoadError as e:
            print(type(e).__name__)
        from zerocopy_pickle_quirks import stable_fast
        assert "sfast" not in sys.modules and not stable_fast.is_patched()
        print("ok")
        """
    assert run_python(code, env={"PYTHONPATH": str(REPO)}).stdout.split() == ["RestrictedLoadError", "ok"]


# -- when the patch applies ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_registration_imports_nothing_and_patches_sfast_on_import() -> None:
    code = """
        import inspect, sys
        import zerocopy_pickle as zp
        zp.dumps(1)  # discovers the plugins: registers the stable-fast quirk
        assert "sfast" not in sys.modules
        from zerocopy_pickle_quirks import stable_fast
        assert not stable_fast.is_patched()
        import sfast.jit.trace_helper
        assert stable_fast.is_patched()
        import sfast.utils.flat_tensors as ft
        assert "def flatten_obj" in inspect.getsource(ft.flatten_obj)  # the wrapped loader still serves sources
        assert not any(type(f).__name__ == "_PatchOnImport" for f in sys.meta_path)  # the hook removed itself
        print("ok")
        """
    assert run_python(code).stdout.strip() == "ok"


@pytest.mark.slow
def test_registration_patches_sfast_imported_before() -> None:
    code = """
        import sfast.jit.trace_helper
        import zerocopy_pickle as zp
        from zerocopy_pickle_quirks import stable_fast
        assert not stable_fast.is_patched()
        zp.dumps(1)
        assert stable_fast.is_patched()
        print("ok")
        """
    assert run_python(code).stdout.strip() == "ok"


# -- without the patch -------------------------------------------------------------------------------------------


@pytest.fixture
def unpatched_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """sfast's own better_trace while this test traces: it attaches its clear hooks as PyObject attributes."""
    stable_fast.ensure_patched()
    monkeypatch.setattr(trace_helper, "better_trace", trace_helper.better_trace.__wrapped__)


@pytest.fixture
def unpatched_flatten(monkeypatch: pytest.MonkeyPatch) -> None:
    """sfast's own flatten_dataclass / unflatten_dataclass: the type travels in an ObjectTensor."""
    stable_fast.ensure_patched()
    monkeypatch.setattr(flat_tensors, "flatten_dataclass", flat_tensors.flatten_dataclass.__wrapped__)
    monkeypatch.setattr(flat_tensors, "unflatten_dataclass", flat_tensors.unflatten_dataclass.__wrapped__)


@pytest.mark.usefixtures("unpatched_trace")
def test_unpatched_trace_cannot_be_saved() -> None:
    wrapper = trace()
    with pytest.raises(RuntimeError, match="PyObject"):
        torch.jit.save(wrapper.module, io.BytesIO())
    with pytest.raises(zp.DumpError) as refused:
        zp.dumps({"wrapper": wrapper})
    # The reducer's own explanation is the cause (the message itself names the deepest object that fails).
    assert "ensure_patched" in str(refused.value.__cause__)


@pytest.mark.usefixtures("unpatched_flatten")
def test_unpatched_flatten_loses_the_dataclass_type(monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = trace()
    assert type(wrapper(request())) is Result  # fine within this process: the ObjectTensor holds the class
    buffer = io.BytesIO()
    torch.jit.save(wrapper.module, buffer)
    loaded = trace_helper.TracedPosArgOnlyModuleWrapper(torch.jit.load(io.BytesIO(buffer.getvalue())))
    with pytest.raises((AssertionError, TypeError)):  # sfast's unflatten finds no class where it expects one
        loaded(request())
    monkeypatch.undo()  # the patch reads the same stream, and says what went wrong
    stable_fast.ensure_patched()
    with pytest.raises(TypeError, match="lost the type of a dataclass"):
        loaded(request())


def test_patched_flatten_survives_torch_jit_save() -> None:
    wrapper = sample()["wrapper"]
    buffer = io.BytesIO()
    torch.jit.save(wrapper.module, buffer)
    loaded = trace_helper.TracedPosArgOnlyModuleWrapper(torch.jit.load(io.BytesIO(buffer.getvalue())))
    assert_same_outputs(wrapper, loaded)


@pytest.mark.slow
def test_module_traced_with_unpatched_flatten_is_repaired_at_dump(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stable_fast.ensure_patched()
    with monkeypatch.context() as patch:
        patch.setattr(flat_tensors, "flatten_dataclass", flat_tensors.flatten_dataclass.__wrapped__)
        wrapper = trace()
    nodes = wrapper.module.graph.findAllNodes("prim::Constant")
    constants = [n.t("value") for n in nodes if n.hasAttribute("value") and n.kindOf("value") == "t"]
    assert any(isinstance(c, flat_tensors.ObjectTensor) for c in constants)
    path = tmp_path / "repaired.zcp"
    zp.dump({"wrapper": wrapper}, path)  # the reducer rewrites the ObjectTensor constant into the pickled type
    assert stable_fast.rewrite_class_constants(wrapper.module) == 0  # nothing left to rewrite
    assert type(wrapper(request())) is Result  # and the module still works here
    code = f"""
        import zerocopy_pickle as zp
        from tests.test_quirk_stable_fast import request, Result
        out = zp.load({str(path)!r}, trusted=True)["wrapper"](request())
        assert type(out) is Result, type(out)
        print("ok")
        """
    assert run_python(code, env={"PYTHONPATH": str(REPO)}).stdout.strip() == "ok"


def test_local_dataclass_is_refused_at_dump() -> None:
    @dataclasses.dataclass
    class Local:
        y: torch.Tensor

    class Returns(torch.nn.Module):
        def forward(self, request: Request) -> Local:
            return Local(request.x * 2)

    stable_fast.ensure_patched()
    wrapper = trace(Returns())
    assert type(wrapper(request())) is Local  # sfast's ObjectTensor fallback works within the process
    with pytest.raises(zp.DumpError) as refused:
        zp.dumps({"wrapper": wrapper})
    assert "define it at module level" in str(refused.value.__cause__)


# -- the type, as bytes ------------------------------------------------------------------------------------------


def test_class_bytes_are_a_plain_reference() -> None:
    data = stable_fast.class_to_bytes(Result)
    assert stable_fast.class_from_bytes(data) is Result
    assert b"Result" in data and len(data) < 100


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(os.system),  # a reference, but not to a dataclass
        pickle.dumps(Result(torch.zeros(1), torch.zeros(1))),  # an instance: REDUCE / BUILD opcodes
        pickle.dumps((Result, Result)),  # two references
        b"\x80\x04not a pickle",
        b"",
    ],
)
def test_class_from_bytes_refuses_anything_else(payload: bytes) -> None:
    with pytest.raises(pickle.UnpicklingError):
        stable_fast.class_from_bytes(payload)


def test_plugin_declares_no_safe_globals_and_claims_sfast() -> None:
    info = zp.default_registry().plugins()["stable-fast"]
    assert info.state == "loaded" and info.safe_globals == () and info.modules == ("sfast",)
    assert info.load_hook is stable_fast.load_hook


def test_frozen_module_round_trip() -> None:
    import sfast.jit.utils as jit_utils

    wrapper = sample()["wrapper"]
    frozen = trace_helper.TracedPosArgOnlyModuleWrapper(jit_utils.better_freeze(wrapper.module))
    loaded = zp.loads(zp.dumps({"wrapper": frozen}), trusted=True)
    assert_same_outputs({"wrapper": wrapper}, loaded)
