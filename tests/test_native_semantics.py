"""The native stream analysis (csrc/, ``analyze_stream``) against its Python reference
(:func:`zerocopy_pickle._trust.streamcheck.check_stream` then :func:`zerocopy_pickle._trust.semantics.analyze`).

The native pass must accept exactly the streams the Python checks accept, with the same :class:`StreamUses`,
and reject the others with a code that names the exception Python raises. Like tests/test_native.py, these
skip only where no C++ toolchain exists.
"""

from __future__ import annotations

import collections
import ctypes
import io
import mmap
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerocopy_pickle as zp
from tests.internals import semantics, streamcheck
from zerocopy_pickle import native
from zerocopy_pickle.errors import RestrictedLoadError, SnapshotError

from .conftest import TiedNet
from .test_native import _toolchain_missing

Analyzer = Callable[..., tuple[int, int, Any]]
OK, MALFORMED, REFUSED, TOO_DEEP, DEFER = range(5)


@pytest.fixture(scope="session")
def analyzer() -> Analyzer:
    """The native analysis, built into the cache if needed (skips only without a toolchain)."""
    missing = _toolchain_missing()
    if missing is not None:
        pytest.skip(f"native helpers cannot be built here: {missing}")
    try:
        native.build()
    except native.NativeBuildError as e:
        pytest.fail(f"a C++ toolchain is present but the native helpers do not build: {e}")
    with native.use("native"):
        found = native.stream_analyzer()
    assert found is not None
    return found


def python_verdict(stream: bytes) -> semantics.StreamUses | type[BaseException]:
    try:
        streamcheck.check_stream(stream)
        return semantics.analyze(stream)
    except Exception as e:  # anything else than the two errors is a bug the comparison reports
        return type(e)


def assert_agree(analyzer: Analyzer, stream: bytes, *, defer_ok: bool = True) -> int:
    """Compare the two verdicts on ``stream``; returns the native code. The native pass also runs with its
    collection of dead tags forced early and often (it must not change any result)."""
    code, offset, payload = analyzer(stream)
    assert analyzer(stream, collect_at=8)[:2] == (code, offset)
    expected = python_verdict(stream)
    if code == OK:
        assert isinstance(expected, semantics.StreamUses), (stream, expected)
        got = semantics._from_native(payload)
        assert got == expected, stream
        assert list(got.mutated) == list(expected.mutated)
    elif code in (MALFORMED, TOO_DEEP):
        assert expected is SnapshotError, (stream, code, offset, expected)
    elif code == REFUSED:
        assert expected is RestrictedLoadError, (stream, code, offset, expected)
    else:
        assert code == DEFER, code
        assert defer_ok, stream
        assert expected in (SnapshotError, RestrictedLoadError) or isinstance(expected, semantics.StreamUses)
    return int(code)


# ---------------------------------------------------------------------------------------------------------
# Real streams
# ---------------------------------------------------------------------------------------------------------


def zerocopy_stream(obj: object) -> bytes:
    out = io.BytesIO()
    zp.ZeroCopyPickler(out, buffer_callback=lambda b: False).dump(obj)
    return out.getvalue()


def _state_dict(n: int) -> collections.OrderedDict[str, torch.Tensor]:
    return collections.OrderedDict((f"layer{i}.weight", torch.zeros(2, 2)) for i in range(n))


