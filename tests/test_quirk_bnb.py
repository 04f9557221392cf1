"""The bitsandbytes quirk (quirks/bnb.py) on real objects quantized on the CPU: Params4bit (nf4, fp4, with and
without nested statistics, before and after the CPU-packing first forward), Int8Params, Linear4bit, Linear8bitLt,
accelerate hooks, and a tiny transformers GPT-2 quantized to 4 and 8 bits. Nothing is downloaded.

``sample`` is the conformance suite's factory (``tests.test_quirk_bnb:sample``): importable from the repository
root in a fresh interpreter, and deterministic, so that the objects it builds there equal the ones dumped here.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle.testing import NativeTensorCase, ReducerConformance, check_native_tensor_arguments

from .conftest import REPO, region_of, run_python
from .hostile_streams import naming

pytest.importorskip("bitsandbytes")

from bitsandbytes.nn import Int8Params, Linear4bit, Linear8bitLt, LinearNF4, Params4bit

IN, OUT = 64, 32  # OUT is a multiple of 32 and IN of the blocksize: the CPU-packed layout applies
VARIANTS = [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]

# bitsandbytes logs this on every int8 matmul on the CPU.
pytestmark = pytest.mark.filterwarnings("ignore:MatMul8bitLt")


class MyLinear4bit(Linear4bit):
    """A user subclass: it travels as a class object, which restricted loads accept only through allow=."""


def inputs(rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, IN, generator=torch.Generator().manual_seed(1))


def linear4bit(quant_type: str, nested: bool, *, seed: int = 0, cls: type[Linear4bit] = Linear4bit) -> Linear4bit:
    """A Linear4bit quantized on the CPU (``.to("cpu")`` quantizes a Params4bit that is not yet quantized)."""
    torch.manual_seed(seed)
    if cls is LinearNF4:
        layer = LinearNF4(IN, OUT, compute_dtype=torch.float32, compress_statistics=nested)
    else:
        layer = cls(IN, OUT, compute_dtype=torch.float32, quant_type=quant_type, compress_statistics=nested)
    return layer.to("cpu").eval()


def linear8bit(*, seed: int = 0) -> Linear8bitLt:
    torch.manual_seed(seed)
    layer = Linear8bitLt(IN, OUT, has_fp16_weights=False).to("cpu").eval()
    # Hook handles are numbered by a process-wide counter: renumber the load-state-dict pre-hook so that the layer
    # built by sample() in a fresh interpreter has the same keys as the one built here.
    layer._load_state_dict_pre_hooks = OrderedDict(enumerate(layer._load_state_dict_pre_hooks.values()))
    return layer


def run(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer(x)  # type: ignore[no-any-return]


def sample() -> dict[str, Any]:
    """The conformance suite's objects. Only objects the generic ``assert_same`` can compare: no layer that ran
    forward (a CPU-packed nested QuantState has no ``state2`` and its ``__eq__`` raises; MatmulLtState's dataclass
    ``__eq__`` compares tensors with ``==``) and no unquantized parameter (``.cpu()`` quantizes those in place);
    layers frozen, as for inference."""
    objects: dict[str, Any] = {
        f"linear4bit-{qt}{'-nested' if nested else ''}": linear4bit(qt, nested, seed=i)
        for i, (qt, nested) in enumerate(VARIANTS)
    }
    objects["linear-nf4"] = linear4bit("nf4", True, seed=4, cls=LinearNF4)
    objects["linear8bit"] = linear8bit(seed=5)
    torch.manual_seed(6)
    objects["params4bit"] = Params4bit(torch.randn(OUT, IN), quant_type="fp4", compress_statistics=True).to("cpu")
    objects["int8params"] = Int8Params(torch.randn(OUT, IN).half(), requires_grad=False).to("cpu")
    objects["quant_state"] = objects["linear4bit-nf4"].weight.quant_state
    for value in objects.values():
        if isinstance(value, torch.nn.Module):
            # Frozen biases: the suite writes into loaded float tensors outside torch.no_grad(), which autograd
            # refuses for a leaf that requires grad.
            value.requires_grad_(False)
    return objects


class TestBitsandbytesConformance(ReducerConformance):
    plugin = "bitsandbytes"
    factory = "tests.test_quirk_bnb:sample"
    fresh_imports = ("bitsandbytes",)  # a restricted load never imports it on a header's say-so

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

    def native_tensor_cases(self) -> list[NativeTensorCase]:
        """Every tensor the quirk's rebuilds hand to bitsandbytes' kernels, from real quantized objects: each one
        element short or long, of another dtype, or not contiguous, must be refused."""
        from zerocopy_pickle_quirks import bnb

        cases: list[NativeTensorCase] = []
        for nested in (False, True):
            weight = linear4bit("nf4", nested).weight
            stats, layout = bnb._quant_state_record(weight.quant_state)
            stats = {k: torch.Tensor.clone(v) for k, v in stats.items()}
            paths = [(0, "absmax"), (0, "quant_map")] + ([(0, "nested_absmax"), (0, "nested_quant_map")] * nested)
            cases.append((bnb.rebuild_quant_state, (stats, layout), paths))
            data = torch.Tensor.clone(weight.data)
            attrs = {"quant_storage": torch.uint8}  # the data's dtype is then fixed by the arguments
            args = ("Params4bit", data, stats, layout, attrs, False)
            cases.append((bnb.rebuild_params4bit, args, [(1,), *((2, *p[1:]) for p in paths)]))
        int8 = Int8Params(torch.randn(OUT, IN).half(), requires_grad=False).to("cpu")
        data, CB, SCB = (torch.Tensor.clone(t) for t in (int8.data, int8.CB, int8.SCB))
        cases.append((bnb.rebuild_int8params, ("Int8Params", CB, False, False, CB, SCB), [(1,), (4,), (5,)]))
        fields = {"CB": CB, "SCB": SCB, "has_fp16_weights": False, "threshold": 0.0}
        cases.append((bnb.rebuild_matmul_lt_state, (fields,), [(0, "CB"), (0, "SCB")]))
        return cases


# -- helpers -----------------------------------------------------------------------------------------------------


def assert_fields_equal(expected: Any, actual: Any, where: str = "") -> None:
    """Exact equality of QuantState / parameter attributes (tensors bit for bit, dtype included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert expected.dtype == actual.dtype and expected.shape == actual.shape, where
        assert torch.equal(torch.Tensor.cpu(expected), torch.Tensor.cpu(actual)), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and expected.keys() == actual.keys(), f"{where}: {expected.keys()} {actual}"
        for name, value in expected.items():
            assert_fields_equal(value, actual[name], f"{where}[{name!r}]")
    elif type(expected).__name__ == "QuantState":
        assert type(actual).__name__ == "QuantState", where
        assert vars(expected).keys() == vars(actual).keys(), f"{where}: {vars(expected).keys()} {vars(actual).keys()}"
        for name, value in vars(expected).items():
            assert_fields_equal(value, vars(actual)[name], f"{where}.{name}")
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


def param_fields(param: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(param).items() if k != "module"}


def fingerprint(layer: torch.nn.Module) -> list[Any]:
    """What the dump must leave untouched: the identity of every attribute of the layer, its weight and its
    quantization state, and the bytes of the weight."""
    weight = layer.weight
    found: list[Any] = [{k: id(v) for k, v in vars(layer).items()}, {k: id(v) for k, v in vars(weight).items()}]
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is not None:
        found.append({k: id(v) for k, v in vars(quant_state).items()})
    found.append(torch.Tensor.clone(weight.data))
    return found


def assert_unchanged(before: list[Any], layer: torch.nn.Module) -> None:
    after = fingerprint(layer)
    assert before[:-1] == after[:-1], "dumping changed the layer's attributes"
    assert torch.equal(before[-1], after[-1]), "dumping changed the layer's weight"


def assert_in_snapshot(tensor: torch.Tensor, path: Path) -> None:
    """The tensor's memory lies inside this process's mapping of the snapshot file: zero-copy."""
    region = region_of(tensor.untyped_storage().data_ptr())
    assert region is not None and region[2] == os.path.realpath(path), f"not in the snapshot's mapping: {region}"


# -- 4-bit -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ran_forward", [False, True], ids=["fresh", "cpu-packed"])
@pytest.mark.parametrize(("quant_type", "nested"), VARIANTS, ids=[f"{q}-nested{n}" for q, n in VARIANTS])
def test_linear4bit_round_trip(tmp_path: Path, quant_type: str, nested: bool, ran_forward: bool) -> None:
    layer = linear4bit(quant_type, nested)
    x = inputs()
    if ran_forward:
        run(layer, x)  # packs the weight into the CPU layout where AVX512-BF16 is available
        if layer.support_avx512bf16_for_cpu:
            assert layer.weight.quant_state.packing_format_for_cpu
    before = fingerprint(layer)
    path = tmp_path / "linear4bit.zcp"
    zp.dump(layer, path)
    assert_unchanged(before, layer)
    assert [p.name for p in zp.read_header(path).plugins] == ["bitsandbytes"]

    loaded = zp.load(path)  # restricted: the quirk's safe globals suffice
    assert type(loaded) is Linear4bit and type(loaded.weight) is Params4bit
    assert loaded.weight.module is loaded
    assert loaded.quant_state is loaded.weight.quant_state
    assert_fields_equal(param_fields(layer.weight), param_fields(loaded.weight))
    assert_in_snapshot(loaded.weight, path)
    assert_in_snapshot(loaded.weight.quant_state.absmax, path)
    assert torch.equal(run(layer, x), run(loaded, x))
    assert torch.equal(run(layer, x), run(loaded, x))  # and again, after both packed (if they had not)
    assert_fields_equal(param_fields(layer.weight), param_fields(loaded.weight))


def test_params4bit_alone_and_quant_state_alone(tmp_path: Path) -> None:
    layer = linear4bit("nf4", True)
    run(layer, inputs())
    weight = Params4bit(torch.randn(OUT, IN), quant_type="nf4", compress_statistics=True).to("cpu")
    weight._is_hf_initialized = True  # what transformers adds: carried as an instance attribute
    path = tmp_path / "params.zcp"
    zp.dump({"weight": weight, "state": weight.quant_state, "packed": layer.weight.quant_state}, path)
    loaded = zp.load(path)
    assert loaded["weight"].module is None and loaded["weight"]._is_hf_initialized is True
    assert_fields_equal(param_fields(weight), param_fields(loaded["weight"]))
    assert_fields_equal(weight.quant_state, loaded["state"])
    assert_fields_equal(layer.weight.quant_state, loaded["packed"])  # CPU layout attributes, no state2
    assert_in_snapshot(loaded["weight"], path)

    # A Params4bit brings its layer along (Params4bit.module), and the cycle closes on the same objects.
    param = zp.loads(zp.dumps(layer.weight))
    assert param.module.weight is param and param.module.quant_state is param.quant_state


def test_unquantized_linear4bit_quantizes_the_same_after_load() -> None:
    torch.manual_seed(0)
    layer = Linear4bit(IN, OUT, compute_dtype=torch.float32, quant_type="nf4").eval()
    assert not layer.weight.bnb_quantized
    loaded = zp.loads(zp.dumps(layer))
    assert not loaded.weight.bnb_quantized and loaded.weight.module is loaded and loaded.quant_state is None
    assert torch.equal(torch.Tensor.cpu(layer.weight), torch.Tensor.cpu(loaded.weight))
    layer, loaded = layer.to("cpu"), loaded.to("cpu")
    assert torch.equal(run(layer, inputs()), run(loaded, inputs()))


def test_user_subclass_needs_allow() -> None:
    layer = linear4bit("fp4", False, cls=MyLinear4bit)
    data = zp.dumps(layer)
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.loads(data)
    assert refused.value.needed == (("tests.test_quirk_bnb", "MyLinear4bit"),)
    loaded = zp.loads(data, allow=[MyLinear4bit])
    assert type(loaded) is MyLinear4bit and loaded.quant_state is loaded.weight.quant_state
    assert torch.equal(run(layer, inputs()), run(loaded, inputs()))


# -- 8-bit -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ran_forward", [False, True], ids=["fresh", "after-forward"])
def test_linear8bit_round_trip(tmp_path: Path, ran_forward: bool) -> None:
    layer = linear8bit()
    x = inputs()
    if ran_forward:
        run(layer, x)  # moves CB and SCB from the weight into layer.state
        assert layer.weight.SCB is None and layer.state.SCB is not None
    else:
        assert layer.weight.SCB is not None
    before = fingerprint(layer)
    path = tmp_path / "linear8bit.zcp"
    zp.dump(layer, path)
    assert_unchanged(before, layer)

    loaded = zp.load(path)
    assert type(loaded) is Linear8bitLt and type(loaded.weight) is Int8Params
    for name in ("CB", "SCB", "has_fp16_weights"):
        assert_fields_equal(getattr(layer.weight, name), getattr(loaded.weight, name), name)
    for name in ("CB", "SCB", "threshold", "has_fp16_weights"):
        assert_fields_equal(getattr(layer.state, name), getattr(loaded.state, name), f"state.{name}")
    assert_in_snapshot(loaded.weight, path)
    int8_rows = loaded.state.CB if ran_forward else loaded.weight.CB
    assert int8_rows.untyped_storage().data_ptr() == loaded.weight.untyped_storage().data_ptr()  # still shared
    # the load-state-dict pre-hook is bitsandbytes' own again, under its original key
    hooks = loaded._load_state_dict_pre_hooks
    assert list(hooks) == list(layer._load_state_dict_pre_hooks)
    assert [hook.hook.__name__ for hook in hooks.values()] == ["maybe_rearrange_weight"]
    assert torch.equal(run(layer, x), run(loaded, x))
    assert torch.equal(run(layer, x), run(loaded, x))


# -- loads are independent, and work in another process ----------------------------------------------------------


def test_repeated_loads_are_independent(tmp_path: Path) -> None:
    layers = {"4bit": linear4bit("nf4", True), "8bit": linear8bit()}
    x = inputs()
    expected = {name: run(layer, x) for name, layer in layers.items()}
    path = tmp_path / "layers.zcp"
    zp.dump(layers, path)
    first, second = zp.load(path), zp.load(path)
    assert first["4bit"].weight.data_ptr() != second["4bit"].weight.data_ptr()
    with torch.no_grad():
        first["4bit"].weight.data.add_(1)
        first["4bit"].weight.quant_state.absmax.add_(1)
        first["8bit"].weight.data.add_(1)  # the forward above moved CB and SCB into the layer's state
        first["8bit"].state.SCB.mul_(2)
    assert not torch.equal(run(first["4bit"], x), expected["4bit"])
    for name in layers:
        assert torch.equal(run(second[name], x), expected[name]), name
        assert torch.equal(run(zp.load(path)[name], x), expected[name]), name


CHILD = """
import os, sys, torch
import zerocopy_pickle as zp
from zerocopy_pickle.plugin import default_registry
from tests.conftest import region_of

registry = default_registry()
registry.ensure_discovered()
assert registry.plugins()["bitsandbytes"].state == "loaded", registry.plugins()["bitsandbytes"]
assert "bitsandbytes.nn.modules:Params4bit" in zp.reducers()
assert "bitsandbytes" not in sys.modules and "accelerate" not in sys.modules  # registering imported neither

import bitsandbytes  # a restricted load never imports it because a header names it: the program does

snapshot = zp.load(sys.argv[1])  # restricted
for name, layer in snapshot["layers"].items():
    region = region_of(layer.weight.untyped_storage().data_ptr())
    assert region is not None and region[2] == os.path.realpath(sys.argv[1]), (name, region)
with torch.no_grad():
    outputs = {name: layer(snapshot["x"]) for name, layer in snapshot["layers"].items()}
zp.dump(outputs, sys.argv[2])
print("ok")
"""


@pytest.mark.slow
def test_load_in_a_fresh_interpreter(tmp_path: Path) -> None:
    layers: dict[str, torch.nn.Module] = {
        f"{qt}-nested{nested}": linear4bit(qt, nested, seed=i) for i, (qt, nested) in enumerate(VARIANTS)
    }
    layers["8bit"] = linear8bit()
    x = inputs()
    run(layers["nf4-nestedTrue"], x)  # one CPU-packed layer, one packed by the child's first forward
    expected = {name: run(layer, x) for name, layer in layers.items()}
    path, out = tmp_path / "layers.zcp", tmp_path / "outputs.zcp"
    zp.dump({"layers": layers, "x": x}, path)
    proc = run_python(CHILD, str(path), str(out), env={"PYTHONPATH": str(REPO)})
    assert proc.stdout.strip() == "ok", proc.stderr
    outputs = zp.load(out)
    for name, value in expected.items():
        assert torch.equal(outputs[name], value), name


# -- accelerate --------------------------------------------------------------------------------------------------


def test_accelerate_dispatched_layer(tmp_path: Path) -> None:
    """dispatch_model puts an AlignDevicesHook, a hooked forward and a ``to`` warning wrapper on the instance (and,
    before accelerate 1.16 or where an accelerator is present, one for the accelerator's method: ``cuda``). The
    snapshot leaves them out (the dumped layer keeps them), and the load attaches an equivalent hook."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.hooks import AlignDevicesHook

    layer = linear4bit("nf4", True)
    x = inputs()
    expected = run(layer, x)
    accelerate.dispatch_model(layer, device_map={"": "cpu"}, force_hooks=True)
    assert {"_hf_hook", "_old_forward", "forward", "to"} <= vars(layer).keys()
    before = fingerprint(layer)
    path = tmp_path / "dispatched.zcp"
    zp.dump(layer, path)
    assert_unchanged(before, layer)
    assert "accelerate.hooks" not in {module for module, _ in zp.scan(path)}

    loaded = zp.load(path)  # restricted: no accelerate class in the stream
    hook, original = loaded._hf_hook, layer._hf_hook
    assert type(hook) is AlignDevicesHook and not hook.offload
    for name in ("execution_device", "io_same_device", "offload_buffers", "place_submodules", "skip_keys"):
        assert getattr(hook, name) == getattr(original, name), name
    assert loaded._old_forward.__func__ is Linear4bit.forward
    assert "to" not in vars(loaded) and "cuda" not in vars(loaded)  # warning wrappers: not re-created
    assert loaded.to("cpu") is loaded
    assert_in_snapshot(loaded.weight, path)  # attaching the hook moved nothing
    assert torch.equal(run(loaded, x), expected)
    assert torch.equal(run(layer, x), expected)


def test_accelerate_hooks_removed_and_unsupported() -> None:
    pytest.importorskip("accelerate")
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    layer = linear4bit("fp4", False)
    add_hook_to_module(layer, ModelHook())
    with pytest.raises(zp.DumpError, match="remove_hook_from_module"):
        zp.dumps(layer, backend="pickle")
    remove_hook_from_module(layer, recurse=True)
    assert "forward" in vars(layer)  # accelerate leaves the bound class method behind
    loaded = zp.loads(zp.dumps(layer))
    assert "forward" not in vars(loaded) and "_hf_hook" not in vars(loaded)
    assert torch.equal(run(layer, inputs()), run(loaded, inputs()))


def test_reattached_hook_follows_weights_moved_by_map_location() -> None:
    """A hook that executed where the weights were follows them when map_location moved them (checked at the
    helper: moving a layer off a GPU needs one)."""
    from zerocopy_pickle_quirks.bnb import _attach_hooks

    spec = {"io_same_device": True, "offload_buffers": False, "place_submodules": True, "skip_keys": None}
    for dumped_on, execution_device, expected in [
        ("cuda:0", "cuda:0", torch.device("cpu")),
        ("cuda:0", 0, torch.device("cpu")),
        ("cuda:0", "cpu", "cpu"),  # executed elsewhere than its weights were: kept as it was
        ("cpu", "cpu", "cpu"),
    ]:
        layer = linear4bit("nf4", False)
        _attach_hooks(layer, {"hooks": [{**spec, "execution_device": execution_device}], "device": dumped_on})
        assert layer._hf_hook.execution_device == expected, (dumped_on, execution_device)


def test_rebuild_functions_refuse_what_they_do_not_build() -> None:
    """The safe globals may be called by a stream with any arguments: they build only bitsandbytes objects."""
    from zerocopy_pickle_quirks import bnb

    weight = linear4bit("nf4", False).weight
    with pytest.raises(zp.UnsafeArgumentError):
        bnb.rebuild_bnb_module("Linear")
    with pytest.raises(zp.UnsafeArgumentError):
        bnb.rebuild_bnb_module(torch.nn.Linear)
    with pytest.raises(zp.UnsafeArgumentError):
        bnb.rebuild_params4bit(torch.nn.Parameter, torch.zeros(2), None, {}, {}, False)
    with pytest.raises(zp.UnsafeArgumentError):
        bnb.rebuild_int8params(Params4bit, torch.zeros(2), False, False, None, None)
    with pytest.raises(zp.UnsafeArgumentError):
        bnb.set_param_state(weight, (None, {"data": torch.zeros(2)}))  # would replace the tensor's data
    with pytest.raises(zp.UnsafeArgumentError):
        bnb.set_param_state(torch.zeros(2), (None, {}))
    with pytest.raises(zp.UnsafeArgumentError):
        bnb.set_bnb_module_state(torch.nn.Linear(2, 2), ({}, False, [], None))
    assert type(bnb.rebuild_bnb_module("Linear8bitLt")) is Linear8bitLt


# -- transformers ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32)
    path = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("bits", ["4bit-nf4-double", "4bit-fp4", "8bit"])
def test_transformers_quantized_model(tmp_path: Path, gpt2_checkpoint: Path, bits: str) -> None:
    from transformers import BitsAndBytesConfig, GPT2LMHeadModel

    if bits == "8bit":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4" if "nf4" in bits else "fp4",
            bnb_4bit_use_double_quant="double" in bits,
            bnb_4bit_compute_dtype=torch.float32,
        )
    # transformers 5 quantizes on the CPU when the device map says so.
    model = GPT2LMHeadModel.from_pretrained(gpt2_checkpoint, quantization_config=config, device_map="cpu").eval()
    quantized = [m for m in model.modules() if isinstance(m, (Linear4bit, Linear8bitLt))]
    assert len(quantized) == 8
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(2))

    def logits(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return m(tokens).logits  # type: ignore[no-any-return]

    for ran_forward in (False, True):
        if ran_forward:
            logits(model)  # 4-bit layers are CPU-packed from here on
        path = tmp_path / f"model-{ran_forward}.zcp"
        zp.dump(model, path)
        # The stream needs transformers' and torch's module classes, which are not this quirk's to declare, and
        # nothing of bitsandbytes beyond what the quirk declares.
        with pytest.raises(zp.RestrictedLoadError) as refused:
            zp.load(path)
        needed = refused.value.needed
        assert not [g for g in needed if g[0].startswith(("bitsandbytes", "zerocopy_pickle"))], needed
        loaded = zp.load(path, allow=needed)
        weights = [m.weight for m in loaded.modules() if isinstance(m, (Linear4bit, Linear8bitLt))]
        assert len(weights) == 8
        for weight in weights:
            assert_in_snapshot(weight, path)
        assert torch.equal(logits(loaded), logits(model))
        assert torch.equal(logits(loaded), logits(model))


class Reduce:
    """Pickles as ``func(*args)``: how a hostile stream calls a safe global with arguments of its choosing."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def _blob(fields: dict[str, Any]) -> torch.Tensor:
    import json

    return torch.tensor(list(json.dumps(fields).encode()), dtype=torch.uint8)


def _stats(**plain: Any) -> dict[str, Any]:
    fields = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [8, 8], **plain}
    return {
        "absmax": torch.ones(1),
        "quant_map": torch.zeros(16),
        "quant_state.bitsandbytes__nf4": _blob(fields),
    }


