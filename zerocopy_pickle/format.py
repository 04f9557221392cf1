"""Internal: the snapshot layout (format versions 1 and 2): encoding the header, and validating every byte of it
before use.

A snapshot is one contiguous byte sequence::

    [0, 32)                        fixed header: magic (version in its last byte), flags, header length,
                                   total length, CRC-32 of the JSON header
    [32, 32 + H)                   JSON header (UTF-8): sizes, buffer table, plugins, producer
    [32 + H, 32 + H + S)           pickle stream (protocol 5, buffers out of band)
    [D, D + N)                     data region; D = 32 + H + S rounded up to a page (4096)

Buffer offsets in the table are relative to ``D``. Every buffer starts on a 64-byte boundary, and buffers of
64 KiB or more on a 4096-byte boundary, so that a storage mapped from the file is as aligned as one from the
CPU allocator. ``docs/format.md`` is the normative description; this module is its only implementation.

Nothing here touches tensors or pickle: it turns sizes into a layout and bytes into a validated
:class:`Header`, and it raises :class:`~zerocopy_pickle.errors.SnapshotError` naming the field and offset for
anything that does not hold.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .errors import SnapshotError

__all__ = [
    "FIXED_NBYTES",
    "FORMAT_VERSION",
    "MAGIC",
    "BufferEntry",
    "BufferSpec",
    "Checksums",
    "Header",
    "Layout",
    "PluginRef",
    "decode_fixed",
    "decode_header",
    "encode",
]

MAGIC_PREFIX = b"\x89ZCP\r\n\x1a"
"""First seven bytes of every snapshot. Like PNG's, the CR LF and ^Z catch text-mode mangling."""
FORMAT_VERSION = 2
"""The version writers produce. Version 2 adds optional integrity fields (checksums, a signature)."""
READABLE_VERSIONS = frozenset({1, 2})
MAGIC = MAGIC_PREFIX + bytes([FORMAT_VERSION])
CHECKSUM_ALGORITHM = "xxh3_64"
SIGNATURE_ALGORITHM = "hmac-sha256"

_FIXED = struct.Struct("<8sIIQII")  # magic, flags, header_nbytes, total_nbytes, header_crc32, reserved
FIXED_NBYTES = _FIXED.size
assert FIXED_NBYTES == 32

PAGE = 4096
MIN_ALIGN = 64
LARGE_ALIGN = 4096
LARGE_BUFFER_NBYTES = 64 * 1024
MAX_HEADER_NBYTES = 64 * 1024 * 1024
"""A reader refuses headers larger than this before reading them (about 400k buffers)."""
MAX_HEADER_DEPTH = 16
"""A reader refuses a JSON header whose arrays and objects nest deeper than this before parsing it (a valid
header nests 3 deep), so that parsing never recurses deeply."""
_MAX_INT = (1 << 63) - 1
_MAX_NAME = 64
_LOCATION_RE = re.compile(r"[a-z][a-z0-9_]*(:[0-9]{1,4})?")
_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]*")

_REQUIRED_KEYS = frozenset({"version", "stream_nbytes", "data_nbytes", "buffers", "plugins", "producer"})
_OPTIONAL_KEYS = {1: frozenset(), 2: frozenset({"checksums", "signature"})}
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def align_up(n: int, alignment: int) -> int:
    """Round ``n`` up to a multiple of ``alignment`` (a power of two)."""
    return (n + alignment - 1) & ~(alignment - 1)


def buffer_alignment(nbytes: int) -> int:
    """The alignment a writer gives a buffer of ``nbytes``."""
    return LARGE_ALIGN if nbytes >= LARGE_BUFFER_NBYTES else MIN_ALIGN


def place_buffers(sizes: Iterable[int], start: int = 0) -> tuple[list[int], int]:
    """Where a writer puts buffers of ``sizes``, one after the other from ``start``: each offset aligned as
    :func:`buffer_alignment` says; and the end of the last one. The one layout rule of every writer (snapshots,
    the model cache's segments and their compaction)."""
    offsets = []
    cursor = start
    for nbytes in sizes:
        offset = align_up(cursor, buffer_alignment(nbytes))
        offsets.append(offset)
        cursor = offset + nbytes
    return offsets, cursor