def _objects() -> Iterator[tuple[str, object]]:
    torch.manual_seed(0)
    yield "state-dict", _state_dict(50)
    yield "module-state-dict", torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU()).state_dict()
    yield "tied-net", TiedNet()
    yield "tied-net-state", TiedNet().state_dict()
    yield "transformer", torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16)
    yield "parameter", torch.nn.Parameter(torch.ones(3))
    yield "frozen", torch.nn.Parameter(torch.ones(3), requires_grad=False)
    yield "sparse-coo", torch.eye(3).to_sparse()
    yield "sparse-csr", torch.eye(3).to_sparse_csr()
    yield "quantized", torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8)
    yield (
        "quantized-channel",
        torch.quantize_per_channel(torch.ones(2, 2), torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), 0, torch.qint8),
    )
    yield "views", [torch.arange(10)[2:5], torch.arange(10).view(2, 5).t()]
    yield "dtypes", {str(d): torch.zeros(2, dtype=d) for d in (torch.float16, torch.bfloat16, torch.int8, torch.bool)}
    nested: dict[str, Any] = {"a": [1, 2.5, "x", b"y", None, True], "b": (1, (2, (3,))), "c": {1, 2}}
    nested["d"] = frozenset({"z"})
    nested["e"] = bytearray(b"abc")
    nested["self"] = [nested["a"], nested["a"]]
    meta = collections.OrderedDict(w=torch.ones(1))
    meta._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    yield "nested", nested
    yield "ordered-dict-metadata", meta
    yield "unicode", {"\u00e9t\u00e9": "\ud800 lone surrogate", "emoji \U0001f600": 1}
    yield "big-ints", [2**100, -(2**70), 1 << 31, -1, 255, 65535]


OBJECTS = dict(_objects())


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_zerocopy_streams_agree(analyzer: Analyzer, name: str) -> None:
    stream = zerocopy_stream(OBJECTS[name])
    assert assert_agree(analyzer, stream, defer_ok=False) in (OK, REFUSED)


def _plain(obj: object) -> object:
    """A container graph pickle can write at every protocol (no tensors: their reductions need protocol 2)."""
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_plain(v) for v in obj)
    return obj


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("name", ["nested", "unicode", "big-ints", "state-dict", "ordered-dict-metadata"])
def test_plain_pickle_streams_agree_at_every_protocol(analyzer: Analyzer, protocol: int, name: str) -> None:
    obj = _plain(OBJECTS[name])
    stream = pickle.dumps(obj, protocol=protocol)
    assert assert_agree(analyzer, stream, defer_ok=False) == OK
    # And the graph with an OrderedDict and a class instance (REDUCE/NEWOBJ/BUILD at protocols 2+).
    stream = pickle.dumps([collections.OrderedDict(a=obj), collections.Counter("abc")], protocol=protocol)
    assert_agree(analyzer, stream, defer_ok=False)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_tensor_pickles_agree(analyzer: Analyzer, protocol: int) -> None:
    stream = pickle.dumps({"t": torch.arange(6).view(2, 3), "sd": _state_dict(3)}, protocol=protocol)
    assert assert_agree(analyzer, stream, defer_ok=False) == OK


def test_uses_agrees_between_backends() -> None:
    stream = zerocopy_stream(OBJECTS["tied-net"])
    with native.use("python"):
        semantics.forget()
        expected = semantics.uses(stream)
    try:
        with native.use("native"):
            semantics.forget()
            assert semantics.uses(stream) == expected
    except native.NativeBuildError:
        if _toolchain_missing() is None:
            raise
    finally:
        semantics.forget()


@pytest.mark.parametrize("backend", ["python", "native"])
def test_uses_refusals_carry_the_python_message(backend: str, analyzer: Analyzer) -> None:
    stream = b"\x80\x05cbuiltins\nobject\n)R}b}b."
    messages = []
    for name in ("python", backend):
        with native.use(name):
            semantics.forget()
            with pytest.raises(RestrictedLoadError) as info:
                semantics.uses(stream)
            messages.append(str(info.value))
    semantics.forget()
    assert messages[0] == messages[1]
    assert "a second BUILD" in messages[0]


# ---------------------------------------------------------------------------------------------------------
# Every refusal and bound
# ---------------------------------------------------------------------------------------------------------

G = b"cbuiltins\nobject\n"
SG = b"\x8c\x08builtins\x8c\x06object\x93"
DEEP = 5_000


def deques(n: int) -> bytes:
    """deque([deque([... n deep ...])]), each filled before it is nested (bottom-up, as pickle writes it): the
    outermost is n + 2 levels deep (a deque of an empty tuple is 2)."""
    deque = b"\x8c\x0bcollections\x8c\x05deque\x93\x94"
    stream = deque + b")R"
    for _ in range(n):
        stream = deque + b")R" + b"(" + stream + b"e"
    return stream + b"."


