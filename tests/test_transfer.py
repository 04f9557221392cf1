"""Bulk host-to-device transfers, planned and executed against a fake device backend (no GPU needed).

The fake runs on the CPU but behaves like a device where it matters: its copies are *deferred* until the host
waits for them (an event, or the end), so a transfer that refilled a staging buffer before its copy ran would
deliver the wrong bytes, and every call is logged so the tests can check what a transfer asked of the device.
The same transfers on a real GPU: tests/test_transfer_cuda.py.
"""

from __future__ import annotations

import gc
import io
import itertools
import os
import random
import tempfile
import types
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from torch import nn

import zerocopy_pickle as zp
from tests.internals import (
    DEVICE_ALIGNMENT,
    PAGE,
    SLOTS,
    Plan,
    SourceFile,
    backend,
    coldread,
    plan,
    readahead,
    register_ranges,
    transfer,
)
from tests.internals import device as devices

from .conftest import REPO, header_of


class HostView:
    """A range of a CPU tensor in the NumPy array interface, holding the tensor."""

    def __init__(self, base: torch.Tensor, offset: int, nbytes: int) -> None:
        self.base = base
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (base.data_ptr() + offset, False),
            "version": 3,
        }


class FakeBackend:
    """A device backend on the CPU: one log of calls, copies deferred until waited for."""

    def __init__(self, refuse_registration: bool = False) -> None:
        self.device = torch.device("cpu")
        self.log: list[tuple[Any, ...]] = []
        self.allocations: list[weakref.ref[torch.Tensor]] = []
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (event, dst, src) not yet run
        self.events = 0
        self.registered: dict[int, int] = {}
        self.refuse_registration = refuse_registration
        self.base_address = 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        base = torch.full((nbytes,), 0xEE, dtype=torch.uint8)  # padding stays visibly unwritten
        self.allocations.append(weakref.ref(base))
        self.base_address = base.data_ptr()
        self.log.append(("allocate", nbytes))
        return base

    def carve(self, base: torch.Tensor, offset: int, nbytes: int) -> torch.UntypedStorage:
        # As CudaBackend does with the CUDA array interface: the storage holds an object that holds ``base``.
        return torch.from_numpy(numpy.asarray(HostView(base, offset, nbytes))).untyped_storage()

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.log.append(("pinned", nbytes))
        # Page-aligned, as cudaHostAlloc's buffers are (a cold read reads into them with O_DIRECT).
        block = torch.zeros(nbytes + PAGE, dtype=torch.uint8)
        skew = -block.data_ptr() % PAGE
        return block[skew : skew + nbytes]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", dst.data_ptr() - self.base_address, src.data_ptr(), dst.numel()))
        self.pending.append((self.events, dst, src))

    def record(self) -> int:
        self.events += 1
        self.log.append(("record", self.events))
        return self.events

    def _run(self, upto: int) -> None:
        for item in [p for p in self.pending if p[0] < upto]:
            item[1].copy_(item[2])
            self.pending.remove(item)

    def wait(self, event: Any) -> None:
        self.log.append(("wait", event))
        self._run(event)

    def finish(self) -> None:
        self.log.append(("finish",))
        self._run(self.events + 1)

    def register(self, address: int, nbytes: int) -> bool:
        self.log.append(("register", address, nbytes))
        if self.refuse_registration:
            return False
        assert address % PAGE == 0 and nbytes % PAGE == 0
        self.registered[address] = nbytes
        return True

    def unregister(self, address: int) -> None:
        self.log.append(("unregister", address))
        del self.registered[address]

    def calls(self, name: str) -> list[tuple[Any, ...]]:
        return [entry for entry in self.log if entry[0] == name]


