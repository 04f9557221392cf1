"""What a reader checked is what it uses, and no header field is trusted beyond the input's real size.

* A JSON header nested 100,000 deep is a ``SnapshotError`` (from the API and from ``inspect``), never a
  ``RecursionError``: the nesting is bounded before the parser runs.
"""

from __future__ import annotations

import fcntl
import io
import json
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import arena, decoding, integrity
from tests.internals import format as fmt

from .conftest import region_of, run_python
from .test_cli import run_cli

KEY = b"the writer's secret"


def snapshot_bytes(**kwargs: object) -> bytes:
    torch.manual_seed(0)
    return zp.dumps({"w": torch.randn(4096), "b": torch.arange(70_000, dtype=torch.uint8), "s": "text"}, **kwargs)  # type: ignore[arg-type]


def with_header(data: bytes, blob: bytes) -> bytes:
    """``data`` (a valid snapshot) with its JSON header replaced by ``blob``, the CRC and total repaired."""
    header = zp.read_header(data)
    stream = data[header.stream_offset : header.stream_offset + header.stream_nbytes]
    region = data[header.data_offset :]
    data_offset = fmt.align_up(32 + len(blob) + len(stream), fmt.PAGE)
    padding = bytes(data_offset - 32 - len(blob) - len(stream))
    fixed = struct.pack("<8sIIQII", fmt.MAGIC, 0, len(blob), data_offset + len(region), zlib.crc32(blob), 0)
    return fixed + blob + stream + padding + region


def header_object(data: bytes) -> dict[str, object]:
    header_nbytes = struct.unpack_from("<I", data, 12)[0]
    parsed: dict[str, object] = json.loads(data[32 : 32 + header_nbytes])
    return parsed


# --- JSON nesting --------------------------------------------------------------------------------------------


DEEP = 100_000


@pytest.mark.parametrize(
    "blob",
    [
        b"[" * DEEP + b"]" * DEEP,
        b'{"a":' * DEEP + b"1" + b"}" * DEEP,
        b"[" * DEEP,  # unbalanced too
        b'{"version":2,"producer":' + b"[" * DEEP + b'"x"' + b"]" * DEEP + b"}",
    ],
    ids=["arrays", "objects", "unbalanced", "inside-a-valid-key"],
)
def test_a_deeply_nested_header_is_a_snapshot_error(blob: bytes) -> None:
    data = with_header(snapshot_bytes(), blob)
    with pytest.raises(zp.SnapshotError, match="nest deeper than 16 levels"):
        zp.loads(data)
    with pytest.raises(zp.SnapshotError, match="nest deeper"):
        zp.read_header(data)


def test_the_nesting_bound_is_exact() -> None:
    fixed = struct.pack("<8sIIQII", fmt.MAGIC, 0, 0, 0, 0, 0)

    def decode(blob: bytes) -> fmt.Header:
        f = bytearray(fixed)
        struct.pack_into("<IQI", f, 12, len(blob), 32 + len(blob), zlib.crc32(blob))
        return decoding.decode_header(bytes(f), blob, None)

    depth = fmt.MAX_HEADER_DEPTH
    with pytest.raises(zp.SnapshotError, match="must be a JSON object"):  # parsed, then refused for its type
        decode(b"[" * depth + b"]" * depth)
    with pytest.raises(zp.SnapshotError, match="nest deeper"):
        decode(b"[" * (depth + 1) + b"]" * (depth + 1))


@pytest.mark.parametrize("text", ["[" * 100, "]]]{{" * 40, 'a \\" [[[[ \\\\', "\\u005b" * 30])
def test_brackets_inside_strings_are_not_nesting(text: str) -> None:
    data = snapshot_bytes()
    header = header_object(data)
    header["producer"] = {"zerocopy_pickle": text}
    edited = with_header(data, json.dumps(header, separators=(",", ":"), sort_keys=True).encode())
    assert zp.read_header(edited).producer == {"zerocopy_pickle": text}
    assert zp.loads(edited)["s"] == "text"


@pytest.mark.slow
def test_inspect_reports_a_deep_header_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "deep.zcp"
    path.write_bytes(with_header(snapshot_bytes(), b"[" * DEEP + b"]" * DEEP))
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("zerocopy-pickle inspect: error: header at offset 32 is not valid JSON")


# --- declared lengths against the input's real size ----------------------------------------------------------


def fixed_claiming(total: int, header_nbytes: int = 100) -> bytes:
    """A well-formed fixed header that declares a ``total``-byte snapshot (the JSON that follows never comes)."""
    return struct.pack("<8sIIQII", fmt.MAGIC, 0, header_nbytes, total, 0, 0)


