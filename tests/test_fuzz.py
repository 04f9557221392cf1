"""Property-based fuzzing of the reader, the stream check and the restricted loader (bounded for CI).

``fuzz/fuzz_snapshot.py`` runs the same harness under atheris (coverage-guided) for long runs. The property
everywhere: any input is either loaded or refused with this library's error; never a crash, a hang, another
exception type, or a stream check that disagrees with its thorough twin.

:data:`COST_MODEL_STREAMS` is the hostile corpus of the analysis's cost model (tags' Note [The cost
model]: late fills and cycles, top-down chains, memo DAGs hashed as keys and members, nesting at MAX_DEPTH and
MAX_UNPROTECTED_DEPTH, long names, TUPLE2/3 over short frames, NEWOBJ_EX keyword dicts), each on both sides of
its bound; mutated copies of it must also raise only this library's errors (fuzz/fuzz_snapshot.py seeds its
mutations with it too).
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
from tests.internals import check_stream, semantics, tags, walk_stream
from tests.internals import format as fmt

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
            stack.append(memo.get(arg))  # type: ignore[arg-type]
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


@pytest.mark.slow
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


def _dag(levels: int, base: bytes = b")") -> bytes:
    """t_0 = base, t_i = (t_{i-1}, t_{i-1}) through the memo (t_{levels} on the stack, memo 0..levels-1)."""
    out = base
    for i in range(levels):
        out += b"\x94" + (b"h" + bytes([i]) if i < 256 else b"j" + i.to_bytes(4, "little")) + b"\x86"
    return out


def _deques(n: int) -> bytes:
    cls = b"\x8c\x0bcollections\x8c\x05deque\x93"
    return (cls + b")R") * n + cls + b")R" + b"a" * n


def _defaultdicts(n: int) -> bytes:
    made = b"\x8c\x0bcollections\x8c\x0bdefaultdict\x93N\x85R"
    return (made + b"K\x00") * n + made + b"s" * n


_DEPTH = tags.MAX_DEPTH
_UNPROTECTED = tags.MAX_UNPROTECTED_DEPTH
_NAME = tags.MAX_NAME_LENGTH
_OBJ = b"cbuiltins\nobject\n"
COST_MODEL_STREAMS = {
    name: b"\x80\x05" + body + b"."
    for name, body in {
        "self-append": b"]\x94h\x00a",
        "self-append-twice": b"]\x94h\x00ah\x00a",
        "fill-after-nesting": b"]\x94]h\x00a0h\x00Na",
        "setitem-after-nesting": b"}\x94]h\x00a0h\x00NNs",
        "additems-after-nesting": b"\x8f\x94]h\x00a0h\x00(N\x90",
        "build-after-nesting": _OBJ + b")R\x94]h\x00a0h\x00}b",
        "top-down-lists": b"]\x94]\x94a0h\x01]\x94a0h\x02]a0h\x00",
        "top-down-deques": b"\x8c\x0bcollections\x8c\x05deque\x93\x94)R\x94h\x00)R\x94a0h\x02h\x00)Ra0h\x01",
        "dag-key": b"}" + _dag(40) + b"Ns",
        "dag-member": b"(" + _dag(40) + b"\x91",
        "dag-set": b"\x8f(" + _dag(40) + b"\x90",
        "dag-dict": b"(" + _dag(40) + b"Nd",
        "dag-kwargs": _OBJ + b")(" + _dag(40) + b"Nd\x92",
        "dag-not-hashed": b"]" + _dag(40) + b"a",
        "repeated-key": b"}" + _dag(12, b"\x8c\x01s") + b"\x94Ns" + b"h\x0cNs" * 300,
        "repeated-key-ok": b"}" + _dag(12, b"\x8c\x01s") + b"\x94Ns" + b"h\x0cNs" * 100,
        "colliding-keys": b"}(" + b"".join(b"G" + i.to_bytes(8, "big") + b"N"
                                           for i in range(9000)) + b"u",
        "deep-tuple-ok": b"N" + b"\x85" * _DEPTH,
        "deep-tuple": b"N" + b"\x85" * (_DEPTH + 1),
        "deep-list": b"(" * (_DEPTH + 1) + b"N" + b"l" * (_DEPTH + 1),
        "deques-ok": _deques(_UNPROTECTED - 2),
        "deques": _deques(_UNPROTECTED + 1),
        "defaultdicts-ok": _defaultdicts(_UNPROTECTED - 2),
        "defaultdicts": _defaultdicts(_UNPROTECTED + 1),
        "long-module": b"c" + b"m" * (_NAME + 1) + b"\nx\n",
        "long-qualname": b"ctorch\n" + b"x." * (_NAME // 2 + 1) + b"\n",
        "long-names-ok": b"c" + b"m" * _NAME + b"\n" + b"x" * _NAME + b"\n",
        "long-unicode": b"\x8c\x01mX\x02\x08\x00\x00" + "\u00e9".encode() * (_NAME + 1) + b"\x93",
        "long-escaped": b"Vm\nV" + b"\\u00e9" * (_NAME + 1) + b"\n\x93",
        "tuple2-short-frame": b"N(N\x86t",
        "tuple3-short-frame": b"NN(N\x87l0",
        "newobj-ex-kwargs": _OBJ + b")}(\x8c\x01kNu\x92",
    }.items()
}  # fmt: skip


# The corpus's streams the analysis admits (the allow-list may still refuse them); it refuses all the others.
ADMITTED = {"self-append", "dag-not-hashed", "repeated-key-ok", "deep-tuple-ok", "deques-ok", "defaultdicts-ok",
            "long-names-ok", "newobj-ex-kwargs"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(COST_MODEL_STREAMS))
def test_the_cost_model_corpus_raises_only_library_errors(name: str) -> None:
    stream = COST_MODEL_STREAMS[name]
    assert judge(check_stream, stream) == judge(lambda s: walk_stream(s).next_buffers, stream)
    try:
        check_stream(stream)
        semantics.analyze(stream)
    except (zp.SnapshotError, zp.RestrictedLoadError):
        assert name not in ADMITTED
    else:
        assert name in ADMITTED
    with contextlib.suppress(zp.ZeroCopyPickleError):
        zp.loads(as_snapshot(stream))


@SETTINGS
@given(name=st.sampled_from(sorted(COST_MODEL_STREAMS)), data=st.data())
def test_damaged_cost_model_streams_raise_only_library_errors(name: str, data: st.DataObject) -> None:
    stream = bytearray(COST_MODEL_STREAMS[name])
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(stream) - 1))
        if data.draw(st.booleans()):
            stream[position] = data.draw(st.integers(0, 255))
        else:
            stream[position:position] = data.draw(st.sampled_from([b"h\x00", b"\x94", b"a", b"s", b"0", b"\x86"]))
    damaged = bytes(stream[: data.draw(st.integers(0, len(stream)))] if data.draw(st.booleans()) else stream)
    assert judge(check_stream, damaged) == judge(lambda s: walk_stream(s).next_buffers, damaged)
    with contextlib.suppress(zp.ZeroCopyPickleError):
        zp.loads(as_snapshot(damaged))
