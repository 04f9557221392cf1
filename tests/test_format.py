"""The snapshot layout: encoding, and one test per validation error (the reader trusts nothing)."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zerocopy_pickle as zp
from tests.internals import decoding
from tests.internals import format as fmt


def snapshot_bytes() -> bytes:
    return zp.dumps({"a": torch.arange(6.0), "b": torch.ones(70_000, dtype=torch.uint8), "c": [1, "x"]})


def split(data: bytes) -> tuple[bytes, dict[str, object], tuple[bytes, bytes]]:
    """(fixed header, parsed JSON header, (pickle stream, data region)) of a valid snapshot."""
    header = decode(data)
    blob = data[32 : 32 + header.header_nbytes]
    stream = data[header.stream_offset : header.stream_offset + header.stream_nbytes]
    return data[:32], json.loads(blob), (stream, data[header.data_offset :])


def rebuild(header: dict[str, object], rest: tuple[bytes, bytes]) -> bytes:
    """Lay a (modified) JSON header out again with the original stream and data region."""
    stream, region = rest
    blob = json.dumps(header, separators=(",", ":")).encode()
    data_offset = fmt.align_up(32 + len(blob) + len(stream), fmt.PAGE)
    padding = bytes(data_offset - 32 - len(blob) - len(stream))
    fixed = struct.pack("<8sIIQII", fmt.MAGIC, 0, len(blob), data_offset + len(region), zlib.crc32(blob), 0)
    return fixed + blob + stream + padding + region


def raw_header(blob: bytes) -> bytes:
    """A fixed header for an arbitrary JSON blob, followed by the blob alone."""
    return struct.pack("<8sIIQII", fmt.MAGIC, 0, len(blob), 32 + len(blob), zlib.crc32(blob), 0) + blob


def decode(data: bytes) -> fmt.Header:
    header_nbytes = struct.unpack_from("<I", data, 12)[0] if len(data) >= 16 else 0
    return decoding.decode_header(data[:32], data[32 : 32 + header_nbytes], len(data))


def test_layout_is_aligned_and_consistent() -> None:
    specs = [fmt.BufferSpec(n) for n in (0, 1, 63, 64, 65, 65_536, 3, 1 << 20)]
    layout = fmt.encode(123, specs)
    assert layout.stream_offset == 32 + len(layout.prefix) - 32
    assert layout.data_offset % 4096 == 0
    assert layout.data_offset >= layout.stream_offset + 123
    previous_end = 0
    for offset, spec in zip(layout.buffer_offsets, specs, strict=True):
        assert offset % (4096 if spec.nbytes >= 65_536 else 64) == 0
        assert offset >= previous_end
        previous_end = offset + spec.nbytes
    assert layout.total_nbytes == layout.data_offset + previous_end


def test_real_snapshot_header_round_trips() -> None:
    data = snapshot_bytes()
    header = decode(data)
    assert header.version == 2
    assert header.total_nbytes == len(data)
    assert header.checksums is not None and len(header.checksums.buffers) == 2
    assert header.signature == ""
    assert len(header.buffers) == 2
    assert [b.dtype for b in header.buffers] == ["float32", "uint8"]
    assert all(b.location == "cpu" for b in header.buffers)
    assert header.producer["torch"] == torch.__version__
    start, stop = header.buffer_range(0)
    assert data[start:stop] == torch.arange(6.0).numpy().tobytes()


def test_modified_header_helper_is_faithful() -> None:
    data = snapshot_bytes()
    _, header, rest = split(data)
    assert rebuild(header, rest) == data


# --- the fixed header ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 8, 31])
def test_too_short_for_the_fixed_header(n: int) -> None:
    with pytest.raises(zp.SnapshotError, match="truncated snapshot"):
        decoding.decode_fixed(snapshot_bytes()[:n], n)


def test_wrong_magic() -> None:
    data = bytearray(snapshot_bytes())
    data[1:4] = b"PK\x03"
    with pytest.raises(zp.SnapshotError, match="not a zerocopy_pickle snapshot"):
        decode(bytes(data))


def test_torch_save_file_is_not_a_snapshot(tmp_path: object) -> None:
    import io

    buf = io.BytesIO()
    torch.save({"a": torch.ones(3)}, buf)
    with pytest.raises(zp.SnapshotError, match="not a zerocopy_pickle snapshot"):
        zp.loads(buf.getvalue())


def test_newer_version() -> None:
    data = bytearray(snapshot_bytes())
    data[7] = 3
    with pytest.raises(zp.SnapshotError, match="format version 3 .* not supported"):
        decode(bytes(data))


def test_unknown_flags() -> None:
    data = bytearray(snapshot_bytes())
    struct.pack_into("<I", data, 8, 1)
    with pytest.raises(zp.SnapshotError, match="unknown flags 0x1"):
        decode(bytes(data))


def test_reserved_field() -> None:
    data = bytearray(snapshot_bytes())
    struct.pack_into("<I", data, 28, 7)
    with pytest.raises(zp.SnapshotError, match="reserved field"):
        decode(bytes(data))


@pytest.mark.parametrize("header_nbytes", [0, 1, fmt.MAX_HEADER_NBYTES + 1, 0xFFFFFFFF])
def test_header_length_outside_the_cap(header_nbytes: int) -> None:
    data = bytearray(snapshot_bytes())
    struct.pack_into("<I", data, 12, header_nbytes)
    with pytest.raises(zp.SnapshotError, match="header length"):
        decoding.decode_fixed(bytes(data), len(data))


def test_header_longer_than_the_snapshot() -> None:
    data = bytearray(snapshot_bytes())
    struct.pack_into("<Q", data, 16, 40)
    with pytest.raises(zp.SnapshotError, match="smaller than the fixed header plus"):
        decoding.decode_fixed(bytes(data), None)


def test_truncated_file() -> None:
    data = snapshot_bytes()
    with pytest.raises(zp.SnapshotError, match="truncated snapshot: the header says"):
        decoding.decode_fixed(data[:100], len(data) - 1)


def test_trailing_bytes() -> None:
    data = snapshot_bytes()
    with pytest.raises(zp.SnapshotError, match="trailing bytes"):
        zp.loads(data + b"\0")


def test_header_checksum() -> None:
    data = bytearray(snapshot_bytes())
    data[40] ^= 0x20
    with pytest.raises(zp.SnapshotError, match="header checksum mismatch"):
        decode(bytes(data))


@pytest.mark.parametrize("cut", ["fixed", "header", "stream", "padding", "data", "last byte"])
def test_truncation_at_each_section(cut: str) -> None:
    data = snapshot_bytes()
    header = decode(data)
    at = {
        "fixed": 16,
        "header": 32 + header.header_nbytes // 2,
        "stream": header.stream_offset + header.stream_nbytes // 2,
        "padding": header.stream_offset + header.stream_nbytes + 1,
        "data": header.data_offset + header.data_nbytes // 2,
        "last byte": len(data) - 1,
    }[cut]
    with pytest.raises(zp.SnapshotError, match="truncated snapshot"):
        zp.loads(data[:at])


# --- the JSON header -----------------------------------------------------------------------------------------


def test_non_utf8_header() -> None:
    with pytest.raises(zp.SnapshotError, match="not UTF-8"):
        decode(raw_header(b'{"version":1,"x":"\xff\xfe"}'))


def test_duplicate_keys() -> None:
    _, header, _ = split(snapshot_bytes())
    text = json.dumps(header, separators=(",", ":"))
    with pytest.raises(zp.SnapshotError, match="duplicate key 'version'"):
        decode(raw_header(('{"version":1,' + text[1:]).encode()))


def test_header_not_an_object() -> None:
    with pytest.raises(zp.SnapshotError, match="must be a JSON object"):
        decode(raw_header(b"[1,2,3]"))


def test_invalid_json() -> None:
    with pytest.raises(zp.SnapshotError, match="not valid JSON"):
        decode(raw_header(b'{"version": 1,'))


@pytest.mark.parametrize("key", ["stream_nbytes", "buffers", "plugins"])
def test_missing_key(key: str) -> None:
    _, header, rest = split(snapshot_bytes())
    del header[key]
    with pytest.raises(zp.SnapshotError, match=f"lacks required key.*{key}"):
        decode(rebuild(header, rest))


def test_unknown_key() -> None:
    _, header, rest = split(snapshot_bytes())
    header["frobnicate"] = "abc"
    with pytest.raises(zp.SnapshotError, match="unknown key.*frobnicate.*newer"):
        decode(rebuild(header, rest))


def test_version_1_header_cannot_carry_version_2_keys() -> None:
    _, header, rest = split(snapshot_bytes())
    header["version"] = 1
    data = bytearray(rebuild(header, rest))
    data[7] = 1
    blob = bytes(data[32 : 32 + struct.unpack_from("<I", data, 12)[0]])
    struct.pack_into("<I", data, 24, zlib.crc32(blob))
    with pytest.raises(zp.SnapshotError, match=r"unknown key.*checksums.*format version 1"):
        decode(bytes(data))


@pytest.mark.parametrize("value", [1, 3, True, "2", None])
def test_header_version_disagrees(value: object) -> None:
    _, header, rest = split(snapshot_bytes())
    header["version"] = value
    with pytest.raises(zp.SnapshotError, match="header version"):
        decode(rebuild(header, rest))


@pytest.mark.parametrize("value", [-1, 1.5, "12", True, 1 << 64])
def test_bad_integer_fields(value: object) -> None:
    _, header, rest = split(snapshot_bytes())
    header["stream_nbytes"] = value
    with pytest.raises(zp.SnapshotError, match="stream_nbytes must be an integer"):
        decode(rebuild(header, rest))


def test_sizes_that_do_not_add_up() -> None:
    _, header, rest = split(snapshot_bytes())
    header["data_nbytes"] += 4096  # type: ignore[operator]
    with pytest.raises(zp.SnapshotError, match="sizes do not add up"):
        decode(rebuild(header, rest))


def test_empty_stream() -> None:
    _, header, rest = split(snapshot_bytes())
    header["stream_nbytes"] = 0
    with pytest.raises(zp.SnapshotError, match="stream_nbytes is 0"):
        decode(rebuild(header, rest))


def test_huge_stream_length_does_not_overflow() -> None:
    _, header, rest = split(snapshot_bytes())
    header["stream_nbytes"] = (1 << 63) - 1
    with pytest.raises(zp.SnapshotError, match="sizes do not add up"):
        decode(rebuild(header, rest))


def mutate_buffer(index: int, position: int, value: object) -> bytes:
    _, header, rest = split(snapshot_bytes())
    buffers = header["buffers"]
    assert isinstance(buffers, list)
    buffers[index][position] = value
    return rebuild(header, rest)


def test_buffer_out_of_range() -> None:
    with pytest.raises(zp.SnapshotError, match=r"buffers\[1\] .* runs past the .*data region"):
        decode(mutate_buffer(1, 1, 1 << 40))


def test_buffer_overlap() -> None:
    with pytest.raises(zp.SnapshotError, match=r"buffers\[1\] .* overlaps"):
        decode(mutate_buffer(1, 0, 0))


def test_buffer_misaligned() -> None:
    with pytest.raises(zp.SnapshotError, match=r"buffers\[1\] offset .* not aligned"):
        decode(mutate_buffer(1, 0, 4096 + 8))


def test_buffer_negative_size() -> None:
    with pytest.raises(zp.SnapshotError, match=r"buffers\[0\] nbytes must be an integer"):
        decode(mutate_buffer(0, 1, -5))


@pytest.mark.parametrize("location", ["", "CPU", "cuda:x", "a b", 3, None, "x" * 100])
def test_buffer_bad_location(location: object) -> None:
    with pytest.raises(zp.SnapshotError, match=r"buffers\[0\] location"):
        decode(mutate_buffer(0, 2, location))


@pytest.mark.parametrize("dtype", ["", "Float", 7, ["float32"]])
def test_buffer_bad_dtype(dtype: object) -> None:
    with pytest.raises(zp.SnapshotError, match=r"buffers\[0\] dtype"):
        decode(mutate_buffer(0, 3, dtype))


def test_buffer_bad_readonly() -> None:
    with pytest.raises(zp.SnapshotError, match=r"buffers\[0\] readonly"):
        decode(mutate_buffer(0, 4, 0))


def test_buffer_row_shape() -> None:
    _, header, rest = split(snapshot_bytes())
    header["buffers"][0] = {"offset": 0}  # type: ignore[index]
    with pytest.raises(zp.SnapshotError, match=r"buffers\[0\] must be \[offset, nbytes"):
        decode(rebuild(header, rest))


def test_buffer_count_must_match_stream() -> None:
    _, header, rest = split(snapshot_bytes())
    del header["checksums"]  # they would already disagree with a changed buffer table
    buffers = header["buffers"]
    assert isinstance(buffers, list)
    end = fmt.align_up(buffers[-1][0] + buffers[-1][1], 64)
    buffers.append([end, 0, "cpu", None, False])
    header["data_nbytes"] = end
    stream, region = rest
    with pytest.raises(zp.SnapshotError, match=r"consumes 2 out-of-band buffer\(s\), the header declares 3"):
        zp.loads(rebuild(header, (stream, region.ljust(end, b"\0"))))
    header["data_nbytes"] = len(region)
    del buffers[-2:]
    with pytest.raises(zp.SnapshotError, match=r"consumes 2 out-of-band buffer\(s\), the header declares 1"):
        zp.loads(rebuild(header, rest))


def test_bad_plugins_and_producer() -> None:
    _, header, rest = split(snapshot_bytes())
    header["plugins"] = ["bitsandbytes"]
    with pytest.raises(zp.SnapshotError, match="'plugins' must be a list of"):
        decode(rebuild(header, rest))
    _, header, rest = split(snapshot_bytes())
    header["producer"] = {"torch": 2}
    with pytest.raises(zp.SnapshotError, match="'producer' must map names"):
        decode(rebuild(header, rest))


# --- properties ------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    stream_nbytes=st.integers(1, 100_000),
    sizes=st.lists(st.integers(0, 300_000), max_size=40),
    locations=st.sampled_from(["cpu", "cuda:0", "cuda:7", "xpu"]),
)
def test_any_layout_decodes_to_itself(stream_nbytes: int, sizes: list[int], locations: str) -> None:
    specs = [fmt.BufferSpec(n, locations, "float16" if n % 2 else None, n % 3 == 0) for n in sizes]
    layout = fmt.encode(stream_nbytes, specs, plugins=[fmt.PluginRef("p", "pkg")], producer={"x": "1"})
    header = decoding.decode_header(layout.prefix[:32], layout.prefix[32:], layout.total_nbytes)
    assert header.stream_offset == layout.stream_offset
    assert header.data_offset == layout.data_offset
    assert header.total_nbytes == layout.total_nbytes
    assert [(b.offset, b.nbytes, b.location, b.dtype, b.readonly) for b in header.buffers] == [
        (o, s.nbytes, s.location, s.dtype, s.readonly) for o, s in zip(layout.buffer_offsets, specs, strict=True)
    ]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_corrupted_header_raises_only_snapshot_error(data: st.DataObject) -> None:
    """Any change to the fixed header or JSON header is either harmless or a SnapshotError, never a crash."""
    original = snapshot_bytes()
    header_end = 32 + struct.unpack_from("<I", original, 12)[0]
    corrupted = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, header_end - 1))
        corrupted[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(original))))
    blob = bytes(corrupted[:cut] if cut is not None else corrupted)
    try:
        loaded = zp.loads(blob)
    except zp.SnapshotError:
        return
    assert torch.equal(loaded["a"], torch.arange(6.0))


# --- limits on what a header holds (issue 25) -----------------------------------------------------------------


def with_field(key: str, value: object) -> bytes:
    """A real snapshot whose JSON header's ``key`` is ``value`` (neither the CRC nor the checksums cover it)."""
    _, header, rest = split(snapshot_bytes())
    header[key] = value
    return rebuild(header, rest)


