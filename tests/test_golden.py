"""Backward compatibility: the format-v1 golden snapshot, written once and checked in, still loads exactly."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp

GOLDEN = Path(__file__).with_name("golden") / "v1.zcp"
GOLDEN_V2 = GOLDEN.with_name("v2.zcp")
GOLDEN_V2_KEY = b"zerocopy_pickle golden v2 key"
# The file must never be regenerated: a reader change that breaks it is a format break.
GOLDEN_V2_SHA256 = "61ca395554ab66c3483c6fa30e2ee0dd7560394ca716711a57fb4eb072adb0d9"
GOLDEN_SHA256 = "293d9e7d063259e4107d2c3116226056c972bccbb03f855112716f021f4aaf9d"


def _made_by(script: str) -> dict[str, Any]:
    """The object a golden file's script (tests/golden/SCRIPT.py) writes, rebuilt to compare."""
    spec = importlib.util.spec_from_file_location(script, GOLDEN.with_name(f"{script}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.golden_object()  # type: ignore[no-any-return]


def golden_object() -> dict[str, Any]:
    return _made_by("make_v1")


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if a.is_meta:
            return bool(b.is_meta and a.shape == b.shape and a.dtype == b.dtype)
        return bool(
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.contiguous().reshape(-1).view(torch.uint8).tolist()
            == b.contiguous().reshape(-1).view(torch.uint8).tolist()
        )
    return bool(a == b)


def test_golden_file_is_unchanged() -> None:
    assert hashlib.sha256(GOLDEN.read_bytes()).hexdigest() == GOLDEN_SHA256


def test_golden_v1_loads() -> None:
    loaded = zp.load(GOLDEN, allow=[torch.nn.Linear])
    expected = golden_object()
    assert loaded.keys() == expected.keys()
    for key in ("float32", "view", "float16", "bfloat16", "int64", "uint8", "uint16", "bool", "complex64",
                "float8_e4m3fn", "scalar", "empty", "meta", "large"):  # fmt: skip
        assert equal(loaded[key], expected[key]), key
    assert loaded["view"].data_ptr() == loaded["float32"].data_ptr() + 6 * 4
    assert isinstance(loaded["parameter"], torch.nn.Parameter) and loaded["parameter"].requires_grad
    assert loaded["tied"][0] is loaded["tied"][1] is loaded["parameter"]
    assert not loaded["frozen"].requires_grad
    assert torch.equal(loaded["linear"].weight, expected["linear"].weight)
    assert torch.equal(loaded["linear"](torch.ones(1, 3)), expected["linear"](torch.ones(1, 3)))
    assert loaded["containers"] == expected["containers"]


def test_golden_v1_header() -> None:
    with zp.Snapshot.open(GOLDEN) as snap:
        header = snap.header
    assert header.version == 1
    assert header.producer["zerocopy_pickle"] == "0.1.0.dev0"
    assert header.plugins == ()
    (large,) = [entry for entry in header.buffers if entry.nbytes == 160_000]
    assert large.dtype == "int32" and large.location == "cpu"
    assert large.offset % 4096 == 0
    assert all(entry.offset % 64 == 0 for entry in header.buffers)


def test_golden_v1_loads_in_every_way() -> None:
    data = GOLDEN.read_bytes()
    assert torch.equal(zp.loads(data, allow=[torch.nn.Linear])["large"], torch.arange(40_000, dtype=torch.int32))
    with open(GOLDEN, "rb") as f:
        assert zp.load(f, trusted=True)["scalar"] == 7.25
    with zp.Snapshot.open(GOLDEN) as snap:
        assert snap.load(trusted=True)["int64"].tolist() == [-3, -2, -1, 0, 1, 2]


def test_golden_v2_file_is_unchanged() -> None:
    assert hashlib.sha256(GOLDEN_V2.read_bytes()).hexdigest() == GOLDEN_V2_SHA256


def test_golden_v2_verifies_and_loads_trusted_with_its_key() -> None:
    loaded = zp.load(GOLDEN_V2, key=GOLDEN_V2_KEY, verify=True)  # trusted: no allow= for Linear
    expected = golden_object()
    assert torch.equal(loaded["linear"].weight, expected["linear"].weight)
    assert equal(loaded["large"], expected["large"])
    header = zp.read_header(GOLDEN_V2)
    assert header.version == 2 and header.signature and header.checksums is not None
    with pytest.raises(zp.IntegrityError, match="signature does not match"):
        zp.load(GOLDEN_V2, key=b"another key")


BEFORE_MOVE = GOLDEN.with_name("before_move.zcp")
BEFORE_MOVE_SHA256 = "a7c52e9eef2eb68af4b8fc0e120f51c0f5fe5f8ac45ef9fe3dd3fa25c08ac55d"


def before_move_object() -> dict[str, Any]:
    return _made_by("make_before_move")


def test_the_snapshot_written_before_the_private_packages_is_unchanged() -> None:
    assert hashlib.sha256(BEFORE_MOVE.read_bytes()).hexdigest() == BEFORE_MOVE_SHA256


def test_the_snapshot_written_before_the_private_packages_loads_restricted_and_equal() -> None:
    import numpy as np

    names = {f"{module}:{name}" for module, name in zp.scan(BEFORE_MOVE)}
    # The library's own paths this file names: they are part of the format and stay where they were.
    assert {name for name in names if name.startswith("zerocopy_pickle.")} == {
        "zerocopy_pickle.rebuild:rebuild_tensor",
        "zerocopy_pickle.rebuild:rebuild_storage",
        "zerocopy_pickle.rebuild:rebuild_memory_format",
        "zerocopy_pickle.rebuild:rebuild_typed_storage",
        "zerocopy_pickle.safeglobals:rebuild_ndarray",
        "zerocopy_pickle.safeglobals:rebuild_numpy_scalar",
        "zerocopy_pickle.safeglobals:rebuild_numpy_dtype",
    }
    loaded = zp.load(BEFORE_MOVE, allow=[torch.nn.Conv1d])
    expected = before_move_object()
    assert loaded.keys() == expected.keys()
    for key in ("tensor", "channels_last", "meta"):
        assert equal(loaded[key], expected[key]), key
    assert loaded["channels_last"].is_contiguous(memory_format=torch.channels_last)
    assert loaded["memory_format"] is torch.channels_last
    assert loaded["typed_storage"].tolist() == expected["typed_storage"].tolist()
    for key in ("ndarray", "fortran"):
        assert loaded[key].dtype == expected[key].dtype and np.array_equal(loaded[key], expected[key]), key
    assert loaded["fortran"].flags.f_contiguous
    for key in ("np_scalar", "np_int", "np_dtype", "np_string"):
        assert type(loaded[key]) is type(expected[key]) and loaded[key] == expected[key], key
    conv, want = loaded["weight_norm_conv"], expected["weight_norm_conv"]
    assert torch.nn.utils.parametrize.is_parametrized(conv, "weight")
    x = torch.arange(20, dtype=torch.float32).reshape(1, 2, 10) / 3
    assert torch.equal(conv(x), want(x))
