"""zerocopy_pickle._storage.sources: every kind of source opens to the same snapshot, and says whether its bytes
are stable."""

from __future__ import annotations

import gzip
import io
import mmap
import os
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import decoding, format, sources


@pytest.fixture(scope="module")
def blob() -> bytes:
    return zp.dumps({"a": torch.arange(10), "b": [torch.ones(3, 3), "x"]})


def _writable_mmap(data: bytes) -> mmap.mmap:
    memory = mmap.mmap(-1, len(data))
    memory[:] = data
    return memory


def test_every_source_kind_opens_to_the_same_header_and_bytes(blob: bytes, tmp_path: Path) -> None:
    path = tmp_path / "s.zcp"
    path.write_bytes(blob)
    padded = tmp_path / "padded.zcp"
    padded.write_bytes(b"\0" * 100 + blob)  # an unaligned position: read, not mapped
    expected = sources.read_header(sources.at_view(memoryview(blob)), len(blob))
    fd = os.open(path, os.O_RDONLY)
    try:
        with open(path, "rb") as mapped, open(padded, "rb") as unaligned:
            unaligned.seek(100)
            opened = {
                "path": sources.open_source(path, sources.LOAD, what="load"),
                "str path, copy": sources.open_source(str(path), sources.LOAD, what="load", copy=True),
                "mapped file": sources.open_source(mapped, sources.LOAD, what="load"),
                "unaligned file": sources.open_source(unaligned, sources.LOAD, what="load"),
                "BytesIO": sources.open_source(io.BytesIO(blob), sources.LOAD, what="load"),
                "gzip": sources.open_source(
                    gzip.GzipFile(fileobj=io.BytesIO(gzip.compress(blob))), sources.LOAD, what="load"
                ),
                "bytes": sources.open_source(blob, sources.LOADS, what="loads", copy=None),
                "mmap": sources.open_source(_writable_mmap(blob), sources.LOADS, what="loads", copy=None),
                "inspected bytes": sources.open_source(blob, sources.INSPECT, what="scan"),
                "inspected path": sources.open_source(path, sources.INSPECT, what="scan"),
                "fd": sources.open_source(fd, sources.FD, what="Snapshot.load"),
            }
            assert sources.read_header(sources.at_fd(fd), os.fstat(fd).st_size) == expected
            assert sources.claimed_nbytes(sources.at_fd(fd)) == len(blob)
    finally:
        os.close(fd)
    for kind, (view, _, header, file) in opened.items():
        assert file is None, kind  # only keep_file=True keeps one
        assert header == expected, kind
        assert view.nbytes == len(blob) and bytes(view) == blob, kind


def test_stable_means_nobody_can_change_the_bytes(blob: bytes, tmp_path: Path) -> None:
    path = tmp_path / "s.zcp"
    path.write_bytes(blob)
    assert not sources.open_source(path, sources.LOAD, what="load").stable  # a file someone may rewrite
    assert sources.open_source(path, sources.LOAD, what="load", copy=True).stable  # private memory
    assert sources.open_source(io.BytesIO(blob), sources.LOAD, what="load").stable
    assert sources.open_source(blob, sources.LOADS, what="loads", copy=None).stable  # copied: bytes are read-only
    memory = _writable_mmap(blob)  # page-aligned and writable: zero-copy, and its owner may write to it
    opened = sources.open_source(memory, sources.LOADS, what="loads", copy=None)
    assert not opened.stable and opened.view.obj is memory
    with zp.freeze({"t": torch.ones(4)}) as frozen:
        assert sources.open_source(frozen.fd, sources.FD, what="Snapshot.load").stable  # a sealed memfd
    fd = os.open(path, os.O_RDONLY)
    try:
        assert not sources.open_source(fd, sources.FD, what="Snapshot.load").stable
    finally:
        os.close(fd)


def test_the_claim_is_read_before_the_rest(blob: bytes) -> None:
    assert sources.claimed_nbytes(sources.at_view(blob[: format.FIXED_NBYTES])) == len(blob)
    with pytest.raises(zp.SnapshotError, match="truncated snapshot: 20 bytes"):
        sources.claimed_nbytes(sources.at_view(blob[:20]))


