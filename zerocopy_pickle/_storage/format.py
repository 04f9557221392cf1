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
import reprlib
import struct
import sys
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
_MAX_INT = (1 << 63) - 1
_MAX_NAME = 64
_LOCATION_RE = re.compile(r"[a-z][a-z0-9_]*(:[0-9]{1,4})?")
_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]*")

_REQUIRED_KEYS = frozenset({"version", "stream_nbytes", "data_nbytes", "buffers", "plugins", "producer"})
_OPTIONAL_KEYS = {1: frozenset(), 2: frozenset({"checksums", "signature"})}
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


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
    """Refuse to write a header that every reader would refuse (the limits :func:`decode_header` enforces)."""
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
    obj = _parse(text)
    if not isinstance(obj, dict):
        raise SnapshotError(f"header must be a JSON object, found {_kind(obj)}")
    missing = _REQUIRED_KEYS - obj.keys()
    if missing:
        raise SnapshotError(f"header lacks required key(s) {sorted(missing)}")
    version = bytes(fixed[7:8])[0]
    unknown = obj.keys() - _REQUIRED_KEYS - _OPTIONAL_KEYS[version]
    if unknown:
        raise SnapshotError(
            f"header has unknown key(s) {_short(sorted(unknown), 200)} for format version {version}: written by a "
            f"newer zerocopy_pickle; upgrade to read it"
        )
    if obj["version"] != version or isinstance(obj["version"], bool):
        raise SnapshotError(f"header version {_short(obj['version'])} disagrees with the magic's {version}")
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
    plugins = _plugins(obj["plugins"])
    producer = _producer(obj["producer"])
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
        plugins=plugins,
        producer=producer,
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
        raise SnapshotError(f"header 'checksums' must be {{algorithm, stream, buffers}}, found {_short(value, 200)}")
    if value["algorithm"] != CHECKSUM_ALGORITHM:
        raise SnapshotError(
            f"header 'checksums' uses {_short(value['algorithm'], 40)}; this reader knows {CHECKSUM_ALGORITHM!r}"
        )
    digests = value["buffers"]
    if not isinstance(digests, list) or len(digests) != n_buffers:
        raise SnapshotError(
            f"header 'checksums' must list one digest per buffer ({n_buffers}), found "
            f"{len(digests) if isinstance(digests, list) else type(digests).__name__}"
        )
    for digest in (value["stream"], *digests):
        if not isinstance(digest, str) or not _HEX16.fullmatch(digest):
            raise SnapshotError(f"header 'checksums' holds {_short(digest, 40)}, not a 16-digit hex digest")
    return Checksums(CHECKSUM_ALGORITHM, value["stream"], tuple(digests))


def _signature(value: object) -> str:
    if not isinstance(value, dict) or value.keys() != {"algorithm", "value"}:
        raise SnapshotError(f"header 'signature' must be {{algorithm, value}}, found {_short(value, 200)}")
    if value["algorithm"] != SIGNATURE_ALGORITHM:
        raise SnapshotError(
            f"header 'signature' uses {_short(value['algorithm'], 40)}; this reader knows {SIGNATURE_ALGORITHM!r}"
        )
    if not isinstance(value["value"], str) or not _HEX64.fullmatch(value["value"]):
        raise SnapshotError("header 'signature' value is not a 64-digit hex digest")
    return value["value"]


