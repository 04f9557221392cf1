"""The demos live in ``examples/``, beside the package: ``zerocopy-pickle demo`` finds them in the checkout it runs
from, and a wheel, which ships none of them, says where the demo is instead of failing on an import."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .conftest import REPO
from .internals import cli_demo, main

pytestmark = pytest.mark.usefixtures("restore_logging_and_environment")  # main() configures logging as a CLI does


def test_the_demo_finds_the_examples_of_the_checkout_it_runs_from() -> None:
    assert cli_demo._examples_checkout() == REPO


def test_the_demo_outside_a_checkout_says_to_run_it_from_a_clone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli_demo, "_examples_checkout", lambda: None)
    assert main(["demo", "--snapshot"]) == 1
    err = capsys.readouterr().err
    assert "git clone" in err
    assert "make demo" in err


@pytest.mark.slow
def test_a_wheel_holds_every_package_and_no_examples_and_its_demo_points_to_a_clone(tmp_path: Path) -> None:
    """Built and unpacked as pip would install it: the library dumps and loads from it, and its demo refuses
    with the one thing that works."""
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*build, str(REPO)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(site)
    assert not any(name.startswith("examples/") for name in names)
    for wing in ("_core", "_devices", "_registry", "_storage", "_trust", "cache"):
        assert f"zerocopy_pickle/{wing}/__init__.py" in names
    script = (
        "import sys, torch, zerocopy_pickle as zp\n"
        f"assert zp.__file__.startswith({str(site)!r}), zp.__file__\n"
        "assert torch.equal(zp.loads(zp.dumps({'w': torch.arange(3.0)}))['w'], torch.arange(3.0))\n"
        "from zerocopy_pickle._cli import main\n"
        "sys.exit(main(['demo']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "make demo" in proc.stderr
