"""The project's examples: the two demos ``zerocopy-pickle demo`` runs and the models that they, the tests and the
benchmarks build. They live beside the library, not in it: a wheel ships none of this.

- ``examples/models.py``: the models built here (random weights, no download).
- ``examples/snapshot_demo.py``: ``zerocopy-pickle demo --snapshot``, dump and load timed against torch.load and
  safetensors.
- ``examples/cache_scenario.py``: ``zerocopy-pickle demo`` and ``benchmarks/cache.py``, the seed scenario timed
  plain and through the model cache, every run a fresh process.

From a checkout: ``zerocopy-pickle demo`` (``make demo``), or ``python -m examples.snapshot_demo`` in the
checkout's root. The examples import the library as any user's code does, and a few of its internals where a
demo reports what the library does inside.
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def importable(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a child process that imports ``examples``: the checkout's root first on its path."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": str(CHECKOUT) + (os.pathsep + path if path else "")}
