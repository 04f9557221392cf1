"""Real models from the libraries users snapshot (issue 26, item 7): built locally from tiny configs (no model hub),
round-tripped through every way in, outputs compared bit for bit (``torch.equal``, eval mode, fixed seeds).

Each model goes through: ``zp.dump`` + a restricted ``zp.load`` that is refused, then loads with the refusal's own
suggested ``allow=`` (``RestrictedLoadError.allow``) — or, where the refusal says at once that only
``trusted=True`` can (``trusted_only``), with the reason this file expects; a trusted load; ``zp.freeze(...).load()``;
``zerocopy_pickle.multiprocessing.Shared`` sent to a spawned worker; and, for one model per library the cache can
serve, the model cache (a server in a private directory, a plain, a missing and a hitting client process).

Libraries in (all installed by ``make setup-test``: transformers, diffusers and accelerate through the [quirks]
extra, peft and silero-vad through the [models] extra):

* transformers: tiny LLaMA, GPT-2 and BERT, and Wav2Vec2 (parametrized: weight_norm, the parametrize quirk);
* diffusers: a tiny UNet2DConditionModel and AutoencoderKL, and a DDPMPipeline saved with save_pretrained (cache);
* peft: LoRA on a tiny GPT-2 (``get_peft_model``; ``PeftModel.from_pretrained`` of a saved adapter for the cache);
* accelerate: ``dispatch_model`` (CPU map) and ``cpu_offload`` of a tiny GPT-2 (``device_map="auto"`` for the
  cache);
* silero-vad: the TorchScript model its package ships (``load_silero_vad()``; the torchscript quirk).

Trusted only, and why (asserted below, so a change shows):

* ``cpu_offload``: accelerate's hooks replace each module's ``forward`` with a local function, pickled by value
  (cloudpickle): loading it runs that code (the dump warns, ``TrustedOnlyWarning``).

Not in, and why (none of them imports next to torch 2.13.0+cpu without a build this project cannot install):

* timm, open_clip: both import torchvision at import time (``timm.layers`` -> ``torchvision.ops.misc``). The
  registry's only torchvision for torch 2.13.0 (0.28.0) is a CUDA build: its ``_C.so`` links libtorch_cuda and
  libcudart, so ``import torchvision`` fails next to the CPU torch ("operator torchvision::nms does not exist").
* torchcrepe: imports torchaudio at import time; the registry's torchaudio (2.11.1) is built for another torch
  (``_torchaudio.so`` does not load: "Could not load this library"). It would also pull librosa/numba/scipy.
* resemblyzer: imports webrtcvad, whose module imports ``pkg_resources``, gone from setuptools since 81 (this venv
  has 84); it would also pull librosa, numba, scikit-learn and scipy (about 500 MB, 45 s to install) and the
  ``typing`` backport.
* silero-vad through the cache: ``load_silero_vad()`` reads its model with ``torch.jit.load``, not a patch point.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import multiprocessing
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle import multiprocessing as zmp

from .cache_helpers import ServerProcess, run_client, running_server, wait_until
from .mp_workers import mapping_of

pytestmark = pytest.mark.slow

SPAWN = multiprocessing.get_context("spawn")

# Why only trusted=True loads a model, as RestrictedLoadError.trusted_only says it (a substring of one reason).
BY_VALUE = "it holds code pickled by value (cloudpickle.cloudpickle)"


def _ids() -> torch.Tensor:
    return torch.tensor([[1, 2, 3, 4, 5, 6]])


def _gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=1
    )
    return transformers.GPT2LMHeadModel(config).eval()


def _llama() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _bert() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return transformers.BertModel(config).eval()


def _wav2vec2() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )
    return transformers.Wav2Vec2Model(config).eval()


def _unet() -> Any:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=8,
        norm_num_groups=8,
    ).eval()


def _vae() -> Any:
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    ).eval()


LORA = {"r": 4, "target_modules": ["c_attn"], "init_lora_weights": False}  # random B: the adapter changes outputs


def _lora() -> Any:
    peft = pytest.importorskip("peft")
    model = _gpt2()
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "fan_in_fan_out is set to False ... Conv1D": GPT-2's layout
        return peft.get_peft_model(model, peft.LoraConfig(**LORA)).eval()


def _dispatched() -> Any:
    accelerate = pytest.importorskip("accelerate")
    return accelerate.dispatch_model(_gpt2(), device_map={"transformer": "cpu", "lm_head": "cpu"})


def _offloaded() -> Any:
    accelerate = pytest.importorskip("accelerate")
    model = _gpt2()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    return model


def _silero() -> Any:
    threads = torch.get_num_threads()
    silero_vad = pytest.importorskip("silero_vad")
    # Importing silero_vad runs torch.set_num_threads(1) (silero_vad/model.py): put it back, for the other tests of
    # the session, and so that this process computes as the workers of the Shared test do.
    torch.set_num_threads(threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return silero_vad.load_silero_vad()


def _logits(model: Any) -> tuple[torch.Tensor, ...]:
    return (model(_ids()).logits,)


def _hidden(model: Any) -> tuple[torch.Tensor, ...]:
    return (model(_ids()).last_hidden_state,)


def _audio_hidden(model: Any) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(2)
    return (model(torch.randn(1, 400)).last_hidden_state,)


def _unet_noise(model: Any) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(2)
    sample, hidden = torch.randn(1, 4, 8, 8), torch.randn(1, 3, 16)
    return (model(sample, 1, encoder_hidden_states=hidden).sample,)


def _vae_roundtrip(model: Any) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(2)
    latents = model.encode(torch.randn(1, 3, 16, 16)).latent_dist
    return latents.mean, latents.logvar, model.decode(latents.mean).sample


def _vad(model: Any) -> tuple[torch.Tensor, ...]:
    model.reset_states()  # the model keeps state between chunks: two chunks from the start
    torch.manual_seed(2)
    chunks = torch.randn(2, 512) * 0.1
    return tuple(model(chunk, 16000) for chunk in chunks)


@dataclasses.dataclass(frozen=True)
class Case:
    build: Callable[[], Any]
    run: Callable[[Any], tuple[torch.Tensor, ...]]
    trusted_only: str | None = None  # why only trusted=True loads it (a substring of a trusted_only reason)
    zero_copy: bool = True  # its first parameter is a view into the snapshot (checked in a Shared's worker)


KERNELS = "kernels._internals" if importlib.util.find_spec("kernels") else None

CASES = {
    # With the `kernels` package installed, transformers gives LLaMA's layers hub-kernel forwards, which pickle
    # as kernels' own rebuild plus BUILD: only a trusted load rebuilds them.
    "transformers-llama": Case(_llama, _logits, trusted_only=KERNELS),
    "transformers-gpt2": Case(_gpt2, _logits),
    "transformers-bert": Case(_bert, _hidden),  # GELUActivation's F.gelu: torch._C._nn:gelu, a safe value
    "transformers-wav2vec2": Case(_wav2vec2, _audio_hidden),
    "diffusers-unet": Case(_unet, _unet_noise),
    "diffusers-vae": Case(_vae, _vae_roundtrip),
    "peft-lora-gpt2": Case(_lora, _logits),
    "accelerate-dispatch_model": Case(_dispatched, _logits),
    # Its parameters are on the meta device: the weights are in accelerate's hooks (weights_map), not parameters.
    "accelerate-cpu_offload": Case(_offloaded, _logits, trusted_only=BY_VALUE, zero_copy=False),
    "silero-vad": Case(_silero, _vad, zero_copy=False),
}


def outputs(case: Case, model: Any) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return tuple(t.detach().clone() for t in case.run(model))


def parametrized(model: Any) -> list[str]:
    """The modules of ``model`` that carry a parametrization (Wav2Vec2's weight-normed positional conv)."""
    if not isinstance(model, torch.nn.Module) or isinstance(model, torch.jit.ScriptModule):
        return []
    return [name for name, module in model.named_modules() if torch.nn.utils.parametrize.is_parametrized(module)]


def assert_same(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"outputs differ: max |diff| {(a.double() - b.double()).abs().max().item()}"


@dataclasses.dataclass
class Built:
    case: Case
    model: Any
    expected: tuple[torch.Tensor, ...]
    path: Path


@pytest.fixture(scope="module", params=sorted(CASES))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    case = CASES[request.param]
    model = case.build()
    expected = outputs(case, model)
    assert bool(parametrized(model)) == (request.param == "transformers-wav2vec2")
    again = outputs(case, model)
    assert all(torch.equal(a, b) for a, b in zip(again, expected, strict=True)), "the model itself is deterministic"
    path = tmp_path_factory.mktemp(request.param) / "model.zp"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zp.dump(model, path)
    trusted_warnings = [w for w in caught if issubclass(w.category, zp.TrustedOnlyWarning)]
    assert bool(trusted_warnings) == (case.trusted_only == BY_VALUE), [str(w.message) for w in trusted_warnings]
    return Built(case, model, expected, path)


def test_a_restricted_load_with_the_suggested_allow_gives_the_same_outputs(built: Built) -> None:
    with pytest.raises(zp.RestrictedLoadError) as refused:
        zp.load(built.path)
    error = refused.value
    if built.case.trusted_only is not None:
        assert error.allow is None
        assert any(built.case.trusted_only in reason for reason in error.trusted_only), error.trusted_only
        assert "trusted=True" in str(error)
        return
    assert error.trusted_only == () and error.allow, str(error)
    loaded = zp.load(built.path, allow=error.allow)  # the suggestion as given: one refusal, then it loads
    assert type(loaded) is type(built.model) and parametrized(loaded) == parametrized(built.model)
    assert_same(outputs(built.case, loaded), built.expected)


def test_a_trusted_load_gives_the_same_outputs(built: Built) -> None:
    loaded = zp.load(built.path, trusted=True)
    assert loaded is not built.model and type(loaded) is type(built.model)
    assert parametrized(loaded) == parametrized(built.model)
    assert_same(outputs(built.case, loaded), built.expected)


def test_a_frozen_snapshot_gives_the_same_outputs(built: Built) -> None:
    with zp.freeze(built.model) as snapshot:
        loaded = snapshot.load()
    assert_same(outputs(built.case, loaded), built.expected)


def shared_worker(name: str, threads: int, model: Any) -> dict[str, Any]:
    """In a spawned worker: the outputs of the model a Shared brought, and the mapping behind its first weight.
    ``threads``: this test process's intra-op thread count (a float reduction's result depends on it)."""
    torch.set_num_threads(threads)
    case = CASES[name]
    result: dict[str, Any] = {"outputs": outputs(case, model), "pid": os.getpid()}
    if case.zero_copy:
        result["mapping"] = mapping_of(next(iter(model.parameters())).data_ptr())["path"]
    return result


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    with SPAWN.Pool(1) as workers:  # one spawned interpreter for every model: nothing inherited
        yield workers


def test_a_shared_model_gives_the_same_outputs_in_a_worker_process(built: Built, pool: Any) -> None:
    name = next(n for n, c in CASES.items() if c is built.case)
    shared = zmp.Shared(built.model)
    try:
        report = pool.apply(shared_worker, (name, torch.get_num_threads(), shared))
    finally:
        shared.close()
    assert report["pid"] != os.getpid()
    assert_same(report["outputs"], built.expected)
    if built.case.zero_copy:
        assert report["mapping"].startswith("/memfd:zerocopy_pickle"), report["mapping"]


# --- The model cache: one model per library it serves, in fresh interpreters against a private server. ---

CACHE_CLIENT = """
import hashlib, json, sys, warnings
warnings.simplefilter("ignore")
import torch
if sys.argv[1] == "cache":
    from zerocopy_pickle import cache
    cache.patch_all(autostart=False)
    key = cache.cached_key
else:
    key = lambda obj: None
gpt2, pipeline, adapter = sys.argv[2:5]
from transformers import GPT2LMHeadModel
from diffusers import DDPMPipeline
from peft import PeftModel

def digest(*tensors):
    return [hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() + str(tuple(t.shape)) for t in tensors]

ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
out = {}
with torch.no_grad():
    model = GPT2LMHeadModel.from_pretrained(gpt2).eval()
    out["transformers"] = {"outputs": digest(model(ids).logits), "key": key(model)}
    pipe = DDPMPipeline.from_pretrained(pipeline)
    torch.manual_seed(2)
    sample = torch.randn(1, 3, 16, 16)
    step = pipe.scheduler.step(sample, 3, sample).prev_sample
    out["diffusers"] = {"outputs": digest(pipe.unet(sample, 3).sample, step), "key": key(pipe)}
    base = GPT2LMHeadModel.from_pretrained(gpt2)
    lora = PeftModel.from_pretrained(base, adapter).eval()
    out["peft"] = {"outputs": digest(lora(ids).logits), "key": key(base)}
    dispatched = GPT2LMHeadModel.from_pretrained(gpt2, device_map="auto").eval()
    out["accelerate"] = {"outputs": digest(dispatched(ids).logits), "key": key(dispatched),
                         "device_map": getattr(dispatched, "hf_device_map", None)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    diffusers = pytest.importorskip("diffusers")
    root = tmp_path_factory.mktemp("saved")
    _gpt2().save_pretrained(root / "gpt2")
    _lora().save_pretrained(root / "adapter")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler(num_train_timesteps=10)).save_pretrained(
        root / "pipeline"
    )
    return [str(root / "gpt2"), str(root / "pipeline"), str(root / "adapter")]


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with running_server() as process:
        yield process


def test_the_cache_serves_one_model_of_each_library_bit_for_bit(server: ServerProcess, saved: list[str]) -> None:
    plain = run_client(server, CACHE_CLIENT, "plain", *saved)
    missed = run_client(server, CACHE_CLIENT, "cache", *saved)
    libraries = ("transformers", "diffusers", "peft", "accelerate")
    for library in libraries:
        assert missed[library]["outputs"] == plain[library]["outputs"], library
    # GPT-2 (also the base of the peft model: a hit already), the pipeline, the adapter file, the device_map load.
    wait_until(lambda: len(server.status()["entries"]) >= 4, "every miss filed")
    before = server.status()
    hit = run_client(server, CACHE_CLIENT, "cache", *saved)
    after = server.status()
    assert after["misses"] == before["misses"], "the second process loads everything from the cache"
    assert after["hits"] > before["hits"]
    for library in libraries:
        assert hit[library]["outputs"] == plain[library]["outputs"], library
        assert hit[library]["key"] is not None, f"{library}: the model came from the cache"
    calls = json.dumps([entry["call"] for entry in after["entries"]])
    for call in ("GPT2LMHeadModel.from_pretrained", "DDPMPipeline.from_pretrained", "load_file"):
        assert call in calls, calls
    assert hit["accelerate"]["device_map"] == plain["accelerate"]["device_map"]


def test_a_disk_offloaded_model_loads_without_its_offload_folder(tmp_path: Path) -> None:
    """accelerate's ``disk_offload``: the weights it wrote to files are copied into the snapshot (issue 26, item 4)."""
    accelerate = pytest.importorskip("accelerate")
    model = _gpt2()
    folder = tmp_path / "offload"
    accelerate.disk_offload(model, offload_dir=str(folder), execution_device=torch.device("cpu"))
    case = CASES["transformers-gpt2"]
    expected = outputs(case, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zp.TrustedOnlyWarning)  # accelerate's hooks: a local forward, by value
        zp.dump(model, tmp_path / "model.zp")
        frozen = zp.freeze(model)
    shutil.rmtree(folder)
    with frozen:
        assert_same(outputs(case, frozen.load()), expected)
    assert_same(outputs(case, zp.load(tmp_path / "model.zp", trusted=True)), expected)
