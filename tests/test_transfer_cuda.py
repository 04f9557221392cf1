"""Bulk transfers to a real CUDA device: loads with ``map_location="cuda"`` and ``zp.to_device``.

Every test here needs a CUDA device and is skipped without one (a skip ``make test`` accepts: its reason names
CUDA). The planning and orchestration they rely on are tested everywhere, on a fake device, in
tests/test_transfer.py. On a GPU machine: ``python -m pytest tests/test_transfer_cuda.py`` (or
benchmarks/device_check.sh, which runs these and the benchmark).
"""

from __future__ import annotations

import gc
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import zerocopy_pickle as zp
from tests.internals import DEVICE_ALIGNMENT, SourceFile, transfer

from .test_transfer import Layout, cold_folder, direct_io_works, evict, raw

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ALLOW = [nn.Sequential, nn.Linear, nn.LayerNorm, nn.Embedding]


@pytest.fixture(scope="module")
def disk() -> Iterator[Path]:
    yield from cold_folder()


def model() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 300, bias=False))
    net[3].weight = net[0].weight  # tied
    net.register_buffer("scale", torch.tensor(2.0, dtype=torch.float64))
    return net


def allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("method", ["staged", "registered", "per-storage"])
def test_move_delivers_the_bytes(method: str) -> None:
    storages = [torch.randint(0, 256, (n,), dtype=torch.uint8).untyped_storage() for n in (1, 513, 5 << 20, 0, 77)]
    moved = transfer.move(storages, torch.device("cuda", 0), method=method, chunk_bytes=1 << 20)
    assert [m.device.type for m in moved] == ["cuda"] * 5
    assert [bytes(m.cpu()) for m in moved] == [bytes(s) for s in storages]
    if method != "per-storage":
        assert all(m.data_ptr() % DEVICE_ALIGNMENT == 0 for m in moved if m.nbytes())


def test_load_to_cuda_equals_the_cpu_load_and_shares_what_it_shared(tmp_path: object) -> None:
    net = model()
    data = zp.dumps(net)
    on_gpu = zp.loads(data, map_location="cuda", allow=ALLOW)
    on_cpu = zp.loads(data, allow=ALLOW)
    for (name, a), b in zip(on_gpu.state_dict().items(), on_cpu.state_dict().values(), strict=True):
        assert a.device.type == "cuda" and a.dtype == b.dtype and torch.equal(a.cpu(), b), name
    assert on_gpu[3].weight is on_gpu[0].weight
    ids = torch.tensor([[1, 2, 3]])
    assert torch.allclose(on_gpu(ids.cuda()).cpu(), on_cpu(ids))


def test_freeing_every_loaded_tensor_frees_its_device_memory() -> None:
    data = zp.dumps({f"w{i}": torch.randn(256, 256) for i in range(8)})
    before = allocated()
    loaded = zp.loads(data, map_location="cuda:0")
    assert allocated() - before >= 8 * 256 * 256 * 4
    one = loaded.pop("w3")
    del loaded
    assert allocated() > before, "one tensor still holds the allocation"
    del one
    assert allocated() == before


def test_torch_save_of_a_loaded_tensor_saves_only_its_own_bytes() -> None:
    loaded = zp.loads(zp.dumps({"big": torch.randn(1 << 20), "small": torch.arange(10.0)}), map_location="cuda")
    out = io.BytesIO()
    torch.save(loaded["small"], out)
    assert out.tell() < 4096
    assert torch.equal(torch.load(io.BytesIO(out.getvalue())).cpu(), torch.arange(10.0))


def test_a_device_recorded_at_dump_is_restored() -> None:
    data = zp.dumps({"gpu": torch.arange(4.0, device="cuda:0"), "cpu": torch.ones(2)})
    assert [b.location for b in zp.read_header(data).buffers] == ["cuda:0", "cpu"]
    loaded = zp.loads(data)
    assert loaded["gpu"].device == torch.device("cuda", 0) and loaded["cpu"].device.type == "cpu"
    assert zp.loads(data, map_location="cpu")["gpu"].device.type == "cpu"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_in_one_snapshot() -> None:
    data = zp.dumps({"a": torch.arange(4.0, device="cuda:0"), "b": torch.arange(3.0, device="cuda:1")})
    loaded = zp.loads(data)
    assert loaded["a"].device.index == 0 and loaded["b"].device.index == 1
    swapped = zp.loads(data, map_location={"cuda:0": "cuda:1", "cuda:1": "cuda:0"})
    assert swapped["a"].device.index == 1 and swapped["b"].device.index == 0


