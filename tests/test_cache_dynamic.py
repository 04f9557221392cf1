"""Results whose classes the loader's process makes at load time, through the model cache: each is a *hit in a fresh
process* (process 1 fills the cache, a new process gets the entry from the server), with outputs identical to a
direct load.

* a ``trust_remote_code=True`` transformers model from a local repository (``transformers_modules``);
* a diffusers custom pipeline with a custom component, from a local folder (``diffusers_modules``);
* a TorchScript module and a stable-fast traced module (built by test loaders routed through the cache);
* a bitsandbytes-quantized transformers model.

The entry records the plugins its stream needs (``dynamic-modules``, ``torchscript``, ``stable-fast``, ``bnb``) and a
hit runs their load hooks through the load core before it unpickles, as a snapshot load does.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .cache_helpers import ServerProcess, run_client, running_server

pytestmark = pytest.mark.slow

SOURCES = Path(__file__).with_name("fixtures") / "dynamic_modules"

# Writes the two local repositories' configs and weights (the code is in tests/fixtures/dynamic_modules).
SETUP = """
import sys
from tests.dynamic_repos import write_repositories
write_repositories(sys.argv[1])
print("{}")
"""

# A client: loads with the cache patched in (argv[1] == "cache") or directly, and prints the outputs, whether
# the result came from the cache, and any CacheWarning.
CLIENT_HEAD = """
import json, sys, warnings
warnings.simplefilter("always")
import torch
if sys.argv[1] == "cache":
    from zerocopy_pickle import cache
    cache.patch_all(POINTS, autostart=False)
caught = warnings.catch_warnings(record=True)
seen = caught.__enter__()
warnings.simplefilter("always")
"""
CLIENT_TAIL = """
caught.__exit__(None, None, None)
key = None
if sys.argv[1] == "cache":
    key = cache.cached_key(result)
print(json.dumps({"outputs": outputs, "key": key, "module": module,
                  "warnings": [str(w.message) for w in seen if "zerocopy_pickle" in str(w.message)]}))
"""

REMOTE_CODE = """
from transformers import AutoModel
result = AutoModel.from_pretrained(sys.argv[2], trust_remote_code=True).eval()
module = type(result).__module__
with torch.no_grad():
    outputs = result(torch.tensor([[1, 2, 3, 15]])).flatten().tolist()
"""

CUSTOM_PIPELINE = """
from diffusers import DiffusionPipeline
result = DiffusionPipeline.from_pretrained(sys.argv[2], trust_remote_code=True)
module = [type(result).__module__, type(result.unet).__module__]
sample = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
outputs = result(sample).flatten().tolist()
"""

SCRIPTED = """
from tests import cache_helpers
result = cache_helpers.scripted_module(int(sys.argv[2]))
module = type(result).__module__
with torch.no_grad():
    outputs = result(torch.linspace(-1, 1, 8).reshape(2, 4)).flatten().tolist()
"""

STABLE_FAST = """
from tests import cache_helpers
result = cache_helpers.stable_fast_module(int(sys.argv[2]))
module = type(result).__module__
got = result(cache_helpers.stable_fast_request())
outputs = [got.y.flatten().tolist(), float(got.total), type(got).__qualname__]
"""

QUANTIZED = """
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
result = AutoModelForCausalLM.from_pretrained(sys.argv[2], quantization_config=BitsAndBytesConfig(load_in_8bit=True))
module = type(result.transformer.h[0].attn.c_attn).__module__
with torch.no_grad():
    outputs = result(torch.tensor([[1, 2, 3, 4]])).logits.flatten().tolist()
"""


def client(body: str, points: list[str] | None = None) -> str:
    return CLIENT_HEAD.replace("POINTS", repr(points)) + body + CLIENT_TAIL


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from .conftest import run_python

    root = tmp_path_factory.mktemp("cache-dynamic")
    for name in ("tiny-remote-model", "tiny-pipeline"):
        shutil.copytree(SOURCES / name, root / name)
    run_python(SETUP, str(root))
    return root


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ServerProcess]:
    # The libraries copy repository code into HF_HOME's modules cache: a private one, for the server (and its
    # loader) and for every client (they inherit the environment).
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_MODULES_CACHE", raising=False)
    with running_server() as process:
        yield process


def hit_in_a_fresh_process(server: ServerProcess, code: str, *args: str) -> dict[str, Any]:
    """Fill the cache in one process, get the entry in a fresh one; compare both with a direct load."""
    first = run_client(server, code, "cache", *args)
    assert first["warnings"] == [], first["warnings"]
    assert first["key"] is not None
    status = server.status()
    assert (status["hits"], status["misses"]) == (0, 1)
    second = run_client(server, code, "cache", *args)
    assert second["warnings"] == [], second["warnings"]
    status = server.status()
    assert (status["hits"], status["misses"]) == (1, 1), "the fresh process did not get a hit"
    assert second["key"] == first["key"]
    direct = run_client(server, code, "direct", *args)
    assert direct["key"] is None
    assert second["outputs"] == direct["outputs"] == first["outputs"]
    assert second["module"] == direct["module"]
    return second


def test_remote_code_model_is_a_hit_in_a_fresh_process(server: ServerProcess, repos: Path) -> None:
    pytest.importorskip("transformers")
    result = hit_in_a_fresh_process(server, client(REMOTE_CODE), str(repos / "tiny-remote-model"))
    assert result["module"].startswith("transformers_modules.")
    plugins = [entry["plugins"] for entry in server.status()["entries"]]
    assert plugins == [["dynamic-modules"]]


def test_custom_pipeline_is_a_hit_in_a_fresh_process(server: ServerProcess, repos: Path) -> None:
    pytest.importorskip("diffusers")
    result = hit_in_a_fresh_process(server, client(CUSTOM_PIPELINE), str(repos / "tiny-pipeline"))
    assert result["module"] == ["diffusers_modules.local.my_pipeline", "diffusers_modules.local.my_unet"]
    calls = {entry["call"].partition("(")[0]: entry["plugins"] for entry in server.status()["entries"]}
    assert calls == {"DiffusionPipeline.from_pretrained": ["dynamic-modules"]}  # its components load inside it


def test_torchscript_module_is_a_hit_in_a_fresh_process(server: ServerProcess) -> None:
    result = hit_in_a_fresh_process(server, client(SCRIPTED, ["tests.cache_helpers:scripted_module"]), "3")
    assert result["module"] == "torch.jit._script"
    assert [entry["plugins"] for entry in server.status()["entries"]] == [["torchscript"]]


def test_stable_fast_result_is_a_hit_in_a_fresh_process(server: ServerProcess) -> None:
    pytest.importorskip("sfast.jit.trace_helper", reason="stable-fast is not installed (make setup)")
    result = hit_in_a_fresh_process(server, client(STABLE_FAST, ["tests.cache_helpers:stable_fast_module"]), "2")
    assert result["outputs"][2] == "StableFastResult"
    # The wrapper is sfast's (stable-fast); the module it wraps is a TorchScript module (torchscript).
    assert [sorted(entry["plugins"]) for entry in server.status()["entries"]] == [["stable-fast", "torchscript"]]


def test_bitsandbytes_model_is_a_hit_in_a_fresh_process(server: ServerProcess, tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("transformers")
    from .cache_helpers import build_gpt2

    path = build_gpt2(tmp_path / "gpt2")
    result = hit_in_a_fresh_process(server, client(QUANTIZED), path)
    assert result["module"].startswith("bitsandbytes.")
    assert [entry["plugins"] for entry in server.status()["entries"]] == [["bitsandbytes"]]