# Files whose pages are not in the page cache, for cold reads (tests/test_transfer_cold.py and, on a GPU,
# tests/test_transfer_cuda.py; kept here, where nothing needs hypothesis, which a GPU machine may lack).


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _evicts(folder: Path) -> bool:
    probe = folder / "probe"
    probe.write_bytes(os.urandom(1 << 16))
    evict(probe)
    fd = os.open(probe, os.O_RDONLY)
    try:
        return readahead.cached_bytes(fd, 0, 1 << 16) == 0
    finally:
        os.close(fd)
        probe.unlink()


def cold_folder() -> Iterator[Path]:
    """A folder on a file system whose clean pages can be evicted (not tmpfs), for a fixture to yield from: a
    temporary folder, or one in the checkout when that is in memory."""
    for parent in (None, REPO):
        with tempfile.TemporaryDirectory(prefix="zcp-cold-", dir=parent) as folder:
            if _evicts(Path(folder)):
                yield Path(folder)
                return
    pytest.skip("no file system here whose pages can be evicted from the page cache")


class Layout:
    """Storages laid out in a file: ``offsets[i]`` is where storage ``i`` (``sizes[i]`` bytes) starts."""

    def __init__(self, path: Path, gaps_and_sizes: list[tuple[int, int]], seed: int = 0) -> None:
        rng = random.Random(seed)
        blob = bytearray()
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        for gap, size in gaps_and_sizes:
            blob += rng.randbytes(gap)
            self.offsets.append(len(blob))
            self.sizes.append(size)
            blob += rng.randbytes(size)
        blob += rng.randbytes(rng.randrange(0, 100))
        self.blob = bytes(blob)
        self.path = path
        path.write_bytes(self.blob)
        evict(path)

    def expected(self) -> list[bytes]:
        return [self.blob[o : o + n] for o, n in zip(self.offsets, self.sizes, strict=True)]

    def storages(self) -> list[torch.UntypedStorage]:
        """CPU storages of the same bytes (as the mapping's views would be; copies, so the file stays cold)."""
        return [
            torch.frombuffer(bytearray(b) or bytearray(1), dtype=torch.uint8)[: len(b)].clone().untyped_storage()
            for b in self.expected()
        ]

    def move(self, fake: FakeBackend, chunk_bytes: int = 1 << 20, **kwargs: Any) -> list[torch.UntypedStorage]:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return transfer.move(
                self.storages(), torch.device("cuda:0"), backend=fake, chunk_bytes=chunk_bytes,
                source=SourceFile(fd, tuple(self.offsets)), **kwargs,
            )  # fmt: skip
        finally:
            os.close(fd)