def test_producer_entries_at_the_limit_load_and_one_more_is_refused() -> None:
    producer = {f"k{i}": "1.0" for i in range(fmt.MAX_PRODUCER_ENTRIES)}
    data = with_field("producer", producer)
    assert decode(data).producer == producer
    assert zp.loads(data)["c"] == [1, "x"]
    producer["one-more"] = "1.0"
    with pytest.raises(
        zp.SnapshotError, match=rf"'producer' .*more entries than the format's {fmt.MAX_PRODUCER_ENTRIES}"
    ):
        decode(with_field("producer", producer))


def test_a_producer_of_a_million_entries_is_refused_before_it_is_built() -> None:
    raw = b"{" + b",".join(b'"%x":""' % i for i in range(1_000_000)) + b"}"
    with pytest.raises(zp.SnapshotError, match=r"'producer' is <an object of 1000000 members>, more entries"):
        decode(with_raw_field("producer", raw))


@pytest.mark.parametrize(
    ("name", "value", "ok"),
    [
        ("n" * fmt.MAX_PRODUCER_NAME, "v" * fmt.MAX_PRODUCER_VALUE, True),
        ("n" * (fmt.MAX_PRODUCER_NAME + 1), "v", False),
        ("n", "v" * (fmt.MAX_PRODUCER_VALUE + 1), False),
        ("n", 2, False),
        ("n", ["v"], False),
    ],
)
def test_producer_names_and_versions_are_bounded(name: str, value: object, ok: bool) -> None:
    data = with_field("producer", {name: value})
    if ok:
        assert decode(data).producer == {name: value}
        return
    with pytest.raises(zp.SnapshotError, match="header 'producer' must map names of at most 64 characters"):
        decode(data)


