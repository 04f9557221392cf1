"""The model cache, end to end: a real server, real tiny models, client processes.

Every client runs in a fresh interpreter (as users run their programs) against a server in a private
temporary directory; the tiny GPT2 and StableDiffusionControlNetPipeline are built here with save_pretrained.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import ANY

import pytest
import torch

from examples.models import build_controlnet_pipeline
from zerocopy_pickle.cache import protocol
from zerocopy_pickle.cache.client import Client
from zerocopy_pickle.cache.server import Server

from .cache_helpers import ServerProcess, build_gpt2, private_dir, run_client, running_server, wait_until
from .conftest import REPO, run_python

pytestmark = pytest.mark.slow

GPT2_CLIENT = """
import json, sys, time, warnings
warnings.simplefilter("always")
import torch
from zerocopy_pickle import cache
cache.patch_all(autostart=False)
from transformers import GPT2LMHeadModel
paths = sys.argv[1:]
out = []
for path in paths:
    start = time.perf_counter()
    model = GPT2LMHeadModel.from_pretrained(path)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    out.append({"sum": float(logits.double().sum()), "first": logits[0, 0, :4].tolist(), "key": cache.cached_key(model),
                "seconds": seconds})
print(json.dumps({"loads": out}))
"""

PLAIN_GPT2_CLIENT = GPT2_CLIENT.replace("cache.patch_all(autostart=False)", "pass")  # the same loads, uncached
assert PLAIN_GPT2_CLIENT != GPT2_CLIENT

PIPELINE_CLIENT = """
import json, sys, warnings
warnings.simplefilter("always")
import torch
patched, mode, pipeline_path, edge_path, depth_path = sys.argv[1:6]
if patched == "cache":
    from zerocopy_pickle import cache
    cache.patch_all(autostart=False)
from diffusers import AutoencoderKL, ControlNetModel, StableDiffusionControlNetPipeline
from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel
vae = AutoencoderKL.from_pretrained(pipeline_path, subfolder="vae")
edge = ControlNetModel.from_pretrained(edge_path)
depth = ControlNetModel.from_pretrained(depth_path)
kwargs = {"vae": vae, "safety_checker": None}
if mode == "wrapper":
    kwargs["controlnet"] = controlnet = MultiControlNetModel([edge, depth])
pipe = StableDiffusionControlNetPipeline.from_pretrained(pipeline_path, **kwargs)
net = pipe.controlnet.nets[1] if mode == "wrapper" else pipe.controlnet
torch.manual_seed(0)
latents = torch.randn(1, 4, 8, 8)
with torch.no_grad():
    decoded = pipe.vae.decode(latents).sample
    hidden = pipe.text_encoder(torch.tensor([[0, 3, 4, 2]]))[0]
    noise = pipe.unet(latents, 1, encoder_hidden_states=hidden).sample
    down, mid = net(latents, 1, encoder_hidden_states=hidden, controlnet_cond=torch.zeros(1, 3, 16, 16),
                    return_dict=False)
print(json.dumps({
    "vae_is_vae": pipe.vae is vae,
    "nets_are_args": [pipe.controlnet.nets[0] is edge, pipe.controlnet.nets[1] is depth] if mode == "wrapper" else [],
    "wrapper_is_arg": mode == "wrapper" and pipe.controlnet is controlnet,
    "outputs": [float(t.double().sum()) for t in (decoded, hidden, noise, mid)],
    "unet_weight": float(pipe.unet.conv_in.weight.double().sum()),
}))
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    paths = build_controlnet_pipeline(root / "controlnet", size="tiny")
    paths["gpt2"] = build_gpt2(root / "gpt2")
    paths["gpt2_b"] = build_gpt2(root / "gpt2-b", seed=1)
    paths["gpt2_c"] = build_gpt2(root / "gpt2-c", seed=2)
    torch.save({"w": torch.arange(1000.0), "b": torch.ones(3)}, root / "state.pt")
    paths["state"] = str(root / "state.pt")
    return paths


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with running_server() as process:
        yield process


def test_gpt2_miss_then_hit_with_identical_outputs(server: ServerProcess, models: dict[str, str]) -> None:
    first = run_client(server, GPT2_CLIENT, models["gpt2"])["loads"][0]
    assert server.status()["misses"] == 1
    second = run_client(server, GPT2_CLIENT, models["gpt2"], models["gpt2"])["loads"]
    status = server.status()
    assert status["hits"] == 2 and status["misses"] == 1
    assert len(status["entries"]) == 1 and status["entries"][0]["call"].startswith("GPT2LMHeadModel.from_pretrained")
    for load in second:
        assert load["sum"] == first["sum"] and load["first"] == first["first"]
        assert load["key"] == first["key"]
    plain = run_client(server, PLAIN_GPT2_CLIENT, models["gpt2"])
    assert plain["loads"][0]["sum"] == first["sum"]


