"""The cold-start benchmark's peer loaders (``benchmarks/coldstart_peers.py``): each peer that works on this machine
gives back every tensor of a safetensors file bit for bit, and each one that does not says why in one line. The
peers come with the ``bench`` extra; without it every peer is unavailable, with a reason, and nothing is skipped.

The peers run in child interpreters: their packages bring native thread pools and import more libraries (boto3,
accelerate, redis) that the rest of the suite's process should not inherit."""

from __future__ import annotations

import hashlib
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:  # benchmarks/ is no package: its scripts import each other from sys.path
    sys.path.append(str(BENCHMARKS))
peers: Any = importlib.import_module("coldstart_peers")  # stdlib, torch and safetensors only: no peer is imported

PACKAGES = ("runai-model-streamer", "fastsafetensors", "flashpack", "tensorizer", "instanttensor")
MODULES = ("runai_model_streamer", "fastsafetensors", "flashpack", "tensorizer", "instanttensor")

# argv: the benchmarks folder, "hide" or "show" (hide: every peer's package missing, as without the bench extra),
# then optionally a safetensors file and a work folder to round-trip through every available peer. Prints JSON:
# {peer: {"reason": ..., "version": ..., "path": what prepare returned,
#         "loaded": {tensor: [type, device, dtype, shape, sha256 of its bytes]}}}.
CHILD = f"""
import hashlib, importlib.abc, importlib.metadata, json, sys, traceback
benchmarks, mode, *files = sys.argv[1:]
if mode == "hide":
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {MODULES!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, Hide())
    real_version = importlib.metadata.version

    def version(name):
        if name in {PACKAGES!r}:
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    importlib.metadata.version = version
sys.path.insert(0, benchmarks)
import coldstart_peers

report = {{}}
for peer in coldstart_peers.PEERS:
    entry = report[peer.name] = {{"reason": peer.unavailable(), "version": peer.version()}}
    if files and entry["reason"] is None:
        try:
            entry["path"] = peer.prepare(*files)
            loaded = peer.load(entry["path"])
            entry["loaded"] = {{
                name: [
                    type(t).__module__ + "." + type(t).__qualname__,
                    str(t.device),
                    str(t.dtype),
                    list(t.shape),
                    hashlib.sha256(t.contiguous().reshape(-1).view(__import__("torch").uint8).numpy()).hexdigest(),
                ]
                for name, t in loaded.items()
            }}
        except Exception:
            entry["error"] = traceback.format_exc()
print(json.dumps(report))
"""


def run_child(mode: str, *files: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(BENCHMARKS), mode, *files],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


PROBE = run_child("show")
AVAILABLE = [name for name, entry in PROBE.items() if entry["reason"] is None]


def state_dict() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40, 65504.0, 3.0])
    return {
        "embed.weight": torch.randn(257, 33, generator=generator, dtype=torch.float32),
        "block.0.attn.weight": torch.randn(61, 7, 3, generator=generator).to(torch.float16),
        "block.0.attn.bias": torch.randn(61, generator=generator).to(torch.bfloat16),
        "block.0.norm.weight": torch.randn(1, generator=generator).to(torch.bfloat16),
        "special.f32": special,
        "special.f16": special.to(torch.float16),
        "special.bf16": special.to(torch.bfloat16),
        "scale": torch.tensor(0.125),
        "head.weight": torch.randn(1021, 5, generator=generator).to(torch.float16),
    }


def describe(tensor: torch.Tensor) -> list[Any]:
    digest = hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    return ["torch.Tensor", "cpu", str(tensor.dtype), list(tensor.shape), digest]


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, Path]:
    """Every available peer's load of one safetensors file, from one child interpreter."""
    folder = tmp_path_factory.mktemp("coldstart-peers")
    source = folder / "model.safetensors"
    safetensors.torch.save_file(state_dict(), str(source))
    workdir = folder / "work"
    workdir.mkdir()
    return run_child("show", str(source), str(workdir)), source, workdir


def test_the_peers_are_the_five_named_once_each() -> None:
    assert [peer.package for peer in peers.PEERS] == list(PACKAGES)
    assert len({peer.name for peer in peers.PEERS}) == len(PACKAGES)
    assert set(PROBE) == {peer.name for peer in peers.PEERS}


@pytest.mark.slow
@pytest.mark.parametrize("name", AVAILABLE or [pytest.param(None, id="no-peer-works-here")])
def test_an_available_peer_loads_every_tensor_bit_for_bit(name: str | None, roundtrip: Any) -> None:
    if name is None:  # the bench extra is not installed: test_unavailable_peers_say_why checks every reason
        return
    report, source, workdir = roundtrip
    entry = report[name]
    assert entry["reason"] is None and entry["version"], entry
    assert "error" not in entry, entry["error"]
    expected = {tensor_name: describe(tensor) for tensor_name, tensor in state_dict().items()}
    assert set(entry["loaded"]) == set(expected)
    for tensor_name, facts in expected.items():
        assert entry["loaded"][tensor_name] == facts, tensor_name  # a plain CPU tensor, same dtype, shape, bytes
    path = Path(entry["path"])  # the safetensors file itself, or the peer's own file, written into the work folder
    assert path == source or (path.parent == workdir and path.is_file()), path


def test_unavailable_peers_say_why() -> None:
    for name, entry in PROBE.items():
        reason = entry["reason"]
        if reason is None:
            continue
        package = next(peer.package for peer in peers.PEERS if peer.name == name)
        assert isinstance(reason, str) and reason.startswith(package) and "\n" not in reason, reason
        if entry["version"] is None:
            assert "not installed" in reason, reason


@pytest.mark.slow
def test_without_any_peer_package_every_peer_says_it_is_not_installed() -> None:
    """With every peer's package hidden (as without the bench extra) the module still imports, and every peer is
    unavailable: not installed, in one line."""
    report = run_child("hide")
    assert set(report) == {peer.name for peer in peers.PEERS}
    for name, entry in report.items():
        assert entry["version"] is None, name
        reason = entry["reason"]
        assert isinstance(reason, str) and "not installed" in reason and "\n" not in reason, (name, reason)