def test_plugins_at_the_limit_decode_and_one_more_is_refused() -> None:
    plugins = [{"name": f"p{i}", "package": "pkg"} for i in range(fmt.MAX_PLUGINS)]
    header = decode(with_field("plugins", plugins))
    assert header.plugins == tuple(fmt.PluginRef(f"p{i}", "pkg") for i in range(fmt.MAX_PLUGINS))
    plugins.append({"name": "one-more", "package": "pkg"})
    with pytest.raises(
        zp.SnapshotError, match=rf"'plugins' lists {fmt.MAX_PLUGINS + 1} plugins, more than .* {fmt.MAX_PLUGINS}"
    ):
        decode(with_field("plugins", plugins))


@pytest.mark.parametrize(
    ("entry", "ok"),
    [
        ({"name": "n" * fmt.MAX_PLUGIN_NAME, "package": "p" * fmt.MAX_PLUGIN_NAME}, True),
        ({"name": "n" * (fmt.MAX_PLUGIN_NAME + 1), "package": "p"}, False),
        ({"name": "n", "package": "p" * (fmt.MAX_PLUGIN_NAME + 1)}, False),
        ({"name": "", "package": "p"}, False),
        ({"name": "n", "package": "p", "extra": "x"}, False),
        ({"name": "n", "package": 1}, False),
        ("n", False),
    ],
)
def test_plugin_names_are_bounded(entry: object, ok: bool) -> None:
    data = with_field("plugins", [entry])
    if ok:
        assert len(decode(data).plugins) == 1
        return
    with pytest.raises(zp.SnapshotError, match=r"header 'plugins' must be a list of .*; plugins\[0\] is"):
        decode(data)


