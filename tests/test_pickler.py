"""ZeroCopyPickler / ZeroCopyUnpickler used directly, as pickle.Pickler / Unpickler-shaped classes."""

from __future__ import annotations

import io
import pickle
import pickletools

import pytest
import torch

import zerocopy_pickle as zp


def opcodes(stream: bytes) -> list[str]:
    return [op.name for op, _, _ in pickletools.genops(stream)]


def test_storages_go_out_of_band_through_buffer_callback() -> None:
    weight = torch.randn(256, 256)
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    pickler = zp.ZeroCopyPickler(out, buffer_callback=lambda b: buffers.append(b) and False)
    pickler.dump({"w": weight, "view": weight[3:], "again": weight})
    stream = out.getvalue()
    assert len(buffers) == 1  # one storage, referenced three times, stored once
    assert len(stream) < 1000  # no tensor bytes in the stream
    assert "NEXT_BUFFER" in opcodes(stream)
    assert [(s.nbytes, s.location, s.dtype) for s in pickler.buffer_specs] == [(weight.nbytes, "cpu", "float32")]
    loaded = zp.ZeroCopyUnpickler(io.BytesIO(stream), buffers=[b.raw() for b in buffers]).load()
    assert torch.equal(loaded["w"], weight)
    assert loaded["again"] is loaded["w"]
    assert loaded["view"].data_ptr() == loaded["w"].data_ptr() + 3 * 256 * 4


def test_plain_pickle_loads_the_stream() -> None:
    """rebuild functions work without this library's unpickler (trusted, saved devices)."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    zp.ZeroCopyPickler(out, buffer_callback=lambda b: buffers.append(b) and False).dump([torch.arange(5)])
    loaded = pickle.loads(out.getvalue(), buffers=[bytearray(b.raw()) for b in buffers])
    assert loaded[0].tolist() == [0, 1, 2, 3, 4]


def test_without_buffer_callback_buffers_are_in_band() -> None:
    out = io.BytesIO()
    zp.ZeroCopyPickler(out).dump({"t": torch.arange(5)})
    stream = out.getvalue()
    assert "NEXT_BUFFER" not in opcodes(stream)
    assert zp.ZeroCopyUnpickler(io.BytesIO(stream)).load()["t"].tolist() == [0, 1, 2, 3, 4]


def test_callback_may_keep_a_buffer_in_band() -> None:
    out = io.BytesIO()
    pickler = zp.ZeroCopyPickler(out, buffer_callback=lambda b: b.raw().nbytes < 100)
    pickler.dump([torch.ones(2), torch.ones(1000)])
    assert [s.nbytes for s in pickler.buffer_specs] == [4000]


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_protocol_below_5_is_refused(protocol: int) -> None:
    with pytest.raises(zp.ArgumentError, match="protocol >= 5"):
        zp.ZeroCopyPickler(io.BytesIO(), protocol=protocol)


def test_highest_protocol_alias() -> None:
    out = io.BytesIO()
    zp.ZeroCopyPickler(out, protocol=-1).dump(1)
    assert out.getvalue()[:2] == b"\x80\x05"


def test_unpicklable_object_is_a_dump_error() -> None:
    with pytest.raises(zp.DumpError, match=r"cannot pickle memoryview at obj\['view'\]") as info:
        zp.dumps({"ok": torch.ones(1), "view": io.BytesIO(b"x").getbuffer()}, backend="pickle")
    assert isinstance(info.value, pickle.PicklingError)
    assert info.value.__cause__ is not None
    assert info.value.path == "obj['view']"


def test_unpickler_restricted_by_default() -> None:
    stream = pickle.dumps(print, protocol=5)
    with pytest.raises(zp.RestrictedLoadError):
        zp.ZeroCopyUnpickler(io.BytesIO(stream)).load()
    assert zp.ZeroCopyUnpickler(io.BytesIO(stream), trusted=True).load() is print


def test_device_storages_are_reduced_with_their_location() -> None:
    meta = torch.empty(10, device="meta")
    out = io.BytesIO()
    pickler = zp.ZeroCopyPickler(out, buffer_callback=lambda b: False)
    pickler.dump(meta)
    assert pickler.buffer_specs == []  # meta storages hold no bytes


class RefusesRuntime:
    def __reduce__(self) -> tuple[object, ...]:
        raise RuntimeError("Cowardly refusing to serialize this")


def test_runtime_errors_from_reducers_are_dump_errors() -> None:
    with pytest.raises(zp.DumpError, match="Cowardly refusing"):
        zp.dumps({"x": RefusesRuntime()})