@pytest.mark.parametrize("kind", ["view", "fd"])
def test_every_reader_refuses_the_same_way(blob: bytes, kind: str) -> None:
    """A view and an fd read through pread give the same header errors (the fd path was once a hand-written copy)."""
    fds: list[int] = []

    def reader(data: bytes) -> sources.ReadAt:
        if kind == "view":
            return sources.at_view(memoryview(data))
        fds.append(os.memfd_create("test_sources"))
        os.write(fds[-1], data)
        return sources.at_fd(fds[-1])

    cut = blob[: format.FIXED_NBYTES + 5]  # the snapshot ends inside its JSON header
    corrupt = bytearray(blob)
    corrupt[format.FIXED_NBYTES + 1] ^= 0xFF
    try:
        for data, nbytes in ((cut, len(cut)), (blob[:20], 20), (bytes(corrupt), len(corrupt)), (cut, None)):
            header_nbytes = int.from_bytes(data[12:16], "little")  # the header read by hand, as the format lays it out
            json_header = data[format.FIXED_NBYTES : format.FIXED_NBYTES + header_nbytes]
            with pytest.raises(zp.SnapshotError) as expected:
                decoding.decode_header(data[: format.FIXED_NBYTES], json_header, nbytes)
            with pytest.raises(zp.SnapshotError) as got:
                sources.read_header(reader(data), nbytes)
            assert str(got.value) == str(expected.value)
    finally:
        for fd in fds:
            os.close(fd)


def test_a_kind_the_caller_does_not_take_is_refused_with_its_message(blob: bytes, tmp_path: Path) -> None:
    with pytest.raises(zp.ArgumentError, match=r"^load\(\) needs a path or a binary file object, not bytes$"):
        sources.open_source(blob, sources.LOAD, what="load")
    with pytest.raises(zp.ArgumentError, match=r"^loads\(\) needs a bytes-like object or an mmap, not str$"):
        sources.open_source(str(tmp_path), sources.LOADS, what="loads")
    with pytest.raises(zp.ArgumentError, match=r"^scan\(\) needs a path, a file object or bytes, not int$"):
        sources.open_source(3, sources.INSPECT, what="scan")


def test_keep_file_hands_back_an_fd_of_the_mapped_file_only(blob: bytes, tmp_path: Path) -> None:
    padded = tmp_path / "padded.zcp"
    padded.write_bytes(b"\0" * mmap.ALLOCATIONGRANULARITY + blob)
    whole = tmp_path / "w.zcp"
    whole.write_bytes(blob)
    own = os.open(whole, os.O_RDONLY)
    try:
        with open(padded, "rb") as f:
            f.seek(mmap.ALLOCATIONGRANULARITY)
            kept = {
                "file": sources.open_source(f, sources.LOAD, what="load", keep_file=True).file,
                "fd": sources.open_source(own, sources.FD, what="Snapshot.load", keep_file=True).file,
                "path": sources.open_source(whole, sources.LOAD, what="load", keep_file=True).file,
            }
        expected = {
            "file": (os.stat(padded).st_ino, mmap.ALLOCATIONGRANULARITY),
            "fd": (os.stat(whole).st_ino, 0),
            "path": (os.stat(whole).st_ino, 0),
        }
        for kind, file in kept.items():
            assert file is not None, kind
            fd, offset = file
            assert fd != own and (os.fstat(fd).st_ino, offset) == expected[kind], kind
            os.close(fd)
        # Read into private memory, or a buffer: nothing to keep.
        assert sources.open_source(whole, sources.LOAD, what="load", copy=True, keep_file=True).file is None
        assert sources.open_source(bytearray(blob), sources.LOADS, what="loads", keep_file=True).file is None
    finally:
        os.close(own)


def test_keep_file_closes_its_fd_when_the_header_is_bad(tmp_path: Path) -> None:
    path = tmp_path / "bad.zcp"
    path.write_bytes(b"\x93ZCP" + b"\xff" * 60)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(zp.SnapshotError):
        sources.open_source(path, sources.LOAD, what="load", keep_file=True)
    assert set(os.listdir("/proc/self/fd")) == before
