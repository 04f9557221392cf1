"""Property-based fuzzing of the reader, the stream check and the restricted loader (bounded for CI).

``fuzz/fuzz_snapshot.py`` runs the same harness under atheris (coverage-guided) for long runs. The property
everywhere: any input is either loaded or refused with this library's error; never a crash, a hang, another
exception type, or a stream check that disagrees with its thorough twin.
"""

from __future__ import annotations

import collections
import contextlib
import pickle
import pickletools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerocopy_pickle as zp
from zerocopy_pickle import format as fmt
from zerocopy_pickle.streamcheck import check_stream, walk_stream

from .test_hostile import as_snapshot

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20),
        st.binary(max_size=300), st.just(collections.OrderedDict(a=1)), st.just(frozenset({1, 2})),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=4), children, max_size=4),
        st.sets(st.integers(), max_size=4),
    ),
    max_leaves=25,
)  # fmt: skip


def reference_globals(stream: bytes) -> list[tuple[str, str]]:
    """The globals of a pickle stream, by pickletools (an independent implementation to compare with)."""
    found: dict[tuple[str, str], None] = {}
    memo: dict[int, Any] = {}
    stack: list[Any] = []
    for op, arg, _ in pickletools.genops(stream):
        if op.name in ("GLOBAL", "INST"):
            module, name = str(arg).split(" ", 1)
            found[module, name] = None
        elif op.name == "STACK_GLOBAL":
            found[stack[-2], stack[-1]] = None
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            stack.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            stack.append(memo.get(arg))
        elif op.name not in ("PROTO", "FRAME", "BINPUT", "LONG_BINPUT", "PUT"):
            stack.append(None)
    return list(found)


@SETTINGS
@given(value=VALUES, protocol=st.integers(0, 5))
def test_both_checks_accept_every_real_stream(value: Any, protocol: int) -> None:
    stream = pickle.dumps(value, protocol=protocol)
    assert check_stream(stream) == walk_stream(stream).next_buffers == 0
    assert list(walk_stream(stream, collect_globals=True).globals) == reference_globals(stream)


def judge(check: Any, stream: bytes) -> Any:
    try:
        return check(stream)
    except zp.SnapshotError:
        return "refused"


@SETTINGS
@given(value=VALUES, protocol=st.integers(0, 5), data=st.data())
def test_both_checks_agree_on_damaged_streams(value: Any, protocol: int, data: st.DataObject) -> None:
    stream = bytearray(pickle.dumps(value, protocol=protocol))
    for _ in range(data.draw(st.integers(1, 3))):
        position = data.draw(st.integers(0, len(stream) - 1))
        stream[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(stream)))
    damaged = bytes(stream[:cut])
    fast = judge(check_stream, damaged)
    thorough = judge(lambda s: walk_stream(s).next_buffers, damaged)
    assert fast == thorough


@SETTINGS
@given(value=VALUES, protocol=st.integers(2, 5), data=st.data())
def test_restricted_load_of_damaged_streams_raises_only_library_errors(
    value: Any, protocol: int, data: st.DataObject
) -> None:
    stream = bytearray(pickle.dumps(value, protocol=protocol))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(stream) - 1))
        stream[position] = data.draw(st.integers(0, 255))
    with contextlib.suppress(zp.ZeroCopyPickleError):
        zp.loads(as_snapshot(bytes(stream)))


def snapshot() -> bytes:
    return zp.dumps({"w": torch.arange(100.0), "n": [1, 2, {"x": torch.ones(70_000, dtype=torch.uint8)}]})


@SETTINGS
@given(data=st.data())
def test_damaged_snapshots_raise_only_library_errors(data: st.DataObject) -> None:
    original = snapshot()
    damaged = bytearray(original)
    header = zp.read_header(original)
    # Concentrate damage where it matters: the header, the stream, the first bytes of the data region.
    hot_end = header.data_offset + 256
    for _ in range(data.draw(st.integers(1, 6))):
        position = data.draw(st.integers(0, hot_end - 1))
        damaged[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(damaged))))
    blob = bytes(damaged[:cut] if cut is not None else damaged)
    with contextlib.suppress(zp.ZeroCopyPickleError):
        zp.loads(blob)


@settings(max_examples=200, deadline=None)
@given(blob=st.binary(max_size=2000))
def test_random_bytes_raise_only_library_errors(blob: bytes) -> None:
    for candidate in (blob, fmt.MAGIC + blob, as_snapshot(blob)):
        with contextlib.suppress(zp.ZeroCopyPickleError):
            zp.loads(candidate)


@pytest.mark.parametrize("protocol", range(6))
def test_truncation_at_every_byte_is_refused(protocol: int) -> None:
    stream = pickle.dumps({"a": [1, 2.5, "x" * 300, (None, True)], "b": frozenset({3})}, protocol=protocol)
    for cut in range(len(stream)):
        with pytest.raises(zp.SnapshotError):
            check_stream(stream[:cut])
        with pytest.raises(zp.SnapshotError):
            zp.loads(as_snapshot(stream[:cut]))