def test_a_changed_file_is_a_miss(server: ServerProcess, models: dict[str, str], tmp_path: Path) -> None:
    import shutil

    path = tmp_path / "gpt2"
    shutil.copytree(models["gpt2"], path)
    before = run_client(server, GPT2_CLIENT, str(path))["loads"][0]
    run_client(server, GPT2_CLIENT, str(path))
    assert server.status()["hits"] == 1
    # Replace the weights with another model's (a retrained checkpoint, same names and sizes).
    shutil.copy(Path(models["gpt2_b"]) / "model.safetensors", path / "model.safetensors")
    after = run_client(server, GPT2_CLIENT, str(path))["loads"][0]
    assert server.status()["misses"] == 2
    assert after["key"] != before["key"] and after["sum"] != before["sum"]


@pytest.mark.parametrize("mode", ["vae", "wrapper"])
def test_controlnet_pipeline_seed_scenario(server: ServerProcess, models: dict[str, str], mode: str) -> None:
    """Load a VAE, two ControlNets, then the pipeline with vae=vae (and the ControlNets in a wrapper)."""
    args = (mode, models["pipeline"], models["edge"], models["depth"])
    plain = run_client(server, PIPELINE_CLIENT, "plain", *args)
    first = run_client(server, PIPELINE_CLIENT, "cache", *args)
    status = server.status()
    assert (status["hits"], status["misses"]) == (0, 4)  # vae, two ControlNets, the pipeline
    second = run_client(server, PIPELINE_CLIENT, "cache", *args)
    status = server.status()
    assert (status["hits"], status["misses"]) == (4, 4), status  # the wrapped arguments hit too
    for run in (first, second):
        assert run["outputs"] == plain["outputs"] and run["unet_weight"] == plain["unet_weight"]
        assert run["vae_is_vae"]
        if mode == "wrapper":
            assert run["wrapper_is_arg"] and run["nets_are_args"] == [True, True]

    # Nothing is stored twice: the arguments travel as references, and the weights are views of the checkpoint
    # files (file segments, not counted in total_bytes) or, for what a loader computed, stored once.
    def weights(*parts: str) -> int:
        return sum(f.stat().st_size for f in Path(*parts).glob("*.safetensors"))

    distinct = sum(weights(models["pipeline"], part) for part in ("vae", "unet", "text_encoder"))
    distinct += weights(models["edge"]) + weights(models["depth"])
    assert status["total_bytes"] <= distinct * 1.05
    if mode == "vae":
        assert status["total_bytes"] < status["logical_bytes"]
    assert "CacheWarning" not in second["stderr"]


def test_identical_storages_are_stored_once(models: dict[str, str]) -> None:
    # --copy-files: every storage in the cache's memfds, where deduplication is what keeps memory down.
    code = """
import json, sys, torch
from zerocopy_pickle import cache
cache.patch_all(autostart=False)
from diffusers import ControlNetModel
a = ControlNetModel.from_pretrained(sys.argv[1])
b = ControlNetModel.from_pretrained(sys.argv[1], torch_dtype=torch.float32)  # another key, the same bytes
print(json.dumps({"equal": all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters())),
                  "keys": [cache.cached_key(a), cache.cached_key(b)]}))
"""
    with private_dir() as directory:
        server = ServerProcess(directory, "--copy-files")
        try:
            result = run_client(server, code, models["edge"])
            assert result["equal"] and result["keys"][0] != result["keys"][1]
            status = server.status()
            assert len(status["entries"]) == 2 and status["file_bytes"] == 0
            assert status["total_bytes"] <= status["entries"][0]["nbytes"] + 64 * 1024  # the second added nothing
            assert status["logical_bytes"] >= 2 * status["entries"][0]["nbytes"]
        finally:
            server.stop()


def test_untouched_checkpoint_tensors_reference_the_file(server: ServerProcess, models: dict[str, str]) -> None:
    code = GPT2_CLIENT.replace(
        'print(json.dumps({"loads": out}))',
        """maps = open("/proc/self/maps").read().splitlines()
def backing(t):
    address = t.data_ptr()
    for line in maps:
        span, *rest = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return rest[-1] if len(rest) >= 5 else ""
    return None
out[-1]["backing"] = backing(model.transformer.h[0].attn.c_attn.weight)
print(json.dumps({"loads": out}))""",
    )
    run_client(server, code, models["gpt2"])  # the miss
    result = run_client(server, code, models["gpt2"])["loads"][0]  # a hit, in a fresh process
    checkpoint = str(Path(models["gpt2"], "model.safetensors").resolve())
    assert result["backing"] == checkpoint  # the weight is a view of the checkpoint's own pages
    status = server.status()
    assert status["files"] == [checkpoint] and status["file_bytes"] == Path(checkpoint).stat().st_size
    assert status["total_bytes"] < status["logical_bytes"] // 10  # (what a loader did compute is copied)