def test_the_writer_refuses_what_a_reader_would() -> None:
    ok_plugins = [fmt.PluginRef(f"p{i}", "pkg") for i in range(fmt.MAX_PLUGINS)]
    ok_producer = {f"k{i}": "v" * fmt.MAX_PRODUCER_VALUE for i in range(fmt.MAX_PRODUCER_ENTRIES)}
    layout = fmt.encode(1, [], plugins=ok_plugins, producer=ok_producer)
    header = decoding.decode_header(layout.prefix[:32], layout.prefix[32:], layout.total_nbytes)
    assert header.plugins == tuple(ok_plugins) and header.producer == ok_producer
    with pytest.raises(zp.SnapshotError, match="at most 64 plugins"):
        fmt.encode(1, [], plugins=[*ok_plugins, fmt.PluginRef("x", "y")])
    with pytest.raises(zp.SnapshotError, match="plugin's name and package"):
        fmt.encode(1, [], plugins=[fmt.PluginRef("x" * (fmt.MAX_PLUGIN_NAME + 1), "y")])
    with pytest.raises(zp.SnapshotError, match="at most 32 entries"):
        fmt.encode(1, [], producer={**ok_producer, "x": "y"})
    with pytest.raises(zp.SnapshotError, match="producer entry"):
        fmt.encode(1, [], producer={"x": "v" * (fmt.MAX_PRODUCER_VALUE + 1)})