class Trickle(io.RawIOBase):
    """A readable stream that delivers its first bytes a few at a time, as a pipe may."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), 7 if self._pos < 64 else 1 << 20, len(self._data) - self._pos)
        buffer[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


def test_a_stream_that_delivers_the_header_in_pieces_loads() -> None:
    data = snapshot_bytes()
    assert zp.load(Trickle(data))["s"] == "text"
    assert zp.load(io.BufferedReader(Trickle(data)))["s"] == "text"
    with pytest.raises(zp.SnapshotError, match=r"the header says \d+ bytes, the input ended after 50"):
        zp.load(Trickle(data[:50]))


def test_a_declared_length_beyond_the_input_is_truncation(tmp_path: Path) -> None:
    tera = 1 << 40
    path = tmp_path / "claims-a-terabyte.zcp"
    path.write_bytes(fixed_claiming(tera) + bytes(200))
    for call in (
        lambda: zp.load(path),
        lambda: zp.load(path, copy=True),
        lambda: zp.load(io.BytesIO(path.read_bytes())),
        lambda: zp.loads(path.read_bytes()),
        lambda: zp.read_header(path),
        lambda: zp.scan(path),
        lambda: zp.Snapshot.open(path),
    ):
        with pytest.raises(zp.SnapshotError, match=f"truncated snapshot: the header says {tera} bytes"):
            call()
    with open(path, "rb") as f, pytest.raises(zp.SnapshotError, match=f"says {tera} bytes, the file holds 232"):
        zp.load(f, copy=True)


BOUNDED_CHILD = """
import io, os, resource, struct, sys, threading
import torch
import zerocopy_pickle as zp
from zerocopy_pickle._storage import format as fmt

def vm_size():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

def pipe_of(payload):
    r, w = os.pipe()
    def write():
        with os.fdopen(w, "wb") as out:
            out.write(payload)
    writer = threading.Thread(target=write)
    writer.start()
    return os.fdopen(r, "rb", buffering=0), writer