def raw(storage: torch.UntypedStorage) -> bytes:
    """A storage's bytes (``bytes(storage)`` iterates byte by byte)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()


def direct_io_works(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        direct = coldread._open_direct(fd)
        if direct is not None:
            os.close(direct)
        return direct is not None
    finally:
        os.close(fd)


def random_storages(rng: random.Random, count: int, largest: int) -> list[torch.UntypedStorage]:
    sizes = [rng.choice([0, 1, 3, 511, 512, 513, rng.randrange(largest)]) for _ in range(count)]
    return [torch.randint(0, 256, (n,), dtype=torch.uint8).untyped_storage() for n in sizes]


def covered_exactly_once(layout: Plan) -> None:
    seen: dict[int, list[tuple[int, int]]] = {}
    for chunk in layout.chunks:
        start = chunk.offset
        for piece in chunk.pieces:
            assert piece.offset >= start, "pieces are in order and do not overlap"
            assert piece.offset + piece.nbytes <= chunk.offset + chunk.nbytes
            assert piece.offset == layout.offsets[piece.source] + piece.source_offset
            seen.setdefault(piece.source, []).append((piece.source_offset, piece.nbytes))
            start = piece.offset + piece.nbytes
    for source, nbytes in enumerate(layout.sizes):
        done = 0
        for offset, length in seen.get(source, []):
            assert offset == done
            done += length
        assert done == nbytes, f"source {source}: {done} of {nbytes} bytes planned"


# ---------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------


def test_plan_aligns_every_storage_and_packs_them_in_order() -> None:
    layout = plan([10, 0, 512, 1, 1000], chunk_bytes=1 << 20)
    assert layout.offsets == (0, 10, 512, 1024, 1536)
    assert layout.total == 2536
    assert [o % DEVICE_ALIGNMENT for o, n in zip(layout.offsets, layout.sizes, strict=True) if n] == [0] * 4
    assert len(layout.chunks) == 1 and layout.chunks[0].offset == 0 and layout.chunks[0].nbytes == 2536
    covered_exactly_once(layout)


def test_plan_splits_a_storage_larger_than_a_chunk() -> None:
    layout = plan([5000, 100], chunk_bytes=1024)
    assert [(c.offset, c.nbytes) for c in layout.chunks] == [(i * 1024, 1024) for i in range(4)] + [
        (4096, 904),
        (5120, 100),
    ]
    assert layout.chunks[-1].pieces[0].source == 1
    covered_exactly_once(layout)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40))
def test_plan_covers_every_byte_once_with_chunks_of_at_most_the_limit(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 7, 512, rng.randrange(1, 20000)]) for _ in range(rng.randrange(1, 60))]
    chunk_bytes = rng.choice([1, 100, 512, 1000, 4096, 65536])
    layout = plan(sizes, chunk_bytes=chunk_bytes)
    assert all(0 < c.nbytes <= chunk_bytes for c in layout.chunks)
    assert all(a.offset + a.nbytes <= b.offset for a, b in itertools.pairwise(layout.chunks))
    ends = [o + n for o, n in zip(layout.offsets, sizes, strict=True)]
    assert layout.total == max(ends, default=0)
    spans = sorted((o, o + n) for o, n in zip(layout.offsets, sizes, strict=True) if n)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "storages never overlap"
    covered_exactly_once(layout)


def test_plan_of_nothing_or_only_empty_storages() -> None:
    assert plan([]).chunks == () and plan([]).total == 0
    assert plan([0, 0]).chunks == () and plan([0, 0]).total == 0


@pytest.mark.parametrize(
    ("sizes", "kwargs"), [([-1], {}), ([1.5], {}), ([True], {}), ([1], {"chunk_bytes": 0}), ([1], {"alignment": -4})]
)
def test_plan_refuses_bad_arguments(sizes: list[Any], kwargs: dict[str, int]) -> None:
    with pytest.raises(zp.ArgumentError):
        plan(sizes, **kwargs)


def test_register_ranges_are_page_aligned_merged_and_cover_every_span() -> None:
    page = 4096
    spans = [(10, 5), (4000, 200), (3 * page, 1), (3 * page + 100, 10), (10 * page, 0), (20 * page - 1, 2)]
    assert register_ranges(spans, page=page) == [(0, 2 * page), (3 * page, page), (19 * page, 2 * page)]
    assert register_ranges([], page=page) == []


# ---------------------------------------------------------------------------------------------------------
# Executing it
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_staged_transfer_delivers_every_byte_through_reused_slots(seed: int) -> None:
    rng = random.Random(seed)
    storages = random_storages(rng, rng.randrange(1, 40), 5000)
    fake = FakeBackend()
    chunk = rng.choice([600, 1024, 4096])
    moved = transfer.move(storages, torch.device("cuda:0"), method="staged", backend=fake, chunk_bytes=chunk)
    assert [bytes(m) for m in moved] == [bytes(s) for s in storages]
    assert [m.nbytes() for m in moved] == [s.nbytes() for s in storages]
    total = sum(s.nbytes() for s in storages)
    assert len(fake.calls("allocate")) == (1 if total else 0), "one device allocation for all storages"
    if not total:
        return
    layout = plan([s.nbytes() for s in storages], chunk_bytes=chunk)
    assert len(fake.calls("copy")) == len(layout.chunks), "one copy per chunk, not per storage"
    assert len(fake.calls("pinned")) == min(SLOTS, len(layout.chunks))
    # The host waits only for the copy that last used the slot it is about to refill, and finishes once.
    assert [e[1] for e in fake.calls("wait")] == list(range(1, len(layout.chunks) - SLOTS + 1))
    assert fake.log[-1] == ("finish",) and len(fake.calls("finish")) == 1
    for entry in fake.log:
        if entry[0] == "copy":
            assert entry[1] in {c.offset for c in layout.chunks}


def test_carved_storages_alias_one_allocation_that_lives_while_any_of_them_does() -> None:
    storages = [torch.arange(n, dtype=torch.uint8).untyped_storage() for n in (100, 2000, 30)]
    fake = FakeBackend()
    moved = transfer.move(storages, torch.device("cuda:0"), backend=fake, chunk_bytes=256)
    base = fake.allocations[0]
    start = fake.base_address
    layout = plan([100, 2000, 30])
    assert [m.data_ptr() - start for m in moved] == list(layout.offsets)
    del storages
    first = moved.pop(0)
    gc.collect()
    assert base() is not None
    del moved, first
    gc.collect()
    assert base() is None, "freeing every storage frees the allocation"


def test_torch_save_of_one_moved_tensor_saves_only_its_own_bytes() -> None:
    big, small = torch.randn(100_000), torch.arange(10.0)
    moved = transfer.move(
        [big.untyped_storage(), small.untyped_storage()], torch.device("cuda:0"), backend=FakeBackend()
    )
    tensor = torch.empty(0).set_(moved[1], 0, (10,), (1,))
    out = io.BytesIO()
    torch.save(tensor, out)
    assert out.tell() < 4096
    assert torch.equal(torch.load(io.BytesIO(out.getvalue())), small)


def test_registered_transfer_copies_from_locked_host_pages_and_unlocks_them_after_the_copies() -> None:
    storages = [torch.randint(0, 256, (n,), dtype=torch.uint8).untyped_storage() for n in (5000, 0, 70000, 3)]
    fake = FakeBackend()
    moved = transfer.move(storages, torch.device("cuda:0"), method="registered", backend=fake)
    assert [bytes(m) for m in moved] == [bytes(s) for s in storages]
    assert fake.registered == {}, "every registration undone"
    assert not fake.calls("pinned"), "no staging"
    copies = fake.calls("copy")
    assert sorted(c[2] for c in copies) == sorted(s.data_ptr() for s in storages if s.nbytes())
    names = [entry[0] for entry in fake.log]
    assert names.index("finish") < names.index("unregister"), "pages stay locked until the copies are done"
    locked = register_ranges([(s.data_ptr(), s.nbytes()) for s in storages])
    assert [(e[1], e[2]) for e in fake.calls("register")] == locked


def test_a_refused_registration_falls_back_to_staging() -> None:
    storages = [torch.randint(0, 256, (n,), dtype=torch.uint8).untyped_storage() for n in (5000, 9000)]
    fake = FakeBackend(refuse_registration=True)
    moved = transfer.move(storages, torch.device("cuda:0"), method="registered", backend=fake)
    assert [bytes(m) for m in moved] == [bytes(s) for s in storages]
    assert fake.calls("register") and not fake.calls("unregister")
    assert fake.calls("pinned"), "staged instead"
    assert len(fake.calls("allocate")) == 1


@pytest.mark.slow
def test_a_partly_refused_registration_undoes_what_it_locked() -> None:
    storages = [torch.randint(0, 256, (n,), dtype=torch.uint8).untyped_storage() for n in (1 << 20, 1 << 20)]
    fake = FakeBackend()
    real = fake.register
    fake.register = lambda address, nbytes: not fake.registered and real(address, nbytes)  # type: ignore[method-assign]
    moved = transfer.move(storages, torch.device("cuda:0"), method="registered", backend=fake)
    if len(register_ranges([(s.data_ptr(), s.nbytes()) for s in storages])) > 1:
        assert len(fake.calls("unregister")) == 1 and fake.registered == {}
        assert fake.calls("pinned")
    assert [bytes(m) for m in moved] == [bytes(s) for s in storages]


def test_per_storage_and_unknown_methods() -> None:
    storages = [torch.arange(5, dtype=torch.uint8).untyped_storage()]
    fake = FakeBackend()
    moved = transfer.move(storages, torch.device("cpu"), method="per-storage", backend=fake)
    assert bytes(moved[0]) == bytes(storages[0]) and moved[0].data_ptr() != storages[0].data_ptr()
    assert fake.log == []
    with pytest.raises(zp.ArgumentError, match="method must be one of"):
        transfer.move(storages, torch.device("cpu"), method="fast")
    with pytest.raises(zp.ArgumentError, match="CPU storages"):
        transfer.move([torch.UntypedStorage(4, device="meta")], torch.device("cpu"), backend=fake)


def test_a_failed_allocation_is_a_device_error() -> None:
    fake = FakeBackend()

    def out_of_memory(nbytes: int) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    fake.allocate = out_of_memory  # type: ignore[method-assign]
    with pytest.raises(zp.DeviceError, match="cannot allocate 4 bytes on cuda:0 for 1 storages"):
        transfer.move([torch.UntypedStorage(4)], torch.device("cuda:0"), backend=fake)


# ---------------------------------------------------------------------------------------------------------
# Loads and to_device on the fake device
# ---------------------------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.tensor([2.0], dtype=torch.float64))
        self.register_buffer("steps", torch.arange(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids))) * self.scale.float() + self.steps.sum()


def fake_allocation(made: list[FakeBackend], tensor: torch.Tensor) -> int:
    """Which fake allocation a tensor's storage was carved from."""
    for number, fake in enumerate(made):
        base = fake.allocations[0]()
        assert base is not None
        if base.data_ptr() <= tensor.data_ptr() < base.data_ptr() + base.numel():
            return number
    raise AssertionError("not carved from a transfer's allocation")