@pytest.mark.parametrize("key", ["signature", "checksums"])
def test_an_object_over_the_member_limit_is_refused_naming_its_field(key: str) -> None:
    data = with_field(key, {f"k{i}": 0 for i in range(fmt.MAX_PRODUCER_ENTRIES + 1)})
    with pytest.raises(zp.SnapshotError, match=rf"header '{key}' must be .*<an object of 33 members>"):
        decode(data)


def test_a_header_of_too_many_keys_is_refused() -> None:
    _, header, rest = split(snapshot_bytes())
    header.update({f"unknown{i}": 0 for i in range(40)})
    with pytest.raises(zp.SnapshotError, match="header must be a JSON object, found <an object of 4[0-9] members>"):
        decode(rebuild(header, rest))


def test_unknown_keys_are_quoted_briefly() -> None:
    _, header, rest = split(snapshot_bytes())
    header.update({f"{i}" + "k" * 100_000: 0 for i in range(20)})
    with pytest.raises(zp.SnapshotError, match="unknown key") as info:
        decode(rebuild(header, rest))
    assert len(str(info.value)) < 500


@pytest.mark.parametrize("value", [list(range(1_000_000)), "x" * 1_000_000, {"k": "v" * 1_000_000}])
def test_a_huge_wrong_value_is_quoted_briefly(value: object) -> None:
    with pytest.raises(zp.SnapshotError, match="stream_nbytes must be an integer") as info:
        decode(with_field("stream_nbytes", value))
    assert len(str(info.value)) < 300