tera = 1 << 40
fixed_only = struct.pack("<8sIIQII", fmt.MAGIC, 0, 100, tera, 0, 0)
layout = fmt.encode(10, [fmt.BufferSpec(tera)])
torch.set_num_threads(1)  # no thread pool (a stack per core) appears under the limit
original = torch.arange(3 << 20, dtype=torch.uint8)
real = zp.dumps({"t": original})  # 3 MiB: the read grows twice
cases = {
    "fixed header claiming 1 TiB, then EOF": fixed_only,
    "valid header claiming 1 TiB, 8 MiB, then EOF": layout.prefix + bytes(8 << 20),
}
threading.Thread(target=lambda: None).start()  # thread machinery set up before the limit
limit = vm_size() + (256 << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
for what, payload in cases.items():
    f, writer = pipe_of(payload)
    try:
        zp.load(f)
    except zp.SnapshotError as e:
        assert str(e).startswith("truncated snapshot: the header says 10995116"), (what, e)
        print("refused:", what, "->", e)
    else:
        raise AssertionError(f"loaded: {what}")
    finally:
        writer.join()
        f.close()
f, writer = pipe_of(real)
assert torch.equal(zp.load(f)["t"], original)
writer.join()
print("bounded ok")
"""


@pytest.mark.slow
def test_a_pipe_declaring_a_terabyte_reserves_only_what_arrives() -> None:
    """Under an address-space limit 256 MiB above the process's size, claims of 1 TiB are refused as
    truncation, and a real snapshot read through a pipe (which grows its buffer) still loads."""
    proc = run_python(BOUNDED_CHILD, timeout=300, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    assert "bounded ok" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("refused:") == 2


# --- what verify=True and key= checked is what the load returns ----------------------------------------------


def big_snapshot(path: Path, **kwargs: object) -> dict[str, torch.Tensor]:
    """Dump tensors small and large (the large one is copied and hashed in several pieces) to ``path``."""
    torch.manual_seed(1)
    obj = {"small": torch.randn(1000), "large": torch.randn((3 << 20) // 4 + 17)}
    zp.dump({**obj, "s": "text"}, path, **kwargs)  # type: ignore[arg-type]
    return {k: v.clone() for k, v in obj.items()}


def overwrite_data(path: Path) -> None:
    """Rewrite every data byte of the snapshot file in place, as another writer of the file could."""
    header = zp.read_header(path)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xa5" * header.data_nbytes, header.data_offset)
    finally:
        os.close(fd)


def test_a_file_rewritten_after_a_verified_load_does_not_change_the_tensors(tmp_path: Path) -> None:
    path = tmp_path / "v.zcp"
    expected = big_snapshot(path)
    plain = zp.load(path)  # the fast path stays zero-copy: a view of the file's pages...
    verified = zp.load(path, verify=True)
    with zp.Snapshot.open(path) as snap:
        verified_snap = snap.load(verify=True)
    with open(path, "rb") as f:
        verified_file = zp.load(f, verify=True)
    overwrite_data(path)
    for loaded in (verified, verified_snap, verified_file):
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), name
    assert not torch.equal(plain["small"], expected["small"])  # ...which follow the file (the SIGBUS caveat too)


class _RewriteAfterEachHash:
    """Stands in for the xxhash module: after each buffer's digest is computed, the attacker rewrites that
    buffer in the file, as a writer racing the check would at the worst moment."""

    def __init__(self, real: Any, path: Path) -> None:
        self._real = real
        self._path = path
        self._header = zp.read_header(path)
        self.hashed = 0

    def _rewrite(self) -> None:
        start, stop = self._header.buffer_range(self.hashed)
        fd = os.open(self._path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\x5a" * (stop - start), start)
        finally:
            os.close(fd)
        self.hashed += 1

    def xxh3_64_hexdigest(self, data: Any) -> str:
        digest: str = self._real.xxh3_64_hexdigest(data)
        if memoryview(data).nbytes != self._header.stream_nbytes:  # not the stream's checksum: a buffer's
            self._rewrite()
        return digest

    def xxh3_64(self) -> Any:
        outer = self
        hasher = self._real.xxh3_64()

        class Hasher:
            def update(self, data: Any) -> None:
                hasher.update(data)

            def hexdigest(self) -> str:
                digest: str = hasher.hexdigest()
                outer._rewrite()
                return digest

        return Hasher()


def test_a_write_racing_the_check_cannot_reach_the_checked_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import xxhash

    path = tmp_path / "race.zcp"
    expected = big_snapshot(path)
    racer = _RewriteAfterEachHash(xxhash, path)
    monkeypatch.setattr(integrity, "_xxh3", lambda: racer)
    loaded = zp.load(path, verify=True)
    assert racer.hashed == 2  # both buffers were rewritten in the file right after their check
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_a_signed_stream_rewritten_after_its_check_is_not_what_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "signed.zcp"
    big_snapshot(path, key=KEY)
    header = zp.read_header(path)
    stream = path.read_bytes()[header.stream_offset : header.stream_offset + header.stream_nbytes]
    at = header.stream_offset + stream.index(b"text")
    real = integrity.verify_signature

    def verify_then_rewrite(*args: Any) -> None:
        real(*args)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"TEXT", at)
        finally:
            os.close(fd)

    monkeypatch.setattr(integrity, "verify_signature", verify_then_rewrite)
    assert zp.load(path, key=KEY)["s"] == "text"
    with pytest.raises(zp.IntegrityError, match="stream"):
        zp.load(path)  # the file did change: the signed load had used its own copy


def test_verify_stays_zero_copy_where_nothing_can_change(tmp_path: Path) -> None:
    with zp.freeze({"t": torch.arange(70_000)}) as snap:
        loaded = snap.load(verify=True)
        region = region_of(loaded["t"].untyped_storage().data_ptr())
        assert region is not None and region[2].startswith("/memfd:zerocopy_pickle")
    path = tmp_path / "c.zcp"
    big_snapshot(path)
    copied = zp.load(path, copy=True, verify=True)  # private already: checked in place, not copied twice
    region = region_of(copied["large"].untyped_storage().data_ptr())
    assert region is not None and region[2] == ""  # anonymous memory


def test_loads_with_verify_copies_a_buffer_the_caller_can_still_change() -> None:
    data = snapshot_bytes()
    memory = mmap.mmap(-1, len(data))
    memory[:] = data
    start, _ = zp.read_header(data).buffer_range(0)
    plain, verified = zp.loads(memory), zp.loads(memory, verify=True)
    original = plain["w"].clone()
    memory[start : start + 4] = b"\xff\xff\xff\xff"
    assert not torch.equal(plain["w"], original)  # zero-copy: a view of the caller's memory
    assert torch.equal(verified["w"], original)  # verified: the checked copy


# --- Snapshot.from_fd: an untrusted sender's fd must be sealed, or be copied ---------------------------------


class Point:
    """A class a restricted load refuses unless allowed."""


def memfd_with(data: bytes, seals: int = 0) -> int:
    fd = os.memfd_create("sender", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_from_fd_refuses_an_unsealed_memfd_or_a_file(tmp_path: Path) -> None:
    data = snapshot_bytes()
    path = tmp_path / "f.zcp"
    path.write_bytes(data)
    cases = [
        (memfd_with(data), "a memfd without the seal.s. F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE"),
        (memfd_with(data, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL), "without the seal.s. F_SEAL_GROW, F_SEAL_WRITE:"),
        (os.open(path, os.O_RDONLY), "a regular file, which cannot be sealed"),
    ]
    for fd, what in cases:
        try:
            with pytest.raises(zp.SnapshotError, match=what) as refused:
                zp.Snapshot.from_fd(fd)
            message = str(refused.value)
            assert "SIGBUS" in message and "copy=True" in message and "trusted=True" in message
            with zp.Snapshot.from_fd(fd, trusted=True) as snap:  # the cache's own fds: used as they are
                assert not snap.sealed
                assert snap.load()["s"] == "text"
        finally:
            os.close(fd)


def test_from_fd_accepts_a_sealed_memfd_without_copying() -> None:
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE  # F_SEAL_SEAL is not needed
    fd = memfd_with(zp.dumps({"t": torch.arange(70_000), "p": Point()}), seals)
    try:
        for copy in (False, True):
            with zp.Snapshot.from_fd(fd, copy=copy) as snap:
                assert os.fstat(snap.fd).st_ino == os.fstat(fd).st_ino  # the sender's memfd itself
                with pytest.raises(zp.RestrictedLoadError):
                    snap.load()  # untrusted: restricted loads...
                loaded = snap.load(verify=True, allow=[Point])
                region = region_of(loaded["t"].untyped_storage().data_ptr())
                assert region is not None and region[2].startswith("/memfd:sender")  # ...zero-copy, verified
    finally:
        os.close(fd)
    with zp.freeze({"t": torch.arange(3)}) as frozen, zp.Snapshot.from_fd(frozen.fd) as snap:
        assert snap.sealed and snap.load()["t"].tolist() == [0, 1, 2]


def test_from_fd_copy_loads_a_private_sealed_copy_the_sender_cannot_touch() -> None:
    data = snapshot_bytes()
    expected = zp.loads(data)
    fd = memfd_with(data)
    try:
        with zp.Snapshot.from_fd(fd, copy=True) as snap:
            assert snap.sealed
            assert os.fstat(snap.fd).st_ino != os.fstat(fd).st_ino
            os.pwrite(fd, b"\xff" * (len(data) - 4096), 4096)  # the sender rewrites its memfd...
            os.ftruncate(fd, 0)  # ...and shrinks it: mapped, this would be SIGBUS
            loaded = snap.load(verify=True)
            assert torch.equal(loaded["w"], expected["w"]) and loaded["s"] == "text"
    finally:
        os.close(fd)


def test_from_fd_copy_refuses_a_malformed_or_shrinking_source(monkeypatch: pytest.MonkeyPatch) -> None:
    fd = memfd_with(b"\x89ZCP\r\n\x1a\x02" + bytes(100))
    try:
        with pytest.raises(zp.SnapshotError, match="header length 0"):
            zp.Snapshot.from_fd(fd, copy=True)
    finally:
        os.close(fd)
    real = arena.copy_to_sealed_memfd

    def shrink_then_copy(source: int, nbytes: int, name: str) -> int:
        os.ftruncate(source, nbytes // 2)  # the sender, between the header check and the copy
        return real(source, nbytes, name)

    monkeypatch.setattr(arena, "copy_to_sealed_memfd", shrink_then_copy)
    fd = memfd_with(snapshot_bytes())
    try:
        with pytest.raises(zp.SnapshotError, match=f"fd {fd} shrank while it was copied: the source ended after"):
            zp.Snapshot.from_fd(fd, copy=True)
    finally:
        os.close(fd)


@pytest.mark.slow
@pytest.mark.parametrize(
    "content",
    [b"", b"\x89ZCP\r\n\x1a\x02", fixed_claiming(1 << 40) + bytes(100), b"not a snapshot at all" * 10, "fifo"],
    ids=["empty", "magic-only", "claims-a-terabyte", "garbage", "fifo"],
)
def test_inspect_reports_malformed_input_in_one_line(tmp_path: Path, content: bytes | str) -> None:
    path = tmp_path / "bad.zcp"
    if content == "fifo":
        os.mkfifo(path)  # no writer will ever come: refused at once, not waited for
    else:
        assert isinstance(content, bytes)
        path.write_bytes(content)
    proc = run_python(
        "import sys; from zerocopy_pickle._cli import main; sys.exit(main(sys.argv[1:]))",
        "inspect",
        str(path),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("zerocopy-pickle inspect: error: "), proc.stderr