def test_load_with_map_location_moves_every_storage_in_one_transfer(fake_cuda: list[FakeBackend]) -> None:
    torch.manual_seed(0)
    net = Net()
    view = net.body[0].weight[2:4]
    data = zp.dumps({"net": net, "view": view, "ids": torch.tensor([1, 2, 3])})
    loaded = zp.loads(data, map_location="cuda:0", allow=[Net, nn.Embedding, nn.Sequential, nn.Linear, nn.LayerNorm])
    assert len(fake_cuda) == 1 and len(fake_cuda[0].calls("allocate")) == 1
    state = loaded["net"].state_dict()
    for name, tensor in net.state_dict().items():
        assert torch.equal(state[name], tensor) and state[name].dtype == tensor.dtype, name
        assert fake_allocation(fake_cuda, state[name]) == 0
    assert loaded["net"].head.weight is loaded["net"].embed.weight
    assert loaded["view"].untyped_storage().data_ptr() == loaded["net"].body[0].weight.untyped_storage().data_ptr()
    assert torch.equal(loaded["net"](loaded["ids"]), net(torch.tensor([1, 2, 3])))


def test_a_dict_map_location_with_two_devices_makes_one_allocation_each(fake_cuda: list[FakeBackend]) -> None:
    data = zp.dumps({"a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.int8)})
    loaded = zp.loads(data, map_location="cuda:1")
    assert len(fake_cuda) == 1
    assert fake_allocation(fake_cuda, loaded["a"]) == fake_allocation(fake_cuda, loaded["b"]) == 0
    # Two saved locations, two targets: one transfer each.
    fake_cuda.clear()
    buffers = header_of(data).buffers
    assert [b.location for b in buffers] == ["cpu", "cpu"]
    mixed = zp.dumps({"a": torch.arange(10.0), "meta": torch.empty(4, device="meta")})
    loaded = zp.loads(mixed, map_location={"cpu": "cuda:2"})
    assert len(fake_cuda) == 1 and torch.equal(loaded["a"], torch.arange(10.0))
    assert loaded["meta"].device.type == "meta"


def test_storages_saved_on_two_devices_go_to_their_own_allocations(
    fake_cuda: list[FakeBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.internals import pickler

    real = pickler._reduce_untyped_storage
    counter = iter(range(1000))

    def two_devices(state: Any, storage: torch.UntypedStorage) -> tuple[Any, ...]:
        import dataclasses

        func, args = real(state, storage)
        if func is not zp.rebuild.rebuild_storage:
            return func, args
        location = f"cuda:{next(counter) % 2}"
        held, spec = state.pending[id(args[0])]
        state.pending[id(args[0])] = (held, dataclasses.replace(spec, location=location))
        return func, (args[0], location)

    monkeypatch.setattr(pickler, "_reduce_untyped_storage", two_devices)
    data = zp.dumps([torch.full((5,), float(i)) for i in range(4)])
    monkeypatch.undo()
    fake_cuda.clear()
    monkeypatch.setitem(backend._BACKENDS, "cuda", lambda d: fake_cuda.append(FakeBackend()) or fake_cuda[-1])
    monkeypatch.setattr(devices, "_require", lambda d, hint: None)
    loaded = zp.loads(data)  # map_location=None: each storage to the device it was saved on
    assert [b.location for b in header_of(data).buffers] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert len(fake_cuda) == 2
    assert [fake_allocation(fake_cuda, t) for t in loaded] == [0, 1, 0, 1]
    assert [t.tolist() for t in loaded] == [[float(i)] * 5 for i in range(4)]


def test_a_callable_map_location_decides_storage_by_storage(fake_cuda: list[FakeBackend]) -> None:
    seen: list[str] = []

    def keep(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        seen.append(location)
        return storage

    loaded = zp.loads(zp.dumps({"a": torch.arange(3.0), "b": torch.ones(2)}), map_location=keep)
    assert seen == ["cpu", "cpu"] and fake_cuda == []
    assert torch.equal(loaded["a"], torch.arange(3.0))


def test_a_refused_restricted_load_moves_nothing(fake_cuda: list[FakeBackend]) -> None:
    data = zp.dumps({"net": Net()})
    with pytest.raises(zp.RestrictedLoadError):
        zp.loads(data, map_location="cuda:0")
    assert fake_cuda == [], "refused before any device memory was taken"


def test_a_non_tensor_buffer_is_not_moved(fake_cuda: list[FakeBackend]) -> None:
    np = numpy
    data = zp.dumps({"array": np.arange(6), "t": torch.arange(4.0)})
    rows = header_of(data).buffers
    loaded = zp.loads(data, map_location="cuda:0", trusted=True)
    assert (loaded["array"] == np.arange(6)).all()
    assert torch.equal(loaded["t"], torch.arange(4.0))
    assert len(fake_cuda) == 1
    moved = sum(row.nbytes for row in rows if row.dtype is not None)
    assert fake_cuda[0].calls("allocate") == [("allocate", moved)]


def test_to_device_moves_a_module_in_place_as_module_to_does(fake_cuda: list[FakeBackend]) -> None:
    torch.manual_seed(1)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    net.body[0].weight.grad = torch.full_like(net.body[0].weight, 0.5)
    net.embed.weight.requires_grad_(False)
    hook = net.body.register_forward_hook(lambda m, i, o: o)
    parameters = {name: id(p) for name, p in net.named_parameters()}
    out = zp.to_device(net, "cuda:0")
    assert out is net
    assert {name: id(p) for name, p in net.named_parameters()} == parameters, "parameters keep their identity"
    assert net.head.weight is net.embed.weight
    assert len(fake_cuda) == 1 and len(fake_cuda[0].calls("allocate")) == 1
    for name, tensor in net.state_dict().items():
        assert torch.equal(tensor, before[name]) and tensor.dtype == before[name].dtype
        assert fake_allocation(fake_cuda, tensor) == 0, name
    assert net.body[0].weight.grad is not None and fake_allocation(fake_cuda, net.body[0].weight.grad) == 0
    assert torch.equal(net.body[0].weight.grad, torch.full_like(net.body[0].weight, 0.5))
    assert not net.embed.weight.requires_grad and net.body[0].weight.requires_grad
    assert hook.id in net.body._forward_hooks
    hook.remove()


def test_to_device_moves_containers_and_the_modules_of_objects_and_keeps_shared_storages(
    fake_cuda: list[FakeBackend],
) -> None:
    class Pipeline:  # like a diffusers pipeline: modules, and a scheduler whose tables pipe.to leaves alone
        def __init__(self) -> None:
            self.net = Net()
            self.scheduler = types.SimpleNamespace(alphas=torch.linspace(0, 1, 5), config={"t": torch.ones(2)})

    pipe = Pipeline()
    base = torch.arange(20.0)
    graph = {"pipe": pipe, "pair": (base[:5], base[5:]), "list": [base], "same": pipe.net.embed.weight}
    pair_id = id(graph["pair"][0])
    assert zp.to_device(graph, "cuda:0") is graph
    assert len(fake_cuda) == 1 and len(fake_cuda[0].calls("allocate")) == 1
    assert id(graph["pair"][0]) == pair_id, "tensors moved in place"
    for tensor in (*graph["pair"], graph["list"][0], graph["same"], pipe.net.body[0].weight, pipe.net.steps):
        assert fake_allocation(fake_cuda, tensor) == 0
    shared = {t.untyped_storage().data_ptr() for t in (*graph["pair"], graph["list"][0])}
    assert len(shared) == 1, "views of one storage still share one"
    assert torch.equal(graph["pair"][1], torch.arange(5.0, 20.0))
    assert graph["same"] is pipe.net.embed.weight
    with pytest.raises(AssertionError, match="not carved"):
        fake_allocation(fake_cuda, pipe.scheduler.alphas)
    with pytest.raises(AssertionError, match="not carved"):
        fake_allocation(fake_cuda, pipe.scheduler.config["t"])


def test_to_device_refuses_before_moving_anything(fake_cuda: list[FakeBackend]) -> None:
    sparse = torch.eye(3).to_sparse()
    graph = {"dense": torch.ones(3), "frozen": (sparse,)}
    with pytest.raises(zp.DeviceError, match=r"sparse|Tensor at an item of the root\['frozen'\]"):
        zp.to_device(graph, "cuda:0")
    assert fake_cuda == [] and graph["dense"].device.type == "cpu"
    with pytest.raises(zp.ArgumentError, match="method must be one of"):
        zp.to_device(graph, "cuda:0", method="dma")


def test_to_device_without_cuda_fails_clearly_and_changes_nothing() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the error raised where CUDA is absent (this machine has CUDA)")
    net = Net()
    with pytest.raises(zp.DeviceError, match=r"cuda.*CUDA is not available here; to_device\(\.\.\., 'cuda'\)"):
        zp.to_device(net, "cuda")
    assert net.embed.weight.device.type == "cpu"
    with pytest.raises(zp.DeviceError, match="not a device name"):
        zp.to_device(net, "gpu0")


def test_to_device_to_the_cpu_leaves_cpu_tensors_alone() -> None:
    net = Net()
    pointers = [p.data_ptr() for p in net.parameters()]
    assert zp.to_device(net, "cpu") is net
    assert [p.data_ptr() for p in net.parameters()] == pointers
    tensor = torch.arange(3)
    assert zp.to_device(tensor, "cpu") is tensor


# ---------------------------------------------------------------------------------------------------------
# Hostile snapshots: what a stream can do with buffers that were moved before it ran
# ---------------------------------------------------------------------------------------------------------


def tensor_snapshot(stream: bytes, buffers: list[bytes]) -> bytes:
    """Like hostile_streams.as_snapshot, but every buffer row claims a dtype, so a load moves them all first."""
    from tests.internals import format as fmt

    layout = fmt.encode(len(stream), [fmt.BufferSpec(len(b), dtype="float32") for b in buffers])
    out = bytearray(layout.prefix + stream)
    out += bytes(layout.data_offset - len(out))
    for offset, data in zip(layout.buffer_offsets, buffers, strict=True):
        out += bytes(layout.data_offset + offset - len(out)) + data
    return bytes(out)


def test_a_moved_buffer_used_twice_gives_one_storage_and_views_stay_in_bounds(fake_cuda: list[FakeBackend]) -> None:
    from .hostile_streams import NEXT_BUFFER, G, call, memo_get, memo_put, program, tensor_view

    rebuild = G("zerocopy_pickle.rebuild", "rebuild_storage")
    payload = torch.arange(4.0).numpy().tobytes()
    # Two storages over one buffer, with different location arguments: both are the one moved storage (the
    # header row and map_location decided where it goes, not the stream's argument).
    twice = program([call(rebuild, memo_put(NEXT_BUFFER, 0), "cpu"), call(rebuild, memo_get(0), "cuda:7")])
    first, second = zp.loads(tensor_snapshot(twice, [payload]), map_location="cuda:0")
    assert first.data_ptr() == second.data_ptr() and first.nbytes() == second.nbytes() == len(payload)
    assert fake_allocation(fake_cuda, torch.empty(0, dtype=torch.uint8).set_(first)) == 0
    assert bytes(first) == payload
    overrun = program(tensor_view(call(rebuild, NEXT_BUFFER, "cuda:7"), (5,), (1,)))
    with pytest.raises(zp.SnapshotError, match="reaches element 4, but the storage holds 4"):
        zp.loads(tensor_snapshot(overrun, [payload]), map_location="cuda:0")


def test_a_moved_buffer_the_stream_keeps_as_bytes_stays_the_mapped_bytes(fake_cuda: list[FakeBackend]) -> None:
    from .hostile_streams import NEXT_BUFFER, program

    payload = bytes(range(64))
    result = zp.loads(tensor_snapshot(program(NEXT_BUFFER), [payload]), map_location="cuda:0")
    assert type(result) is memoryview and bytes(result) == payload
    del result
    gc.collect()
    assert len(fake_cuda) == 1 and fake_cuda[0].allocations[0]() is None, "the unused transfer was freed"


@pytest.mark.parametrize("verify", [False, True])
def test_a_mapped_file_loads_to_the_device_in_one_transfer(
    fake_cuda: list[FakeBackend], tmp_path: Any, verify: bool
) -> None:
    state = {f"w{i}": torch.randn(64, 33) for i in range(20)} | {"tied": None}
    state["tied"] = state["w3"][1:]
    zp.dump(state, tmp_path / "s.zcp", checksums=True)
    loaded = zp.load(tmp_path / "s.zcp", map_location="cuda:0", verify=verify)
    assert len(fake_cuda) == 1 and len(fake_cuda[0].calls("allocate")) == 1
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor) and fake_allocation(fake_cuda, loaded[name]) == 0
    assert loaded["tied"].untyped_storage().data_ptr() == loaded["w3"].untyped_storage().data_ptr()


def test_a_failed_direct_copy_waits_for_the_copies_before_it_then_unlocks(monkeypatch: pytest.MonkeyPatch) -> None:
    storages = [torch.randint(0, 256, (n,), dtype=torch.uint8).untyped_storage() for n in (5000, 7000)]
    fake = FakeBackend()
    real = fake.copy
    calls = []

    def failing(dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access (fake)")
        real(dst, src)

    fake.copy = failing  # type: ignore[method-assign]
    with pytest.raises(zp.DeviceError, match="the transfer of .* failed"):
        transfer.move(storages, torch.device("cuda:0"), method="registered", backend=fake)
    names = [entry[0] for entry in fake.log]
    assert names.index("finish") < names.index("unregister") and fake.registered == {}