@pytest.mark.parametrize("method", ["auto", "registered"])
def test_to_device_gives_the_state_module_to_gives(method: str) -> None:
    reference = model().to("cuda")
    net = zp.loads(zp.dumps(model()), allow=ALLOW)
    identities = [id(p) for p in net.parameters()]
    assert zp.to_device(net, "cuda", method=method) is net
    assert [id(p) for p in net.parameters()] == identities
    assert net[3].weight is net[0].weight
    mine, theirs = net.state_dict(), reference.state_dict()
    assert list(mine) == list(theirs)
    for name in mine:
        assert mine[name].device == theirs[name].device and mine[name].dtype == theirs[name].dtype, name
        assert torch.equal(mine[name], theirs[name]), name
    ids = torch.tensor([[4, 5]], device="cuda")
    assert torch.equal(net(ids), reference(ids))


def test_to_device_from_a_frozen_snapshot_frees_on_release() -> None:
    before = allocated()
    pipe = {"unet": model(), "text": model(), "config": {"steps": 20}}
    snap = zp.freeze(pipe)
    loaded = snap.load(trusted=True)
    zp.to_device(loaded, "cuda")
    assert loaded["unet"][1].weight.device.type == "cuda" and loaded["config"] == {"steps": 20}
    del loaded
    assert allocated() == before


def test_a_cold_file_is_read_into_pinned_slots_and_arrives_bit_for_bit(disk: Path) -> None:
    layout = Layout(disk / "cold", [(0, 1), (63, 513), (4096, 5 << 20), (0, 0), (7, 77), (100, 3 << 20)])
    before = dict(transfer.STATS)
    fd = os.open(layout.path, os.O_RDONLY)
    try:
        moved = transfer.move(
            layout.storages(), torch.device("cuda", 0), chunk_bytes=1 << 20,
            source=SourceFile(fd, tuple(layout.offsets)),
        )  # fmt: skip
    finally:
        os.close(fd)
    assert transfer.STATS["cold"] == before.get("cold", 0) + 1
    if direct_io_works(layout.path):
        assert transfer.STATS["direct bytes"] > before.get("direct bytes", 0), "pinned memory takes O_DIRECT"
    assert [m.device.type for m in moved] == ["cuda"] * 6
    assert [raw(m.cpu()) for m in moved] == layout.expected()
    assert all(m.data_ptr() % DEVICE_ALIGNMENT == 0 for m in moved if m.nbytes())


def test_a_cold_snapshot_loads_to_cuda_from_the_file(disk: Path) -> None:
    state = {f"w{i}": torch.randn(256, 257) for i in range(12)} | {"b": torch.arange(5.0)}
    path = disk / "cold.zcp"
    zp.dump(state, path)
    evict(path)
    cold = transfer.STATS["cold"]
    loaded = zp.load(path, map_location="cuda:0")
    assert transfer.STATS["cold"] == cold + 1, "the snapshot passed its file to the transfer"
    for name, tensor in state.items():
        assert loaded[name].device.type == "cuda" and torch.equal(loaded[name].cpu(), tensor), name


def test_a_cold_file_truncated_under_the_load_frees_its_device_memory(disk: Path) -> None:
    layout = Layout(disk / "short", [(0, 1 << 20), (0, 2 << 20)])
    os.truncate(layout.path, 1 << 20)
    before = allocated()
    fd = os.open(layout.path, os.O_RDONLY)
    try:
        with pytest.raises(zp.SnapshotError, match="truncated"):
            transfer.move(
                layout.storages(), torch.device("cuda", 0), chunk_bytes=1 << 20,
                source=SourceFile(fd, tuple(layout.offsets)),
            )  # fmt: skip
    finally:
        os.close(fd)
    assert allocated() == before
