"""Internal: the reader's side of the snapshot format (``format``): the fixed header and the JSON header decoded,
and every byte of them validated before use.

Bytes become a validated :class:`~zerocopy_pickle._storage.format.Header`, or a
:class:`~zerocopy_pickle.errors.SnapshotError` naming the field and offset of the first thing that does not hold:
magic, version, flags and lengths; the CRC; the JSON's nesting (bounded before it is parsed), numbers and object
sizes (refused before they are built); then each field, the buffer table row by row. ``docs/format.md`` is the
normative description.
"""

from __future__ import annotations

import json
import re
import sys
import zlib
from typing import Any

from ..errors import SnapshotError
from .format import (
    _FIXED,
    CHECKSUM_ALGORITHM,
    FIXED_NBYTES,
    MAGIC,
    MAGIC_PREFIX,
    MAX_HEADER_DEPTH,
    MAX_HEADER_NBYTES,
    MAX_INT_DIGITS,
    MAX_PLUGIN_NAME,
    MAX_PLUGINS,
    MAX_PRODUCER_ENTRIES,
    MAX_PRODUCER_NAME,
    MAX_PRODUCER_VALUE,
    MIN_ALIGN,
    PAGE,
    READABLE_VERSIONS,
    SIGNATURE_ALGORITHM,
    BufferEntry,
    Checksums,
    Header,
    PluginRef,
    _short,
    align_up,
    canonical,
)

_MAX_INT = (1 << 63) - 1
_MAX_NAME = 64
_LOCATION_RE = re.compile(r"[a-z][a-z0-9_]*(:[0-9]{1,4})?")
_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]*")

_REQUIRED_KEYS = frozenset({"version", "stream_nbytes", "data_nbytes", "buffers", "plugins", "producer"})
_OPTIONAL_KEYS = {1: frozenset(), 2: frozenset({"checksums", "signature"})}
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


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
    obj = _header_object(blob, header_nbytes, crc)
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


def _header_object(blob: bytes | memoryview, header_nbytes: int, crc: int) -> dict[str, Any]:
    """The JSON header's object, from the ``header_nbytes`` bytes the fixed header names and their CRC-32 (the
    first step of :func:`decode_header`): length, CRC, UTF-8, nesting and the parse checked in that order.

    Raises:
        SnapshotError: naming the first check that does not hold.
    """
    if len(blob) != header_nbytes:
        raise SnapshotError(
            f"truncated snapshot: the header is {header_nbytes} bytes at offset {FIXED_NBYTES}, "
            f"only {len(blob)} are present"
        )
    blob = bytes(blob)  # as with the fixed header: CRC, nesting and parsing see one private copy, whatever backs it
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
    return obj


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
