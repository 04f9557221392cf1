"""Devices are recorded; map_location follows torch.load; a missing device fails before anything is built."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle import pickler

from .conftest import header_of, region_of

BUILT: list[int] = []


class Witness:
    """Records that unpickling reached it (to prove a failed load built nothing)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        BUILT.append(1)
        self.__dict__.update(state)


@pytest.fixture
def saved_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the pickler record every CPU storage as saved on cuda:0 (this machine has no GPU)."""
    real = pickler._reduce_untyped_storage

    def fake(state: Any, storage: torch.UntypedStorage) -> tuple[Any, ...]:
        func, args = real(state, storage)
        if func is not zp.rebuild.rebuild_storage:
            return func, args
        buffer, _ = args
        held, spec = state.pending[id(buffer)]
        state.pending[id(buffer)] = (held, dataclasses.replace(spec, location="cuda:0"))
        return func, (buffer, "cuda:0")

    monkeypatch.setattr(pickler, "_reduce_untyped_storage", fake)


def cuda_snapshot(saved_on_cuda: None) -> bytes:
    return zp.dumps({"w": torch.arange(4.0), "witness": Witness()})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_cuda_snapshot_without_cuda_names_map_location(saved_on_cuda: None) -> None:
    data = cuda_snapshot(saved_on_cuda)
    assert [b.location for b in header_of(data).buffers] == ["cuda:0"]
    BUILT.clear()
    with pytest.raises(zp.DeviceError, match=r"cuda:0.*CUDA is not available.*map_location='cpu'"):
        zp.loads(data, trusted=True)
    assert BUILT == []  # refused before unpickling


@pytest.mark.parametrize(
    "map_location",
    ["cpu", torch.device("cpu"), {"cuda:0": "cpu"}, {"cuda:0": torch.device("cpu")}],
    ids=["str", "device", "dict", "dict-device"],
)
def test_map_location_to_cpu_is_zero_copy(saved_on_cuda: None, map_location: Any) -> None:
    data = bytearray(cuda_snapshot(saved_on_cuda))
    loaded = zp.loads(data, map_location=map_location, trusted=True)
    assert torch.equal(loaded["w"], torch.arange(4.0))
    # Zero-copy even after remapping: the tensor's memory lies inside the caller's buffer.
    region = region_of(loaded["w"].data_ptr())
    assert region is not None
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(data))
    assert base <= loaded["w"].data_ptr() < base + len(data)


def test_map_location_callable_sees_saved_location(saved_on_cuda: None) -> None:
    data = cuda_snapshot(saved_on_cuda)
    seen: list[tuple[str, str]] = []

    def choose(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append((location, str(storage.device)))
        return storage

    loaded = zp.loads(data, map_location=choose, trusted=True)
    assert seen == [("cuda:0", "cpu")]
    assert loaded["w"].device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_map_location_callable_returning_none_restores_saved_device(saved_on_cuda: None) -> None:
    with pytest.raises(zp.DeviceError, match="CUDA is not available"):
        zp.loads(cuda_snapshot(saved_on_cuda), map_location=lambda s, loc: None, trusted=True)


def test_map_location_callable_returning_garbage(saved_on_cuda: None) -> None:
    with pytest.raises(zp.DeviceError, match="must return a storage or None"):
        zp.loads(cuda_snapshot(saved_on_cuda), map_location=lambda s, loc: 3, trusted=True)


def test_dict_leaves_unmapped_locations(saved_on_cuda: None) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the error raised where CUDA is absent")
    with pytest.raises(zp.DeviceError, match="map_location=.*cuda:1"):
        zp.loads(cuda_snapshot(saved_on_cuda), map_location={"cuda:1": "cpu"}, trusted=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_map_location_to_missing_device() -> None:
    data = zp.dumps({"w": torch.ones(2)})
    with pytest.raises(zp.DeviceError, match=r"map_location='cuda'"):
        zp.loads(data, map_location="cuda")


def test_map_location_to_meta() -> None:
    loaded = zp.loads(zp.dumps({"w": torch.ones(2, 3)}), map_location="meta")
    assert loaded["w"].is_meta and loaded["w"].shape == (2, 3)


@pytest.mark.parametrize("bad", [3, 1.5, ["cpu"]])
def test_malformed_map_location(bad: Any) -> None:
    with pytest.raises(zp.ArgumentError, match="map_location must be"):
        zp.loads(zp.dumps({"w": torch.ones(2)}), map_location=bad)


def test_unknown_device_name() -> None:
    with pytest.raises(zp.DeviceError, match="not a device name"):
        zp.loads(zp.dumps({"w": torch.ones(2)}), map_location="warp-drive")


def test_cpu_locations_are_recorded() -> None:
    assert [b.location for b in header_of(zp.dumps({"w": torch.ones(2)})).buffers] == ["cpu"]
    with zp.freeze({"w": torch.ones(2)}) as snap:
        assert [b.location for b in snap.header.buffers] == ["cpu"]
