"""A mapping lives as long as any storage in it: closing or dropping things never pulls memory from a tensor."""

from __future__ import annotations

import gc
import mmap
import os
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp

from .conftest import mapped_regions, run_python


def open_fds() -> int:
    gc.collect()  # earlier tests' garbage (in a parallel run, this worker ran others) is not this test's to count
    return len(os.listdir("/proc/self/fd"))


def test_snapshot_close_with_live_tensors() -> None:
    snap = zp.freeze({"t": torch.arange(100_000, dtype=torch.float64)})
    loaded = snap.load()
    snap.close()
    snap.close()  # idempotent
    assert snap.closed
    with pytest.raises(zp.ZeroCopyPickleError, match="closed"):
        snap.load()
    gc.collect()
    assert loaded["t"].sum() == sum(range(100_000))
    loaded["t"][0] = 1.0  # still writable (private page)


def test_dropping_every_reference_but_a_view() -> None:
    snap = zp.freeze({"t": torch.arange(10_000, dtype=torch.int64)})
    view = snap.load()["t"][5000:]
    del snap
    gc.collect()
    assert int(view[0]) == 5000 and int(view.sum()) == sum(range(5000, 10_000))


def test_storage_outlives_everything(tmp_path: Path) -> None:
    path = tmp_path / "s.zcp"
    zp.dump({"t": torch.full((4096,), 3, dtype=torch.int32)}, path)
    storage = zp.load(path)["t"].untyped_storage()
    os.unlink(path)  # the mapping keeps the inode alive
    gc.collect()
    assert storage.nbytes() == 4096 * 4
    assert bytes(storage)[:4] == (3).to_bytes(4, "little")


def test_mapping_is_released_with_the_last_storage(tmp_path: Path) -> None:
    path = tmp_path / "r.zcp"
    zp.dump({"t": torch.ones(100_000)}, path)
    loaded = zp.load(path)
    assert any(str(path) in p for _, _, p in mapped_regions())
    del loaded
    gc.collect()
    assert not any(str(path) in p for _, _, p in mapped_regions())


def test_no_fd_leak_across_many_loads(tmp_path: Path) -> None:
    path = tmp_path / "f.zcp"
    zp.dump({"t": torch.ones(10)}, path)
    zp.load(path)
    before = open_fds()
    for _ in range(200):
        zp.load(path)
        with zp.Snapshot.open(path) as snap:
            snap.load()
    with zp.freeze({"t": torch.ones(3)}) as snap:
        for _ in range(50):
            snap.load()
    gc.collect()
    assert open_fds() == before


def test_snapshot_garbage_collected_closes_fd() -> None:
    before = open_fds()
    snap = zp.freeze([torch.ones(1)])
    assert open_fds() == before + 1
    del snap
    gc.collect()
    assert open_fds() == before


def test_memfd_is_sealed_and_immutable() -> None:
    snap = zp.freeze({"t": torch.ones(1000)})
    assert snap.sealed
    with pytest.raises(PermissionError):
        os.pwrite(snap.fd, b"x", 100)
    with pytest.raises(PermissionError):
        os.ftruncate(snap.fd, 10)
    with pytest.raises(PermissionError):
        mmap.mmap(snap.fd, snap.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
    snap.close()


def test_snapshot_from_fd_duplicates(tmp_path: Path) -> None:
    original = zp.freeze({"t": torch.arange(3)})
    copy = zp.Snapshot.from_fd(original.fd, trusted=True)
    assert copy.fd != original.fd
    original.close()
    assert copy.load()["t"].tolist() == [0, 1, 2]
    assert copy.nbytes == original.nbytes
    copy.close()


def test_snapshot_rejects_bad_fds(tmp_path: Path) -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(zp.SnapshotError, match="mappable"):
            zp.Snapshot.from_fd(r)
    finally:
        os.close(r)
        os.close(w)
    bad = tmp_path / "bad.zcp"
    bad.write_bytes(b"hello")
    with pytest.raises(zp.SnapshotError, match="truncated"):
        zp.Snapshot.open(bad)
    with pytest.raises(TypeError, match="freeze"):
        zp.Snapshot()


def test_file_changed_size_since_open(tmp_path: Path) -> None:
    path = tmp_path / "g.zcp"
    zp.dump({"t": torch.ones(10)}, path)
    with zp.Snapshot.open(path) as snap:
        with open(path, "ab") as f:  # someone appends in place (this library never does)
            f.write(b"junk")
        with pytest.raises(zp.SnapshotError, match="changed size"):
            snap.load()


@pytest.mark.slow
def test_closing_the_mmap_under_a_tensor_is_refused_not_a_crash() -> None:
    """Note [Arena lifetime]: the storage holds the mapping's buffer export."""
    code = """
    import gc, mmap, torch, zerocopy_pickle as zp
    from zerocopy_pickle.rebuild import storage_from_buffer
    m = mmap.mmap(-1, 8192, flags=mmap.MAP_PRIVATE)
    storage = storage_from_buffer(memoryview(m)[4096:])
    try:
        m.close()
    except BufferError:
        print("refused")
    del m
    gc.collect()
    torch.empty(0, dtype=torch.uint8).set_(storage).fill_(7)
    print("alive", bytes(storage)[0])
    """
    out = run_python(code).stdout.split()
    assert out == ["refused", "alive", "7"]


def test_snapshot_repr_and_context() -> None:
    with zp.freeze({"t": torch.ones(2)}) as snap:
        assert "buffers=1" in repr(snap)
        assert snap.fileno() == snap.fd
    assert "closed" in repr(snap)