def _packed_stats(shape: list[int] | None = None, absmax: torch.Tensor | None = None) -> dict[str, Any]:
    """The statistics of a (32, 64) weight in bitsandbytes' CPU layout (blocksize 64): absmax (1, 32) bfloat16."""
    stats = _stats(shape=shape or [32, 64], dtype="bfloat16")
    stats["absmax"] = torch.ones(1, 32, dtype=torch.bfloat16) if absmax is None else absmax
    return stats


def test_rebuild_quant_state_never_resolves_stream_names() -> None:
    """QuantState.from_dict does getattr(torch, <dtype string>): the quirk builds the QuantState itself, dtype by
    name from a fixed table, every field checked (the hostile values of the attacker's review)."""
    from zerocopy_pickle_quirks import bnb

    genuine = bnb.rebuild_quant_state(_stats(), {})
    assert genuine.dtype is torch.float32 and genuine.shape == (8, 8) and not genuine.nested
    packed = bnb.rebuild_quant_state(_packed_stats(), {"packing_format_for_cpu": True})
    assert packed.packing_format_for_cpu and packed.absmax.shape == (1, 32)
    hostile: list[tuple[Any, Any]] = [
        (_stats(dtype="__class__"), {}),
        (_stats(dtype="system"), {}),
        (_stats(dtype="os.system"), {}),
        (_stats(shape=[2**40, 2**40]), {}),  # more elements than absmax's blocks cover
        (_stats(shape=[-1]), {}),
        (_stats(blocksize=2**63), {}),
        (_stats(quant_type="int8"), {}),
        (_stats(extra=1), {}),
        ({**_stats(), "absmax": torch.nn.Parameter(torch.ones(1))}, {}),  # a subclass: exact tensors only
        ({**_stats(), "quant_state.bitsandbytes__nf4": torch.zeros(100_000, dtype=torch.uint8)}, {}),
        ({**_stats(), "quant_state.bitsandbytes__nf4": torch.tensor(list(b"[1, 2"), dtype=torch.uint8)}, {}),
        ({**_stats(), "nested_absmax": torch.ones(1)}, {}),  # incomplete nested statistics
        ({**_stats(), "dtype": "float16"}, {}),  # both a packed blob and plain entries
        (_stats(), {"original_dtype": "float16"}),
        (_stats(), {"original_qshape": (2**63,)}),
        (_stats(), {"unknown": True}),
        ([("absmax", torch.ones(1))], {}),
        ({**_stats(), "absmax": torch.ones(4)[::2]}, {}),  # not contiguous: the kernels read it as a dense array
        ({**_stats(), "absmax": torch.ones(1).expand(4)}, {}),  # stride 0: four blocks "covered" by one float
        # The CPU layout (bitsandbytes on AVX512-BF16 CPUs): absmax (K // blocksize, N) bfloat16, nothing nested.
        (_stats(shape=[32, 64]), {"packing_format_for_cpu": True}),  # 1-D absmax
        (_packed_stats(absmax=torch.ones(2, 16, dtype=torch.bfloat16)), {"packing_format_for_cpu": True}),
        (_packed_stats(absmax=torch.ones(1, 32)), {"packing_format_for_cpu": True}),  # float32
        (_packed_stats(shape=[32, 48]), {"packing_format_for_cpu": True}),  # K not a multiple of the blocksize
        (_packed_stats(shape=[2, 32, 64]), {"packing_format_for_cpu": True}),
        (
            {**_packed_stats(), "nested_absmax": torch.ones(1), "nested_quant_map": torch.zeros(256)},
            {"packing_format_for_cpu": True},
        ),
    ]
    for stats, layout in hostile:
        with pytest.raises(zp.UnsafeArgumentError):
            bnb.rebuild_quant_state(stats, layout)
        with pytest.raises(zp.SnapshotError):  # and through a restricted load of a stream that calls it so
            zp.loads(naming(zp.dumps(Reduce(bnb.rebuild_quant_state, stats, layout)), "bitsandbytes"))


