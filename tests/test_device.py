"""Devices are recorded; map_location follows torch.load; a missing device fails before anything is built."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import pickler

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


class _CountingMap(dict[str, str]):
    """A ``map_location`` dict that counts how often a load looks a saved location up."""

    looked_up = 0

    def get(self, key: Any, default: Any = None) -> Any:
        self.looked_up += 1
        return super().get(key, default)


@pytest.mark.parametrize("source", ["file", "bytes"])
def test_a_load_examines_map_location_once_per_saved_location(tmp_path: Any, source: str) -> None:
    """The load core turns map_location into one Targets per load: the device check, the prefetch decision and
    the storage builder all read its answer, so 100 tensors saved on the CPU look "cpu" up once, not per storage
    and not once per place that asks."""
    state = {f"t{i}": torch.full((3,), float(i)) for i in range(100)}
    mapping = _CountingMap(cpu="cpu")
    if source == "file":
        zp.dump(state, tmp_path / "s.zcp")
        loaded = zp.load(tmp_path / "s.zcp", map_location=mapping)
    else:
        loaded = zp.loads(zp.dumps(state), map_location=mapping)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert mapping.looked_up == 1


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


# -- placement by the header's buffer rows, one device storage per buffer (issue 25) ------------------------------


def rows_snapshot(stream: bytes, buffers: list[bytes], location: str, dtype: str | None) -> bytes:
    """A snapshot whose buffer rows all say ``location`` and ``dtype`` (the stream says what it likes)."""
    from tests.internals import format as fmt

    layout = fmt.encode(len(stream), [fmt.BufferSpec(len(b), location=location, dtype=dtype) for b in buffers])
    out = bytearray(layout.prefix + stream)
    out += bytes(layout.data_offset - len(out))
    for offset, data in zip(layout.buffer_offsets, buffers, strict=True):
        out += bytes(layout.data_offset + offset - len(out)) + data
    return bytes(out)


def storages_of_one_buffer(k: int, stream_location: str) -> bytes:
    """A stream that consumes one buffer and passes it to ``k`` separate ``rebuild_storage`` calls."""
    from .hostile_streams import NEXT_BUFFER, G, call, memo_get, memo_put, program

    rebuild = memo_put(G("zerocopy_pickle.rebuild", "rebuild_storage"), 0)
    first = call(rebuild, memo_put(NEXT_BUFFER, 1), stream_location)
    return program([first] + [call(memo_get(0), memo_get(1), stream_location) for _ in range(k - 1)])


PAYLOAD = bytes(range(256)) * 16


@pytest.mark.parametrize("trusted", [False, True])
def test_k_references_to_one_buffer_make_one_device_copy(fake_cuda: list[Any], trusted: bool) -> None:
    k = 50
    data = rows_snapshot(storages_of_one_buffer(k, "cuda:0"), [PAYLOAD], "cuda:0", "uint8")
    storages = zp.loads(data, trusted=trusted)
    assert len(storages) == k and all(s is storages[0] for s in storages)
    assert len(fake_cuda) == 1
    assert len(fake_cuda[0].calls("allocate")) == 1 and len(fake_cuda[0].calls("copy")) == 1
    assert bytes(storages[0]) == PAYLOAD


def test_the_header_row_not_the_stream_chooses_the_device(fake_cuda: list[Any]) -> None:
    """The row says cpu, each of the K calls says cuda:0: the storages stay one zero-copy CPU storage (the stream's
    location argument is checked as a device string and otherwise ignored), and nothing reaches the device."""
    k = 40
    data = bytearray(rows_snapshot(storages_of_one_buffer(k, "cuda:0"), [PAYLOAD], "cpu", "uint8"))
    storages = zp.loads(data)
    assert all(s is storages[0] for s in storages) and storages[0].device.type == "cpu"
    assert fake_cuda == []
    import ctypes

    base = ctypes.addressof(ctypes.c_char.from_buffer(data))
    assert base <= storages[0].data_ptr() < base + len(data)  # a view of the caller's bytes, not a copy


def test_buffers_without_a_bulk_transfer_are_placed_once(fake_cuda: list[Any]) -> None:
    """Rows without a dtype go storage by storage: still once per buffer, not once per reference."""
    k = 30
    data = rows_snapshot(storages_of_one_buffer(k, "cpu"), [PAYLOAD], "cuda:0", None)
    seen: list[str] = []

    def to_cpu(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append(location)
        return storage

    storages = zp.loads(data, map_location=to_cpu)
    assert seen == ["cuda:0"]  # called once, with the row's location (the stream said "cpu")
    assert all(s is storages[0] for s in storages)
    metas = zp.loads(data, map_location={"cuda:0": "meta"})
    assert all(s is metas[0] for s in metas) and metas[0].device.type == "meta"
    assert fake_cuda == []


def test_the_stream_s_location_argument_is_still_checked(fake_cuda: list[Any]) -> None:
    data = rows_snapshot(storages_of_one_buffer(2, "x" * 65), [PAYLOAD], "cpu", "uint8")
    with pytest.raises(zp.SnapshotError, match="location must be a device string"):
        zp.loads(data)


def test_the_public_unpickler_places_each_buffer_once() -> None:
    """ZeroCopyUnpickler used directly (no header rows): a list of buffers gets its own placement, so K
    references to one buffer are one storage, and a map_location is asked once."""
    import io

    k = 20
    stream = storages_of_one_buffer(k, "cpu")
    buffers = [pickle.PickleBuffer(bytearray(PAYLOAD))]
    storages = zp.ZeroCopyUnpickler(io.BytesIO(stream), buffers=buffers).load()
    assert len(storages) == k and all(s is storages[0] for s in storages)
    assert bytes(storages[0]) == PAYLOAD
    moved: list[str] = []

    def placed(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        moved.append(location)
        return storage

    again = zp.ZeroCopyUnpickler(io.BytesIO(stream), buffers=buffers, map_location=placed).load()
    assert moved == ["cpu"] and all(s is again[0] for s in again)
