"""Cold reads: a transfer to a device that reads its storages' bytes from the file (``transfer.move(source=)``)
when they are not in the page cache, on the fake device of tests/test_transfer.py (no GPU needed).

The files are real files whose pages are evicted (``fsync`` then ``POSIX_FADV_DONTNEED``: no root needed), so
the reads really are direct I/O on file systems that take it. Which path ran is observed through
``transfer.STATS`` and a spy on the reads, never through timing. The same on a real GPU:
tests/test_transfer_cuda.py.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import itertools
import mmap
import os
import random
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerocopy_pickle as zp
from tests.internals import (
    DIRECT_ALIGNMENT,
    SLOTS,
    BufferTable,
    LoadPolicy,
    SourceFile,
    coldread,
    loadcore,
    plan,
    plan_reads,
    readahead,
    transfer,
)

from .conftest import left_behind, settled
from .test_transfer import FakeBackend, Layout, cold_folder, direct_io_works, evict, raw

CUDA0 = torch.device("cuda:0")


@pytest.fixture(scope="module")
def disk() -> Iterator[Path]:
    yield from cold_folder()


def stats() -> dict[str, int]:
    return dict(transfer.STATS)


def delta(before: dict[str, int], key: str) -> int:
    return transfer.STATS[key] - before.get(key, 0)


LAYOUTS = {
    "many small": [(random.Random(i).choice([0, 1, 60, 64]), random.Random(i).randrange(1, 900)) for i in range(300)],
    "one huge": [(0, 5 << 20)],
    "huge at an odd offset": [(12345, (3 << 20) + 7)],
    "odd sizes and offsets": [(3, 1), (7, 4095), (1, 4097), (511, 513), (4096, 8191), (0, 3)],
    "empty storages": [(0, 0), (10, 100), (0, 0), (0, 0), (4000, 5000), (0, 0)],
    "sharing 4 KiB pages": [(64, 64)] * 40,
    "page-aligned, as a snapshot lays out large buffers": [(0, 1 << 16), (0, 3 << 16), (4096 - 1000, 1000 + 4096)],
    "a large gap between two storages": [(100, 5000), (3 << 20, 7000)],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("chunk_bytes", [4096, 10000, 1 << 20])
def test_a_cold_transfer_delivers_the_files_bytes(disk: Path, name: str, chunk_bytes: int) -> None:
    layout = Layout(disk / "file", LAYOUTS[name])
    fake = FakeBackend()
    before = stats()
    moved = layout.move(fake, chunk_bytes)
    assert [raw(m) for m in moved] == layout.expected()
    assert [m.nbytes() for m in moved] == layout.sizes
    assert delta(before, "cold") == 1 and delta(before, "mapped") == 0
    if direct_io_works(layout.path):
        assert delta(before, "direct bytes") > 0, "O_DIRECT where aligned"
    assert delta(before, "direct bytes") + delta(before, "buffered bytes") >= sum(layout.sizes)
    assert len(fake.calls("allocate")) == 1 and fake.log[-1] == ("finish",)
    # The same storages carved out of the same layout as a transfer from the mapping.
    expected = plan(layout.sizes, chunk_bytes=chunk_bytes)
    assert fake.calls("allocate") == [("allocate", expected.total)]
    assert [m.data_ptr() - fake.base_address for m in moved if m.nbytes()] == [
        o for o, n in zip(expected.offsets, layout.sizes, strict=True) if n
    ]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    items=st.lists(
        st.tuples(
            st.one_of(st.integers(0, 70), st.integers(0, 9000), st.sampled_from([0, 4096, 1 << 16])),
            st.one_of(st.integers(0, 600), st.integers(0, 70000), st.sampled_from([0, 4096, 1 << 16, 200_000])),
        ),
        min_size=1,
        max_size=30,
    ),
    chunk_bytes=st.sampled_from([4096, 8192, 12288, 65536, 100_000]),
    seed=st.integers(0, 1000),
)
def test_any_layout_arrives_bit_for_bit(disk: Path, items: list[tuple[int, int]], chunk_bytes: int, seed: int) -> None:
    layout = Layout(disk / "any", items, seed)
    fake = FakeBackend()
    before = stats()
    moved = layout.move(fake, chunk_bytes)
    assert [raw(m) for m in moved] == layout.expected()
    if sum(layout.sizes):
        assert delta(before, "cold") == 1
        assert len(fake.calls("pinned")) <= SLOTS


# ---------------------------------------------------------------------------------------------------------
# The plan of the reads
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(
    items=st.lists(st.tuples(st.integers(0, 10000), st.integers(0, 30000)), min_size=1, max_size=40),
    capacity_pages=st.integers(1, 8),
)
def test_plan_reads_fills_every_storage_through_aligned_reads_that_fit_their_slot(
    items: list[tuple[int, int]], capacity_pages: int
) -> None:
    capacity = capacity_pages * DIRECT_ALIGNMENT
    offsets, sizes, at = [], [], 0
    for gap, size in items:
        offsets.append(at + gap)
        sizes.append(size)
        at += gap + size
    file = bytes(random.Random(at).randbytes(at + DIRECT_ALIGNMENT))
    layout = plan(sizes)
    reads = plan_reads(sizes, offsets, layout.offsets, capacity=capacity)
    device = bytearray(layout.total)
    written = bytearray(layout.total)
    for read in reads:
        assert read.file_offset % DIRECT_ALIGNMENT == 0 and read.nbytes > 0
        assert read.nbytes + (-read.nbytes % DIRECT_ALIGNMENT) <= capacity, "a direct read fits its slot"
        slot = file[read.file_offset : read.file_offset + read.nbytes]
        for run in read.runs:
            assert run.slot_offset >= 0 and run.slot_offset + run.nbytes <= read.nbytes
            device[run.offset : run.offset + run.nbytes] = slot[run.slot_offset : run.slot_offset + run.nbytes]
            for i in range(run.offset, run.offset + run.nbytes):
                written[i] += 1
    assert max(written, default=0) <= 1, "no device byte is written twice"
    for offset, size, start in zip(offsets, sizes, layout.offsets, strict=True):
        assert device[start : start + size] == file[offset : offset + size]
        assert all(written[start : start + size])
    assert all(a.file_offset <= b.file_offset for a, b in itertools.pairwise(reads)), "file order"


def test_plan_reads_makes_contiguous_storages_one_copy_and_cuts_at_large_gaps() -> None:
    sizes = [1 << 16, 1 << 16, 1 << 16]
    offsets = [8192, 8192 + (1 << 16), 8192 + (2 << 16)]
    reads = plan_reads(sizes, offsets, plan(sizes).offsets, capacity=1 << 20)
    assert len(reads) == 1 and len(reads[0].runs) == 1 and reads[0].runs[0].nbytes == 3 << 16
    small = [100, 100]  # 64-byte aligned in the file, 512 on the device: a copy each
    assert [len(r.runs) for r in plan_reads(small, [0, 128], plan(small).offsets, capacity=4096)] == [2]
    apart = plan_reads([10, 10], [0, 5 << 20], [0, 512], capacity=16 << 20)
    assert [r.file_offset for r in apart] == [0, 5 << 20], "a gap larger than GAP_BYTES is not read"
    with pytest.raises(zp.ArgumentError):
        plan_reads([1], [0], [0], capacity=1000)


# ---------------------------------------------------------------------------------------------------------
# Which path, and the order of the ring
# ---------------------------------------------------------------------------------------------------------


def test_resident_pages_are_copied_from_the_mapping_and_evicted_ones_read_from_the_file(disk: Path) -> None:
    layout = Layout(disk / "file", [(100, 300_000), (0, 5000)])
    before = stats()
    moved = layout.move(FakeBackend())
    assert delta(before, "cold") == 1 and delta(before, "mapped") == 0
    assert [raw(m) for m in moved] == layout.expected()
    assert layout.path.read_bytes() == layout.blob  # now in the page cache
    before = stats()
    moved = layout.move(FakeBackend())
    assert delta(before, "cold") == 0 and delta(before, "mapped") == 1
    assert [raw(m) for m in moved] == layout.expected()
    # Explicit methods copy from the mapping, cold or not.
    evict(layout.path)
    before = stats()
    layout.move(FakeBackend(), method="staged")
    assert delta(before, "cold") == 0 and delta(before, "mapped") == 1


def test_unknown_residency_is_copied_from_the_mapping(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Layout(disk / "file", [(0, 100_000)])
    monkeypatch.setattr(readahead, "cached_bytes", lambda fd, start, stop: None)
    before = stats()
    assert [raw(m) for m in layout.move(FakeBackend())] == layout.expected()
    assert delta(before, "cold") == 0 and delta(before, "mapped") == 1


class ReadSpy:
    """Logs every read into the fake backend's log, as ``("read", address, nbytes, direct)``."""

    def __init__(self, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch, refuse: bool = False) -> None:
        self.real = coldread._preadv
        self.fake = fake
        self.refuse = refuse
        monkeypatch.setattr(coldread, "_preadv", self)

    def __call__(self, fd: int, view: memoryview, offset: int) -> int:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        direct = _has_direct(fd)
        if self.refuse and direct:
            raise OSError(errno.EINVAL, "Invalid argument (fake)")
        self.fake.log.append(("read", address, len(view), direct))
        return self.real(fd, view, offset)


