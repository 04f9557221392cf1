"""What a reader checked is what it uses, and no header field is trusted beyond the input's real size.

* A JSON header nested 100,000 deep is a ``SnapshotError`` (from the API and from ``inspect``), never a
  ``RecursionError``: the nesting is bounded before the parser runs.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from zerocopy_pickle import format as fmt

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