_ZEROS = memoryview(bytes(PAGE))


def padded_pieces(
    views: Sequence[memoryview], offsets: Sequence[int], *, cursor: int = 0, end: int | None = None
) -> list[memoryview]:
    """The pieces that, written in order from position ``cursor``, put each view at its offset (same
    coordinates as ``cursor``) with zero bytes in the gaps, and zeros up to ``end`` after the last one."""
    pieces: list[memoryview] = []

    def pad(to: int) -> None:
        nonlocal cursor
        while cursor < to:
            gap = min(to - cursor, PAGE)
            pieces.append(_ZEROS[:gap])
            cursor += gap

    for offset, view in zip(offsets, views, strict=True):
        if offset < cursor:
            raise ValueError(f"buffer offset {offset} overlaps what comes before it (at {cursor})")
        pad(offset)
        pieces.append(view)
        cursor = offset + view.nbytes
    if end is not None:
        pad(end)
    return pieces


@dataclass(frozen=True)
class BufferSpec:
    """What a writer knows about one out-of-band buffer before it is placed."""

    nbytes: int
    location: str = "cpu"
    dtype: str | None = None
    readonly: bool = False


class PluginRef(NamedTuple):
    """A plugin a snapshot's stream needs: its entry-point name and the distribution that provides it."""

    name: str
    package: str


class BufferEntry(NamedTuple):
    """One row of the buffer table: where a buffer lies (relative to the data region) and what it holds.

    ``location`` is the device the storage was on when dumped (``"cpu"``, ``"cuda:0"``; meta storages hold
    no bytes and have no row); ``dtype`` is the element type of the tensor that first referenced the
    storage, if known.
    """

    offset: int
    nbytes: int
    location: str = "cpu"
    dtype: str | None = None
    readonly: bool = False


class Checksums(NamedTuple):
    """Per-buffer and stream checksums (format version 2), as lowercase hex digests."""

    algorithm: str
    stream: str
    buffers: tuple[str, ...]


class Header(NamedTuple):
    """A validated snapshot header. All offsets are absolute positions in the snapshot unless noted.

    ``signature`` is the hex HMAC the writer computed over ``signed_header`` (the canonical JSON header without
    its signature) followed by the pickle stream; both are empty for unsigned snapshots.
    """

    version: int
    total_nbytes: int
    header_nbytes: int
    stream_offset: int
    stream_nbytes: int
    data_offset: int
    data_nbytes: int
    buffers: tuple[BufferEntry, ...]
    plugins: tuple[PluginRef, ...]
    producer: dict[str, str]
    checksums: Checksums | None = None
    signature: str = ""
    signed_header: bytes = b""

    def buffer_range(self, index: int) -> tuple[int, int]:
        """Absolute ``(start, stop)`` of buffer ``index``."""
        entry = self.buffers[index]
        start = self.data_offset + entry.offset
        return start, start + entry.nbytes


@dataclass(frozen=True)
class Layout:
    """Where a writer puts everything: the encoded prefix (fixed header + JSON) and each buffer's offset."""

    prefix: bytes
    stream_offset: int
    data_offset: int
    buffer_offsets: tuple[int, ...]
    total_nbytes: int


