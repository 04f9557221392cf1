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
from zerocopy_pickle.testing import ReducerConformance

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

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


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

snapshot = zp.load(sys.argv[1])  # restricted; the rebuild functions import bitsandbytes
for name, layer in snapshot["layers"].items():
    region = region_of(layer.weight.untyped_storage().data_ptr())
    assert region is not None and region[2] == os.path.realpath(sys.argv[1]), (name, region)
with torch.no_grad():
    outputs = {name: layer(snapshot["x"]) for name, layer in snapshot["layers"].items()}
zp.dump(outputs, sys.argv[2])
print("ok")
"""


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

    registry = zp.registry.default_registry()
    pairs = registry.safe_globals(plugins=["bitsandbytes"])
    assert pairs and all(module == "zerocopy_pickle_quirks.bnb" for module, _ in pairs)
    for module, name in pairs:
        assert type(registry.resolve_safe_global(module, name)) is types.FunctionType
