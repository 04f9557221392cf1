"""The zerocopy-pickle command line: inspect, convert, demo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle.cli import main

from .conftest import REPO


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, as a user runs it."""
    script = shutil.which("zerocopy-pickle", path=os.path.dirname(sys.executable))
    assert script is not None, "the zerocopy-pickle console script is not installed"
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    path = tmp_path / "sd.zcp"
    zp.dump({"w": torch.ones(4, 4, dtype=torch.float16), "b": torch.arange(3), "layer": torch.nn.Linear(2, 2)}, path)
    return path


def test_inspect_text(snapshot: Path) -> None:
    proc = run_cli("inspect", str(snapshot))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "format v2" in out
    assert "checksums: xxh3_64" in out
    assert "float16 32 B" in out and "int64 24 B" in out
    assert "torch.nn.modules.linear:Linear" in out
    assert "zerocopy_pickle.rebuild:rebuild_storage" in out
    assert "cpu" in out


def test_inspect_json(snapshot: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "--json", str(snapshot)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format_version"] == 2
    assert report["checksums"]["algorithm"] == "xxh3_64"
    assert report["signed"] is False
    assert report["nbytes_by_dtype"]["float16"] == 32
    assert len(report["buffers"]) == 4
    assert {"offset", "nbytes", "location", "dtype", "readonly"} == set(report["buffers"][0])
    assert "torch.nn.modules.linear:Linear" in report["globals"]
    assert report["total_nbytes"] == snapshot.stat().st_size


def test_inspect_bad_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.zcp"
    bad.write_bytes(b"x" * 100)
    assert main(["inspect", str(bad)]) == 1
    assert "not a zerocopy_pickle snapshot" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "missing")]) == 1


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_convert_torch_save(tmp_path: Path, zipfile: bool) -> None:
    state = {"a": torch.randn(3, 3), "b": torch.arange(4)}
    state["tied"] = state["a"]
    src, dst = tmp_path / "m.pt", tmp_path / "m.zcp"
    torch.save(state, src, _use_new_zipfile_serialization=zipfile)
    proc = run_cli("convert", str(src), str(dst))
    assert proc.returncode == 0, proc.stderr
    assert "(torch)" in proc.stdout
    loaded = zp.load(dst)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    assert loaded["tied"].data_ptr() == loaded["a"].data_ptr()


def test_convert_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    state = {"x": torch.randn(5), "y": torch.ones(2, 2, dtype=torch.bfloat16)}
    src, dst = tmp_path / "m.safetensors", tmp_path / "m.zcp"
    save_file(state, src)
    assert main(["convert", str(src), str(dst)]) == 0
    assert "(safetensors)" in capsys.readouterr().out
    loaded = zp.load(dst)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


class Custom:
    def __init__(self) -> None:
        self.t = torch.ones(2)


def test_convert_untrusted_torch_file_needs_trusted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, dst = tmp_path / "c.pt", tmp_path / "c.zcp"
    torch.save({"obj": Custom()}, src)
    assert main(["convert", str(src), str(dst)]) == 1
    assert "--trusted" in capsys.readouterr().err
    assert not dst.exists()
    assert main(["convert", "--trusted", str(src), str(dst)]) == 0
    assert zp.load(dst, allow=[Custom])["obj"].t.sum() == 2


def test_convert_refuses_garbage_and_snapshots(
    tmp_path: Path, snapshot: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "g.bin"
    garbage.write_bytes(b"\x00" * 50)
    assert main(["convert", str(garbage), str(tmp_path / "o.zcp")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert main(["convert", str(snapshot), str(tmp_path / "o.zcp")]) == 1
    assert "already a zerocopy_pickle snapshot" in capsys.readouterr().err


def test_snapshot_demo_runs_small() -> None:
    proc = run_cli("demo", "--snapshot", "--size-mb", "40", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for method in ("torch.save / torch.load", "safetensors", "zerocopy_pickle dump / load", "whole nn.Module"):
        assert method in out
    assert "outputs identical" in out


def test_help_lists_commands() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("inspect", "convert", "demo"):
        assert command in proc.stdout