def encode(
    stream_nbytes: int,
    buffers: Sequence[BufferSpec],
    *,
    plugins: Sequence[PluginRef] = (),
    producer: dict[str, str] | None = None,
    checksums: Checksums | None = None,
    sign: Callable[[bytes], str] | None = None,
) -> Layout:
    """Lay out a snapshot and encode its fixed header and JSON header.

    Args:
        stream_nbytes: length of the pickle stream.
        buffers: the out-of-band buffers, in the order the stream consumes them.
        plugins: the plugins whose load hooks must run before the stream is unpickled.
        producer: versions of the software that wrote the snapshot (informational).
        checksums: the stream's and every buffer's checksum, to record.
        sign: given the canonical header without a signature, returns the signature to record.

    Returns:
        The :class:`Layout`; the caller writes ``prefix``, the stream, zero padding up to ``data_offset``,
        then each buffer at ``data_offset + buffer_offsets[i]`` (zero padding between them).
    """
    offsets, cursor = place_buffers(spec.nbytes for spec in buffers)
    table = [
        [offset, spec.nbytes, spec.location, spec.dtype, spec.readonly]
        for offset, spec in zip(offsets, buffers, strict=True)
    ]
    header = {
        "version": FORMAT_VERSION,
        "stream_nbytes": stream_nbytes,
        "data_nbytes": cursor,
        "buffers": table,
        "plugins": [{"name": p.name, "package": p.package} for p in plugins],
        "producer": dict(producer or {}),
    }
    if checksums is not None:
        header["checksums"] = {
            "algorithm": checksums.algorithm,
            "stream": checksums.stream,
            "buffers": list(checksums.buffers),
        }
    if sign is not None:
        header["signature"] = {"algorithm": SIGNATURE_ALGORITHM, "value": sign(canonical(header))}
    blob = canonical(header)
    if len(blob) > MAX_HEADER_NBYTES:
        raise SnapshotError(
            f"snapshot header would be {len(blob)} bytes, over the format's limit of {MAX_HEADER_NBYTES}; "
            f"the object graph has {len(buffers)} storages - merge small tensors or split the object"
        )
    stream_offset = FIXED_NBYTES + len(blob)
    data_offset = align_up(stream_offset + stream_nbytes, PAGE)
    total = data_offset + cursor
    fixed = _FIXED.pack(MAGIC, 0, len(blob), total, zlib.crc32(blob), 0)
    return Layout(fixed + blob, stream_offset, data_offset, tuple(offsets), total)


def canonical(header: Mapping[str, Any]) -> bytes:
    """The one byte form of a header object: what is written, CRC'd and signed."""
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")


def decode_fixed(fixed: bytes | memoryview, actual_nbytes: int | None) -> tuple[int, int, int]:
    """Validate the 32-byte fixed header.

    Args:
        fixed: the first bytes of the snapshot (at least 32 of them).
        actual_nbytes: the snapshot's real size when known (file size, buffer length), else None.

    Returns:
        ``(header_nbytes, total_nbytes, header_crc32)``.

    Raises:
        SnapshotError: wrong magic or version, unknown flags, a header length beyond the cap or the
            snapshot, or a total length that disagrees with ``actual_nbytes``.
    """
    if len(fixed) < FIXED_NBYTES:
        raise SnapshotError(
            f"truncated snapshot: {len(fixed)} bytes, but the fixed header alone is {FIXED_NBYTES} bytes"
        )
    magic, flags, header_nbytes, total, crc, reserved = _FIXED.unpack_from(fixed, 0)
    if magic[:7] != MAGIC_PREFIX:
        raise SnapshotError(f"not a zerocopy_pickle snapshot: bytes 0-7 are {bytes(magic)!r}, expected {MAGIC!r}")
    if magic[7] not in READABLE_VERSIONS:
        raise SnapshotError(
            f"snapshot format version {magic[7]} (byte 7) is not supported; this reader understands versions "
            f"{', '.join(map(str, sorted(READABLE_VERSIONS)))}. Upgrade zerocopy_pickle to read newer snapshots."
        )
    if flags != 0:
        raise SnapshotError(f"unknown flags {flags:#x} in the fixed header (offset 8); version 1 defines none")
    if reserved != 0:
        raise SnapshotError(f"reserved field at offset 28 is {reserved:#x}, must be 0")
    if not 2 <= header_nbytes <= MAX_HEADER_NBYTES:
        raise SnapshotError(f"header length {header_nbytes} (offset 12) is outside [2, {MAX_HEADER_NBYTES}]")
    if total < FIXED_NBYTES + header_nbytes:
        raise SnapshotError(
            f"total length {total} (offset 16) is smaller than the fixed header plus the {header_nbytes}-byte header"
        )
    if actual_nbytes is not None and actual_nbytes != total:
        what = "truncated snapshot" if actual_nbytes < total else "trailing bytes after the snapshot"
        raise SnapshotError(f"{what}: the header says {total} bytes, found {actual_nbytes}")
    return header_nbytes, total, crc


