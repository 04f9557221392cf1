"""The seed scenario's runs as ``benchmarks/cache.py`` uses them: the first call with no server running (which
must leave no server behind), and the Overmind side's runner, whose runs must have the scenario's shape.

Overmind itself is not installed here (it lives in a virtualenv of its own, ``benchmarks/overmind_runner.py``);
what is tested is the part that runs without it: the runner's ``plain`` mode, and that a Python without Overmind
is refused with the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

from examples import cache_scenario as scenario
from examples import importable
from examples.models import build_controlnet_pipeline
from zerocopy_pickle.cache.protocol import DIR_ENV

from .conftest import REPO

pytestmark = pytest.mark.slow

RUNNER = REPO / "benchmarks" / "overmind_runner.py"
COLUMNS = {*scenario.STEPS, "load", "touch", "total"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_controlnet_pipeline(tmp_path_factory.mktemp("models"), size="tiny")


def _runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("overmind_runner", RUNNER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _processes_with(text: str) -> list[int]:
    """Pids of the live processes whose environment contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_autostart_run_starts_a_server_and_stops_it(
    models: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the run's fresh cache directory goes under here
    run = scenario.measure_autostart(models, "wrapper")
    assert set(run) == COLUMNS
    assert run["total"] == pytest.approx(run["load"] + run["touch"])
    assert all(run[step] > 0 for step in scenario.STEPS)
    assert not _processes_with(f"{DIR_ENV}={tmp_path}"), "the server the run started is still running"
    assert not list(tmp_path.iterdir())  # its directory is gone too


def test_overmind_runner_plain_run_has_the_scenario_shape(models: dict[str, str]) -> None:
    ours = subprocess.run(
        [sys.executable, "-m", "examples.cache_scenario", "plain", "wrapper", json.dumps(models), "float32"],
        env=importable(dict(os.environ)), capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    theirs = subprocess.run(
        [sys.executable, str(RUNNER), "run", "plain", "wrapper", json.dumps(models), "float32"],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    ours_run, their_run = json.loads(ours.stdout.splitlines()[-1]), json.loads(theirs.stdout.splitlines()[-1])
    assert set(their_run) == set(ours_run) == COLUMNS
    assert their_run["load"] == pytest.approx(sum(their_run[step] for step in scenario.STEPS))


def test_overmind_runner_remote_variant_has_the_extra_step(models: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(RUNNER), "run", "plain", "remote", json.dumps(models), "float32"],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    assert set(json.loads(proc.stdout.splitlines()[-1])) == {*COLUMNS, scenario.REMOTE_STEP}


@pytest.mark.parametrize("mode", ["plain", "cache"])
def test_a_run_prints_its_result_and_nothing_else(models: dict[str, str], mode: str) -> None:
    """The demo shows a run's stderr when it fails: no third-party noise or progress bars may bury the error."""
    with scenario.private_server() if mode == "cache" else contextlib.nullcontext(dict(os.environ)) as env:
        runs = [
            scenario._run_process(env, mode, "remote", models, "float32") for _ in range(2 if mode == "cache" else 1)
        ]
    for proc in runs:  # a cache's miss, then its hit
        assert proc.returncode == 0, proc.stderr
        assert set(json.loads(proc.stdout)) == {*COLUMNS, scenario.REMOTE_STEP}  # one line: the result
        assert proc.stderr == ""


def test_a_python_without_overmind_is_refused_with_the_reason(tmp_path: Path) -> None:
    runner = _runner()
    with pytest.raises(runner.OvermindUnavailable, match="cannot import overmind"):
        runner.Overmind(sys.executable)  # this venv has torch and diffusers, not Overmind
    with pytest.raises(runner.OvermindUnavailable, match="does not exist"):
        runner.Overmind(str(tmp_path / "no-venv"))
