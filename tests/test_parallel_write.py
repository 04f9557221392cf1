"""A large dump to a path writes in two threads (issue 24): the file cut at aligned window boundaries between
buffers, each thread hashing the buffers it writes. The bytes, the checksums, the write calls and the page-cache
folios a load maps must be those of the single-threaded writer; a failure in either thread must fail the dump
and leave the previous snapshot in place."""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerocopy_pickle as zp
from tests.internals import integrity, writes

from .conftest import left_behind, settled

MiB = 1 << 20
W = writes.WRITE_CHUNK

# Buffer sizes around the window size and the format's alignments, and odd ones.
SIZES = st.one_of(
    st.sampled_from([0, 1, 63, 64, 4095, 4096, W - 1, W, W + 1, 2 * W + 5, 3 * W]),
    st.integers(0, 3 * W),
    st.integers(0, 5000),
)


def layout(sizes: list[int], start: int) -> list[tuple[int, bytes]]:
    """Buffers back to back from ``start``, aligned as format.encode aligns them (4096 bytes for large ones)."""
    placed = []
    at = start
    for i, size in enumerate(sizes):
        align = 4096 if size >= 1 << 16 else 64
        at = -(-at // align) * align
        placed.append((at, bytes([i % 251 + 1]) * size))  # distinct bytes per buffer, cheap to make
        at += size
    return placed


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parallel")


def write_recorded(path: Path, size: int, write: Callable[[int], object]) -> list[tuple[int, int]]:
    """Run ``write(fd)`` on a new preallocated file; return its pwrite(v) calls as (offset, bytes)."""
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()
    pwrite, pwritev = os.pwrite, os.pwritev

    def record(offset: int, nbytes: int) -> None:
        with lock:
            calls.append((offset, nbytes))

    def record_pwrite(fd: int, data: Any, offset: int) -> int:
        record(offset, memoryview(data).nbytes)
        return pwrite(fd, data, offset)

    def record_pwritev(fd: int, views: Any, offset: int) -> int:
        record(offset, sum(memoryview(v).nbytes for v in views))
        return pwritev(fd, views, offset)

    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600)
    try:
        writes.preallocate(fd, size)
        os.pwrite, os.pwritev = record_pwrite, record_pwritev  # type: ignore[assignment]
        try:
            write(fd)
        finally:
            os.pwrite, os.pwritev = pwrite, pwritev
    finally:
        os.close(fd)
    return sorted(calls)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(SIZES, min_size=0, max_size=24),
    start=st.sampled_from([0, 64, 4096 + 40, W - 128, W]),
    parts=st.integers(2, 4),
)
def test_shares_write_the_bytes_and_calls_of_write_placed_and_hash_every_buffer_once(
    scratch: Path, sizes: list[int], start: int, parts: int
) -> None:
    placed = layout(sizes, start)
    size = max([offset + len(b) for offset, b in placed] + [1])
    shares = writes.split_placed(placed, parts)
    if shares is None:
        return  # nothing to divide (fewer than two filled buffers, or no balanced cut): write_placed does it all
    assert [s.first for s in shares] == sorted({s.first for s in shares})
    assert shares[0].first == 0 and shares[-1].stop == len(placed)
    for before, after in itertools.pairwise(shares):
        assert before.stop == after.first and before.hi == after.lo and after.lo % W == 0

    serial_calls = write_recorded(scratch / "serial", size, lambda fd: writes.write_placed(fd, placed))
    hashers = [integrity._xxh3().xxh3_64() for _ in placed]
    observers: dict[int, set[int]] = {}
    reported: list[int] = []

    def observe(i: int, chunk: memoryview) -> None:
        observers.setdefault(i, set()).add(threading.get_ident())
        hashers[i].update(chunk)

    parallel_calls = write_recorded(
        scratch / "parallel",
        size,
        lambda fd: writes.write_shares(fd, shares, observe=observe, progress=reported.append),
    )
    assert (scratch / "parallel").read_bytes() == (scratch / "serial").read_bytes()
    assert parallel_calls == serial_calls  # the same windows, each filled by one call
    assert [h.hexdigest() for h in hashers] == [integrity.checksum(b) for _, b in placed]
    assert sorted(observers) == list(range(len(placed)))  # every buffer observed (an empty one as one chunk)
    assert all(len(threads) == 1 for threads in observers.values())  # each by one thread
    assert sum(reported) == sum(len(b) for _, b in placed)  # every byte once, padding not counted


