"""Internal: the snapshot layout (format versions 1 and 2): its constants and limits, where a writer places each
buffer, and the encoding of the header.

A snapshot is one contiguous byte sequence::

    [0, 32)                        fixed header: magic (version in its last byte), flags, header length,
                                   total length, CRC-32 of the JSON header
    [32, 32 + H)                   JSON header (UTF-8): sizes, buffer table, plugins, producer
    [32 + H, 32 + H + S)           pickle stream (protocol 5, buffers out of band)
    [D, D + N)                     data region; D = 32 + H + S rounded up to a page (4096)

Buffer offsets in the table are relative to ``D``. Every buffer starts on a 64-byte boundary, and buffers of
64 KiB or more on a 4096-byte boundary, so that a storage mapped from the file is as aligned as one from the
CPU allocator. ``docs/format.md`` is the normative description; this module and ``decoding`` (the reader's side:
every byte of a header validated before use) are its only implementation.

Nothing here touches tensors or pickle: it turns sizes into a layout and an encoded header, and it raises
:class:`~zerocopy_pickle.errors.SnapshotError` for a header no reader would accept.
"""

from __future__ import annotations

import json
import reprlib
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import SnapshotError

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
MAX_PRODUCER_ENTRIES = 32
"""A reader refuses a header whose informational ``producer`` object has more entries than this (a writer records
4); each name is at most :data:`MAX_PRODUCER_NAME` characters and each version string at most
:data:`MAX_PRODUCER_VALUE`. No object of a valid header has more members than this, so the parser refuses any
larger object before it builds the dict."""
MAX_PRODUCER_NAME = 64
MAX_PRODUCER_VALUE = 200
MAX_PLUGINS = 64
"""A reader refuses a header that lists more plugins than this; each name and package is 1 to
:data:`MAX_PLUGIN_NAME` characters."""
MAX_PLUGIN_NAME = 200
MAX_INT_DIGITS = 20
"""No integer of a valid header is written with more characters than this (2**63 - 1 has 19 digits): a longer one is
never converted (converting a digit string costs time quadratic in its length)."""


def align_up(n: int, alignment: int) -> int:
    """Round ``n`` up to a multiple of ``alignment``, any positive int (the package's one rounding-up helper:
    the snapshot's alignments are powers of two, a device transfer's may be any)."""
    return -(-n // alignment) * alignment


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
    producer = dict(producer or {})
    _check_writable(plugins, producer)
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
        "producer": producer,
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


def _check_writable(plugins: Sequence[PluginRef], producer: Mapping[str, str]) -> None:
    """Refuse to write a header that every reader would refuse (the limits ``decoding.decode_header`` enforces)."""
    if len(plugins) > MAX_PLUGINS:
        raise SnapshotError(f"a snapshot lists at most {MAX_PLUGINS} plugins, this one would list {len(plugins)}")
    for plugin in plugins:
        if not all(isinstance(v, str) and 0 < len(v) <= MAX_PLUGIN_NAME for v in plugin):
            raise SnapshotError(
                f"plugin {_short(plugin)}: a plugin's name and package must be 1 to {MAX_PLUGIN_NAME} characters"
            )
    if len(producer) > MAX_PRODUCER_ENTRIES:
        raise SnapshotError(f"a header's producer has at most {MAX_PRODUCER_ENTRIES} entries, not {len(producer)}")
    for name, value in producer.items():
        if not (
            isinstance(name, str)
            and isinstance(value, str)
            and len(name) <= MAX_PRODUCER_NAME
            and len(value) <= MAX_PRODUCER_VALUE
        ):
            raise SnapshotError(
                f"producer entry {_short(name)}: {_short(value)}: names are strings of at most {MAX_PRODUCER_NAME} "
                f"characters, versions strings of at most {MAX_PRODUCER_VALUE}"
            )


def canonical(header: Mapping[str, Any]) -> bytes:
    """The one byte form of a header object: what is written, CRC'd and signed."""
    return json.dumps(header, separators=(",", ":"), sort_keys=True).encode("utf-8")


_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 4
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 80


def _short(value: object, limit: int = 80) -> str:
    """A repr of ``value`` of at most about ``limit`` characters, built without a repr of the whole value (a field
    of a hostile header can be a list of millions of items)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
