"""Shared fixtures: fresh interpreters, small models, and helpers to read process memory figures."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from zerocopy_pickle import format as fmt

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (same venv), with ``args`` as ``sys.argv[1:]``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


@pytest.fixture
def python() -> object:
    """``python(code, *args)`` runs code in a fresh interpreter and returns the CompletedProcess."""
    return run_python


class TiedNet(torch.nn.Module):
    """A module with a buffer, a frozen parameter and tied weights (importable, so it pickles by reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.body[0].bias.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)) * self.scale)


TIED_NET_ALLOW = [
    TiedNet,
    torch.nn.Embedding,
    torch.nn.Sequential,
    torch.nn.Linear,
    torch.nn.GELU,
    torch.nn.LayerNorm,
]


@pytest.fixture
def tied_net() -> TiedNet:
    torch.manual_seed(0)
    return TiedNet().eval()


def header_of(data: bytes) -> fmt.Header:
    """The validated header of a snapshot held in ``data``."""
    header_nbytes, _, _ = fmt.decode_fixed(data[:32], len(data))
    return fmt.decode_header(data[:32], data[32 : 32 + header_nbytes], len(data))


def mapped_regions(pid: int | str = "self") -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of every mapping of a process, from /proc/<pid>/maps."""
    regions = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in parts[0].split("-"))
            regions.append((start, end, parts[5].strip() if len(parts) > 5 else ""))
    return regions


def region_of(address: int) -> tuple[int, int, str] | None:
    """The mapping of this process that contains ``address``."""
    for start, end, path in mapped_regions():
        if start <= address < end:
            return start, end, path
    return None
