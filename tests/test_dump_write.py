"""How a dump to a path writes its file: preallocated, buffers placed at their offsets in chunks and checksummed
in the same pass, the header last. The file must be byte for byte what ``dumps`` returns."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import arena, integrity, writes

from .conftest import left_behind, settled

MiB = 1 << 20


def mixed_graph() -> dict[str, object]:
    """Buffers of every shape the writer has to place: tiny ones a few bytes apart, an empty one, one that spans
    several write chunks with an odd length, half precision, a view sharing a storage, and plain objects."""
    torch.manual_seed(3)
    big = torch.randn(5 * MiB // 4 + 3)  # 5 MiB + 12 bytes: three chunks, the last one short
    small = {f"bias{i}": torch.randn(i + 1) for i in range(40)}
    return {
        **small,
        "empty": torch.empty(0),
        "big": big,
        "big_view": big[7:1000],
        "half": torch.randn(300, 301).half(),
        "step": 17,
        "name": "mixed",
    }


def assert_graph_equal(got: dict[str, object], want: dict[str, object]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[name], torch.Tensor)
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


@pytest.mark.parametrize(
    "options",
    [{}, {"checksums": False}, {"key": b"k" * 32}],
    ids=["checksums", "no-checksums", "signed"],
)
def test_dump_to_a_path_writes_the_bytes_dumps_returns(tmp_path: Path, options: dict[str, object]) -> None:
    graph = mixed_graph()
    path = tmp_path / "mixed.zcp"
    zp.dump(graph, path, **options)
    assert path.read_bytes() == zp.dumps(graph, **options)
    key = options.get("key")
    loaded = zp.load(path, trusted=True, verify="checksums" not in options, key=key)
    assert_graph_equal(loaded, graph)


def test_dump_over_a_larger_snapshot_leaves_nothing_of_it(tmp_path: Path) -> None:
    path = tmp_path / "s.zcp"
    zp.dump({"w": torch.randn(3 * MiB)}, path)
    small = {"w": torch.ones(10)}
    zp.dump(small, path)
    assert path.read_bytes() == zp.dumps(small)


@pytest.mark.parametrize(
    ("cpus", "writers"), [(1, "auto"), (2, "1"), (2, "auto")], ids=["same-thread", "hashing-thread", "two-writers"]
)
def test_checksums_computed_while_writing_are_the_checksums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int, writers: str
) -> None:
    # Every way of hashing: in the writing thread (one CPU), in a second thread beside one writer, and in two
    # writing threads (every size counts as large). tests/test_parallel_write.py tests the last in depth.
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: cpus)
    monkeypatch.setenv(integrity.WRITERS_ENV, writers)
    monkeypatch.setattr(integrity, "PARALLEL_HASH_MIN_NBYTES", 0)
    monkeypatch.setattr(integrity, "_HASH_SLICE", 4096 + 3)  # slices that do not divide the buffers
    buffers = [b"", os.urandom(100), os.urandom(2 * writes.WRITE_CHUNK + 5), bytearray(os.urandom(4096))]
    placed = []
    offset = 0
    for b in buffers:
        placed.append((offset, b))
        offset += len(b) + 64
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        writes.preallocate(fd, offset)
        sums = integrity.write_checksummed(fd, placed)
        data = os.pread(fd, offset + 1, 0)
    finally:
        os.close(fd)
    assert sums == tuple(integrity.checksum(b) for b in buffers)
    assert len(data) == offset
    expected = bytearray(offset)
    for at, b in placed:
        expected[at : at + len(b)] = b
    assert data == expected


def test_a_failed_write_stops_the_hashing_thread_and_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: 2)
    monkeypatch.setenv(integrity.WRITERS_ENV, "1")  # one writing thread and the hashing thread
    monkeypatch.setattr(integrity, "PARALLEL_HASH_MIN_NBYTES", 0)
    monkeypatch.setattr(integrity, "_HASH_SLICE", 4096)
    events: list[threading.Event] = []

    class RecordingEvent(threading.Event):  # the writer's stop signal, so the hashing thread can wait for it
        def __init__(self) -> None:
            super().__init__()
            events.append(self)

    monkeypatch.setattr(integrity, "threading", SimpleNamespace(Event=RecordingEvent, Thread=threading.Thread))
    started = threading.Event()
    hashed: list[int] = []
    real = integrity._xxh3()

    class Hasher:  # takes its first slice, then holds the thread until the writer has signalled a stop
        def __init__(self) -> None:
            self._h = real.xxh3_64()

        def update(self, data: Any) -> None:
            hashed.append(len(data))
            started.set()
            events[0].wait(5 if len(hashed) == 1 else 0)  # without a stop signal, every slice gets hashed
            self._h.update(data)

        def hexdigest(self) -> str:
            return str(self._h.hexdigest())

    monkeypatch.setattr(integrity, "_xxh3", lambda: SimpleNamespace(xxh3_64=Hasher))

    def failing_write(fd: int, placed: object, **kwargs: object) -> None:
        assert started.wait(5)
        raise OSError(errno.ENOSPC, "no space left")

    monkeypatch.setattr(writes, "write_placed", failing_write)
    buffers = [os.urandom(64 * 4096) for _ in range(64)]
    before = settled()
    with pytest.raises(OSError) as info:
        integrity.write_checksummed(-1, [(i * 64 * 4096, b) for i, b in enumerate(buffers)])
    assert info.value.errno == errno.ENOSPC
    assert left_behind(before)[1] == set()  # joined, not left running
    assert hashed == [4096]  # it stopped at the next slice


def test_observer_sees_every_chunk_in_order_before_it_is_written(tmp_path: Path) -> None:
    piece = os.urandom(writes.WRITE_CHUNK * 2 + 1)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    seen: list[tuple[int, int, int]] = []  # (piece index, chunk length, bytes of the piece in the file by then)

    def observe(index: int, chunk: memoryview) -> None:
        seen.append((index, chunk.nbytes, len(os.pread(fd, len(piece), 10))))

    try:
        writes.write_placed(fd, [(10, piece), (20 + len(piece), b"")], observe=observe)
        assert os.pread(fd, len(piece), 10) == piece
    finally:
        os.close(fd)
    # Chunks end at multiples of WRITE_CHUNK in the file: the piece starts at offset 10.
    w = writes.WRITE_CHUNK
    assert [(i, n) for i, n, _ in seen] == [(0, w - 10), (0, w), (0, 11), (1, 0)]
    starts = [0, w - 10, 2 * w - 10]  # where each chunk begins within the piece
    assert all(in_file <= start for (_, _, in_file), start in zip(seen, starts, strict=False))


def test_each_aligned_window_of_contiguous_buffers_is_written_by_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buffers laid out back to back (small alignment gaps) at unaligned offsets: every pwrite(v) covers at most one
    WRITE_CHUNK-aligned window, and each window the buffers cover whole is covered by exactly one call, so the page
    cache can build it from folios of the window's size (one page fault per window when a load maps it)."""
    w = writes.WRITE_CHUNK
    sizes = [w // 3 + 17, w + 5, 64, 3 * w // 2, w - 1, 2 * w + 100]
    placed, at = [], 4096 + 40
    for size in sizes:
        placed.append((at, os.urandom(size)))
        at = (at + size + 63) // 64 * 64  # 64-byte alignment: gaps under a page
    # A gap of 300 bytes that a window boundary cuts, then a buffer that fills the next window whole.
    placed += [(at, os.urandom(8 * w - 100 - at)), (8 * w + 200, os.urandom(w + 4000))]
    calls: list[tuple[int, int]] = []
    pwrite, pwritev = os.pwrite, os.pwritev

    def record_pwrite(fd: int, data: Any, offset: int) -> int:
        calls.append((offset, memoryview(data).nbytes))
        return pwrite(fd, data, offset)

    def record_pwritev(fd: int, views: Any, offset: int) -> int:
        calls.append((offset, sum(memoryview(v).nbytes for v in views)))
        return pwritev(fd, views, offset)

    monkeypatch.setattr(os, "pwrite", record_pwrite)
    monkeypatch.setattr(os, "pwritev", record_pwritev)
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        writes.write_placed(fd, placed)
        for offset, data in placed:
            assert os.pread(fd, len(data), offset) == data
    finally:
        os.close(fd)
    for offset, nbytes in calls:
        assert offset // w == (offset + nbytes - 1) // w, (offset, nbytes)  # inside one window
    first, last = placed[0][0], placed[-1][0] + len(placed[-1][1])
    for window in range(-(-first // w), last // w):  # the windows the buffers cover whole
        assert (window * w, w) in calls, window


def test_short_writes_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may write less than asked (a signal, a nearly full disk); the rest must follow."""
    real_pwrite, real_pwritev = os.pwrite, os.pwritev
    calls = []

    def short_pwrite(fd: int, data: memoryview, offset: int) -> int:
        calls.append(offset)
        return real_pwrite(fd, memoryview(data)[:1000], offset)

    def short_pwritev(fd: int, views: list[memoryview], offset: int) -> int:
        calls.append(offset)
        return real_pwritev(fd, [memoryview(views[0])[:1000]], offset)

    monkeypatch.setattr(os, "pwrite", short_pwrite)
    monkeypatch.setattr(os, "pwritev", short_pwritev)
    graph = mixed_graph()
    path = tmp_path / "short.zcp"
    zp.dump(graph, path)
    monkeypatch.undo()
    assert len(calls) > 100
    assert path.read_bytes() == zp.dumps(graph)


def test_a_write_that_makes_no_progress_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    monkeypatch.setattr(os, "pwritev", lambda fd, views, offset: 0)
    with pytest.raises(OSError) as info:
        zp.dump({"w": torch.ones(10)}, tmp_path / "x.zcp")
    assert info.value.errno == errno.EIO
    assert os.listdir(tmp_path) == []


def _failing_fallocate(code: int) -> object:
    def fallocate(fd: int, mode: int, offset: int, length: int) -> int:
        ctypes.set_errno(code)
        return -1

    return fallocate


def test_without_fallocate_the_size_is_set_by_ftruncate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writes, "_fallocate", _failing_fallocate(errno.EOPNOTSUPP))
    graph = mixed_graph()
    path = tmp_path / "nofalloc.zcp"
    zp.dump(graph, path)
    monkeypatch.undo()
    assert path.read_bytes() == zp.dumps(graph)


def test_a_full_disk_at_preallocation_keeps_the_old_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.zcp"
    old = {"w": torch.randn(100)}
    zp.dump(old, path)
    before = path.read_bytes()
    monkeypatch.setattr(writes, "_fallocate", _failing_fallocate(errno.ENOSPC))
    with pytest.raises(OSError) as info:
        zp.dump({"w": torch.randn(MiB)}, path)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["s.zcp"]
    assert path.read_bytes() == before


def test_preallocate_on_a_memfd_sets_the_size_and_reads_zeros() -> None:
    fd = arena.create_memfd("prealloc-test")
    try:
        writes.preallocate(fd, 3 * 4096 + 5)
        assert os.fstat(fd).st_size == 3 * 4096 + 5
        assert os.pread(fd, 4 * 4096, 0) == bytes(3 * 4096 + 5)
        writes.preallocate(fd, 0)  # nothing to do
        assert os.fstat(fd).st_size == 3 * 4096 + 5
    finally:
        os.close(fd)