@pytest.mark.parametrize(
    ("sizes", "divided"),
    [
        ([3 * W + 7] * 20, True),  # many buffers
        ([1000] * 300 + [W // 3] * 30, True),  # many small ones sharing windows
        ([64 * W], False),  # one giant buffer: nothing to divide
        ([64 * W, 100, 200], False),  # a giant and a few small: no balanced cut
        ([0, 5 * W + 1, 0, 0, 7 * W - 3, 0], True),  # empty buffers between
        ([W - 1, W + 1, 1, 3, 2 * W, 5, W], True),  # odd sizes
    ],
    ids=["many", "small", "giant", "giant-and-small", "empties", "odd"],
)
def test_write_checksummed_in_two_threads_gives_the_checksums(
    scratch: Path, monkeypatch: pytest.MonkeyPatch, sizes: list[int], divided: bool
) -> None:
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: 2)
    monkeypatch.setattr(integrity, "PARALLEL_HASH_MIN_NBYTES", 0)
    used = spy_on_write_shares(monkeypatch)
    placed = layout(sizes, 4096 + 200)
    size = placed[-1][0] + len(placed[-1][1])
    sums: list[tuple[str, ...]] = []
    write_recorded(scratch / "w", size, lambda fd: sums.append(integrity.write_checksummed(fd, placed)))
    assert sums == [tuple(integrity.checksum(b) for _, b in placed)]
    assert bool(used) == divided
    data = (scratch / "w").read_bytes()
    for offset, b in placed:
        assert data[offset : offset + len(b)] == b


def spy_on_write_shares(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an entry for every call of writes.write_shares (the parallel writer)."""
    used: list[int] = []
    real = writes.write_shares

    def spy(*args: Any, **kwargs: Any) -> None:
        used.append(len(args[1]))
        real(*args, **kwargs)

    monkeypatch.setattr(writes, "write_shares", spy)
    return used


def graphs() -> Iterator[tuple[str, dict[str, object]]]:
    torch.manual_seed(5)
    yield "many-small", {f"b{i}": torch.randn(i * 37 + 1) for i in range(400)}
    yield "giant", {"w": torch.randn(9 * MiB // 4 + 3)}
    yield (
        "mixed",
        {
            "big": torch.randn(3 * MiB + 1),
            "empty": torch.empty(0),
            **{f"s{i}": torch.randn(i + 1).half() for i in range(50)},
            "mid": torch.randn(700, 301),
            "tail": torch.arange(5),
            "meta": "x",
        },
    )


@pytest.mark.parametrize(("name", "graph"), list(graphs()), ids=[name for name, _ in graphs()])
@pytest.mark.parametrize("options", [{}, {"checksums": False}, {"key": b"k" * 32}], ids=["sums", "nock", "signed"])
def test_a_parallel_dump_is_byte_for_byte_the_single_threaded_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, graph: dict[str, object], options: dict[str, Any]
) -> None:
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: 2)
    monkeypatch.setattr(integrity, "PARALLEL_HASH_MIN_NBYTES", 0)
    monkeypatch.setenv(integrity.WRITERS_ENV, "1")
    zp.dump(graph, tmp_path / "one.zcp", **options)
    monkeypatch.setenv(integrity.WRITERS_ENV, "auto")
    zp.dump(graph, tmp_path / "two.zcp", **options)
    assert (tmp_path / "two.zcp").read_bytes() == (tmp_path / "one.zcp").read_bytes() == zp.dumps(graph, **options)
    zp.load(tmp_path / "two.zcp", trusted=True, verify="checksums" not in options, key=options.get("key"))


def fail_in_worker(monkeypatch: pytest.MonkeyPatch, nth: int) -> list[str]:
    """Make the ``nth`` pwrite(v) from a thread other than the main one fail with ENOSPC; return the names of
    the threads that wrote."""
    main = threading.main_thread()
    writers: list[str] = []
    count = [0]
    lock = threading.Lock()
    pwrite, pwritev = os.pwrite, os.pwritev

    def check() -> None:
        with lock:
            writers.append(threading.current_thread().name)
            if threading.current_thread() is not main:
                count[0] += 1
                if count[0] == nth:
                    raise OSError(errno.ENOSPC, "no space left (injected)")

    def failing_pwrite(fd: int, data: Any, offset: int) -> int:
        check()
        return pwrite(fd, data, offset)

    def failing_pwritev(fd: int, views: Any, offset: int) -> int:
        check()
        return pwritev(fd, views, offset)

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    monkeypatch.setattr(os, "pwritev", failing_pwritev)
    return writers


@pytest.mark.parametrize("nth", [1, 7], ids=["first", "seventh"])
@pytest.mark.parametrize("options", [{}, {"checksums": False}], ids=["sums", "nock"])
def test_a_failed_write_in_the_second_thread_fails_the_dump_and_keeps_the_old_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nth: int, options: dict[str, Any]
) -> None:
    path = tmp_path / "s.zcp"
    old = {"w": torch.randn(100)}
    zp.dump(old, path)
    before = path.read_bytes()
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: 2)
    monkeypatch.setattr(integrity, "PARALLEL_HASH_MIN_NBYTES", 0)
    writers = fail_in_worker(monkeypatch, nth)
    before_run = settled()
    with pytest.raises(OSError) as info:
        zp.dump({f"w{i}": torch.randn(MiB // 2 + i) for i in range(24)}, path, **options)
    assert info.value.errno == errno.ENOSPC
    assert left_behind(before_run)[1] == set()  # every writing thread joined
    assert any(name.startswith("zerocopy_pickle-write") for name in writers)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["s.zcp"]
    assert path.read_bytes() == before
    assert torch.equal(zp.load(path)["w"], old["w"])


def test_a_failure_in_the_calling_thread_stops_the_other_and_raises_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: 2)
    monkeypatch.setattr(integrity, "PARALLEL_HASH_MIN_NBYTES", 0)
    main = threading.main_thread()
    worker_calls = []
    failed = threading.Event()
    pwrite = os.pwrite

    def failing_pwrite(fd: int, data: Any, offset: int) -> int:
        if threading.current_thread() is main:
            failed.set()
            raise OSError(errno.EIO, "injected")
        worker_calls.append(offset)
        failed.wait(5)  # the worker writes only after the calling thread failed: it must stop at its next chunk
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing_pwrite)
    before = settled()
    with pytest.raises(OSError) as info:
        zp.dump({f"w{i}": torch.randn(MiB + 3) for i in range(16)}, tmp_path / "x.zcp")
    assert info.value.errno == errno.EIO
    assert left_behind(before)[1] == set()
    assert len(worker_calls) <= 1  # the chunk it had started, then it stopped
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_progress_counts_every_byte_once_from_both_threads(scratch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: 2)
    monkeypatch.setattr(integrity, "PARALLEL_HASH_MIN_NBYTES", 0)
    placed = layout([W // 2 + 3] * 40 + [0, 17, 5 * W], 100)
    size = placed[-1][0] + len(placed[-1][1])
    reports: list[tuple[int, int]] = []

    def progress(n: int) -> None:
        reports.append((threading.get_ident(), n))

    write_recorded(scratch / "p", size, lambda fd: integrity.write_checksummed(fd, placed, progress=progress))
    assert sum(n for _, n in reports) == sum(len(b) for _, b in placed)
    assert len({thread for thread, _ in reports}) == 2
    assert max(n for _, n in reports) <= W  # one call per window at most


def test_the_writers_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: 16)
    for value, expected in [("", integrity.MAX_WRITERS), ("auto", integrity.MAX_WRITERS), ("1", 1), ("2", 2)]:
        monkeypatch.setenv(integrity.WRITERS_ENV, value)
        assert integrity.writers() == expected
    # Large dumps write with one thread unless the setting says otherwise (docs/benchmark.md measured why).
    big = integrity.PARALLEL_WRITE_MAX_NBYTES + 1
    for value, expected in [("", 1), ("auto", 1), ("1", 1), ("2", 2)]:
        monkeypatch.setenv(integrity.WRITERS_ENV, value)
        assert integrity.writers(big) == expected
        assert integrity.writers(integrity.PARALLEL_WRITE_MAX_NBYTES) == (1 if value == "1" else 2)
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: 1)
    monkeypatch.setenv(integrity.WRITERS_ENV, "2")
    assert integrity.writers() == 1
    for bad in ["0", "two", "-1"]:
        monkeypatch.setenv(integrity.WRITERS_ENV, bad)
        with pytest.raises(zp.ArgumentError):
            integrity.writers()


_TOUCH = """
import mmap, os, resource, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.fstat(fd).st_size
m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
total = 0
for at in range(0, size, 4096):
    total += m[at]
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def minor_faults_to_touch(path: Path) -> int:
    out = subprocess.run([sys.executable, "-c", _TOUCH, str(path)], check=True, capture_output=True, text=True)
    return int(out.stdout)


def test_a_parallel_dump_leaves_folios_as_large_as_the_single_threaded_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh process maps each file and reads one byte per page: the page faults count the folios the writes
    left in the page cache (one per aligned window when each window was filled by one call)."""
    monkeypatch.setattr(integrity, "_usable_cpus", lambda: 2)
    torch.manual_seed(0)
    graph = {f"w{i}": torch.randn((MiB + 4099 * i) // 4) for i in range(64)}  # 66 MiB, odd sizes
    monkeypatch.setenv(integrity.WRITERS_ENV, "1")
    zp.dump(graph, tmp_path / "one.zcp")
    one = minor_faults_to_touch(tmp_path / "one.zcp")
    used = spy_on_write_shares(monkeypatch)
    monkeypatch.setenv(integrity.WRITERS_ENV, "auto")
    zp.dump(graph, tmp_path / "two.zcp")
    two = minor_faults_to_touch(tmp_path / "two.zcp")
    assert used  # the parallel writer wrote it
    assert os.path.getsize(tmp_path / "two.zcp") >= 64 * MiB
    assert two <= 1.5 * one, (two, one)