def test_checkpoint_rewritten_in_place_with_its_mtime_restored_is_a_miss(
    server: ServerProcess, models: dict[str, str], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save
    from transformers import GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    shutil.copytree(models["gpt2"], folder)
    checkpoint = folder / "model.safetensors"
    before = run_client(server, GPT2_CLIENT, str(folder))["loads"][0]
    state = load_file(checkpoint)
    state["transformer.h.0.mlp.c_fc.weight"] *= 2
    data = save(state, metadata={"format": "pt"})
    info = checkpoint.stat()
    assert len(data) == info.st_size
    with open(checkpoint, "r+b") as f:  # in place, same size, and the modification time put back (rsync -t)
        f.write(data)
    os.utime(checkpoint, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert checkpoint.stat().st_mtime_ns == info.st_mtime_ns and checkpoint.stat().st_ino == info.st_ino
    after = run_client(server, GPT2_CLIENT, str(folder))["loads"][0]
    assert after["key"] != before["key"] and after["sum"] != before["sum"]  # the ctime changed: a new key
    with torch.no_grad():
        expected = GPT2LMHeadModel.from_pretrained(folder)(torch.tensor([[1, 2, 3, 4]])).logits
    assert after["sum"] == pytest.approx(float(expected.double().sum()), rel=1e-12)
    status = server.status()
    assert status["misses"] == 2 and status["hits"] == 0


VAE_CLIENT = """
import json, sys
import torch
from zerocopy_pickle import cache
cache.patch_all(autostart=False)
from diffusers import AutoencoderKL
vae = AutoencoderKL.from_pretrained(sys.argv[1], subfolder="vae")
print(json.dumps({"weights": sum(float(p.double().sum()) for p in vae.parameters()), "key": cache.cached_key(vae)}))
"""


def test_a_repointed_symlinked_subfolder_is_a_miss(
    server: ServerProcess, models: dict[str, str], tmp_path: Path
) -> None:
    from diffusers import AutoencoderKL

    # A pipeline folder whose vae is a link to a shared folder (vae -> /shared/vae), as users share components.
    pipeline, shared = tmp_path / "pipeline", tmp_path / "shared"
    shutil.copytree(models["pipeline"], pipeline)
    shared.mkdir()
    (pipeline / "vae").rename(shared / "vae-a")
    vae_b = AutoencoderKL.from_pretrained(shared / "vae-a")
    with torch.no_grad():
        for parameter in vae_b.parameters():
            parameter.mul_(1.5)
    vae_b.save_pretrained(shared / "vae-b")
    expected_b = sum(float(p.detach().double().sum()) for p in vae_b.parameters())
    (pipeline / "vae").symlink_to(shared / "vae-a")
    (pipeline / "loop").symlink_to(pipeline)  # a cycle in the model folder: keyed all the same, without hanging
    first = run_client(server, VAE_CLIENT, str(pipeline))
    assert run_client(server, VAE_CLIENT, str(pipeline)) == {**first, "stderr": ANY}
    assert (server.status()["hits"], server.status()["misses"]) == (1, 1)
    (pipeline / "vae").unlink()
    (pipeline / "vae").symlink_to(shared / "vae-b")  # re-pointed at another VAE of the same shapes
    after = run_client(server, VAE_CLIENT, str(pipeline))
    assert after["key"] != first["key"]
    assert after["weights"] == pytest.approx(expected_b, rel=1e-9) and after["weights"] != first["weights"]
    assert (server.status()["hits"], server.status()["misses"]) == (1, 2)


def test_relative_paths_resolve_in_each_callers_directory(server: ServerProcess, tmp_path: Path) -> None:
    code = """
import json, torch
from zerocopy_pickle import cache
cache.patch_all(autostart=False)
state = torch.load("model.pt", weights_only=True)
print(json.dumps({"w": state["w"].tolist()}))
"""
    projects = {}
    for number in (1, 2):
        project = projects[number] = tmp_path / f"project-{number}"
        project.mkdir()
        torch.save({"w": torch.full((4,), float(number))}, project / "model.pt")
    for _ in range(2):  # a miss then a hit in each folder, from one server started elsewhere
        for number, project in projects.items():
            result = run_client(server, code, cwd=project)
            assert result["w"] == [float(number)] * 4, result["stderr"]
            assert "CacheWarning" not in result["stderr"]
    status = server.status()
    assert (status["hits"], status["misses"], len(status["entries"])) == (2, 2, 2)
    # A working directory the loader cannot enter: the miss fails (the caller then loads directly); the loader
    # never falls back to another folder, where "model.pt" could be somebody else's.
    missing = tmp_path / "gone"
    code = f"""
import dataclasses, json, torch
from zerocopy_pickle.cache import client
kwargs = {{"weights_only": True, "map_location": "cpu"}}  # not cached yet: a miss
request = client.describe("torch:load", None, ("model.pt",), kwargs)
request = dataclasses.replace(request, get=dataclasses.replace(request.get, cwd={str(missing)!r}))
try:
    client._fetch(request, ("model.pt",), kwargs, autostart=False)
except client.CacheError as e:
    print(json.dumps({{"error": str(e)}}))
"""
    result = run_client(server, code, cwd=projects[1])
    assert "FileNotFoundError" in result["error"] and str(missing) in result["error"]


HUB_CLIENT = """
import json, sys, warnings
warnings.simplefilter("always")
from zerocopy_pickle import cache
cache.patch_all(autostart=False)
from transformers import GPT2LMHeadModel
out = []
for name in sys.argv[1:]:
    try:
        model = GPT2LMHeadModel.from_pretrained(name)
    except Exception as e:
        out.append({"error": type(e).__name__})
    else:
        out.append({"weights": sum(float(p.double().sum()) for p in model.parameters()),
                    "key": cache.cached_key(model)})
print(json.dumps({"loads": out}))
"""


def hub_cache_with_two_commits(root: Path) -> tuple[Path, dict[str, float]]:
    """A local Hub cache as huggingface_hub lays it out, made by hand: ``models--org--tiny`` with two commits of a
    tiny GPT-2 (one of real files, one of symlinks to ``blobs/``), ``refs/main`` at the first. Returns the cache
    and each commit's parameter sum."""
    import hashlib

    from transformers import GPT2LMHeadModel

    repo = root / "models--org--tiny"
    commits = {hashlib.sha1(name.encode()).hexdigest(): seed for seed, name in enumerate(["a", "b"])}
    sums = {}
    for commit, seed in commits.items():
        snapshot = repo / "snapshots" / commit
        if seed == 0:
            build_gpt2(snapshot, seed=seed)
        else:
            staged = build_gpt2(root / "staged", seed=seed)
            snapshot.mkdir(parents=True)
            (repo / "blobs").mkdir(exist_ok=True)
            for file in Path(staged).iterdir():
                blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
                file.rename(blob)
                (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
        model = GPT2LMHeadModel.from_pretrained(snapshot)
        sums[commit] = sum(float(p.detach().double().sum()) for p in model.parameters())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(next(iter(commits)))
    return root, sums


def test_hub_ids_resolve_to_the_commit_their_ref_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub, sums = hub_cache_with_two_commits(tmp_path / "hub")
    commit_a, commit_b = sums
    assert sums[commit_a] != sums[commit_b]
    # The server has no HF_HUB_CACHE of its own (an autostarted server inherits the first client's): the loader
    # reads the commit the caller's key names, in the caller's Hub cache.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with private_dir() as directory:
        server = ServerProcess(directory)
        try:
            first = run_client(server, HUB_CLIENT, "org/tiny", HF_HUB_CACHE=str(hub))["loads"][0]
            second = run_client(server, HUB_CLIENT, "org/tiny", HF_HUB_CACHE=str(hub))["loads"][0]
            assert first["weights"] == pytest.approx(sums[commit_a], rel=1e-9)
            assert (second["weights"], second["key"]) == (first["weights"], first["key"])
            assert (server.status()["hits"], server.status()["misses"]) == (1, 1)
            (hub / "models--org--tiny" / "refs" / "main").write_text(commit_b)  # main moved on
            moved = run_client(server, HUB_CLIENT, "org/tiny", HF_HUB_CACHE=str(hub))["loads"][0]
            assert moved["key"] != first["key"]
            assert moved["weights"] == pytest.approx(sums[commit_b], rel=1e-9)
            assert (server.status()["hits"], server.status()["misses"]) == (1, 2)
            # A repository the local cache does not hold: which commit it names cannot be known offline. The call
            # is loaded directly (here the library's own error), warned about once, and not cached.
            absent = run_client(server, HUB_CLIENT, "org/absent", "org/absent", HF_HUB_CACHE=str(hub))
            assert absent["loads"] == [{"error": "OSError"}] * 2
            assert absent["stderr"].count("CacheWarning") == 1 and "cannot be known offline" in absent["stderr"]
            status = server.status()
            assert (status["hits"], status["misses"], len(status["entries"])) == (1, 2, 2)
        finally:
            server.stop()


def test_a_hit_checks_every_file_its_key_was_computed_from(server: ServerProcess, tmp_path: Path) -> None:
    code = """
import dataclasses, json, sys, torch
from zerocopy_pickle import cache
from zerocopy_pickle.cache import client
cache.patch_all(autostart=False)
if len(sys.argv) > 2:  # a client that could not see the file change: it asks for the key the entry was made under
    describe = client.describe
    def same_key(*args, **kwargs):
        request = describe(*args, **kwargs)
        request = dataclasses.replace(request, get=dataclasses.replace(request.get, key=sys.argv[2]))
        return request
    client.describe = same_key
state = torch.load(sys.argv[1], weights_only=True)
print(json.dumps({"w": state["w"].tolist()}))
"""
    checkpoint = tmp_path / "state.pt"
    torch.save({"w": torch.arange(4.0)}, checkpoint)
    assert run_client(server, code, str(checkpoint))["w"] == [0.0, 1.0, 2.0, 3.0]
    (key,) = [entry["key"] for entry in server.status()["entries"]]
    info = checkpoint.stat()
    rewritten = tmp_path / "next" / "state.pt"  # the same name: torch.save's archive records it
    rewritten.parent.mkdir()
    torch.save({"w": torch.arange(4.0) + 10}, rewritten)
    data = rewritten.read_bytes()
    assert len(data) == info.st_size
    with open(checkpoint, "r+b") as f:  # in place, same size, the modification time put back
        f.write(data)
    os.utime(checkpoint, ns=(info.st_atime_ns, info.st_mtime_ns))
    after = run_client(server, code, str(checkpoint), key)
    assert after["w"] == [10.0, 11.0, 12.0, 13.0], after["stderr"]
    status = server.status()
    assert (status["stale"], status["misses"], status["hits"]) == (1, 2, 0)
    assert run_client(server, code, str(checkpoint), key)["w"] == [10.0, 11.0, 12.0, 13.0]  # the new entry: a hit
    assert server.status()["hits"] == 1


def test_sixteen_clients_twenty_loads_each(server: ServerProcess, models: dict[str, str]) -> None:
    # The reference is a plain load (a miss is answered from the stored entry, as the hits are); every hit then
    # gives the miss's result exactly.
    plain = run_client(server, PLAIN_GPT2_CLIENT, models["gpt2"])["loads"][0]["sum"]
    expected = run_client(server, GPT2_CLIENT, models["gpt2"])["loads"][0]["sum"]
    assert expected == pytest.approx(plain, rel=1e-12)
    # Sixteen clients at once, each a child of the test zygote (torch and transformers already imported).
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        args = [models["gpt2"]] * 20
        runs = [
            pool.submit(run_python, GPT2_CLIENT, *args, env=server.env, timeout=900, check=False, preloaded=True)
            for _ in range(16)
        ]
        procs = [run.result() for run in runs]
    for proc in procs:
        out, err = proc.stdout, proc.stderr
        assert proc.returncode == 0, err
        loads = json.loads(out.strip().splitlines()[-1])["loads"]
        assert len(loads) == 20 and all(load["sum"] == expected for load in loads)
        assert "CacheWarning" not in err
    assert server.status()["hits"] == 16 * 20


def test_server_killed_mid_request_clients_fall_back(
    server: ServerProcess, models: dict[str, str], tmp_path: Path
) -> None:
    code = """
import json, os, sys, warnings, torch
warnings.simplefilter("always")
os.environ["ZEROCOPY_PICKLE_CACHE_FILL"] = "server"  # the miss loads in the server's loader
from zerocopy_pickle import cache
cache.patch_all(["tests.cache_helpers:gated_load"], autostart=False)
from tests import cache_helpers
result = cache_helpers.gated_load(sys.argv[1], sys.argv[2])
print(json.dumps({"sum": float(result["state"]["w"].sum()), "cached": cache.cached_key(result) is not None}))
"""
    gate = tmp_path / "gate"
    gate.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, models["state"], str(gate)], env={**os.environ, **server.env},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        wait_until(lambda: (gate / "entered").exists() or proc.poll() is not None, "the loader to take the miss")
        assert (gate / "entered").exists(), proc.communicate()
        server.kill()  # while the loader works on the client's miss (it waits for the release below)
    finally:
        (gate / "release").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"sum": float(sum(range(1000))), "cached": False}
    assert "CacheWarning" in err and "loading directly" in err


def test_no_server_loads_directly_and_warns_once(models: dict[str, str]) -> None:
    with private_dir() as directory:
        env = {"ZEROCOPY_PICKLE_CACHE_DIR": str(directory), "PYTHONPATH": str(REPO)}
        from .conftest import run_python

        proc = run_python(GPT2_CLIENT, models["gpt2"], models["gpt2_b"], env=env)
    loads = json.loads(proc.stdout.strip().splitlines()[-1])["loads"]
    assert all(load["key"] is None for load in loads)
    assert proc.stderr.count("CacheWarning") == 1


def test_loader_crash_is_reported_and_the_server_stays_up(server: ServerProcess, models: dict[str, str]) -> None:
    code = """
import json, os, sys, warnings, torch
warnings.simplefilter("always")
os.environ["ZEROCOPY_PICKLE_CACHE_FILL"] = "server"  # the miss loads in the server's loader
from zerocopy_pickle import cache
cache.patch_all(["tests.cache_helpers:crash_in_loader"], autostart=False)
from tests import cache_helpers
result = cache_helpers.crash_in_loader(sys.argv[1])
print(json.dumps({"sum": float(result["state"]["w"].sum())}))
"""
    result = run_client(server, code, models["state"])
    assert result["sum"] == float(sum(range(1000)))
    assert "loader process died" in result["stderr"]
    assert server.request("ping")["ok"]
    assert run_client(server, GPT2_CLIENT, models["gpt2"])["loads"][0]["key"] is not None  # still serving


def test_torch_load_and_load_file_are_cached(server: ServerProcess, models: dict[str, str], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"x": torch.arange(10.0)}, tmp_path / "w.safetensors")
    code = """
import json, sys, torch
from zerocopy_pickle import cache
cache.patch_all(autostart=False)
from safetensors.torch import load_file
state = torch.load(sys.argv[1], weights_only=True)
tensors = load_file(sys.argv[2])
print(json.dumps({"w": float(state["w"].sum()), "x": float(tensors["x"].sum()),
                  "cached": [cache.cached_key(state) is not None, cache.cached_key(tensors) is not None]}))
"""
    for _ in range(2):
        result = run_client(server, code, models["state"], str(tmp_path / "w.safetensors"))
        assert result["w"] == float(sum(range(1000))) and result["x"] == 45.0
    status = server.status()
    assert (status["hits"], status["misses"]) == (2, 2)


