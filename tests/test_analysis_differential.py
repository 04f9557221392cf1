"""Differential fuzz of the stream analysis: Python (:func:`zerocopy_pickle._trust.semantics.analyze`, after
:func:`zerocopy_pickle._trust.streamcheck.check_stream`) against its native twin (``analyze_stream`` in
csrc/zerocopy_native.cpp), on streams aimed at the cost model's rules (tags' Note [The cost model]).

Each generator writes streams near one rule's edge, on both sides of it:

* late fills: containers, call results and objects memoized, nested, fetched from the memo and filled
  (APPEND(S), SETITEM(S), ADDITEMS, BUILD), or filled first and nested after, in random orders;
* memo DAGs hashed by SETITEM(S), DICT, ADDITEMS, FROZENSET and NEWOBJ_EX's keyword dict, repeated through
  the memo, with counts around the hashing budget and the collision budget;
* deque and defaultdict chains around MAX_UNPROTECTED_DEPTH, by REDUCE, NEWOBJ, OBJ, INST and BUILD, with
  other containers between the levels;
* nesting around MAX_DEPTH by a mix of wrappers (TUPLE1/2/3, MARK..TUPLE/LIST/FROZENSET/DICT, APPEND,
  SETITEM, REDUCE, BUILD, NEWOBJ_EX keyword dicts);
* names around MAX_NAME_LENGTH characters by GLOBAL, INST and STACK_GLOBAL of SHORT_BINUNICODE, BINUNICODE,
  BINUNICODE8 and UNICODE (raw-unicode-escape) strings, ASCII, multi-byte UTF-8, escapes and surrogates;
* TUPLE1/2/3 over frames with too few items, then whatever closes the frame;
* and the random opcode programs of tests/test_opcode_programs.py, as written and with a few bytes changed.

The verdicts must agree (:func:`tests.test_native_semantics.assert_agree`: the same StreamUses, or the native
code naming the exception Python raises). Bounded for CI (hypothesis, at most 300 examples each, no deadline);
skipped only where no C++ toolchain exists (the ``analyzer`` fixture).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.internals import tags

from .test_native_semantics import OK, Analyzer, analyzer, assert_agree
from .test_opcode_programs import programs, write

__all__ = ["analyzer"]  # the fixture, imported for pytest

SETTINGS = settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
SMALL = settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))

MAX_DEPTH = tags.MAX_DEPTH
MAX_UNPROTECTED = tags.MAX_UNPROTECTED_DEPTH
MAX_NAME = tags.MAX_NAME_LENGTH
PROTO = b"\x80\x05"


def glob(module: str, qualname: str) -> bytes:
    return b"c" + module.encode() + b"\n" + qualname.encode() + b"\n"


def get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def put(index: int) -> bytes:
    return b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)


def binunicode(text: str, width: int = 4) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    if width == 1:
        return b"\x8c" + bytes([len(raw) % 256]) + raw[:255]
    if width == 8:
        return b"\x8d" + struct.pack("<Q", len(raw)) + raw
    return b"X" + struct.pack("<I", len(raw)) + raw


def unicode_line(text: str) -> bytes:
    return b"V" + text.replace("\\", "\\u005c").replace("\n", "\\u000a").encode("raw-unicode-escape") + b"\n"


OBJECT = glob("builtins", "object")
DEQUE = glob("collections", "deque")
DEFAULTDICT = glob("collections", "defaultdict")
ORDERED = glob("collections", "OrderedDict")

# ---------------------------------------------------------------------------------------------------------
# Late fills: a random program over a few containers and the memo
# ---------------------------------------------------------------------------------------------------------

# What pushes an empty fillable value, and how it is filled with one pushed item.
EMPTIES = {
    "list": b"]",
    "dict": b"}",
    "set": b"\x8f",
    "deque": DEQUE + b")R",
    "defaultdict": DEFAULTDICT + b")R",
    "ordered": ORDERED + b")\x81",
    "object": OBJECT + b")R",
    "obj": b"(" + ORDERED + b"o",
    "inst": b"(icollections\nOrderedDict\n",
}
FILLS = {
    "append": (b"", b"a"),
    "appends": (b"(", b"e"),
    "setitem": (b"K\x07", b"s"),
    "setitems": (b"(K\x07", b"u"),
    "additems": (b"(", b"\x90"),
    "build": (b"", b"b"),
    "build-slots": (b"(N", b"tb"),
}


# The fills that suit each kind of value (a stream mostly fills what it may, so the refusal is about order).
SUITED = {
    "list": ["append", "appends"],
    "dict": ["setitem", "setitems"],
    "set": ["additems"],
    "deque": ["append", "appends"],
    "defaultdict": ["setitem", "setitems", "build"],
    "ordered": ["setitem", "setitems", "build", "build-slots"],
    "object": ["build", "build-slots"],
    "obj": ["setitem", "build"],
    "inst": ["setitems", "build-slots"],
    "leaf": sorted(FILLS),
}


@st.composite
def late_fill_streams(draw: st.DrawFn) -> bytes:
    """Up to 16 steps over a stack of values and a memo of them: push an empty value (memoized), fetch one from
    the memo, put the top into the one below (mostly by a fill that suits it), nest the top in a
    tuple/frozenset, pop. Then everything left is put into one list and the stream stops."""
    out = bytearray(PROTO)
    memo: list[str] = []
    stack: list[str] = []
    for _ in range(draw(st.integers(1, 16))):
        step = draw(st.sampled_from(["empty", "empty", "get", "get", "fill", "fill", "fill", "nest", "pop", "leaf"]))
        if step == "empty" or not stack:
            kind = draw(st.sampled_from(sorted(EMPTIES)))
            out += EMPTIES[kind] + b"\x94"
            memo.append(kind)
            stack.append(kind)
        elif step == "get" and memo:
            index = draw(st.integers(0, len(memo) - 1))
            out += get(index)
            stack.append(memo[index])
        elif step == "leaf":
            out += draw(st.sampled_from([b"N", b"K\x01", b"\x8c\x01a", b"G" + bytes(8), b")", b"(K\x01K\x02t"]))
            stack.append("leaf")
        elif step == "fill" and len(stack) >= 2:
            target = stack[-2]
            fill = draw(st.sampled_from(SUITED[target] if draw(st.integers(0, 4)) else sorted(FILLS)))
            before, after = FILLS[fill]
            if before:  # the item is on top: memoize it, pop it, open the fill's frame, fetch it back
                out += b"\x94" + b"0" + before + get(len(memo))
                memo.append(stack[-1])
            out += after
            stack.pop()
        elif step == "nest":
            if draw(st.booleans()):
                out += draw(st.sampled_from([b"\x85", b"N\x86", b"NN\x87"]))
            else:
                out += b"\x94" + b"0" + b"(" + get(len(memo)) + b"\x91"
                memo.append(stack[-1])
            stack[-1] = "leaf"
        elif step == "pop" and len(stack) >= 2:
            out += b"0"
            stack.pop()
    if len(stack) > 1:  # gather the values left into one list: MARK cannot go under them, so memoize and refetch
        indices = []
        for kind in stack:
            out += b"\x94" + b"0"
            indices.append(len(memo))
            memo.append(kind)
        out += b"(" + b"".join(get(i) for i in reversed(indices)) + b"l"
    return bytes(out + b".")


@SETTINGS
@given(stream=late_fill_streams())
def test_late_fills_agree(analyzer: Analyzer, stream: bytes) -> None:
    assert_agree(analyzer, stream)


# ---------------------------------------------------------------------------------------------------------
# Memo DAGs and the hashing budgets
# ---------------------------------------------------------------------------------------------------------

DAG_BASES = [b"N", b"K\x05", b"\x8c\x01s", b"G" + bytes(8), b"\x8a\x08" + bytes(7) + b"\x01", b")", b"C\x01b",
             OBJECT + b")R", b"\x97"]  # fmt: skip
HASHERS = ["setitem", "setitems", "dict", "additems", "frozenset", "newobj_ex", "setitem-result"]


def dag(base: bytes, levels: int, op: str, first: int) -> tuple[bytes, int]:
    """``base``, then ``levels`` times: memoize and pair (TUPLE2), triple (TUPLE3) or list it with itself.
    Returns the stream and the memo size after it (``first`` entries existed before)."""
    out = bytearray(base)
    memo = first
    for _ in range(levels):
        out += b"\x94"
        if op == "tuple2":
            out += get(memo) + b"\x86"
        elif op == "tuple3":
            out += get(memo) * 2 + b"\x87"
        elif op == "mark-tuple":
            out += b"0(" + get(memo) * 4 + b"t"
        else:
            out += b"0(" + get(memo) * 2 + b"\x91"
        memo += 1
    return bytes(out), memo


@st.composite
def hashing_streams(draw: st.DrawFn) -> bytes:
    """A key (a DAG of ``levels`` over a base) hashed ``count`` times through the memo by one of HASHERS, with
    counts picked around the hashing budget (HASH_FLOOR over the key's size) and the collision one."""
    levels = draw(st.one_of(st.integers(0, 4), st.integers(8, 14), st.integers(18, 21), st.integers(38, 64)))
    op = draw(st.sampled_from(["tuple2", "tuple3", "mark-tuple", "frozenset"]))
    key, memo = dag(draw(st.sampled_from(DAG_BASES)), levels, op, 0)
    width = {"tuple2": 2, "tuple3": 3, "mark-tuple": 4, "frozenset": 2}[op]
    size = (width ** (levels + 1) - 1) // (width - 1) if width > 1 else levels + 1
    near_budget = max(1, tags.HASH_FLOOR // max(size, 1))
    near_collisions = int((2 * tags.COLLISION_FLOOR / max(size, 1)) ** 0.5) if size < 1 << 24 else 1
    count = draw(
        st.one_of(
            st.integers(1, 3),
            st.integers(max(1, near_budget - 2), near_budget + 2),
            st.integers(max(1, near_collisions - 2), near_collisions + 2),
        )
    )
    count = min(count, 12_000)  # keeps the stream under about 60 KB
    how = draw(st.sampled_from(HASHERS))
    key_at = memo
    value = b"N"
    if how in ("setitem", "setitems", "setitem-result"):
        head = b"}" if how != "setitem-result" else ORDERED + b")R"
        out = head + key + b"\x94" + value
        if how == "setitems":
            out = head + b"(" + key + b"\x94" + value + (get(key_at) + value) * (count - 1) + b"u"
        else:
            out += b"s" + (get(key_at) + value + b"s") * (count - 1)
    elif how == "dict":
        out = b"(" + key + b"\x94" + value + (get(key_at) + value) * (count - 1) + b"d"
    elif how == "additems":
        out = b"\x8f(" + key + b"\x94" + get(key_at) * (count - 1) + b"\x90"
    elif how == "frozenset":
        out = b"(" + key + b"\x94" + get(key_at) * (count - 1) + b"\x91"
    else:  # NEWOBJ_EX with the keys in its keyword dict
        out = OBJECT + b")(" + key + b"\x94" + value + (get(key_at) + value) * (count - 1) + b"d\x92"
    return PROTO + out + b"."


@SETTINGS
@given(stream=hashing_streams())
def test_hashed_memo_dags_agree(analyzer: Analyzer, stream: bytes) -> None:
    assert_agree(analyzer, stream)


@st.composite
def many_keys_streams(draw: st.DrawFn) -> bytes:
    """Distinct keys of chosen or secret hash (tuples of small ints, floats, large ints, strings, results) in
    one dict or set, by the thousands: the collision budget's edge."""
    kind = draw(st.sampled_from(["pair", "float", "long", "str", "result", "mixed"]))
    count = draw(st.one_of(st.integers(1, 20), st.integers(8100, 8300)))
    keys = []
    for i in range(count):
        k = kind if kind != "mixed" else ("pair", "float", "str")[i % 3]
        if k == "pair":
            keys.append(b"M" + struct.pack("<H", i) + b"K\x00\x86")
        elif k == "float":
            keys.append(b"G" + struct.pack(">d", float(i)))
        elif k == "long":
            keys.append(b"\x8a\x08" + struct.pack("<q", (1 << 60) + i))
        elif k == "str":
            keys.append(binunicode(str(i), 1))
        else:
            keys.append(OBJECT + b")R")
    how = draw(st.sampled_from(["dict", "set", "frozenset"]))
    if how == "dict":  # every key with None as its value
        return PROTO + b"}(" + b"N".join(keys) + b"Nu."
    if how == "set":
        return PROTO + b"\x8f(" + b"".join(keys) + b"\x90."
    return PROTO + b"(" + b"".join(keys) + b"\x91."


@pytest.mark.slow
@SMALL
@given(stream=many_keys_streams())
def test_many_keys_agree(analyzer: Analyzer, stream: bytes) -> None:
    assert_agree(analyzer, stream)


# ---------------------------------------------------------------------------------------------------------
# Nesting: MAX_DEPTH and MAX_UNPROTECTED_DEPTH
# ---------------------------------------------------------------------------------------------------------

# A wrapper puts the value built between its prefix and its suffix into a new value.
WRAPPERS: dict[str, tuple[bytes, bytes]] = {
    "tuple1": (b"", b"\x85"),
    "tuple2": (b"N", b"\x86"),
    "tuple3": (b"NN", b"\x87"),
    "mark-tuple": (b"(", b"t"),
    "mark-list": (b"(", b"l"),
    "mark-frozenset": (b"(", b"\x91"),
    "mark-dict": (b"(N", b"d"),
    "append": (b"]", b"a"),
    "appends": (b"](", b"e"),
    "setitem": (b"}N", b"s"),
    "additems": (b"\x8f(", b"\x90"),
    "reduce": (OBJECT + b"(", b"tR"),
    "newobj": (OBJECT + b"(", b"t\x81"),
    "newobj-ex-kwargs": (OBJECT + b")(N", b"d\x92"),
    "build": (OBJECT + b")R", b"b"),
    "obj": (b"(" + OBJECT, b"o"),
    "inst": (b"(", b"ibuiltins\nobject\n"),
    "deque": (DEQUE + b"(", b"tR"),
    "deque-append": (DEQUE + b")R", b"a"),
    "deque-newobj": (DEQUE + b"(", b"t\x81"),
    "defaultdict": (DEFAULTDICT + b")RN", b"s"),
    "defaultdict-args": (DEFAULTDICT + b"(N}(N", b"dtR"),
    "defaultdict-build": (DEFAULTDICT + b")R", b"b"),
    "defaultdict-inst": (b"(N}(N", b"dicollections\ndefaultdict\n"),
}
UNPROTECTED_WRAPPERS = [name for name in WRAPPERS if name.startswith(("deque", "defaultdict"))]
CORES = [b"N", b")", b"]", b"}", b"\x8f", b"\x8c\x01x", b"(t", OBJECT + b")R", DEQUE + b")R", DEFAULTDICT + b")R"]


@st.composite
def nesting_streams(draw: st.DrawFn) -> bytes:
    """A core value wrapped by up to 4 runs of wrappers whose lengths add up to a target around MAX_DEPTH or,
    with a deque/defaultdict wrapper among them, around MAX_UNPROTECTED_DEPTH."""
    unprotected = draw(st.booleans())
    names = st.sampled_from(sorted(WRAPPERS))
    runs = draw(st.lists(names, min_size=1, max_size=4))
    if unprotected:
        runs.append(draw(st.sampled_from(UNPROTECTED_WRAPPERS)))
        target = draw(st.integers(MAX_UNPROTECTED - 4, MAX_UNPROTECTED + 3))
    else:
        target = draw(st.integers(MAX_DEPTH - 4, MAX_DEPTH + 3))
    counts = [draw(st.integers(0, target)) for _ in runs[:-1]]
    counts = [min(c, max(0, target - sum(counts[:i]))) for i, c in enumerate(counts)]
    counts.append(max(0, target - sum(counts)))
    draw(st.randoms()).shuffle(order := list(zip(runs, counts, strict=True)))
    prefix = bytearray()
    suffix = bytearray()
    for name, count in order:
        prefix += WRAPPERS[name][0] * count
    for name, count in reversed(order):
        suffix += WRAPPERS[name][1] * count
    return PROTO + bytes(prefix) + draw(st.sampled_from(CORES)) + bytes(suffix) + b"."


@pytest.mark.slow
@SETTINGS
@given(stream=nesting_streams())
def test_nesting_around_the_bounds_agrees(analyzer: Analyzer, stream: bytes) -> None:
    assert_agree(analyzer, stream)


# ---------------------------------------------------------------------------------------------------------
# Names around MAX_NAME_LENGTH
# ---------------------------------------------------------------------------------------------------------

CHARS = ["a", ".", "_", "\u00e9", "\u4e2d", "\U0001f600", "\\", "\n", "\ud800", "\udfff", "\x00", "\u0085"]


@st.composite
def names(draw: st.DrawFn) -> str:
    length = draw(st.one_of(st.integers(MAX_NAME - 3, MAX_NAME + 3), st.integers(0, 8), st.just(3 * MAX_NAME)))
    pieces = draw(st.lists(st.sampled_from(CHARS), min_size=1, max_size=4))
    text = "".join(pieces)
    return (text * (length // len(text) + 1))[:length]


@st.composite
def name_streams(draw: st.DrawFn) -> bytes:
    """One global named by GLOBAL, INST or STACK_GLOBAL (strings by SHORT_BINUNICODE, BINUNICODE, BINUNICODE8 or
    UNICODE, directly or from the memo), its module and qualname drawn by :func:`names`, then called."""
    module = draw(st.one_of(names(), st.sampled_from(["builtins", "collections", "torch"])))
    qualname = draw(st.one_of(names(), st.sampled_from(["object", "OrderedDict", "x"])))
    how = draw(st.sampled_from(["global", "inst", "short", "binunicode", "binunicode8", "unicode", "memo"]))
    if how in ("global", "inst"):
        raw_module = module.encode("utf-8", "surrogatepass")
        raw_qualname = qualname.encode("utf-8", "surrogatepass")
        if draw(st.booleans()):  # without the newlines inside, so that the line split is the name's own
            raw_module, raw_qualname = raw_module.replace(b"\n", b"_"), raw_qualname.replace(b"\n", b"_")
        if how == "inst":
            return PROTO + b"(i" + raw_module + b"\n" + raw_qualname + b"\n."
        return PROTO + b"c" + raw_module + b"\n" + raw_qualname + b"\n)R."
    if how == "unicode":
        pushed = unicode_line(module) + unicode_line(qualname)
    elif how == "memo":
        pushed = binunicode(module) + b"\x94" + binunicode(qualname) + b"\x940" + b"0" + get(0) + get(1)
    else:
        width = {"short": 1, "binunicode": 4, "binunicode8": 8}[how]
        pushed = b"".join(
            binunicode(text, 4 if width == 1 and len(text.encode("utf-8", "surrogatepass")) > 255 else width)
            for text in (module, qualname)
        )
    return PROTO + pushed + b"\x93" + draw(st.sampled_from([b")R", b")\x81", b"", b"}b"])) + b"."


@SETTINGS
@given(stream=name_streams())
def test_long_names_agree(analyzer: Analyzer, stream: bytes) -> None:
    assert_agree(analyzer, stream)


@SMALL
@given(escapes=st.lists(st.sampled_from(["\\u00e9", "\\U0001f600", "\\u005c", "a", "\\x41", "\\u12"]), max_size=8),
       length=st.integers(MAX_NAME - 2, MAX_NAME + 2))  # fmt: skip
def test_raw_unicode_escape_names_agree(analyzer: Analyzer, escapes: list[str], length: int) -> None:
    """UNICODE lines written with escapes (one character each, some malformed) around the bound: the length is
    counted in decoded characters by both."""
    units = escapes or ["a"]
    line = "".join((units * (length // len(units) + 1))[:length])  # `length` escapes, most one character each
    for module in (line, "builtins"):
        qualname = "object" if module == line else line
        stream = PROTO + b"V" + module.encode() + b"\nV" + qualname.encode() + b"\n\x93)R."
        assert_agree(analyzer, stream)


# ---------------------------------------------------------------------------------------------------------
# TUPLE1/2/3 over short frames
# ---------------------------------------------------------------------------------------------------------


@SETTINGS
@given(
    below=st.integers(0, 3),
    inside=st.integers(0, 3),
    tuple_op=st.sampled_from([b"\x85", b"\x86", b"\x87"]),
    closing=st.lists(st.sampled_from([b"t", b"l", b"d", b"\x91", b"0", b"1", b"e", b"u", b"\x90", b"\x94", b"2",
                                      b"\x85", b"\x86", b"\x87", b"N"]), max_size=4),
    stop=st.booleans(),
)  # fmt: skip
def test_tuple_opcodes_over_short_frames_agree(
    analyzer: Analyzer, below: int, inside: int, tuple_op: bytes, closing: list[bytes], stop: bool
) -> None:
    stream = PROTO + b"]" * below + b"(" + b"N" * inside + tuple_op + b"".join(closing) + (b"." if stop else b"")
    assert_agree(analyzer, stream)


# ---------------------------------------------------------------------------------------------------------
# The random opcode programs
# ---------------------------------------------------------------------------------------------------------


def _edited(stream: bytes, edits: list[tuple[int, int]]) -> bytes:
    data = bytearray(stream)
    for where, byte in edits:
        if data:
            data[where % len(data)] = byte
    return bytes(data)


@pytest.mark.slow
@SETTINGS
@given(
    node=programs(),
    edits=st.one_of(st.just([]), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=2)),
)
def test_random_programs_agree(analyzer: Analyzer, node: tuple[object, ...], edits: list[tuple[int, int]]) -> None:
    stream, _ = write(node, "/nonexistent/sentinel")
    assert_agree(analyzer, _edited(stream, edits))


@pytest.mark.slow
def test_the_generators_reach_every_verdict(analyzer: Analyzer) -> None:
    """Control: each generator's streams are accepted, refused and found too deep or malformed, not all one
    verdict (so the comparison is not between two identical refusals of garbage)."""
    generators: dict[str, Callable[[], st.SearchStrategy[bytes]]] = {
        "late fills": late_fill_streams,
        "hashing": hashing_streams,
        "nesting": nesting_streams,
        "names": name_streams,
    }
    for name, generator in generators.items():
        codes = _verdicts(analyzer, generator())
        assert OK in codes and len(codes) >= 2, (name, codes)


def _verdicts(analyzer: Analyzer, streams: st.SearchStrategy[bytes]) -> set[int]:
    codes: set[int] = set()

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(stream=streams)
    def collect(stream: bytes) -> None:
        codes.add(assert_agree(analyzer, stream))

    collect()
    return codes