def with_raw_field(key: str, raw: bytes) -> bytes:
    """A real snapshot whose JSON header's ``key`` is the JSON text ``raw``, written as it is."""
    _, header, rest = split(snapshot_bytes())
    header[key] = "PLACEHOLDER"
    blob = json.dumps(header, separators=(",", ":")).encode().replace(b'"PLACEHOLDER"', raw)
    stream, region = rest
    data_offset = fmt.align_up(32 + len(blob) + len(stream), fmt.PAGE)
    fixed = struct.pack("<8sIIQII", fmt.MAGIC, 0, len(blob), data_offset + len(region), zlib.crc32(blob), 0)
    return fixed + blob + stream + bytes(data_offset - 32 - len(blob) - len(stream)) + region


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (b"1" + b"0" * (fmt.MAX_INT_DIGITS - 1), "10000000000000000000"),  # at the limit: converted, out of range
        (b"-" + b"9" * (fmt.MAX_INT_DIGITS - 1), "-9999999999999999999"),
        (b"1" + b"0" * fmt.MAX_INT_DIGITS, "100000000000"),  # one over: not converted where Python's bound is lifted
        (b"7" * 5000, "<an integer of 5000 digits"),  # over Python's own 4300-digit bound
        (b"7" * 2_000_000, "<an integer of 2000000 digits"),
        (b"1.5", "1.5"),
        (b"1e400", "1e400"),
        (b"NaN", "NaN"),
        (b"-Infinity", "-Infinity"),
        (b"1." + b"5" * 100_000, "<a number of 100002 characters"),
    ],
)
def test_numbers_are_bounded_before_they_are_converted(raw: bytes, shown: str) -> None:
    with pytest.raises(zp.SnapshotError, match="header field stream_nbytes must be an integer") as info:
        decode(with_raw_field("stream_nbytes", raw))
    assert shown in str(info.value)