class _Refused:
    """What the parser puts in place of a JSON value it refuses to build: a number written with more than
    :data:`MAX_INT_DIGITS` characters, any non-integer number, or an object with more members than any object of a
    valid header. Validation then refuses it as the wrong type for its field, naming the field; ``repr`` says what
    it was, briefly."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return self.what


def _number(text: str) -> int | _Refused:
    if len(text) <= MAX_INT_DIGITS:
        return int(text)
    return _Refused(f"<an integer of {len(text)} digits, {text[:12]}...>")


def _not_integer(text: str) -> _Refused:
    return _Refused(text if len(text) <= 24 else f"<a number of {len(text)} characters, {text[:12]}...>")


_MAX_MEMBERS = max(MAX_PRODUCER_ENTRIES, len(_REQUIRED_KEYS | _OPTIONAL_KEYS[2]))


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any] | _Refused:
    if len(pairs) > _MAX_MEMBERS:
        return _Refused(f"<an object of {len(pairs)} members>")
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {_short(key)}")
        out[key] = value
    return out


# The usual decoder converts integers in C; it is used while the interpreter's own bound on integer digits
# (sys.int_max_str_digits, 4300 by default) keeps each conversion cheap: a header of 4300-digit numbers then costs
# about what a header of real rows of the same size costs, and a number over that bound fails to parse. Where a
# program lifted that bound, a decoder that refuses long numbers before converting them is used instead (it is
# slower per integer, so it is not the default). Either way no float, NaN or Infinity is ever kept.
_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_float=_not_integer, parse_constant=_not_integer)
_BOUNDED_DECODER = json.JSONDecoder(
    object_pairs_hook=_object, parse_float=_not_integer, parse_constant=_not_integer, parse_int=_number
)
_DEFAULT_INT_DIGITS = 4300


def _parse(text: str) -> Any:
    """The JSON header's value, from text whose nesting :func:`_check_nesting` has bounded."""
    digits = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    decoder = _DECODER if 0 < digits <= _DEFAULT_INT_DIGITS else _BOUNDED_DECODER
    try:
        try:
            return decoder.decode(text)
        except ValueError:
            if decoder is _BOUNDED_DECODER:
                raise
            # Perhaps a number over the interpreter's bound: parse again refusing long numbers, so that the
            # error names the field that holds it (and says what else is wrong, if that was not it).
            return _BOUNDED_DECODER.decode(text)
    except ValueError as e:  # json.JSONDecodeError, or a duplicate key from the hook
        raise SnapshotError(f"header at offset {FIXED_NBYTES} is not valid JSON: {_short(str(e), 200)}") from e
    except RecursionError as e:  # unreachable after _check_nesting; kept so no input can escape as one
        raise SnapshotError(f"header at offset {FIXED_NBYTES} nests too deeply to parse") from e


_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 4
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 80


def _short(value: object, limit: int = 80) -> str:
    """A repr of ``value`` of at most about ``limit`` characters, built without a repr of the whole value (a field
    of a hostile header can be a list of millions of items)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _kind(value: object) -> str:
    return repr(value) if isinstance(value, _Refused) else type(value).__name__


def _plugins(value: object) -> tuple[PluginRef, ...]:
    if not isinstance(value, list):
        raise SnapshotError(
            f"header 'plugins' must be a list of {{'name': ..., 'package': ...}} objects, found {_kind(value)}"
        )
    if len(value) > MAX_PLUGINS:
        raise SnapshotError(f"header 'plugins' lists {len(value)} plugins, more than the format's {MAX_PLUGINS}")
    for i, p in enumerate(value):
        if not (
            isinstance(p, dict)
            and p.keys() == {"name", "package"}
            and all(isinstance(v, str) and 0 < len(v) <= MAX_PLUGIN_NAME for v in p.values())
        ):
            raise SnapshotError(
                f"header 'plugins' must be a list of {{'name': ..., 'package': ...}} objects of 1 to "
                f"{MAX_PLUGIN_NAME} characters each; plugins[{i}] is {_short(p, 200)}"
            )
    return tuple(PluginRef(p["name"], p["package"]) for p in value)


def _producer(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        if isinstance(value, _Refused) and value.what.startswith("<an object"):
            raise SnapshotError(
                f"header 'producer' is {value!r}, more entries than the format's {MAX_PRODUCER_ENTRIES}"
            )
        raise SnapshotError(f"header 'producer' must map names to version strings, found {_kind(value)}")
    if len(value) > MAX_PRODUCER_ENTRIES:
        raise SnapshotError(
            f"header 'producer' has {len(value)} entries, more than the format's {MAX_PRODUCER_ENTRIES}"
        )
    for name, version in value.items():
        if not (isinstance(version, str) and len(name) <= MAX_PRODUCER_NAME and len(version) <= MAX_PRODUCER_VALUE):
            raise SnapshotError(
                f"header 'producer' must map names of at most {MAX_PRODUCER_NAME} characters to version strings of "
                f"at most {MAX_PRODUCER_VALUE}, found {_short(name)}: {_short(version)}"
            )
    return value


def _int(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _MAX_INT:
        raise SnapshotError(f"header field {what} must be an integer in [0, 2**63), found {_short(value, 80)}")
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
        return SnapshotError(f"{where} must be [offset, nbytes, location, dtype, readonly], found {_short(row, 200)}")
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
        return SnapshotError(f"{where} readonly flag must be true or false, found {_short(readonly, 80)}")
    if not _valid_location(location):
        return SnapshotError(f"{where} location {_short(location, 80)} is not a device name like 'cpu' or 'cuda:0'")
    return SnapshotError(f"{where} dtype {_short(dtype, 80)} is not a dtype name")