def test_hostile_streams_calling_the_rebuilds_are_refused(tmp_path: Path) -> None:
    from zerocopy_pickle_quirks import bnb

    data = torch.zeros(32, dtype=torch.uint8)
    packed = {"packing_format_for_cpu": True}
    direct: list[tuple[Any, ...]] = [
        # 64 bytes for 64 4-bit values, but a stride-0 view of one row: the kernels would read past its storage.
        ("Params4bit", torch.zeros(32, dtype=torch.uint8)[None].expand(2, 32), _stats(), {}, {}, False),
        ("Params4bit", torch.zeros(16, 64, dtype=torch.uint8), _packed_stats(), packed, {}, False),  # not (32, 32)
        ("Params4bit", torch.zeros(32 * 32, dtype=torch.uint8), _packed_stats(), packed, {}, False),
    ]
    for args in direct:
        with pytest.raises(zp.UnsafeArgumentError):
            bnb.rebuild_params4bit(*args)
    assert bnb.rebuild_params4bit("Params4bit", torch.zeros(32, 32, dtype=torch.uint8), _packed_stats(), packed, {},
                                  False).quant_state.packing_format_for_cpu  # fmt: skip
    calls: list[Any] = [
        (bnb.rebuild_params4bit, "Parameter", data, None, {}, {}, False),
        (bnb.rebuild_params4bit, "Params4bit", data, _stats(shape=[64, 64]), {}, {}, False),  # > 2 values a byte
        (bnb.rebuild_params4bit, "Params4bit", data, None, {}, {"quant_storage": "uint8"}, False),
        (bnb.rebuild_params4bit, "Params4bit", data, None, {}, {}, 1),
        (bnb.rebuild_int8params, "Int8Params", data, False, False, torch.nn.Parameter(torch.zeros(2)), None),
        (bnb.rebuild_matmul_lt_state, {"threshold": float("nan")}),
        (bnb.rebuild_matmul_lt_state, {"outlier_pool": None}),
        (bnb.rebuild_bnb_module, "Module"),
    ]
    for fn, *args in calls:
        with pytest.raises(zp.SnapshotError):
            zp.loads(naming(zp.dumps(Reduce(fn, *args)), "bitsandbytes"))
    # A class the caller allowed is still checked against the family the rebuild builds.
    hostile = naming(zp.dumps(Reduce(bnb.rebuild_bnb_module, torch.nn.Linear)), "bitsandbytes")
    with pytest.raises(zp.SnapshotError, match="not a subclass"):
        zp.loads(hostile, allow=[torch.nn.Linear])
    layer = Reduce(bnb.rebuild_bnb_module, "Linear4bit")
    shadowing = naming(
        zp.dumps(Reduce(bnb.set_bnb_module_state, layer, ({"forward": None}, False, [], None))), "bitsandbytes"
    )
    with pytest.raises(zp.SnapshotError, match="shadow"):
        zp.loads(shadowing)


