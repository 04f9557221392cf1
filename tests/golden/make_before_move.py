"""Writes tests/golden/before_move.zcp: a snapshot written before the internal modules moved into private
packages (``_storage``, ``_trust``, ``_registry``, ``_devices``, ``_core``), holding every kind of value whose
rebuild function this library names in a stream: tensors, typed and meta storages, memory formats
(``zerocopy_pickle.rebuild``), NumPy arrays, scalars and dtypes (``zerocopy_pickle.safeglobals``) and a
parametrized module (a built-in quirk's rebuild). test_golden.py loads it, restricted, after the move.

Run once, before the move; the file is checked in and must never be regenerated (test_golden.py pins its SHA-256).

    .venv/bin/python tests/golden/make_before_move.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import zerocopy_pickle as zp


def golden_object() -> dict[str, object]:
    """Deterministic contents (no randomness): test_golden.py rebuilds the same values to compare."""
    torch.manual_seed(0)
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(2, 3, 3))
    with torch.no_grad():
        conv.parametrizations.weight.original0.copy_(torch.arange(3, dtype=torch.float32).reshape(3, 1, 1) + 1)
        conv.parametrizations.weight.original1.copy_(torch.arange(18, dtype=torch.float32).reshape(3, 2, 3) / 7)
        conv.bias.copy_(torch.tensor([0.25, -0.5, 1.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated: the stream still names it
        typed = torch.arange(4, dtype=torch.int16).storage()
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 2, 2)
    return {
        "tensor": torch.arange(12, dtype=torch.float16).reshape(3, 4),
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "memory_format": torch.channels_last,
        "typed_storage": typed,
        "meta": torch.empty(3, 5, device="meta"),
        "ndarray": np.arange(10, dtype=np.float64).reshape(2, 5),
        "fortran": np.asfortranarray(np.arange(6, dtype=">i4").reshape(2, 3)),
        "np_scalar": np.float64(0.91),
        "np_int": np.int16(-7),
        "np_dtype": np.dtype("<u2"),
        "np_string": np.str_("abc"),
        "weight_norm_conv": conv,
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("before_move.zcp")
    zp.dump(golden_object(), out)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