def defaultdicts(n: int) -> bytes:
    """defaultdict(None, {0: defaultdict(None, {0: ...})}) n deep, bottom-up."""
    made = b"\x8c\x0bcollections\x8c\x0bdefaultdict\x93N\x85R"
    stream = made
    for _ in range(n):
        stream = made + b"K\x00" + stream + b"s"
    return stream + b"."


def dag(k: int) -> bytes:
    """t0 = (); t_i = (t_{i-1}, t_{i-1}): 2**k elements from 5k bytes, memo entry k - 1 is t_{k-1}... (t_k on
    the stack, unmemoized)."""
    stream = b")"
    for i in range(k):
        stream += b"\x94h" + bytes([i]) + b"\x86"
    return stream


CASES: dict[str, tuple[bytes, int]] = {
    "reduce-on-a-list": (b"])R.", REFUSED),
    "reduce-on-a-result": (G + b")R)R.", REFUSED),
    "reduce-with-a-list": (G + b"]R.", REFUSED),
    "reduce-ok": (G + b")R.", OK),
    "stack-global-ok": (SG + b")R.", OK),
    "stack-global-memo": (b"\x8c\x08builtins\x94\x8c\x03int\x94\x93h\x00h\x01\x93\x86.", OK),
    "build-twice": (G + b")R}b}b.", REFUSED),
    "build-once": (G + b")R}b.", OK),
    "build-on-a-global": (G + b"}b.", REFUSED),
    "build-on-a-dict": (b"}}b.", REFUSED),
    "append-after-build": (G + b")R}bNa.", REFUSED),
    "appends-after-build": (G + b")R}b(Ne.", REFUSED),
    "additems-after-build": (G + b")R}b(N\x90.", REFUSED),
    "setitem-after-build": (G + b")R}bNNs.", OK),
    "setitems-after-build": (G + b")R}b(NNu.", OK),
    "append-on-a-dict": (b"}Na.", REFUSED),
    "setitem-on-a-list": (b"]NNs.", REFUSED),
    "additems-on-a-list": (b"](N\x90.", REFUSED),
    "append-on-a-result": (G + b")RNa.", OK),
    "dynamic-stack-global": (b"U\x08builtinsU\x06object\x93.", REFUSED),
    "stack-global-from-a-result": (G + b")R\x8c\x01x\x93.", REFUSED),
    "ext1": (b"\x82\x01.", REFUSED),
    "ext2": (b"\x83\x01\x00.", REFUSED),
    "ext4": (b"\x84\x01\x00\x00\x00.", REFUSED),
    "persid": (b"P1\n.", MALFORMED),
    "binpersid": (b"NQ.", MALFORMED),
    "odd-setitems": (b"}(Nu.", MALFORMED),
    "odd-dict": (b"(Nd.", MALFORMED),
    "newobj-on-a-list": (b"])\x81.", REFUSED),
    "newobj-ok": (G + b")\x81.", OK),
    "newobj-ex-ok": (G + b")}\x92.", OK),
    "newobj-ex-list-kwargs": (G + b")]\x92.", REFUSED),
    "newobj-ex-list-kwargs-alone": (b"NN(]\x921.", REFUSED),
    "obj-ok": (b"(" + G + b"No.", OK),
    "obj-on-nothing": (b"(o.", REFUSED),
    "obj-on-a-list": (b"(]o.", REFUSED),
    "inst": (b"(Nibuiltins\nobject\n.", OK),
    "inst-not-utf8": (b"(Nibuiltins\nob\xffject\n.", MALFORMED),
    "global-not-utf8": (b"cbuil\xfftins\nobject\n.", MALFORMED),
    "readonly-list": (b"]\x98.", REFUSED),
    "readonly-buffer": (b"\x97\x98.", OK),
    "readonly-bytes": (b"C\x01x\x98.", OK),
    "tuple2-short-frame": (b"N(N\x86.", MALFORMED),  # accepted by the analysis, the STOP then fails
    "tuple2-short-frame-closed": (b"N(N\x86t.", MALFORMED),
    "tuple3-over-a-mark": (b"NN(N\x87l00.", MALFORMED),  # as the C unpickler: "unexpected MARK found"
    "tuple2-on-an-empty-frame": (b"NN(\x86l0.", MALFORMED),
    "tuple2-over-a-mark": (b"NN(N\x86l0.", MALFORMED),
    "pop-the-mark": (b"N(0.", MALFORMED),  # the walk keeps the MARK (and refuses STOP), the analysis pops it
    "pop-below-mark": (b"N(00.", MALFORMED),
    "memoize-empty-frame": (b"N(\x94.", MALFORMED),
    "too-deep-tuple1": (b")" + b"\x85" * DEEP + b".", TOO_DEEP),
    "deep-tuple1-ok": (b")" + b"\x85" * (DEEP - 1) + b".", OK),
    # The cost model (tags' Note [The cost model]).
    "self-append": (b"]\x94" + b"h\x00a" * (DEEP + 1) + b".", REFUSED),  # filled after it was nested
    "self-append-once": (b"]\x94h\x00a.", OK),
    "self-append-twice": (b"]\x94h\x00ah\x00a.", REFUSED),
    "fill-after-nesting": (b"]\x94]h\x00a0h\x00Na.", REFUSED),
    "setitem-after-nesting": (b"}\x94]h\x00a0h\x00NNs.", REFUSED),
    "additems-after-nesting": (b"\x8f\x94]h\x00a0h\x00(N\x90.", REFUSED),
    "build-after-nesting": (G + b")R\x94]h\x00a0h\x00}b.", REFUSED),
    "top-down-chain": (b"]\x94]\x94a0h\x01]\x94a0h\x02]a.", REFUSED),
    "fill-before-nesting": (b"]\x94Na0]h\x00a.", OK),
    "key-at-max-key-depth": (b"})" + b"\x85" * 99 + b"Ns.", OK),
    "key-too-deep": (b"})" + b"\x85" * 100 + b"Ns.", TOO_DEEP),
    "dict-key-too-deep": (b"()" + b"\x85" * 100 + b"Nd.", TOO_DEEP),
    "set-member-too-deep": (b"\x8f()" + b"\x85" * 100 + b"\x90.", TOO_DEEP),
    "frozenset-member-too-deep": (b"()" + b"\x85" * 100 + b"\x91.", TOO_DEEP),
    "deep-value-not-key-ok": (b"}N)" + b"\x85" * 1000 + b"s.", OK),
    "deque-deep-ok": (deques(198), OK),
    "deque-too-deep": (deques(199), TOO_DEEP),
    "defaultdict-too-deep": (defaultdicts(199), TOO_DEEP),
    "defaultdict-deep-ok": (defaultdicts(198), OK),
    "deque-of-deep-args": (b"\x8c\x0bcollections\x8c\x05deque\x93" + b")" + b"\x85" * 200 + b"\x85R.", TOO_DEEP),
    "newobj-ex-deep-kwargs": (b"]" + G + b")(N)" + b"\x85" * (DEEP - 3) + b"d\x92a.", TOO_DEEP),
    "newobj-ex-kwargs-ok": (b"]" + G + b")(N)" + b"\x85" * (DEEP - 4) + b"d\x92a.", OK),
    "hash-dag-key": (b"}" + dag(40) + b"Ns.", TOO_DEEP),
    "hash-dag-member": (b"(" + dag(40) + b"\x91.", TOO_DEEP),
    "hash-dag-dict-key": (b"(" + dag(40) + b"Nd.", TOO_DEEP),
    "hash-dag-additems": (b"\x8f(" + dag(40) + b"\x90.", TOO_DEEP),
    "dag-not-hashed": (b"]" + dag(40) + b"a.", OK),
    "hash-repeated-key": (b"}" + dag(12) + b"Ns" + b"h\x0bNs" * 300 + b".", TOO_DEEP),
    "hash-small-keys": (b"}" + dag(12) + b"Ns" + b"h\x0bNs" * 100 + b".", OK),
    "chosen-hash-keys": (
        b"}(" + b"".join(b"G%sN" % i.to_bytes(8, "big") for i in range(9000)) + b"u.",
        TOO_DEEP,
    ),
    "chosen-hash-keys-ok": (b"}(" + b"".join(b"G%sN" % i.to_bytes(8, "big") for i in range(8000)) + b"u.", OK),
    "known-hash-keys": (b"}(" + b"".join(b"J%sN" % i.to_bytes(4, "little") for i in range(20000)) + b"u.", OK),
    "chosen-tuple-members": (
        b"(" + b"".join(b"J%sK\x01\x86" % i.to_bytes(4, "little") for i in range(9000)) + b"\x91.",
        TOO_DEEP,
    ),
    "secret-tuple-members": (
        b"(" + b"".join(b"J%s\x8c\x01x\x86" % i.to_bytes(4, "little") for i in range(20000)) + b"\x91.",
        OK,
    ),
    "chosen-setitem-keys": (
        b"}" + b"".join(b"\x8a\x08%sNs" % i.to_bytes(8, "little") for i in range(9000)) + b".",
        TOO_DEEP,
    ),
    "long1-short-keys": (b"}" + b"".join(b"\x8a\x07%sNs" % i.to_bytes(7, "little") for i in range(20000)) + b".", OK),
    "text-int-keys": (b"}" + b"".join(b"I%d\nNs" % (10**16 + i) for i in range(9000)) + b".", TOO_DEEP),
    "text-int-short-keys": (b"}" + b"".join(b"I%d\nNs" % i for i in range(20000)) + b".", OK),
    "result-keys": (b"}" + b"".join(G + b")RNs" for _ in range(9000)) + b".", TOO_DEEP),
    "big-int-key-repeated": (
        b"}\x8b\x00\x00\x10\x00" + b"\x07" * (1 << 20) + b"\x94Ns" + b"h\x00Ns" * 40 + b".",
        TOO_DEEP,
    ),
    "big-int-key-once": (b"}\x8b\x00\x00\x10\x00" + b"\x07" * (1 << 20) + b"Ns.", OK),
    # A frozenset XORs its members' hashes: a secret member common to all cancels out.
    "chosen-frozenset-keys": (
        b"}(" + b"".join(b"(\x8c\x01sJ%s\x91N" % i.to_bytes(4, "little") for i in range(9000)) + b"u.",
        TOO_DEEP,
    ),
    "secret-frozenset-keys": (b"}(" + b"".join(b"(\x8c\x06%06d\x91N" % i for i in range(20000)) + b"u.", OK),
    "long-module-name": (b"c" + b"m" * 1025 + b"\nx\n.", MALFORMED),
    "long-qualname": (b"cm\n" + b"x" * 1025 + b"\n.", MALFORMED),
    "long-names-ok": (b"c" + b"m" * 1024 + b"\n" + b"x" * 1024 + b"\n.", OK),
    "long-stack-global-name": (b"\x8c\x01mX\x01\x04\x00\x00" + b"x" * 1025 + b"\x93.", MALFORMED),
    "long-unicode-name-ok": (b"\x8c\x01mX\x00\x08\x00\x00" + "\u00e9".encode() * 1024 + b"\x93.", OK),
    "long-unicode-name": (b"\x8c\x01mX\x02\x08\x00\x00" + "\u00e9".encode() * 1025 + b"\x93.", MALFORMED),
    "unicode-escape": (b"Vbuiltins\nVobj\\u0065ct\n\x93.", OK),
    "bad-unicode-escape": (b"V\\u12\n.", MALFORMED),
    "surrogate": (b"\x8c\x03\xed\xa0\x80.", OK),
    "bad-utf8": (b"\x8c\x01\xff.", MALFORMED),
    "memo-bomb": (b"N\x72\xff\xff\xff\x7f.", MALFORMED),
    "memo-unwritten": (b"h\x00.", MALFORMED),
    "memo-text": (b"Np0\n0g0\n.", OK),
    "memo-text-signed": (b"Np+0\n.", DEFER),
    "mark-bomb": (b"(" * 50_001 + b".", MALFORMED),
    "marks-ok": (b"(" * 50_000 + b"1" * 50_000 + b"N.", OK),
    "absurd-length": (b"X\xff\xff\xff\xff.", MALFORMED),
    "absurd-length8": (b"\x8e" + b"\xff" * 8 + b".", MALFORMED),
    "negative-binstring": (b"T\xff\xff\xff\xff.", MALFORMED),
    "negative-long4": (b"\x8b\xff\xff\xff\xff.", MALFORMED),
    "frame-past-the-end": (b"\x95\xff\x00\x00\x00\x00\x00\x00\x00N.", MALFORMED),
    "bytes-after-stop": (b"N.N", MALFORMED),
    "no-stop": (b"N", MALFORMED),
    "empty": (b"", MALFORMED),
    "stop-with-two": (b"NN.", MALFORMED),
    "unknown-opcode": (b"\xffN.", MALFORMED),
    "refusal-then-malformed": (b"])RN\xff.", MALFORMED),
    "refusal-then-bad-stop": (b"])R.N", MALFORMED),
    "odd-setitems-then-refusal": (b"}(Nu\x82\x01.", MALFORMED),
    "dup-bomb": (b"N" + b"2" * (1 << 20) + b".", MALFORMED),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_refusals_and_bounds_agree(analyzer: Analyzer, name: str) -> None:
    stream, expected = CASES[name]
    assert assert_agree(analyzer, stream) == expected


# ---------------------------------------------------------------------------------------------------------
# Hypothesis: mutated real streams, random opcode sequences
# ---------------------------------------------------------------------------------------------------------

SEEDS = [
    zerocopy_stream(OBJECTS["tied-net"]),
    zerocopy_stream(OBJECTS["ordered-dict-metadata"]),
    zerocopy_stream(OBJECTS["quantized"]),
    pickle.dumps(_plain(OBJECTS["nested"]), protocol=0),
    pickle.dumps(_plain(OBJECTS["nested"]), protocol=2),
    pickle.dumps([collections.OrderedDict(a=1), collections.Counter("ab")], protocol=1),
]

SNIPPETS = [
    b"(", b")", b"]", b"}", b"\x8f", b"N", b"\x88", b"K\x01", b"M\x01\x02", b"J\x01\x02\x03\x04",
    b"G" + b"\x00" * 8, b"\x8a\x01\x05", b"\x8b\x01\x00\x00\x00\x05", b"\x8c\x08builtins", b"\x8c\x03set",
    b"\x8c\x01\xff", b"X\x04\x00\x00\x00dict", b"U\x03abc", b"C\x01x", b"B\x01\x00\x00\x00y", b"\x96" + b"\x00" * 8,
    b"\x93", b"R", b"b", b"a", b"e", b"s", b"u", b"\x90", b"t", b"l", b"d", b"\x91", b"\x85", b"\x86", b"\x87",
    b"\x94", b"h\x00", b"h\x01", b"j\x00\x00\x00\x00", b"q\x00", b"q\x01", b"r\x01\x00\x00\x00", b"2", b"0",
    b"1", b"\x81", b"\x92", b"o", b"cbuiltins\nlist\n", b"ibuiltins\nset\n", b"c\xff\n\n", b"\x97", b"\x98",
    b"\x82\x01", b"P1\n", b"Q", b"p0\n", b"p1\n", b"g0\n", b"p-1\n", b"Vabc\n", b"V\\u12\n", b"Vset\n", b"I1\n",
    b"L1L\n", b"F1.5\n", b"S'a'\n", b"\x80\x05", b"\x95\x00\x00\x00\x00\x00\x00\x00\x00", b".", b"\xfe",
]  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    parts=st.lists(st.sampled_from(SNIPPETS), max_size=40),
    stop=st.booleans(),
)
def test_random_opcode_sequences_agree(analyzer: Analyzer, parts: list[bytes], stop: bool) -> None:
    assert_agree(analyzer, b"".join(parts) + (b"." if stop else b""))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.sampled_from(range(len(SEEDS))),
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate", "snippet"]), st.integers(0, 1 << 30),
                  st.integers(0, 255), st.sampled_from(SNIPPETS)),
        min_size=1,
        max_size=4,
    ),
)  # fmt: skip
def test_mutated_real_streams_agree(analyzer: Analyzer, seed: int, edits: list[tuple[str, int, int, bytes]]) -> None:
    data = bytearray(SEEDS[seed])
    for kind, where, byte, snippet in edits:
        at = where % (len(data) + 1)
        if kind == "flip" and at < len(data):
            data[at] = byte
        elif kind == "insert":
            data[at:at] = bytes([byte])
        elif kind == "delete":
            del data[at : at + 1 + byte % 4]
        elif kind == "truncate":
            del data[at:]
        elif kind == "snippet":
            data[at:at] = snippet
    assert_agree(analyzer, bytes(data))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=64))