def _has_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def test_the_ring_has_at_most_slots_buffers_and_none_is_refilled_before_its_copy_is_waited_for(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout(disk / "file", [(0, 10_000), (4000, 300_000), (10, 5), (0, 200_000), (1, 90_000)])
    fake = FakeBackend()
    spy_slots: list[tuple[int, int]] = []
    real_pinned = fake.pinned

    def pinned(nbytes: int) -> torch.Tensor:
        slot = real_pinned(nbytes)
        spy_slots.append((slot.data_ptr(), slot.data_ptr() + nbytes))
        return slot

    fake.pinned = pinned  # type: ignore[method-assign]
    ReadSpy(fake, monkeypatch)
    moved = layout.move(fake, chunk_bytes=3 * 4096)
    assert [raw(m) for m in moved] == layout.expected()
    assert 1 < len(spy_slots) <= SLOTS
    reads = fake.calls("read")
    assert len(reads) > 2 * SLOTS, "the slots were reused"

    def slot_of(address: int) -> int:
        (slot,) = [i for i, (a, b) in enumerate(spy_slots) if a <= address < b]
        return slot

    # Replay the log: a read into a slot must come after the wait for every copy out of it.
    copied_before: dict[int, int] = {}  # slot -> the number of the event that covers its last copy
    unrecorded: set[int] = set()  # slots copied from since the last record
    waited = 0
    for entry in fake.log:
        if entry[0] == "copy":
            unrecorded.add(slot_of(entry[2]))
        elif entry[0] == "record":
            for slot in unrecorded:
                copied_before[slot] = entry[1]
            unrecorded.clear()
        elif entry[0] == "wait":
            waited = max(waited, entry[1])
        elif entry[0] == "read":
            slot = slot_of(entry[1])
            assert slot not in unrecorded
            assert copied_before.get(slot, 0) <= waited, f"slot {slot} refilled before its copy was waited for"
    assert fake.log[-1] == ("finish",)


def test_refused_direct_io_reads_buffered(disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Layout(disk / "file", LAYOUTS["odd sizes and offsets"] + [(0, 300_000)])
    real_open = os.open

    def no_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument (fake tmpfs)")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_direct)
    before = stats()
    assert [raw(m) for m in layout.move(FakeBackend(), chunk_bytes=8192)] == layout.expected()
    assert delta(before, "cold") == 1
    assert delta(before, "direct bytes") == 0 and delta(before, "buffered bytes") >= sum(layout.sizes)


def test_direct_reads_refused_by_the_file_system_fall_back_to_buffered(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = Layout(disk / "file", [(5, 200_000), (0, 3)])
    fake = FakeBackend()
    ReadSpy(fake, monkeypatch, refuse=True)
    before = stats()
    assert [raw(m) for m in layout.move(fake, chunk_bytes=65536)] == layout.expected()
    assert delta(before, "direct bytes") == 0 and delta(before, "buffered bytes") > 0
    assert fake.calls("read") and not any(entry[3] for entry in fake.calls("read"))


# ---------------------------------------------------------------------------------------------------------
# Failures leave nothing behind
# ---------------------------------------------------------------------------------------------------------


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_truncated_file_is_a_snapshot_error_and_frees_everything(disk: Path) -> None:
    layout = Layout(disk / "file", [(0, 100_000), (100, 200_000), (0, 50_000)])
    fake = FakeBackend()
    pinned: list[weakref.ref[torch.Tensor]] = []
    real_pinned = fake.pinned
    fake.pinned = lambda n: pinned.append(weakref.ref(t := real_pinned(n))) or t  # type: ignore[method-assign]
    os.truncate(layout.path, 150_000)
    before = settled()
    with pytest.raises(zp.SnapshotError, match="truncated") as info:
        layout.move(fake, chunk_bytes=65536)
    assert not isinstance(info.value, zp.DeviceError)
    gc.collect()
    assert fake.allocations and fake.allocations[0]() is None, "the device allocation is freed"
    assert pinned and all(ref() is None for ref in pinned), "the pinned slots are freed"
    assert left_behind(before) == (set(), set())


def test_a_failed_allocation_or_pinning_is_a_device_error(disk: Path) -> None:
    layout = Layout(disk / "file", [(0, 100_000)])
    fake = FakeBackend()

    def out_of_memory(nbytes: int) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    fake.allocate = out_of_memory  # type: ignore[method-assign]
    with pytest.raises(zp.DeviceError, match="cannot allocate 100000 bytes on cuda:0"):
        layout.move(fake)
    fake = FakeBackend()

    def no_pinned(nbytes: int) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory (fake cudaHostAlloc)")

    fake.pinned = no_pinned  # type: ignore[method-assign]
    before = settled()
    with pytest.raises(zp.DeviceError, match="transfer of 100000 bytes to cuda:0 failed"):
        layout.move(fake)
    gc.collect()
    assert fake.allocations[0]() is None and left_behind(before)[0] == set()


def test_a_failed_copy_waits_for_the_copies_before_it_and_frees_everything(disk: Path) -> None:
    layout = Layout(disk / "file", [(0, 100_000)] * 4)
    fake = FakeBackend()
    real = fake.copy

    def failing(dst: torch.Tensor, src: torch.Tensor) -> None:
        if len(fake.calls("copy")) == 3:
            raise RuntimeError("CUDA error: an illegal memory access (fake)")
        real(dst, src)

    fake.copy = failing  # type: ignore[method-assign]
    with pytest.raises(zp.DeviceError, match="the transfer of .* failed"):
        layout.move(fake, chunk_bytes=65536)
    assert fake.log[-1] == ("finish",) and not fake.pending, "the enqueued copies ended before the slots went"
    gc.collect()
    assert fake.allocations[0]() is None


def test_no_fd_or_thread_outlives_a_transfer(disk: Path) -> None:
    layout = Layout(disk / "file", [(0, 3 << 20), (7, 11)])
    before = settled()
    assert [raw(m) for m in layout.move(FakeBackend(), chunk_bytes=1 << 20)] == layout.expected()
    assert left_behind(before) == (set(), set())


def test_a_source_must_give_one_offset_per_storage() -> None:
    with pytest.raises(zp.ArgumentError, match="2 offsets for 1 storages"):
        transfer.move([torch.UntypedStorage(4)], CUDA0, backend=FakeBackend(), source=SourceFile(0, (0, 4)))


# ---------------------------------------------------------------------------------------------------------
# Through the load core: a snapshot file's buffers, by buffer index
# ---------------------------------------------------------------------------------------------------------


def test_load_stream_reads_a_cold_snapshot_file_for_the_device(disk: Path, fake_cuda: list[FakeBackend]) -> None:
    state = {"big": torch.randn(300, 257), "small": torch.arange(7.0), "cpu": torch.ones(3), "array": None}
    state["array"] = state["small"].numpy().copy()  # a buffer that is not a tensor's: it stays on the CPU
    path = disk / "s.zcp"
    zp.dump(state, path)
    header = zp.read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        with open(path, "rb") as f:
            view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
        ranges = [header.buffer_range(i) for i in range(len(header.buffers))]
        buffers = [view[a:b] for a, b in ranges]
        stream = bytes(view[header.stream_offset : header.stream_offset + header.stream_nbytes])
        evict(path)  # reading the header and the stream read ahead into the buffers' pages
        before = stats()
        table = BufferTable(
            buffers,
            locations=[b.location for b in header.buffers],
            tensor_buffers=[b.dtype is not None for b in header.buffers],
            source_file=(fd, [a for a, _ in ranges]),
        )
        loaded = loadcore.load_stream(stream, table, LoadPolicy(trusted=True, map_location="cuda:0"))
    finally:
        os.close(fd)
    assert delta(before, "cold") == 1 and len(fake_cuda) == 1
    for name in ("big", "small", "cpu"):
        assert torch.equal(loaded[name], state[name]), name
        base = fake_cuda[0].allocations[0]()
        assert base is not None and base.data_ptr() <= loaded[name].data_ptr() < base.data_ptr() + base.numel()
    assert (loaded["array"] == state["array"]).all()
