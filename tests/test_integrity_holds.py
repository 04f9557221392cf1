"""What a reader checked is what it uses, and no header field is trusted beyond the input's real size.

* A JSON header nested 100,000 deep is a ``SnapshotError`` (from the API and from ``inspect``), never a
  ``RecursionError``: the nesting is bounded before the parser runs.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle import format as fmt

from .conftest import run_python
from .test_cli import run_cli


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
        return fmt.decode_header(bytes(f), blob, None)

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
from zerocopy_pickle import format as fmt

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
real = zp.dumps({"t": torch.arange(3 << 20, dtype=torch.uint8)})  # 3 MiB: the read grows twice
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
assert zp.load(f)["t"].sum().item() == torch.arange(3 << 20, dtype=torch.uint8).sum().item()
writer.join()
print("bounded ok")
"""


def test_a_pipe_declaring_a_terabyte_reserves_only_what_arrives() -> None:
    """Under an address-space limit 256 MiB above the process's size, claims of 1 TiB are refused as
    truncation, and a real snapshot read through a pipe (which grows its buffer) still loads."""
    proc = run_python(BOUNDED_CHILD, timeout=300)
    assert "bounded ok" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("refused:") == 2
