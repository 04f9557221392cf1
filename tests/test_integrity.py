"""Checksums (a flipped byte is detected) and signatures (only an authentic snapshot loads trusted)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
import torch

import zerocopy_pickle as zp
from tests.internals import decoding, integrity
from tests.internals import format as fmt

KEY = b"a secret shared by the writer and the reader"


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)


def make() -> dict[str, object]:
    torch.manual_seed(0)
    return {"w": torch.randn(1000), "model": Model()}


def flip(data: bytes, offset: int) -> bytes:
    damaged = bytearray(data)
    damaged[offset] ^= 0x01
    return bytes(damaged)


def test_checksums_are_recorded_by_default() -> None:
    data = zp.dumps(make())
    header = zp.read_header(data)
    assert header.checksums is not None
    assert header.checksums.algorithm == "xxh3_64"
    start, stop = header.buffer_range(0)
    assert header.checksums.buffers[0] == integrity.checksum(data[start:stop])
    assert zp.read_header(zp.dumps(make(), checksums=False)).checksums is None


def test_a_flipped_data_byte_is_detected_with_verify() -> None:
    data = zp.dumps(make())
    header = zp.read_header(data)
    start, _ = header.buffer_range(0)
    damaged = flip(data, start + 123)
    loaded = zp.loads(damaged, trusted=True)  # lazy by default: data is not read at load
    assert not torch.equal(loaded["w"], make()["w"])  # type: ignore[arg-type]
    with pytest.raises(zp.IntegrityError, match=rf"buffer 0 at \[{start}, \d+\) does not match its checksum"):
        zp.loads(damaged, trusted=True, verify=True)
    assert zp.loads(data, trusted=True, verify=True)["w"].equal(make()["w"])


def test_a_flipped_stream_byte_is_always_detected() -> None:
    data = zp.dumps(make())
    header = zp.read_header(data)
    with pytest.raises(zp.IntegrityError, match="pickle stream .* does not match its checksum"):
        zp.loads(flip(data, header.stream_offset + header.stream_nbytes // 2), trusted=True)


def test_verify_needs_checksums() -> None:
    with pytest.raises(zp.IntegrityError, match="records no checksums"):
        zp.loads(zp.dumps(make(), checksums=False), trusted=True, verify=True)


def test_verify_through_every_entry_point(tmp_path: Path) -> None:
    path = tmp_path / "v.zcp"
    zp.dump(make(), path)
    assert zp.load(path, trusted=True, verify=True)["model"].layer.in_features == 8
    with zp.Snapshot.open(path) as snap:
        snap.load(trusted=True, verify=True)
    with zp.freeze(make()) as snap:
        snap.load(verify=True)


def test_signed_snapshot_loads_trusted_with_the_key(tmp_path: Path) -> None:
    path = tmp_path / "signed.zcp"
    zp.dump(make(), path, key=KEY)
    with pytest.raises(zp.RestrictedLoadError):
        zp.load(path)  # without the key it is just another file: restricted
    loaded = zp.load(path, key=KEY)  # verified: trusted, no allow= needed for Model
    assert isinstance(loaded["model"], Model)
    with pytest.raises(zp.RestrictedLoadError):
        zp.load(path, key=KEY, trusted=False)  # the caller can still insist on restrictions
    assert isinstance(zp.load(path, key=KEY.decode()), dict)  # a str key is its UTF-8 bytes


def test_wrong_key_and_missing_signature() -> None:
    signed = zp.dumps(make(), key=KEY)
    with pytest.raises(zp.IntegrityError, match="signature does not match"):
        zp.loads(signed, key=b"not the key")
    with pytest.raises(zp.IntegrityError, match="not signed"):
        zp.loads(zp.dumps(make()), key=KEY)


def resign_crc(data: bytes) -> bytes:
    """Repair the header CRC after editing the JSON header (what an attacker can always do)."""
    fixed = bytearray(data)
    header_nbytes = struct.unpack_from("<I", fixed, 12)[0]
    struct.pack_into("<I", fixed, 24, zlib.crc32(bytes(fixed[32 : 32 + header_nbytes])))
    return bytes(fixed)


def test_tampering_with_a_signed_snapshot_is_detected() -> None:
    signed = zp.dumps({"x": torch.ones(3), "text": "hello"}, key=KEY)
    header = zp.read_header(signed)
    # Change the stream and fix its checksum and the header CRC, as an attacker without the key would.
    stream = bytearray(signed[header.stream_offset : header.stream_offset + header.stream_nbytes])
    at = stream.find(b"hello")
    stream[at : at + 5] = b"HELLO"
    old_sum, new_sum = header.checksums.stream, integrity.checksum(bytes(stream))  # type: ignore[union-attr]
    tampered = bytearray(signed)
    tampered[header.stream_offset : header.stream_offset + header.stream_nbytes] = stream
    blob_start = 32
    blob = bytes(tampered[blob_start : blob_start + header.header_nbytes]).replace(old_sum.encode(), new_sum.encode())
    tampered[blob_start : blob_start + header.header_nbytes] = blob
    tampered_bytes = resign_crc(bytes(tampered))
    assert zp.loads(tampered_bytes)["text"] == "HELLO"  # checksums alone are no authentication...
    with pytest.raises(zp.IntegrityError, match="signature does not match"):
        zp.loads(tampered_bytes, key=KEY)  # ...the signature is


def test_signed_checksums_cover_the_data() -> None:
    signed = zp.dumps({"x": torch.arange(100.0)}, key=KEY)
    header = zp.read_header(signed)
    start, _ = header.buffer_range(0)
    damaged = flip(signed, start)
    zp.loads(damaged, key=KEY)  # the signature covers the stream and the checksums...
    with pytest.raises(zp.IntegrityError, match="buffer 0"):
        zp.loads(damaged, key=KEY, verify=True)  # ...verify=True checks the data against them


def test_snapshot_and_freeze_with_keys(tmp_path: Path) -> None:
    path = tmp_path / "s.zcp"
    zp.dump(make(), path, key=KEY)
    with zp.Snapshot.open(path) as snap:
        assert isinstance(snap.load(key=KEY)["model"], Model)
        with pytest.raises(zp.IntegrityError):
            snap.load(key=b"wrong")
    with zp.freeze(make(), key=KEY) as snap:
        assert snap.header.signature
        snap.load(key=KEY, verify=True)


def test_empty_key_is_refused() -> None:
    with pytest.raises(zp.ArgumentError, match="key must be non-empty"):
        zp.dumps(make(), key=b"")


def test_malformed_integrity_fields() -> None:
    data = zp.dumps({"x": torch.ones(2)}, key=KEY)
    header_nbytes = struct.unpack_from("<I", data, 12)[0]
    blob = data[32 : 32 + header_nbytes]
    for old, new, match in [
        (b'"xxh3_64"', b'"md5"', "uses 'md5'"),
        (b'"hmac-sha256"', b'"hmac-md5"', "uses 'hmac-md5'"),
    ]:
        edited = blob.replace(old, new)
        fixed = struct.pack("<8sIIQII", fmt.MAGIC, 0, len(edited), len(data), zlib.crc32(edited), 0)
        with pytest.raises(zp.SnapshotError, match=match):
            decoding.decode_header(fixed, edited, None)
