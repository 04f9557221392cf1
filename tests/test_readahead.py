"""Prefetch: a snapshot's pages read into the page cache by background threads, sequentially per stream, while the
load returns at once; the result stays a view of the shared page cache, and the page cache keeps the large folios
that make every later mapped load fault once per folio."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import readahead
from tests.test_transfer import evict
from tests.test_transfer_cold import delta, stats
from zerocopy_pickle.errors import ArgumentError, RestrictedLoadError

from .conftest import left_behind, settled

MIB = 1 << 20


def cached(path: Path, start: int = 0, stop: int | None = None) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        got = readahead.cached_bytes(fd, start, os.fstat(fd).st_size if stop is None else stop)
    finally:
        os.close(fd)
    assert got is not None, "this kernel tells neither cachestat nor mincore"
    return got


def write_file(path: Path, nbytes: int) -> Path:
    with open(path, "wb") as f:
        block = os.urandom(MIB)
        for _ in range(nbytes // MIB):
            f.write(block)
    return path


def state_dict(nbytes: int = 96 * MIB, tensors: int = 24) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"w{i}": torch.randn(nbytes // tensors // 4) for i in range(tensors)}


@pytest.fixture
def snapshot(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = state_dict()
    path = tmp_path / "sd.zcp"
    zp.dump(sd, path)
    evict(path)
    return path, sd


def data_range(path: Path) -> tuple[int, int]:
    header = zp.read_header(path)
    return header.data_offset, header.data_offset + header.data_nbytes


def in_prefetch() -> bool:
    return threading.current_thread().name.startswith("zerocopy_pickle-prefetch")


def hold_reads(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make every prefetch read wait until the returned event is set (other reads go on)."""
    release = threading.Event()
    real = os.preadv

    def held(fd: int, buffers: list[memoryview], offset: int) -> int:
        if in_prefetch():
            release.wait()
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", held)
    return release


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# --- the reads ---------------------------------------------------------------------------------------------------


def test_a_prefetch_brings_an_evicted_file_into_the_page_cache(tmp_path: Path) -> None:
    path = write_file(tmp_path / "f.bin", 80 * MIB)
    evict(path)
    assert cached(path) < 8 * MIB
    job = zp.prefetch(path)
    assert job is not None
    assert job.wait(timeout=120)
    assert job.error is None and not job.cancelled
    assert job.read == job.nbytes == 80 * MIB
    assert job.cached is not None and job.cached < 8 * MIB
    assert cached(path) == 80 * MIB


def test_prefetch_reads_through_streams_of_their_own_and_leaves_no_fd_open(tmp_path: Path) -> None:
    path = write_file(tmp_path / "f.bin", 256 * MIB)
    evict(path)
    before = settled()
    job = zp.prefetch(path, streams=4, wait=True)
    assert job is not None and job.done
    assert job.streams == 4
    assert left_behind(before)[0] == set()
    assert zp.prefetches() == []