def test_declares_only_validating_functions() -> None:
    """No class (a constructor allocates what it is told, NEWOBJ/BUILD would set anything) among the safe globals."""
    import types

    registry = zp.default_registry()
    pairs = registry.safe_globals(plugins=["bitsandbytes"])
    assert pairs and all(module == "zerocopy_pickle_quirks.bnb" for module, _ in pairs)
    for module, name in pairs:
        assert type(registry.resolve_safe_global(module, name)) is types.FunctionType


# -- exactly what the kernels read (issue 25) ---------------------------------------------------------------------


def _restricted(fn: Any, *args: Any) -> bytes:
    """A restricted stream whose header names this plugin and that calls ``fn(*args)``."""
    return naming(zp.dumps(Reduce(fn, *args)), "bitsandbytes")


def _real_stats(nested: bool) -> tuple[dict[str, Any], dict[str, Any], torch.Tensor]:
    from zerocopy_pickle_quirks import bnb

    weight = linear4bit("nf4", nested).weight
    stats, layout = bnb._quant_state_record(weight.quant_state)
    return {k: torch.Tensor.clone(v) for k, v in stats.items()}, layout, torch.Tensor.clone(weight.data)


def _with_plain(stats: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """``stats`` with fields of its packed JSON blob changed."""
    import json

    key = next(k for k in stats if k.startswith("quant_state.bitsandbytes__"))
    fields = json.loads(bytes(stats[key].tolist()).decode())
    return {**stats, key: _blob({**fields, **changes})}


def test_statistics_must_be_exactly_what_the_kernels_read() -> None:
    """A quantization map one element short, of the wrong dtype or not contiguous, an unsupported blocksize, an
    absmax count other than ceil(n / blocksize), nested statistics of another size or dtype: each refused by a
    restricted load (heap contents would otherwise flow into the layer's outputs)."""
    from zerocopy_pickle_quirks import bnb

    plain, layout, data = _real_stats(nested=False)
    nested, nested_layout, _ = _real_stats(nested=True)
    assert plain["absmax"].numel() == OUT * IN // 64 and plain["quant_map"].numel() == 16
    cases: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
        "map one short": ({**plain, "quant_map": plain["quant_map"][:-1].clone()}, layout),
        "map one long": ({**plain, "quant_map": torch.zeros(17)}, layout),
        "map of 256 for 4-bit": ({**plain, "quant_map": torch.zeros(256)}, layout),
        "map float16": ({**plain, "quant_map": plain["quant_map"].half()}, layout),
        "map int32": ({**plain, "quant_map": plain["quant_map"].view(torch.int32)}, layout),
        "map not contiguous": ({**plain, "quant_map": torch.zeros(32)[::2]}, layout),
        "absmax one short": ({**plain, "absmax": plain["absmax"][:-1].clone()}, layout),
        "absmax one long": ({**plain, "absmax": torch.ones(plain["absmax"].numel() + 1)}, layout),
        "absmax float16": ({**plain, "absmax": plain["absmax"].half()}, layout),
        "absmax not contiguous": ({**plain, "absmax": torch.ones(2 * plain["absmax"].numel())[::2]}, layout),
        "blocksize 16": (_with_plain(plain, blocksize=16), layout),
        "blocksize 8192": (_with_plain(plain, blocksize=8192), layout),
        "blocksize 96": (_with_plain(plain, blocksize=96), layout),
        "blocksize 128 for absmax of 64": (_with_plain(plain, blocksize=128), layout),
        "dtype int8": (_with_plain(plain, dtype="int8"), layout),
        "0-d shape": (_with_plain(plain, shape=[]), layout),
        "nested map one short": ({**nested, "nested_quant_map": nested["nested_quant_map"][:-1].clone()}, layout),
        "nested map float64": ({**nested, "nested_quant_map": nested["nested_quant_map"].double()}, layout),
        "nested map 16": ({**nested, "nested_quant_map": torch.zeros(16)}, layout),
        "nested absmax one long": ({**nested, "nested_absmax": torch.ones(2)}, layout),
        "nested absmax float16": ({**nested, "nested_absmax": nested["nested_absmax"].half()}, layout),
        "nested absmax of floats": ({**nested, "absmax": nested["absmax"].float()}, layout),
        "nested absmax one short": ({**nested, "absmax": nested["absmax"][:-1].clone()}, layout),
        "nested blocksize 64": (_with_plain(nested, nested_blocksize=64), layout),
        "nested dtype float16": (_with_plain(nested, nested_dtype="float16"), layout),
    }
    assert bnb.rebuild_quant_state(plain, layout).absmax.numel() == plain["absmax"].numel()
    assert bnb.rebuild_quant_state(nested, nested_layout).state2.code.numel() == 256
    for label, (stats, lay) in cases.items():
        with pytest.raises(zp.UnsafeArgumentError):
            bnb.rebuild_quant_state(stats, lay)
        with pytest.raises(zp.UnsafeArgumentError):
            zp.loads(_restricted(bnb.rebuild_quant_state, stats, lay))
        with pytest.raises(zp.UnsafeArgumentError):
            zp.loads(_restricted(bnb.rebuild_params4bit, "Params4bit", data, stats, lay, {}, False))
        del label


