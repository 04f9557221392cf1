"""Writes tests/golden/v1.zcp: a format-v1 snapshot that every later reader must still load.

Run once, when format v1 was introduced; the file is checked in and must never be regenerated (test_golden.py
pins its SHA-256). A new format version gets a new golden file and a new script, beside this one.

    .venv/bin/python tests/golden/make_v1.py
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import zerocopy_pickle as zp


def golden_object() -> dict[str, object]:
    """Deterministic contents (no randomness): test_golden.py rebuilds the same values to compare."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    linear = torch.nn.Linear(3, 2)
    with torch.no_grad():
        linear.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 10)
        linear.bias.copy_(torch.tensor([0.5, -0.5]))
    tied = torch.nn.Parameter(torch.linspace(-1, 1, 5))
    return {
        "float32": base,
        "view": base[1:, ::2],
        "float16": torch.arange(7, dtype=torch.float16) / 4,
        "bfloat16": torch.arange(5, dtype=torch.bfloat16) * 3,
        "int64": torch.arange(-3, 3, dtype=torch.int64),
        "uint8": torch.arange(250, 256).to(torch.uint8),
        "uint16": torch.arange(4).to(torch.uint16) * 1000,
        "bool": torch.tensor([True, False, True]),
        "complex64": torch.tensor([1 + 2j, -3j]),
        "float8_e4m3fn": torch.tensor([0.5, 1.0, -2.0]).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(7.25, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "meta": torch.empty(2, 2, device="meta"),
        "parameter": tied,
        "tied": [tied, tied],
        "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False),
        "large": torch.arange(40_000, dtype=torch.int32),
        "linear": linear,
        "containers": collections.OrderedDict(
            a=[1, 2.5, "x", None, True], b=(b"\x00\xff", {3, 4}), c=torch.Size([2, 3]), d=torch.device("cpu")
        ),
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("v1.zcp")
    zp.dump(golden_object(), out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
