"""loads(): when it copies and when it is zero-copy; load() on file objects, pipes and odd inputs."""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp


def address_range(buffer: bytearray | mmap.mmap) -> tuple[int, int]:
    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    return base, base + len(buffer)


def data() -> bytes:
    return zp.dumps({"t": torch.arange(1000, dtype=torch.int32)})


def test_bytes_are_copied_and_never_aliased() -> None:
    blob = data()
    before = bytes(blob)
    loaded = zp.loads(blob)
    loaded["t"][0] = 12345  # would corrupt an immutable bytes object if it aliased it
    assert blob == before
    assert zp.loads(blob)["t"][0] == 0


def test_bytearray_is_zero_copy_and_aliased() -> None:
    buf = bytearray(data())
    loaded = zp.loads(buf)
    start, end = address_range(buf)
    assert start <= loaded["t"].data_ptr() < end
    loaded["t"][0] = 77
    assert zp.loads(buf)["t"][0] == 77  # documented: loads of the same writable buffer share it
    with pytest.raises(BufferError):
        buf.extend(b"x")  # the storage holds the buffer export: it cannot be resized under the tensor


def test_copy_true_gives_private_tensors() -> None:
    buf = bytearray(data())
    loaded = zp.loads(buf, copy=True)
    start, end = address_range(buf)
    assert not start <= loaded["t"].data_ptr() < end
    loaded["t"][0] = 5
    assert zp.loads(buf, copy=True)["t"][0] == 0


def test_copy_false_refuses_read_only_data() -> None:
    with pytest.raises(zp.ArgumentError, match="read-only"):
        zp.loads(data(), copy=False)


def test_misaligned_buffer_is_copied_or_refused() -> None:
    blob = data()
    buf = bytearray(len(blob) + 1)
    view = memoryview(buf)[1:]
    view[:] = blob
    assert zp.loads(view)["t"].tolist() == list(range(1000))
    with pytest.raises(zp.ArgumentError, match="not aligned"):
        zp.loads(view, copy=False)


def test_mmap_inputs(tmp_path: Path) -> None:
    path = tmp_path / "x.zcp"
    path.write_bytes(data())
    with open(path, "rb") as f:
        read_only = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        private = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    from_read_only = zp.loads(read_only)
    from_read_only["t"][0] = 1  # a copy: the read-only mapping is untouched
    from_private = zp.loads(private)
    start, end = address_range(private)
    assert start <= from_private["t"].data_ptr() < end
    from_private["t"][1] = 9
    assert path.read_bytes() == data()


def test_non_contiguous_and_wrong_types() -> None:
    with pytest.raises(zp.ArgumentError, match="contiguous"):
        zp.loads(memoryview(bytearray(100))[::2])
    with pytest.raises(zp.ArgumentError, match="bytes-like"):
        zp.loads("not bytes")  # type: ignore[arg-type]
    with pytest.raises(zp.ArgumentError, match="path or a binary file"):
        zp.load(3.5)  # type: ignore[arg-type]
    with pytest.raises(zp.ArgumentError, match="path or a binary file"):
        zp.dump({}, 3.5)  # type: ignore[arg-type]


def test_empty_and_tiny_inputs() -> None:
    for blob in (b"", b"\x89", bytearray(10)):
        with pytest.raises(zp.SnapshotError):
            zp.loads(blob)


def test_load_from_pipe_reads_once() -> None:
    blob = data()
    read_fd, write_fd = os.pipe()

    def feed() -> None:
        with os.fdopen(write_fd, "wb") as w:
            w.write(blob)

    thread = threading.Thread(target=feed)
    thread.start()
    with os.fdopen(read_fd, "rb") as r:
        loaded = zp.load(r)
    thread.join()
    assert loaded["t"].tolist() == list(range(1000))


def test_load_from_bytesio_and_consecutive_snapshots(tmp_path: Path) -> None:
    first, second = zp.dumps({"n": 1, "t": torch.ones(3)}), zp.dumps({"n": 2})
    stream = io.BytesIO(first + second)
    assert zp.load(stream)["n"] == 1
    assert zp.load(stream)["n"] == 2
    path = tmp_path / "two.bin"
    # Two snapshots in one file: the first at offset 0 is mapped, the second (unaligned) is read.
    path.write_bytes(first + second)
    with open(path, "rb") as f:
        assert zp.load(f)["n"] == 1
        assert f.tell() == len(first)
        assert zp.load(f)["n"] == 2


def test_load_file_at_page_aligned_offset_is_mapped(tmp_path: Path) -> None:
    blob = data()
    path = tmp_path / "offset.bin"
    path.write_bytes(b"\0" * mmap.ALLOCATIONGRANULARITY + blob)
    with open(path, "rb") as f:
        f.seek(mmap.ALLOCATIONGRANULARITY)
        loaded = zp.load(f)
    with open("/proc/self/maps") as maps:
        regions = [line for line in maps if str(path) in line]
    assert any(
        int(line.split()[0].split("-")[0], 16) <= loaded["t"].data_ptr() < int(line.split()[0].split("-")[1], 16)
        for line in regions
    )


def test_truncated_stream_input() -> None:
    blob = data()
    with pytest.raises(zp.SnapshotError, match="truncated snapshot"):
        zp.load(io.BytesIO(blob[:-10]))


def test_load_copy_reads_into_private_memory(tmp_path: Path) -> None:
    path = tmp_path / "x.zcp"
    path.write_bytes(data())
    loaded = zp.load(path, copy=True)
    with open("/proc/self/maps") as maps:
        assert not any(str(path) in line for line in maps)
    assert loaded["t"].sum() == sum(range(1000))


def test_directory_and_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(zp.SnapshotError, match="directory"):
        zp.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        zp.load(tmp_path / "missing.zcp")