def test_packed_data_must_hold_exactly_the_shape() -> None:
    """Two 4-bit values a byte, (n + 1) // 2 bytes whatever quant_storage is; dense; of a storage dtype; the
    attributes agree with the statistics."""
    from zerocopy_pickle_quirks import bnb

    stats, layout, data = _real_stats(nested=True)
    assert bnb.rebuild_params4bit("Params4bit", data, stats, layout, {}, False).quant_state.nested
    as_float = data.reshape(-1).view(torch.float32)  # quant_storage float32: the same bytes
    attrs = {"quant_storage": torch.float32}
    assert bnb.rebuild_params4bit("Params4bit", as_float, stats, layout, attrs, False).quant_storage is torch.float32
    hostile: dict[str, tuple[Any, dict[str, Any]]] = {
        "one byte short": (data[:-1].clone(), {}),
        "one byte long": (torch.cat([data, data[:1]]), {}),
        "float64 storage, same numel": (data.double(), {}),
        "int32 (not a storage dtype)": (data.reshape(-1).view(torch.int32), {}),
        "not contiguous": (torch.zeros(2 * data.numel(), dtype=torch.uint8)[::2], {}),
        "quant_storage other than data": (data, {"quant_storage": torch.float16}),
        "blocksize disagrees": (data, {"blocksize": 128}),
        "quant_type disagrees": (data, {"quant_type": "fp4"}),
        "not quantized": (data, {"bnb_quantized": False}),
        "unsupported blocksize attribute": (data, {"blocksize": 100}),
    }
    for label, (tensor, attrs) in hostile.items():
        with pytest.raises(zp.UnsafeArgumentError):
            zp.loads(_restricted(bnb.rebuild_params4bit, "Params4bit", tensor, stats, layout, attrs, False))
        del label
    # An unquantized weight cannot claim to be quantized: the layer's forward would attach a quant_state to it.
    with pytest.raises(zp.UnsafeArgumentError):
        zp.loads(
            _restricted(
                bnb.rebuild_params4bit, "Params4bit", torch.zeros(64, 1), None, {}, {"bnb_quantized": True}, False
            )
        )