def decode_header(fixed: bytes | memoryview, blob: bytes | memoryview, actual_nbytes: int | None) -> Header:
    """Validate the fixed header and the JSON header and return the :class:`Header`.

    Every range the header names is checked against the snapshot's total length; buffers must lie inside the
    data region, in increasing order, without overlap, and aligned to at least 64 bytes.

    Args:
        fixed: the first 32 bytes.
        blob: the JSON header (exactly the length the fixed header names).
        actual_nbytes: the snapshot's real size when known.

    Raises:
        SnapshotError: naming the first field that does not hold.
    """
    fixed = bytes(fixed[:FIXED_NBYTES])  # one copy: the bytes checked are the bytes used
    header_nbytes, total, crc = decode_fixed(fixed, actual_nbytes)
    if len(blob) != header_nbytes:
        raise SnapshotError(
            f"truncated snapshot: the header is {header_nbytes} bytes at offset {FIXED_NBYTES}, "
            f"only {len(blob)} are present"
        )
    blob = bytes(blob)  # likewise: CRC, nesting and parsing see one private copy, whatever backs the input
    if zlib.crc32(blob) != crc:
        raise SnapshotError(
            f"header checksum mismatch: CRC-32 of bytes {FIXED_NBYTES}-{FIXED_NBYTES + header_nbytes} is "
            f"{zlib.crc32(blob):#010x}, the fixed header (offset 24) says {crc:#010x}; the header is corrupt"
        )
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SnapshotError(f"header at offset {FIXED_NBYTES} is not UTF-8: {e}") from e
    _check_nesting(blob)
    try:
        obj = _DECODER.decode(text)
    except ValueError as e:  # json.JSONDecodeError, or a duplicate key from the hook
        raise SnapshotError(f"header at offset {FIXED_NBYTES} is not valid JSON: {e}") from e
    except RecursionError as e:  # unreachable after _check_nesting; kept so no input can escape as one
        raise SnapshotError(f"header at offset {FIXED_NBYTES} nests too deeply to parse") from e
    if not isinstance(obj, dict):
        raise SnapshotError(f"header must be a JSON object, found {type(obj).__name__}")
    missing = _REQUIRED_KEYS - obj.keys()
    if missing:
        raise SnapshotError(f"header lacks required key(s) {sorted(missing)}")
    version = bytes(fixed[7:8])[0]
    unknown = obj.keys() - _REQUIRED_KEYS - _OPTIONAL_KEYS[version]
    if unknown:
        raise SnapshotError(
            f"header has unknown key(s) {sorted(unknown)} for format version {version}: written by a newer "
            f"zerocopy_pickle; upgrade to read it"
        )
    if obj["version"] != version or isinstance(obj["version"], bool):
        raise SnapshotError(f"header version {obj['version']!r} disagrees with the magic's {version}")
    stream_nbytes = _int(obj["stream_nbytes"], "stream_nbytes")
    data_nbytes = _int(obj["data_nbytes"], "data_nbytes")
    stream_offset = FIXED_NBYTES + header_nbytes
    data_offset = align_up(stream_offset + stream_nbytes, PAGE)
    if stream_nbytes < 1:
        raise SnapshotError("stream_nbytes is 0: a snapshot holds at least a pickle STOP opcode")
    if data_offset + data_nbytes != total:
        raise SnapshotError(
            f"sizes do not add up: stream [{stream_offset}, {stream_offset + stream_nbytes}) and a "
            f"{data_nbytes}-byte data region at {data_offset} end at {data_offset + data_nbytes}, "
            f"but the snapshot is {total} bytes"
        )
    buffers = _buffers(obj["buffers"], data_nbytes)
    plugins = obj["plugins"]
    if not isinstance(plugins, list) or not all(
        isinstance(p, dict)
        and p.keys() == {"name", "package"}
        and all(isinstance(v, str) and 0 < len(v) <= 200 for v in p.values())
        for p in plugins
    ):
        raise SnapshotError(
            f"header 'plugins' must be a list of {{'name': ..., 'package': ...}} objects, found {plugins!r:.200}"
        )
    producer = obj["producer"]
    if not isinstance(producer, dict) or not all(
        isinstance(v, str) and len(k) <= _MAX_NAME and len(v) <= 200 for k, v in producer.items()
    ):
        raise SnapshotError(f"header 'producer' must map names to version strings, found {producer!r:.200}")
    checksums = _checksums(obj.get("checksums"), len(buffers))
    signature, signed_header = "", b""
    if "signature" in obj:
        signature = _signature(obj["signature"])
        signed_header = canonical({k: v for k, v in obj.items() if k != "signature"})
    return Header(
        version=version,
        total_nbytes=total,
        header_nbytes=header_nbytes,
        stream_offset=stream_offset,
        stream_nbytes=stream_nbytes,
        data_offset=data_offset,
        data_nbytes=data_nbytes,
        buffers=buffers,
        plugins=tuple(PluginRef(p["name"], p["package"]) for p in plugins),
        producer=dict(producer),
        checksums=checksums,
        signature=signature,
        signed_header=signed_header,
    )