def test_long_numbers_are_refused_cheaply_where_python_s_digit_bound_is_lifted() -> None:
    import sys

    previous = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # unlimited: int() of a long digit string is then quadratic
    try:
        with pytest.raises(zp.SnapshotError, match=r"stream_nbytes must be an integer .*<an integer of 4000000 digits"):
            decode(with_raw_field("stream_nbytes", b"7" * 4_000_000))
        data = with_raw_field("buffers", b"[[" + b"6" * 1_000_000 + b',0,"cpu",null,false]]')
        with pytest.raises(zp.SnapshotError, match=r"buffers\[0\] offset must be an integer"):
            decode(data)
        assert decode(snapshot_bytes()).version == 2  # the slower decoder reads valid headers alike
    finally:
        sys.set_int_max_str_digits(previous)


def test_a_header_nested_past_the_parser_s_recursion_is_a_snapshot_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nesting check runs first; if it ever let a deep header through, the parser's RecursionError would
    still be a SnapshotError."""
    monkeypatch.setattr(decoding, "_check_nesting", lambda blob: None)
    deep = 200_000
    with pytest.raises(zp.SnapshotError, match="nests too deeply|not valid JSON"):
        decode(raw_header(b"[" * deep + b"]" * deep))
    with pytest.raises(zp.SnapshotError, match="nests too deeply|not valid JSON"):
        decode(raw_header(b'{"a":' * deep + b"1" + b"}" * deep))


def _peak_decoding(data: bytes) -> int:
    import tracemalloc

    blob = data[32 : 32 + struct.unpack_from("<I", data, 12)[0]]
    tracemalloc.start()
    try:
        with pytest.raises(zp.SnapshotError):
            decoding.decode_header(data[:32], blob, None)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
@pytest.mark.parametrize("what", ["producer", "plugins", "buffers"])
def test_decoding_a_hostile_header_holds_memory_linear_in_its_length(what: str) -> None:
    """Each collection at several MiB of JSON: the decoder's peak is at most 20 times the header's length (the
    blob, its text, the parsed JSON and the rows; measured: producer 16, buffer rows 13, plugins 11), and it
    refuses the header."""
    n = 400_000
    if what == "producer":
        raw = b"{" + b",".join(b'"%x":""' % i for i in range(n)) + b"}"
    elif what == "plugins":
        raw = b"[" + b",".join([b'{"name":"a","package":"b"}'] * n) + b"]"
    else:  # rows without buffers behind them: as many as the header holds, refused for the stream
        raw = b"[" + b",".join([b'[0,0,"cpu",null,false]'] * n) + b"]"
    data = with_raw_field(what, raw)
    blob = data[32 : 32 + struct.unpack_from("<I", data, 12)[0]]
    assert len(blob) > 4_000_000
    assert _peak_decoding(data) < 20 * len(blob)