def test_int8_rows_and_scales_must_match() -> None:
    """SCB float32 with one scale per row of CB; CB dense int8 with the weight's shape; both or neither."""
    from zerocopy_pickle_quirks import bnb

    int8 = Int8Params(torch.randn(OUT, IN).half(), requires_grad=False).to("cpu")
    CB, SCB = torch.Tensor.clone(int8.CB), torch.Tensor.clone(int8.SCB)
    assert bnb.rebuild_int8params("Int8Params", CB, False, False, CB, SCB).SCB.numel() == OUT
    hostile = [
        (CB, CB, SCB[:-1].clone()),  # one scale short
        (CB, CB, SCB.half()),
        (CB, CB, SCB.view(torch.int32)),
        (CB, CB, torch.ones(2 * OUT)[::2]),
        (CB, CB, None),
        (CB, None, SCB),
        (CB[:-1].clone(), CB, SCB),  # data is not CB's shape
        (CB.float(), CB, SCB),
        (CB, CB.view(torch.uint8), SCB),
        (CB.t(), CB.t(), SCB),  # not contiguous
        (CB.reshape(-1), CB.reshape(-1), SCB),
    ]
    for data, rows, scales in hostile:
        with pytest.raises(zp.UnsafeArgumentError):
            zp.loads(_restricted(bnb.rebuild_int8params, "Int8Params", data, False, False, rows, scales))
        if rows is not CB or scales is not SCB:  # the layer's state holds the int8 rows and scales alone
            with pytest.raises(zp.UnsafeArgumentError):
                zp.loads(_restricted(bnb.rebuild_matmul_lt_state, {"CB": rows, "SCB": scales, "threshold": 0.0}))
    with pytest.raises(zp.UnsafeArgumentError):
        zp.loads(_restricted(bnb.rebuild_matmul_lt_state, {"threshold": -1.0}))
    with pytest.raises(zp.UnsafeArgumentError):
        zp.loads(_restricted(bnb.rebuild_matmul_lt_state, {"idx": torch.zeros(2, dtype=torch.int32)}))