# Nesting check. Strings are blanked first (a bracket inside a string is not structure); what remains of the
# blob is its brackets, and one round of deleting every adjacent "[]" and "{}" pair peels one level off a
# balanced sequence. Everything runs in C (translate, replace, one regex), with no recursion.
_STRUCTURE = b'[]{}"\\'
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _check_nesting(blob: bytes) -> None:
    """Raise unless the JSON text ``blob`` nests arrays and objects at most :data:`MAX_HEADER_DEPTH` deep.

    Conservative: brackets that do not balance are refused too (the text is then not valid JSON anyway). Costs
    a few milliseconds for a 4 MB header, a few percent of parsing it.
    """
    brackets = blob.translate(None, _NOT_STRUCTURE)
    if b"\\" not in brackets:
        # Without escapes each string is a pair of quotes, adjacent once its other bytes are gone unless it
        # holds a bracket. If every quote pairs off this way, the strings held no brackets.
        brackets = brackets.replace(b'""', b"")
    if b'"' in brackets or b"\\" in brackets:
        brackets = _JSON_STRING.sub(b"", blob).translate(None, _NOT_BRACKET)
    for _ in range(MAX_HEADER_DEPTH):
        if not brackets:
            return
        peeled = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if len(peeled) == len(brackets):
            break
        brackets = peeled
    if brackets:
        raise SnapshotError(
            f"header at offset {FIXED_NBYTES} is not valid JSON for a snapshot header: its arrays and objects "
            f"nest deeper than {MAX_HEADER_DEPTH} levels or do not balance (a valid header nests 3 deep); the "
            f"snapshot is damaged or hostile"
        )


def _checksums(value: object, n_buffers: int) -> Checksums | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.keys() != {"algorithm", "stream", "buffers"}:
        raise SnapshotError(f"header 'checksums' must be {{algorithm, stream, buffers}}, found {value!r:.200}")
    if value["algorithm"] != CHECKSUM_ALGORITHM:
        raise SnapshotError(
            f"header 'checksums' uses {value['algorithm']!r:.40}; this reader knows {CHECKSUM_ALGORITHM!r}"
        )
    digests = value["buffers"]
    if not isinstance(digests, list) or len(digests) != n_buffers:
        raise SnapshotError(
            f"header 'checksums' must list one digest per buffer ({n_buffers}), found "
            f"{len(digests) if isinstance(digests, list) else type(digests).__name__}"
        )
    for digest in (value["stream"], *digests):
        if not isinstance(digest, str) or not _HEX16.fullmatch(digest):
            raise SnapshotError(f"header 'checksums' holds {digest!r:.40}, not a 16-digit hex digest")
    return Checksums(CHECKSUM_ALGORITHM, value["stream"], tuple(digests))