def test_clients_load_copy_on_write(server: ServerProcess, models: dict[str, str]) -> None:
    code = """
import json, sys, torch
from zerocopy_pickle import cache
cache.patch_all(autostart=False)
from transformers import GPT2LMHeadModel
a = GPT2LMHeadModel.from_pretrained(sys.argv[1])
with torch.no_grad():
    a.lm_head.weight.fill_(7.0)  # in place, in this client's private mapping
b = GPT2LMHeadModel.from_pretrained(sys.argv[1])
print(json.dumps({"b": float(b.lm_head.weight.double().sum()), "a": float(a.lm_head.weight.double().sum())}))
sys.stdout.flush()
sys.stdin.readline()  # stay alive while another client loads
"""
    baseline = run_client(server, GPT2_CLIENT, models["gpt2"])["loads"][0]
    writer = subprocess.Popen(
        [sys.executable, "-c", code, models["gpt2"]], env={**os.environ, **server.env}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    assert writer.stdout is not None and writer.stdin is not None
    line = json.loads(writer.stdout.readline())
    assert line["a"] != line["b"]
    other = run_client(server, GPT2_CLIENT, models["gpt2"])["loads"][0]
    assert other["sum"] == baseline["sum"]  # the writer's change never reached another client
    writer.stdin.write("\n")
    writer.stdin.flush()
    writer.communicate(timeout=60)


KEEPS_LOADING = """
import sys
from zerocopy_pickle import cache
cache.patch_all(autostart=False)
from transformers import GPT2LMHeadModel
held = []
for _ in range(1000):  # until killed
    held.append(GPT2LMHeadModel.from_pretrained(sys.argv[1]))  # each one's segments mapped, held
    print("loaded", cache.cached_key(held[-1]) is not None, flush=True)
"""


def test_killed_clients_leak_nothing_in_the_server(server: ServerProcess, models: dict[str, str]) -> None:
    run_client(server, GPT2_CLIENT, models["gpt2"])  # an entry to ask for
    key = server.status()["entries"][0]["key"]
    baseline_fds = server.open_fds()
    baseline_rss = server.rss()

    def abandon() -> None:
        # A client that asks for an entry and vanishes without reading the reply (fds in flight).
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(server.directory / "server.sock"))
            protocol.send(sock, {"op": "get", "key": key, "call": {"function": "x:y", "cls": None}, "refs": []})

    # In batches below the server's connection limit: a connection beyond it is refused (and closed) before the
    # client sends, which on a busy machine the 200 at once reached. Each batch's threads notice their hung-up
    # client before the next; the status connection is the only one left.
    for _ in range(200 // 25):
        for _ in range(25):
            abandon()
        wait_until(lambda: server.status()["connections"] <= 1, "the server to end the abandoned connections")
    assert server.status()["refused_connections"] == 0
    # A client killed while it loads: it says when it has two cached models mapped, and goes on asking.
    killed = subprocess.Popen(
        [sys.executable, "-c", KEEPS_LOADING, models["gpt2"]], env={**os.environ, **server.env},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert killed.stdout is not None
        lines = [killed.stdout.readline().strip() for _ in range(2)]
    finally:
        killed.kill()  # SIGKILL, mid-way through its next load
        _, err = killed.communicate()
    assert lines == ["loaded True", "loaded True"], err
    # The server notices hung-up clients on its own threads: wait for the descriptors to go (the bound fails it).
    wait_until(lambda: server.open_fds() <= baseline_fds + 2, "the server to close what the clients left")
    assert server.rss() < baseline_rss + 32 * 2**20
    assert run_client(server, GPT2_CLIENT, models["gpt2"])["loads"][0]["key"] == key


def test_eviction_under_a_small_budget(models: dict[str, str]) -> None:
    with private_dir() as directory:
        # --copy-files: the budget bounds the cache's own memory; referenced checkpoint files are page cache.
        probe = ServerProcess(directory, "--copy-files")  # how much one model takes in the cache
        try:
            run_client(probe, GPT2_CLIENT, models["gpt2"])
            one_model = probe.status()["total_bytes"]
        finally:
            probe.stop()
        server = ServerProcess(directory, "--copy-files", "--max-bytes", str(int(one_model * 1.5)))
        try:
            run_client(server, GPT2_CLIENT, models["gpt2"], models["gpt2_b"], models["gpt2_c"])
            status = server.status()
            assert len(status["entries"]) == 1 and status["evictions"] == 2
            assert status["total_bytes"] <= status["max_bytes"]
            run_client(server, GPT2_CLIENT, models["gpt2"])  # evicted: a miss again, correct all the same
            assert server.status()["misses"] == 4
        finally:
            server.stop()


def test_warm_restart_from_persistence(models: dict[str, str], tmp_path: Path) -> None:
    persist = tmp_path / "persist"
    with private_dir() as directory:
        server = ServerProcess(directory, "--persist", str(persist))
        try:
            first = run_client(server, GPT2_CLIENT, models["gpt2"])["loads"][0]
        finally:
            server.stop()
        server = ServerProcess(directory, "--persist", str(persist))
        try:
            assert len(server.status()["entries"]) == 1
            again = run_client(server, GPT2_CLIENT, models["gpt2"])["loads"][0]
            status = server.status()
            assert (status["hits"], status["misses"]) == (1, 0)
            assert again["sum"] == first["sum"]
        finally:
            server.stop()


SEALS_CLIENT = """
import fcntl, json, os, sys, torch
from zerocopy_pickle import cache
from zerocopy_pickle._storage import arena
from zerocopy_pickle.cache import client
cache.patch_all(autostart=False)
out = {"values": [torch.load(path, weights_only=True)["w"].tolist() for path in sys.argv[1:]]}
client._filer.drain()  # the misses above are filed: the request below is a hit, not a load by the server's loader
request = client.describe("torch:load", None, (sys.argv[1],), {"weights_only": True})
with client.Client(timeout=120) as connection:  # not the 5 s default: a busy machine may be slower than that
    header, _, fds = connection.request(request.get, request.payload)
out["hit"] = header["hit"]
out["sealed"] = [fcntl.fcntl(fd, fcntl.F_GET_SEALS) & arena.SEALS == arena.SEALS for fd in fds]
for fd in fds:
    os.close(fd)
print(json.dumps(out))
"""


def test_a_persisted_segment_changed_while_stopped_drops_only_its_entry(tmp_path: Path) -> None:
    persist = tmp_path / "persist"
    states = {name: torch.arange(256.0) * (index + 1) for index, name in enumerate(["a", "b"])}
    paths = {}
    for name, values in states.items():
        paths[name] = str(tmp_path / f"{name}.pt")
        torch.save({"w": values}, paths[name])
    with private_dir() as directory:
        server = ServerProcess(directory, "--persist", str(persist))
        try:
            run_client(server, SEALS_CLIENT, paths["a"], paths["b"])
            calls = {e["key"]: e["call"] for e in server.status()["entries"]}
        finally:
            server.stop()
        # Which segment holds a.pt's tensor: the index lists each entry's buffers (place, segment, ...).
        body = json.loads(json.loads((persist / "index.json").read_text())["body"])
        (entry_a,) = [e for e in body["entries"] if "a.pt" in calls[e["key"]]]
        (segment_a,) = {row[1] for row in entry_a["buffers"]}
        segment = persist / f"segment-{segment_a}.bin"
        data = bytearray(segment.read_bytes())
        data[-1] ^= 0xFF
        with open(segment, "r+b") as f:  # in place, same size
            f.write(data)
        server = ServerProcess(directory, "--persist", str(persist))
        try:
            status = server.status()
            assert status["persist_cold_start"] is None
            assert [e["call"] for e in status["entries"]] == [c for c in calls.values() if "b.pt" in c]
            result = run_client(server, SEALS_CLIENT, paths["b"], paths["a"])  # b: a hit; a: a miss, loaded anew
            assert result["values"] == [states["b"].tolist(), states["a"].tolist()]
            assert result["hit"] and result["sealed"] and all(result["sealed"])  # restored: sealed memfds
            status = server.status()
            assert (status["hits"], status["misses"]) == (2, 1)
        finally:
            server.stop()


def test_the_server_refuses_other_users_by_credentials() -> None:
    with private_dir() as directory:
        server = Server(directory / "server.sock")
        server.bind()
        assert server._listener is not None
        serving = threading.Thread(target=server.serve_forever, daemon=True)
        server.misses._start_zygote = lambda: None  # type: ignore[method-assign]  # no loader needed here
        serving.start()
        try:
            from zerocopy_pickle.cache import server as server_module

            real = server_module.peer_credentials
            server_module.peer_credentials = lambda sock: (1, os.getuid() + 1, 0)  # type: ignore[assignment]
            try:
                with Client(directory / "server.sock") as client:
                    # The server refuses at once and hangs up: wait for the hang-up, so that the request meets a
                    # closed socket every time; the client must still report the server's reason.
                    poller = select.poll()
                    poller.register(client.sock, select.POLLHUP)
                    wait_until(lambda: bool(poller.poll(100)), what="the server hanging up on a foreign peer")
                    with pytest.raises(protocol.CacheError, match=f"uid {os.getuid() + 1} may not use the cache"):
                        client.request({"op": "ping"})
            finally:
                server_module.peer_credentials = real
        finally:
            server.stop()
            serving.join(timeout=10)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another user")
def test_another_users_process_is_refused(
    server: ServerProcess, models: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    nobody = 65534
    sock_path = server.directory / "server.sock"
    # Open the door at the file-system level (as a careless admin might) to reach the credential check.
    os.chmod(server.directory.parent, 0o711)
    os.chmod(server.directory, 0o755)
    os.chmod(sock_path, 0o777)
    try:
        # A forked child that becomes uid 65534 (a fresh interpreter could not even start: the venv may live
        # under a home directory that user cannot read), asks for the status and reports the reply in a pipe.
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read_end)
                os.setgid(nobody)
                os.setuid(nobody)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.connect(str(sock_path))
                    # The server answers a foreign peer at once and hangs up: the request may meet a closed
                    # socket, the refusal is waiting to be read all the same.
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                        protocol.send(sock, {"op": "status"})
                    answer, _, _ = protocol.receive(sock)
                os.write(write_end, json.dumps(answer).encode())
                code = 0
            except BaseException as e:
                os.write(write_end, repr(e).encode())
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            output = pipe.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, output
        reply = json.loads(output)
        assert reply["ok"] is False and f"uid {nobody} may not use the cache" in reply["error"]
        # And the client side refuses a cache directory that is not private.
        monkeypatch.setenv(protocol.DIR_ENV, str(server.directory))
        with pytest.raises(protocol.CacheError, match="accessible to other users"):
            protocol.runtime_dir(create=False)
    finally:
        os.chmod(server.directory, 0o700)


def test_cli_serve_status_clear_stop(models: dict[str, str]) -> None:
    with private_dir() as directory:
        server = ServerProcess(directory)
        env = {**os.environ, **server.env}
        run_client(server, GPT2_CLIENT, models["gpt2"])
        cli = [sys.executable, "-m", "zerocopy_pickle.cache"]
        status = subprocess.run([*cli, "status"], capture_output=True, text=True, env=env, cwd=REPO, check=True)
        assert "1 entries" in status.stdout and "misses 1" in status.stdout
        report = subprocess.run(
            [*cli, "status", "--json"], capture_output=True, text=True, env=env, cwd=REPO, check=True
        )
        assert json.loads(report.stdout)["misses"] == 1
        cleared = subprocess.run([*cli, "clear"], capture_output=True, text=True, env=env, cwd=REPO, check=True)
        assert "dropped 1 entries" in cleared.stdout
        subprocess.run([*cli, "stop"], capture_output=True, text=True, env=env, cwd=REPO, check=True)
        server.process.wait(timeout=30)
        assert server.process.returncode == 0
        server.stop()