def _layer_state(layer: torch.nn.Module, **changes: Any) -> tuple[Any, ...]:
    from zerocopy_pickle_quirks import bnb

    _, _, state, *_ = bnb.reduce_bnb_module(layer)
    fields, relink, keys, hooks = state
    return ({**fields, **changes}, relink, keys, hooks)


def test_layer_state_refuses_hooks_and_mismatched_tensors() -> None:
    """The layer's state setter refuses non-empty hook tables (forward, pre-forward, backward, state-dict,
    load-state-dict beyond bitsandbytes' own placeholder) and a bias, quant_state or int8 state that disagrees
    with the weight the kernels read."""
    from zerocopy_pickle_quirks import bnb

    hook = bnb.rebuild_bnb_module  # any value a restricted stream can name: a safe global
    four, eight = linear4bit("nf4", True), linear8bit()
    four.weight.module = None  # no reference cycle through the layer in these hand-made streams
    run(eight, inputs())  # CB and SCB now in the layer's state
    other = linear4bit("nf4", False, seed=3).weight.quant_state
    hostile: list[tuple[str, torch.nn.Module, dict[str, Any]]] = [
        *(
            (name, layer, {name: OrderedDict({0: hook})})
            for name in (
                "_forward_hooks",
                "_forward_pre_hooks",
                "_backward_hooks",
                "_backward_pre_hooks",
                "_state_dict_hooks",
                "_state_dict_pre_hooks",
                "_load_state_dict_post_hooks",
            )
            for layer in (four, eight)
        ),
        ("_load_state_dict_pre_hooks", four, {"_load_state_dict_pre_hooks": OrderedDict({0: hook})}),
        ("_forward_hooks_with_kwargs", four, {"_forward_hooks_with_kwargs": {0: True}}),
        ("_is_full_backward_hook", four, {"_is_full_backward_hook": "yes"}),
        ("hooks not a dict", four, {"_forward_hooks": [hook]}),
        ("bias one short", four, {"_parameters": {**four._parameters, "bias": torch.zeros(OUT - 1)}}),
        ("bias 2-d", eight, {"_parameters": {**eight._parameters, "bias": torch.zeros(OUT, 1)}}),
        ("bias not contiguous", eight, {"_parameters": {**eight._parameters, "bias": torch.zeros(2 * OUT)[::2]}}),
        ("another quant_state", four, {"quant_state": other}),
        ("plain weight", four, {"_parameters": {"weight": torch.nn.Parameter(torch.zeros(OUT, IN)), "bias": None}}),
        ("4-bit weight in an 8-bit layer", eight, {"_parameters": {"weight": four.weight, "bias": None}}),
        (
            "int8 rows of another shape",
            eight,
            {
                "state": bnb.rebuild_matmul_lt_state(
                    {"CB": eight.state.CB[:-1].clone(), "SCB": eight.state.SCB[:-1].clone(), "has_fp16_weights": False}
                )
            },
        ),
    ]
    for label, layer, changes in hostile:
        name = type(layer).__name__
        with pytest.raises(zp.UnsafeArgumentError):
            bnb.set_bnb_module_state(bnb.rebuild_bnb_module(name), _layer_state(layer, **changes))
        stream = _restricted(
            bnb.set_bnb_module_state, Reduce(bnb.rebuild_bnb_module, name), _layer_state(layer, **changes)
        )
        with pytest.raises(zp.UnsafeArgumentError):
            zp.loads(stream)
        del label
    # The genuine states still load (the placeholder of bitsandbytes' own rearrange pre-hook included).
    for layer in (four, eight):
        rebuilt = bnb.rebuild_bnb_module(type(layer).__name__)
        bnb.set_bnb_module_state(rebuilt, _layer_state(layer))
        assert torch.equal(run(rebuilt, inputs()), run(layer, inputs()))