def _signature(value: object) -> str:
    if not isinstance(value, dict) or value.keys() != {"algorithm", "value"}:
        raise SnapshotError(f"header 'signature' must be {{algorithm, value}}, found {value!r:.200}")
    if value["algorithm"] != SIGNATURE_ALGORITHM:
        raise SnapshotError(
            f"header 'signature' uses {value['algorithm']!r:.40}; this reader knows {SIGNATURE_ALGORITHM!r}"
        )
    if not isinstance(value["value"], str) or not _HEX64.fullmatch(value["value"]):
        raise SnapshotError("header 'signature' value is not a 64-digit hex digest")
    return value["value"]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates)


def _int(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise SnapshotError(f"header field {what} must be an integer in [0, 2**63), found {value!r:.80}")
    return value


def _buffers(table: object, data_nbytes: int) -> tuple[BufferEntry, ...]:
    if not isinstance(table, list):
        raise SnapshotError(f"header 'buffers' must be a list, found {type(table).__name__}")
    out = []
    previous_end = 0
    locations: set[str] = set()  # names already validated
    dtypes: set[str] = set()
    for i, row in enumerate(table):
        # One cheap combined test per row (a snapshot can have thousands); the precise message comes from
        # _buffer_error only when something is wrong.
        if (
            type(row) is not list
            or len(row) != 5
            or type(row[0]) is not int
            or type(row[1]) is not int
            or row[0] < previous_end
            or row[0] & (MIN_ALIGN - 1)
            or not 0 <= row[1] <= data_nbytes - row[0]
            or type(row[4]) is not bool
            or type(row[2]) is not str
            or (row[2] not in locations and not _valid_location(row[2]))
            or (row[3] is not None and (type(row[3]) is not str or (row[3] not in dtypes and not _valid_dtype(row[3]))))
        ):
            raise _buffer_error(i, row, previous_end, data_nbytes)
        locations.add(row[2])
        if row[3] is not None:
            dtypes.add(row[3])
        previous_end = row[0] + row[1]
        out.append(_new_entry(BufferEntry, row))
    return tuple(out)


# tuple.__new__ builds the row's NamedTuple from the already-validated list without NamedTuple.__new__'s
# Python-level argument handling (thousands of rows per header).
_new_entry = tuple.__new__


def _valid_location(value: object) -> bool:
    return isinstance(value, str) and len(value) <= _MAX_NAME and _LOCATION_RE.fullmatch(value) is not None


def _valid_dtype(value: object) -> bool:
    return isinstance(value, str) and len(value) <= _MAX_NAME and _DTYPE_RE.fullmatch(value) is not None


def _buffer_error(i: int, row: object, previous_end: int, data_nbytes: int) -> SnapshotError:
    where = f"buffers[{i}]"
    if not isinstance(row, list) or len(row) != 5:
        return SnapshotError(f"{where} must be [offset, nbytes, location, dtype, readonly], found {row!r:.200}")
    offset = _int(row[0], f"{where} offset")
    nbytes = _int(row[1], f"{where} nbytes")
    location, dtype, readonly = row[2], row[3], row[4]
    if offset % MIN_ALIGN:
        return SnapshotError(f"{where} offset {offset} is not aligned to {MIN_ALIGN} bytes")
    if offset < previous_end:
        return SnapshotError(
            f"{where} at [{offset}, {offset + nbytes}) overlaps or precedes the previous buffer, "
            f"which ends at {previous_end}"
        )
    if offset + nbytes > data_nbytes:
        return SnapshotError(f"{where} at [{offset}, {offset + nbytes}) runs past the {data_nbytes}-byte data region")
    if not isinstance(readonly, bool):
        return SnapshotError(f"{where} readonly flag must be true or false, found {readonly!r:.80}")
    if not _valid_location(location):
        return SnapshotError(f"{where} location {location!r:.80} is not a device name like 'cpu' or 'cuda:0'")
    return SnapshotError(f"{where} dtype {dtype!r:.80} is not a dtype name")