def test_random_bytes_agree(analyzer: Analyzer, data: bytes) -> None:
    assert_agree(analyzer, data)


def test_native_takes_any_buffer(analyzer: Analyzer) -> None:
    stream = zerocopy_stream(OBJECTS["tied-net"])
    assert analyzer(bytearray(stream)) == analyzer(memoryview(stream)) == analyzer(stream)


def test_no_read_past_the_end(analyzer: Analyzer) -> None:
    """Every stream (and every prefix of real ones) ends right where an unreadable page begins: a read past the
    end would crash the process instead of passing unnoticed in the slack of a bytes object."""
    page = mmap.PAGESIZE
    span = 16 * page
    region = mmap.mmap(-1, span + page, flags=mmap.MAP_PRIVATE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    anchor = ctypes.c_char.from_buffer(region)
    guard = ctypes.addressof(anchor) + span
    assert libc.mprotect(guard, page, 0) == 0  # PROT_NONE
    try:
        streams = [s for s, _ in CASES.values() if len(s) <= span]
        for seed in SEEDS:
            streams += [seed[:n] for n in range(0, min(len(seed), span) + 1, 7)]
        view = memoryview(region)
        for stream in streams:
            at = span - len(stream)
            region[at:span] = stream
            assert analyzer(view[at:span]) == analyzer(stream)
        view.release()
    finally:
        assert libc.mprotect(guard, page, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        del anchor


def test_python_backend_has_no_analyzer() -> None:
    with native.use("python"):
        assert native.stream_analyzer() is None
        assert semantics._native_uses(b"N.") is None


def test_native_errors_fall_back_to_python(analyzer: Analyzer) -> None:
    with native.use("native"):
        assert semantics._native_uses(b"N.") == python_verdict(b"N.")
        for stream in (b"])R.", b"N", b"Np+0\n."):
            assert semantics._native_uses(stream) is None


_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8), st.binary(max_size=8)
)
_graphs = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=4), inner, max_size=5),
        st.frozensets(st.integers(), max_size=4),
        st.dictionaries(st.text(max_size=4), inner, max_size=3).map(collections.OrderedDict),
        st.lists(inner, max_size=3).map(collections.deque),
    ),
    max_leaves=25,
)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(graph=_graphs, protocol=st.integers(0, pickle.HIGHEST_PROTOCOL), shared=st.booleans())
def test_random_object_graphs_agree(analyzer: Analyzer, graph: object, protocol: int, shared: bool) -> None:
    obj = [graph, graph] if shared else graph  # shared: the memo's GET/BINGET paths
    assert_agree(analyzer, pickle.dumps(obj, protocol=protocol), defer_ok=False)


@pytest.mark.parametrize(
    "stream",
    [
        b"]0" * 100_000 + b"N.",  # dead lists
        b"\x8c\x01a0" * 100_000 + b"\x8c\x02\xc3\xa90" * 1000 + b"N.",  # dead strings (ASCII, decoded)
        b"\x8c\x08builtins\x94\x8c\x04list\x9400" + b"]0" * 70_000 + b"h\x00h\x01\x93)R.",  # names kept by the memo
        b"]\x94" + b"]0h\x00" * 40_000 + b"(" + b"h\x00" * 10 + b"e" + b"0" * 40_000 + b".",  # one list, many aliases
    ],
    ids=["lists", "strings", "memo", "aliases"],
)
def test_dead_tags_are_collected_without_changing_the_result(analyzer: Analyzer, stream: bytes) -> None:
    assert assert_agree(analyzer, stream, defer_ok=False) == OK
    assert analyzer(stream) == analyzer(stream, collect_at=1 << 30) == analyzer(stream, collect_at=8)