TOUCH = r"""
import mmap, os, resource, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
view = memoryview(m)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
total = 0
for offset in range(0, len(m), 4096):
    total += view[offset]
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def touch_faults(path: Path) -> int:
    """The page faults a fresh process takes to touch one byte of every page of ``path`` (a mapping of it)."""
    out = subprocess.run([sys.executable, "-c", TOUCH, str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_a_prefetched_file_touches_with_as_few_faults_as_after_one_sequential_read(tmp_path: Path) -> None:
    # The trap a prefetch must avoid: pages brought in by scattered reads (several threads sharing one open file,
    # or reads out of order) are 4 KiB folios, and every later mapped load then takes one fault per 64 KiB of
    # fault-around at best. Sequential reads per stream leave the large folios one plain sequential read leaves.
    path = write_file(tmp_path / "f.bin", 128 * MIB)
    evict(path)
    with open(path, "rb") as f:
        while f.read(8 * MIB):
            pass
    sequential = touch_faults(path)

    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:  # four threads, one open file, 8 MiB reads interleaved
        threads = [
            threading.Thread(
                target=lambda i=i: [os.pread(fd, 8 * MIB, at) for at in range(i * 8 * MIB, 128 * MIB, 32 * MIB)]
            )
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        os.close(fd)
    scattered = touch_faults(path)
    assert scattered > 2 * sequential, (
        f"this file system keeps no large folios after sequential reads ({sequential} faults) against "
        f"scattered ones ({scattered}): the comparison below would prove nothing here"
    )

    evict(path)
    job = zp.prefetch(path, streams=4, wait=True)
    assert job is not None and job.read == 128 * MIB
    prefetched = touch_faults(path)
    assert prefetched <= 1.5 * sequential + 64, (prefetched, sequential, scattered)


def test_an_io_error_ends_the_prefetch_and_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.preadv

    def fail(fd: int, buffers: list[memoryview], offset: int) -> int:
        if in_prefetch():
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", fail)
    path = write_file(tmp_path / "f.bin", 64 * MIB)
    evict(path)
    job = zp.prefetch(path, wait=True)
    assert job is not None and job.done
    assert isinstance(job.error, OSError) and job.error.errno == errno.EIO
    assert job.read == 0


def test_cancel_stops_every_stream_after_its_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entered = threading.Semaphore(0)
    release = threading.Event()
    real = os.preadv

    def held(fd: int, buffers: list[memoryview], offset: int) -> int:
        if in_prefetch():
            entered.release()
            release.wait()
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", held)
    path = write_file(tmp_path / "f.bin", 256 * MIB)
    evict(path)
    job = zp.prefetch(path, streams=2)
    assert job is not None
    assert entered.acquire(timeout=60) and entered.acquire(timeout=60)  # both streams are in their first chunk
    assert job in zp.prefetches()
    job.cancel()
    release.set()
    assert job.wait(timeout=60)
    assert job.cancelled
    assert job.read <= 2 * readahead.READ_NBYTES  # one read per stream, then they stopped
    assert job not in zp.prefetches()


# --- when it does not pay ----------------------------------------------------------------------------------------


def test_no_prefetch_of_a_small_file(tmp_path: Path) -> None:
    path = write_file(tmp_path / "small.bin", 16 * MIB)
    evict(path)
    assert zp.prefetch(path) is None


def test_no_prefetch_of_a_file_already_in_the_page_cache(tmp_path: Path) -> None:
    path = write_file(tmp_path / "f.bin", 64 * MIB)
    path.read_bytes()
    assert zp.prefetch(path) is None


def test_a_partly_cached_file_is_read_whole_and_says_how_much_was_cached(tmp_path: Path) -> None:
    path = write_file(tmp_path / "f.bin", 128 * MIB)
    evict(path)
    with open(path, "rb") as f:  # the first half is cached already
        while f.tell() < 64 * MIB:
            f.read(8 * MIB)
    job = zp.prefetch(path, streams=1, wait=True)
    assert job is not None and job.cached is not None
    assert 64 * MIB <= job.cached < 128 * MIB
    assert job.read == 128 * MIB
    assert cached(path) == 128 * MIB


def test_no_prefetch_of_memory_file_systems() -> None:
    fd = os.memfd_create("zp-test")
    try:
        os.ftruncate(fd, 64 * MIB)
        assert zp.prefetch(fd) is None
    finally:
        os.close(fd)


def test_prefetch_of_something_not_a_regular_file_is_refused() -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(ArgumentError, match="regular file"):
            zp.prefetch(r)
    finally:
        os.close(r)
        os.close(w)


def test_a_prefetch_reads_at_most_a_share_of_the_available_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(readahead, "_memory_budget", lambda: 40 * MIB)
    path = write_file(tmp_path / "f.bin", 128 * MIB)
    evict(path)
    job = zp.prefetch(path, wait=True)
    assert job is not None and job.nbytes == 40 * MIB
    assert cached(path, 0, 40 * MIB) == 40 * MIB  # the front: what a load touches first


# --- loads -------------------------------------------------------------------------------------------------------


def test_a_load_with_prefetch_wait_returns_with_the_data_cached(snapshot: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, sd = snapshot
    start, stop = data_range(path)
    assert cached(path, start, stop) < 8 * MIB
    loaded = zp.load(path, prefetch="wait")
    assert cached(path, start, stop) == stop - start
    assert zp.prefetches() == []
    for name, tensor in sd.items():
        assert torch.equal(loaded[name], tensor)


def test_a_load_returns_before_its_prefetch_ends(
    snapshot: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sd = snapshot
    release = hold_reads(monkeypatch)
    loaded = zp.load(path)  # the default starts a prefetch and does not wait for it
    (job,) = zp.prefetches()
    assert not job.done
    for name, tensor in sd.items():  # touching the pages meanwhile is correct: they fault in as usual
        assert torch.equal(loaded[name], tensor)
    release.set()
    assert job.wait(timeout=120) and job.error is None


def test_prefetch_false_and_the_environment_switch_read_nothing_ahead(
    snapshot: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = snapshot
    start, stop = data_range(path)
    zp.load(path, prefetch=False)
    assert zp.prefetches() == []
    assert cached(path, start, stop) < 8 * MIB
    monkeypatch.setenv("ZEROCOPY_PICKLE_PREFETCH", "0")
    zp.load(path)
    assert zp.prefetches() == []
    assert cached(path, start, stop) < 8 * MIB
    zp.load(path, prefetch="wait")  # an explicit argument wins over the environment
    assert cached(path, start, stop) == stop - start


def test_the_environment_can_make_every_load_wait(
    snapshot: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = snapshot
    start, stop = data_range(path)
    monkeypatch.setenv("ZEROCOPY_PICKLE_PREFETCH", "wait")
    zp.load(path)
    assert cached(path, start, stop) == stop - start


@pytest.mark.parametrize("bad", ["yes", 1.5, "WAIT "])
def test_an_unknown_prefetch_value_is_refused_before_anything_is_read(
    snapshot: tuple[Path, dict[str, torch.Tensor]], bad: object
) -> None:
    path, _ = snapshot
    with pytest.raises(ArgumentError, match="prefetch must be"):
        zp.load(path, prefetch=bad)  # type: ignore[arg-type]


class Config:
    """A class no restricted load allows unless the call names it."""


def test_a_refused_load_cancels_its_prefetch(tmp_path: Path) -> None:
    path = tmp_path / "obj.zcp"
    zp.dump({"data": state_dict(), "config": Config()}, path)
    evict(path)
    start, stop = data_range(path)
    started = []
    real = readahead.start

    def spy(*args: object, **kwargs: object) -> readahead.Prefetch | None:
        job = real(*args, **kwargs)  # type: ignore[arg-type]
        started.append(job)
        return job

    readahead_start = pytest.MonkeyPatch()
    readahead_start.setattr(readahead, "start", spy)
    try:
        with pytest.raises(RestrictedLoadError):
            zp.load(path, prefetch="wait")
    finally:
        readahead_start.undo()
    # The refusal comes from the unpickler's admission, once the buffers are sliced: the prefetch started there
    # is cancelled by the failed load and stops before it has read the file.
    for job in started:
        if job is not None:
            assert job.cancelled
            assert job.wait(timeout=60)
            assert job.read < job.nbytes, job  # stopped before the end (how far it got first is a race)
    assert cached(path, start, stop) < stop - start


def test_the_loaded_tensors_stay_views_of_the_shared_page_cache(snapshot: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, sd = snapshot
    loaded = zp.load(path, prefetch="wait")
    maps = Path("/proc/self/smaps").read_text().split("\n")
    regions = []
    for i, line in enumerate(maps):
        if line.endswith(str(path)):
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            fields = {}
            for entry in maps[i + 1 : i + 25]:
                key, _, value = entry.partition(":")
                if value.strip().endswith("kB"):
                    fields[key] = int(value.split()[0])
            regions.append((low, high, fields))
    assert regions, "the snapshot is not mapped"
    for tensor in loaded.values():
        address = tensor.data_ptr()
        assert any(low <= address < high for low, high, _ in regions)
    assert sum(fields["Anonymous"] for _, _, fields in regions) == 0  # nothing copied into private memory
    for name, tensor in sd.items():
        assert torch.equal(loaded[name], tensor)


def test_snapshot_load_prefetches_a_file_but_never_a_memfd(snapshot: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, sd = snapshot
    start, stop = data_range(path)
    with zp.Snapshot.open(path) as snap:
        loaded = snap.load(prefetch="wait")
    assert cached(path, start, stop) == stop - start
    assert torch.equal(loaded["w0"], sd["w0"])
    with zp.freeze(sd) as frozen:
        frozen.load(prefetch="wait")
        assert zp.prefetches() == []


def test_a_file_object_load_prefetches_from_its_position(tmp_path: Path) -> None:
    path = tmp_path / "two.bin"
    sd = state_dict()
    with open(path, "wb") as f:
        f.write(b"\0" * mmap.ALLOCATIONGRANULARITY)
        zp.dump(sd, f)
    evict(path)
    with open(path, "rb") as f:
        f.seek(mmap.ALLOCATIONGRANULARITY)
        loaded = zp.load(f, prefetch="wait")
    data_nbytes = sum(t.nbytes for t in sd.values())
    assert cached(path) >= data_nbytes
    assert torch.equal(loaded["w3"], sd["w3"])


def test_a_fork_child_sees_its_parents_prefetches_as_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = hold_reads(monkeypatch)
    path = write_file(tmp_path / "f.bin", 64 * MIB)
    evict(path)
    job = zp.prefetch(path)
    assert job is not None
    pid = os.fork()
    if pid == 0:  # the child: its copy of the job can never finish, so it must read as ended
        ok = job.wait(timeout=5) and job.cancelled and zp.prefetches() == []
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    release.set()
    assert os.waitstatus_to_exitcode(status) == 0
    assert job.wait(timeout=120) and not job.cancelled


def test_a_load_to_a_device_reads_the_cold_file_itself_and_prefetches_nothing(
    snapshot: tuple[Path, dict[str, torch.Tensor]],
    fake_cuda: list[object],
) -> None:
    path, sd = snapshot
    start, stop = data_range(path)
    before = stats()
    loaded = zp.load(path, map_location="cuda:0")
    assert delta(before, "cold") == 1 and len(fake_cuda) == 1  # read from the file into the staging ring
    assert zp.prefetches() == []
    assert cached(path, start, stop) < 8 * MIB  # O_DIRECT: the page cache was not filled on the way
    for name, tensor in sd.items():
        assert torch.equal(loaded[name], tensor)