def test_layer_state_keeps_its_own_parameter_table() -> None:
    """The stream keeps the dict it passed as ``_parameters``: filling it after the state setter checked it must not
    change the layer's weight."""
    from zerocopy_pickle_quirks import bnb

    layer = linear4bit("nf4", False)
    state = _layer_state(layer, _parameters=dict(layer._parameters))
    rebuilt = bnb.rebuild_bnb_module("Linear4bit")
    bnb.set_bnb_module_state(rebuilt, state)
    state[0]["_parameters"]["bias"] = torch.zeros(1)
    assert rebuilt.bias.shape == (OUT,)


def test_parameter_state_never_replaces_what_the_rebuild_checked() -> None:
    """set_param_state refuses quant_state, CB, SCB, the Params4bit attributes and tensor hook attributes
    (zerocopy_pickle._trust.safe_set's _HOOK_ATTRIBUTES: a tensor's own attributes, refused as shadowing the class)."""
    from zerocopy_pickle_quirks import bnb

    four = linear4bit("nf4", False).weight
    other = linear4bit("nf4", False, seed=3).weight.quant_state
    int8 = Int8Params(torch.randn(OUT, IN).half(), requires_grad=False).to("cpu")
    names = {
        "quant_state": other, "blocksize": 32, "quant_type": "fp4", "quant_storage": torch.float32,
        "compress_statistics": True, "bnb_quantized": False, "module": None,
        "_backward_hooks": {0: bnb.rebuild_bnb_module}, "_post_accumulate_grad_hooks": {}, "grad_fn": None,
    }  # fmt: skip
    for name, value in names.items():
        with pytest.raises(zp.UnsafeArgumentError):
            bnb.set_param_state(four, (None, {name: value}))
    for name in ("CB", "SCB", "has_fp16_weights"):
        with pytest.raises(zp.UnsafeArgumentError):
            bnb.set_param_state(int8, (None, {name: torch.zeros(1)}))
    bnb.set_param_state(four, (None, {"_is_hf_initialized": True}))  # what transformers adds
    assert four._is_hf_initialized is True


def test_check_native_tensor_arguments_finds_a_missing_check() -> None:
    """The conformance check reports a rebuild that reads a tensor without checking its size and dtype."""

    def trusting(code: torch.Tensor) -> torch.Tensor:
        if type(code) is not torch.Tensor:
            raise zp.UnsafeArgumentError("not a tensor")
        return code

    with pytest.raises(AssertionError, match="one element short"):
        check_native_tensor_arguments(trusting, (torch.zeros(16),), [(0,)], "trusting")

    def exact(code: torch.Tensor) -> torch.Tensor:
        if type(code) is not torch.Tensor or code.dtype is not torch.float32 or code.shape != (16,):
            raise zp.UnsafeArgumentError("not 16 float32")
        if not code.is_contiguous():
            raise zp.UnsafeArgumentError("not contiguous")
        return code

    check_native_tensor_arguments(exact, (torch.zeros(16),), [(0,)], "exact")


# -- a restricted load never imports bitsandbytes on a header's say-so -------------------------------------------

IMPORT_CHILD = """
import sys
import zerocopy_pickle as zp

data = open(sys.argv[1], "rb").read()  # 60-odd bytes of stream: rebuild_bnb_module("Linear4bit"), header naming it
assert zp.read_header(data).plugins[0].name == "bitsandbytes"
try:
    zp.loads(data)
except zp.PluginError as e:
    assert "import bitsandbytes" in str(e) and "trusted=True" in str(e), e
else:
    raise AssertionError("loaded")
assert "bitsandbytes" not in sys.modules, "a refused restricted load imported bitsandbytes"
assert not [m for m in sys.modules if m.startswith(("bitsandbytes", "accelerate"))]

import bitsandbytes  # the one thing that works: the program imports it
print(type(zp.loads(data)).__name__)
"""

TRUSTED_CHILD = """
import sys
import zerocopy_pickle as zp

layer = zp.loads(open(sys.argv[1], "rb").read(), trusted=True)  # the plugin's load hook imports bitsandbytes
assert "bitsandbytes" in sys.modules
print(type(layer).__name__)
"""


@pytest.mark.slow
def test_restricted_load_does_not_import_bitsandbytes(tmp_path: Path) -> None:
    from zerocopy_pickle_quirks import bnb

    path = tmp_path / "tiny.zcp"
    path.write_bytes(_restricted(bnb.rebuild_bnb_module, "Linear4bit"))
    header = zp.read_header(path)
    assert header.stream_nbytes < 120, header.stream_nbytes
    env = {"PYTHONPATH": str(REPO)}
    assert run_python(IMPORT_CHILD, str(path), env=env).stdout.strip() == "Linear4bit"
    assert run_python(TRUSTED_CHILD, str(path), env=env).stdout.strip() == "Linear4bit"
