"""Random opcode programs over the safe set, loaded with the defaults (hypothesis, bounded for CI).

A generator of *valid-shaped* pickle programs: every value is pushed by opcodes that leave exactly one item on
the stack (primitives, GLOBAL/STACK_GLOBAL of the safe set's and the plugins' safe globals and a few others,
MARK/TUPLE/LIST/DICT, APPENDS, SETITEMS, BUILD, REDUCE, NEWOBJ, DUP, POP, MEMOIZE and memo GET, out-of-band
buffers and tensor views), wrapped into a snapshot with a few small buffers and loaded with the defaults. The
globals are enumerated at test time (``safe_globals()`` and ``default_registry().safe_globals()``), so the
generator follows the code. Strings include attribute names and a sentinel path.

It also writes the shapes the cost model of ``zerocopy_pickle/_trust/tags.py`` (Note [The cost model]) bounds:
memo DAGs (a value memoized and referenced two or three times per level through BINGET/LONG_BINGET, nested
into tuples, lists or frozensets: 2**k elements from a few bytes per level), the same value hashed many times
through the memo (as dict keys by SETITEM/SETITEMS/DICT, set members by ADDITEMS, frozenset members), deep
nesting around MAX_DEPTH (TUPLE1, MARK..LIST, MARK..FROZENSET), deque/defaultdict chains around
MAX_UNPROTECTED_DEPTH, top-down filling (containers and call results memoized, put into their parent, then
fetched from the memo and filled or given state: what the late-fill rule refuses) and long names (GLOBAL and
STACK_GLOBAL, by SHORT_BINUNICODE/BINUNICODE or raw-unicode-escape UNICODE, with module or qualname around and
above MAX_NAME_LENGTH, dotted, ASCII and not).

The property: a load returns or raises a ``ZeroCopyPickleError``, nothing else; no sentinel is written; no
watched global or standard stream is changed (:class:`tests.hostile_streams.ProcessState`). The hypothesis loop
runs in a child under ``RLIMIT_AS`` and a timeout; the parent requires exit code 0, not a signal.

``fuzz/fuzz_restricted.py`` runs the same generator under atheris for long runs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import struct
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import zerocopy_pickle as zp
from tests.internals import safe_globals, tags
from zerocopy_pickle.plugin import default_registry

from .conftest import REPO
from .hostile_streams import ProcessState, as_snapshot

SENTINEL = "\x00SENTINEL\x00"  # replaced by the real sentinel path when a program is written out

# Globals a hostile stream may name besides the safe set: blocked, unlisted, and gadgets from the review.
OTHER_GLOBALS = [
    ("builtins", "getattr"),
    ("builtins", "len"),
    ("builtins", "object"),
    ("os", "system"),
    ("math", "sqrt"),
    ("torch", "save"),
    ("torch", "load"),
    ("sys", "stdout"),
    ("pydoc", "pipepager"),
    ("torch.utils.collect_env", "run"),
    ("collections", "namedtuple"),
    ("bitsandbytes.functional", "QuantState"),
]

NAMES = [
    "__defaults__", "__kwdefaults__", "__code__", "__dict__", "__class__", "__globals__", "__setstate__",
    "__reduce__", "__iter__", "__getitem__", "__repr__", "__hash__", "write", "flush", "read", "readline",
    "stdin", "stdout", "stderr", "__stdin__", "__stderr__", "save", "load", "os", "float16", "dtype", "cpu",
    "meta", "nf4", "fp4", "absmax", "quant_map", "quant_type", "blocksize", "shape", "offset", "state2", "nested",
    "nested_absmax", "nested_dtype", "nested_offset", "data", "requires_grad", "_backward_hooks", "most_common",
    SENTINEL, "touch " + SENTINEL, "open(" + repr(SENTINEL) + ", 'w').close()",
]  # fmt: skip

INTS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(-4, 64),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, -(2**63), 2**64, 10**30]),
)
PRIMITIVES = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(),
    st.sampled_from(NAMES),
    st.text(max_size=12),
    st.binary(max_size=24),
)


def all_globals() -> list[tuple[str, str]]:
    """The safe set's pairs, the plugins' declared safe globals, and :data:`OTHER_GLOBALS` (read now)."""
    pairs = sorted(set(safe_globals()) | set(default_registry().safe_globals()))
    return [*pairs, *OTHER_GLOBALS]


# A program is a tree of tuples, written out by :func:`write`:
#   ("prim", v) ("global", (m, q), stack) ("memoref", k) ("buffer",) ("tensor", size, stride, (m, q))
#   ("tuple", [x]) ("list", [x]) ("dict", [(k, v)]) ("call", f, [x]) ("newobj", f, [x]) ("build", x, state)
#   ("appends", x, [x]) ("setitems", x, [(k, v)]) ("memoize", x) ("dup", x) ("popped", x, y)
# and the cost model's shapes:
#   ("dag", x, levels, width, op)    x, then per level: MEMOIZE, `width` memo GETs of it, `op` (a tuple opcode,
#                                    MARK..TUPLE/LIST/FROZENSET); 2**levels elements for width 2
#   ("hashed", how, x, count, v)     x as a dict key / set member `count` times through the memo; `how` is one of
#                                    HASH_WAYS (v the dict value)
#   ("deep", x, n, op)               x nested n levels deep by `op` ("tuple1", "list", "frozenset")
#   ("chain", pair, n, stack)        n levels of collections.deque / defaultdict, bottom-up (pickle's own order)
#   ("topdown", kinds, leaf, fill)   containers memoized, each put into the one before, then fetched from the
#                                    memo and filled with `leaf` (`fill` True) or given the next (late fills)
#   ("cycle", kind, leaf)            a container memoized and filled with itself, then with `leaf` (if not None)
# and ("global", pair, "V"): STACK_GLOBAL from raw-unicode-escape UNICODE strings.
Node = tuple[Any, ...]

MAX_NAME = tags.MAX_NAME_LENGTH
MAX_UNPROTECTED = tags.MAX_UNPROTECTED_DEPTH
HASH_WAYS = ("setitem", "setitems", "dict", "additems", "frozenset")
DAG_OPS = ("\x86", "\x87", "t", "l", "\x91")  # TUPLE2, TUPLE3, MARK..TUPLE, MARK..LIST, MARK..FROZENSET
TOPDOWN_KINDS = ("list", "dict", "set", "deque", "defaultdict", "OrderedDict", "Counter-build")


def long_names() -> st.SearchStrategy[str]:
    """Module names and qualnames around and above MAX_NAME_LENGTH characters: one repeated character (ASCII or
    not), dotted names (``torch.nn.`` repeated, as a deep module path), and a few existing names padded."""
    lengths = st.one_of(st.integers(MAX_NAME - 3, MAX_NAME + 3), st.sampled_from([MAX_NAME // 2, 2 * MAX_NAME, 3000]))
    chars = st.sampled_from(["a", "_", "\u00e9", "\u4e2d", "\U0001f600", "\\", "\ud800"])
    single = st.builds(lambda c, n: c * n, chars, lengths)
    dotted = st.builds(
        lambda part, n, tail: (part * (n // len(part) + 1))[:n].rstrip(".") + tail,
        st.sampled_from(["torch.nn.", "a.", "collections.", "\u00e9."]),
        lengths,
        st.sampled_from(["", ".Linear", ".OrderedDict", "x"]),
    )
    padded = st.builds(
        lambda name, n: name + "." + "x" * max(0, n - len(name) - 1),
        st.sampled_from(["torch", "collections", "builtins", "os", "zerocopy_pickle.rebuild"]),
        lengths,
    )
    return st.one_of(single, dotted, padded)


def programs() -> st.SearchStrategy[Node]:
    """Valid-shaped programs over the globals of :func:`all_globals`."""
    pairs = all_globals()
    dtypes = [pair for pair in pairs if pair[0] == "torch" and pair[1][:1].islower()] or [("torch", "float32")]
    plugin = sorted(set(default_registry().safe_globals()) - set(safe_globals())) or OTHER_GLOBALS
    others = [pair for pair in pairs if pair not in dtypes and pair not in plugin] or OTHER_GLOBALS
    # The safe set is mostly dtypes, qschemes and memory formats: draw a kind first, so that functions and classes
    # (the built-in ones, the plugins', the unlisted and blocked ones) come up as often as module-level constants.
    some_global = st.one_of(st.sampled_from(dtypes), st.sampled_from(others), st.sampled_from(plugin))
    name = long_names()
    long_pair = st.one_of(
        st.tuples(name, st.sampled_from(["Linear", "OrderedDict", "x"])),
        st.tuples(st.sampled_from(["torch", "collections", "builtins"]), name),
        st.tuples(name, name),
    )
    ways = st.sampled_from([False, True, "V"])  # GLOBAL, STACK_GLOBAL of BINUNICODE strings, of UNICODE ones
    globals_ = st.one_of(
        st.builds(lambda pair, stack: ("global", pair, stack), some_global, ways),
        st.builds(lambda pair, stack: ("global", pair, stack), long_pair, ways),
    )
    dims = st.lists(st.one_of(st.integers(0, 8), INTS), max_size=3).map(tuple)
    prim = PRIMITIVES.map(lambda v: ("prim", v))
    flat_state = st.lists(st.tuples(st.sampled_from(NAMES).map(lambda v: ("prim", v)), prim), max_size=2)
    leaves = st.one_of(
        prim,
        # BUILD applied to a global with a small state, as a leaf too: the attack is short, so it must be common.
        st.builds(
            lambda g, kv, slots: ("build", g, ("tuple", [("prim", None), ("dict", kv)]) if slots else ("dict", kv)),
            globals_,
            flat_state,
            st.booleans(),
        ),
        globals_,
        st.integers(0, 1000).map(lambda k: ("memoref", k)),
        st.just(("buffer",)),
        st.builds(lambda size, stride, dtype: ("tensor", size, stride, dtype), dims, dims, st.sampled_from(dtypes)),
        # The cost model's leaves: chains of the two types CPython frees recursively around their bound, and
        # top-down filling (refused wherever a container is filled after it was nested).
        st.builds(
            lambda pair, n, stack: ("chain", pair, n, stack),
            st.sampled_from(["deque", "defaultdict"]),
            st.one_of(st.integers(0, 4), st.integers(MAX_UNPROTECTED - 3, MAX_UNPROTECTED + 2)),
            st.booleans(),
        ),
        st.builds(
            lambda kinds, leaf, fill: ("topdown", kinds, leaf, fill),
            st.lists(st.sampled_from(TOPDOWN_KINDS), min_size=1, max_size=5),
            prim,
            st.booleans(),
        ),
        st.builds(lambda kind, leaf: ("cycle", kind, leaf), st.sampled_from(TOPDOWN_KINDS), st.one_of(st.none(), prim)),
    )
    levels = st.one_of(st.integers(0, 6), st.integers(17, 22), st.integers(30, 45))
    counts = st.one_of(st.integers(1, 4), st.integers(100, 400), st.sampled_from([2000, 20_000]))
    depths = st.one_of(
        st.integers(0, 8),
        st.integers(tags.MAX_DEPTH - 3, tags.MAX_DEPTH + 2),
        st.integers(MAX_UNPROTECTED - 2, MAX_UNPROTECTED + 2),
    )

    def extend(children: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
        few = st.lists(children, max_size=4)
        pairs_ = st.lists(st.tuples(children, children), max_size=3)
        callee = st.one_of(globals_, globals_, children)
        named = st.lists(st.tuples(st.sampled_from(NAMES).map(lambda v: ("prim", v)), children), max_size=2)
        state = st.one_of(
            named.map(lambda kv: ("dict", kv)),
            st.builds(lambda d, kv: ("tuple", [d, ("dict", kv)]), st.just(("prim", None)), named),
        )
        return st.one_of(
            st.builds(lambda g, s: ("build", g, s), globals_, state),  # BUILD applied to a global
            st.builds(lambda f, xs: ("call", f, xs), globals_, st.lists(leaves, max_size=4)),  # flat calls
            few.map(lambda xs: ("tuple", xs)),
            few.map(lambda xs: ("list", xs)),
            pairs_.map(lambda kv: ("dict", kv)),
            st.builds(lambda f, xs: ("call", f, xs), callee, few),
            st.builds(lambda f, xs: ("call", f, xs), callee, few),
            st.builds(lambda f, xs: ("newobj", f, xs), callee, few),
            st.builds(lambda x, s: ("build", x, s), children, children),
            st.builds(lambda x, s: ("build", x, s), children, state),
            st.builds(lambda x, xs: ("appends", x, xs), children, few),
            st.builds(lambda x, kv: ("setitems", x, kv), children, pairs_),
            children.map(lambda x: ("memoize", x)),
            children.map(lambda x: ("dup", x)),
            st.builds(lambda x, y: ("popped", x, y), children, children),
            # Memo DAGs, hashed or not; the same key or member hashed many times; deep nesting.
            st.builds(
                lambda x, k, w, op: ("dag", x, k, w, op), children, levels, st.integers(1, 3), st.sampled_from(DAG_OPS)
            ),
            st.builds(
                lambda how, x, n, v: ("hashed", how, x, n, v), st.sampled_from(HASH_WAYS), children, counts, leaves
            ),
            st.builds(
                lambda how, x, k, n: ("hashed", how, ("dag", x, k, 2, "\x86"), n, ("prim", None)),
                st.sampled_from(HASH_WAYS),
                leaves,
                levels,
                counts,
            ),
            st.builds(
                lambda x, n, op: ("deep", x, n, op), children, depths, st.sampled_from(["tuple1", "list", "frozenset"])
            ),
        )

    # A program is a few statements (each value popped but the last), so one failing call need not hide the rest.
    program = st.recursive(leaves, extend, max_leaves=14)
    return st.lists(program, min_size=1, max_size=3).map(
        lambda xs: xs[0] if len(xs) == 1 else ("popped", xs[0], ("popped", xs[1], xs[2]) if len(xs) == 3 else xs[1])
    )


def _enc_prim(value: Any, sentinel: str) -> bytes:
    if value is None:
        return b"N"
    if value is True:
        return b"\x88"
    if value is False:
        return b"\x89"
    if isinstance(value, int):
        if -(2**31) <= value < 2**31:
            return b"J" + struct.pack("<i", value)
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw
    if isinstance(value, float):
        return b"G" + struct.pack(">d", value)
    if isinstance(value, str):
        raw = value.replace(SENTINEL, sentinel).encode("utf-8", "surrogatepass")
        return b"X" + struct.pack("<I", len(raw)) + raw
    raw = bytes(value)
    return b"B" + struct.pack("<I", len(raw)) + raw


def _enc_unicode(text: str) -> bytes:
    """UNICODE (protocol 0): raw-unicode-escape text, backslash and newline escaped as pickle writes them."""
    return b"V" + text.replace("\\", "\\u005c").replace("\n", "\\u000a").encode("raw-unicode-escape") + b"\n"


def _enc_global(pair: tuple[str, str], stack: bool | str, sentinel: str) -> bytes:
    if stack == "V":
        return _enc_unicode(pair[0]) + _enc_unicode(pair[1]) + b"\x93"
    if stack:
        return _enc_prim(pair[0], sentinel) + _enc_prim(pair[1], sentinel) + b"\x93"
    module, qualname = (name.encode("utf-8", "surrogatepass") for name in pair)
    return b"c" + module + b"\n" + qualname + b"\n"


def _get(index: int) -> bytes:
    """BINGET or LONG_BINGET ``index``."""
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


_COLLECTION = {"deque": "deque", "defaultdict": "defaultdict", "OrderedDict": "OrderedDict", "Counter-build": "Counter"}
_KEYED = ("dict", "defaultdict", "OrderedDict")


def write(node: Node, sentinel: str) -> tuple[bytes, int]:
    """The protocol-5 stream of ``node`` and the number of out-of-band buffers it consumes."""
    out = bytearray(b"\x80\x05")
    memo = 0
    buffers = 0

    def emit(n: Node) -> None:
        nonlocal memo, buffers
        kind = n[0]
        if kind == "prim":
            out.extend(_enc_prim(n[1], sentinel))
        elif kind == "global":
            out.extend(_enc_global(n[1], n[2], sentinel))
        elif kind == "memoref":
            out.extend(b"j" + struct.pack("<I", n[1] % memo) if memo else b"N")
        elif kind == "buffer":
            out.extend(b"\x97")
            buffers += 1
        elif kind == "tensor":
            out.extend(_enc_global(("zerocopy_pickle.rebuild", "rebuild_tensor"), False, sentinel) + b"(")
            out.extend(_enc_global(("zerocopy_pickle.rebuild", "rebuild_storage"), False, sentinel))
            out.extend(b"(\x97" + _enc_prim("cpu", sentinel) + b"tR")
            buffers += 1
            out.extend(_enc_global(n[3], False, sentinel) + _enc_prim(0, sentinel))
            for dims in (n[1], n[2]):
                out.extend(b"(" + b"".join(_enc_prim(d, sentinel) for d in dims) + b"t")
            out.extend(b"\x89tR")
        elif kind in ("tuple", "list"):
            out.extend(b"(")
            for x in n[1]:
                emit(x)
            out.extend(b"t" if kind == "tuple" else b"l")
        elif kind == "dict":
            out.extend(b"(")
            for k, v in n[1]:
                emit(k)
                emit(v)
            out.extend(b"d")
        elif kind in ("call", "newobj"):
            emit(n[1])
            emit(("tuple", n[2]))
            out.extend(b"R" if kind == "call" else b"\x81")
        elif kind == "build":
            emit(n[1])
            emit(n[2])
            out.extend(b"b")
        elif kind == "appends":
            emit(n[1])
            out.extend(b"(")
            for x in n[2]:
                emit(x)
            out.extend(b"e")
        elif kind == "setitems":
            emit(n[1])
            out.extend(b"(")
            for k, v in n[2]:
                emit(k)
                emit(v)
            out.extend(b"u")
        elif kind == "memoize":
            emit(n[1])
            out.extend(b"\x94")
            memo += 1
        elif kind == "dup":
            emit(n[1])
            out.extend(b"20")  # DUP, POP
        elif kind == "popped":
            emit(n[1])
            out.extend(b"0")
            emit(n[2])
        elif kind == "dag":
            _, x, levels, width, op = n
            emit(x)
            for _ in range(levels):
                index = memoize()
                if op in ("\x86", "\x87"):  # TUPLE2, TUPLE3 of the value and one or two references
                    out.extend(_get(index) * (1 if op == "\x86" else 2) + op.encode("latin-1"))
                else:  # MARK, `width` references, TUPLE/LIST/FROZENSET
                    out.extend(b"0(" + _get(index) * width + op.encode("latin-1"))
        elif kind == "hashed":
            emit_hashed(*n[1:])
        elif kind == "deep":
            _, x, depth, op = n
            if op == "tuple1":
                emit(x)
                out.extend(b"\x85" * depth)
            else:
                out.extend(b"(" * depth)
                emit(x)
                out.extend((b"l" if op == "list" else b"\x91") * depth)
        elif kind == "chain":  # bottom-up, as pickle writes it: each level is filled before it is nested
            _, name, depth, stack = n
            cls = _enc_global(("collections", name), stack, sentinel)
            if name == "deque":
                out.extend((cls + b")R(") * depth + cls + b")R" + b"e" * depth)
            else:
                made = cls + b"N\x85R"
                out.extend((made + b"K\x00") * depth + made + b"s" * depth)
        elif kind == "topdown":
            _, kinds, leaf, fill = n
            empty(kinds[0])
            root = parent = memoize()
            for i, child_kind in enumerate(kinds[1:]):
                attach(kinds[i], functools.partial(empty, child_kind))
                child = memo - 1
                out.extend(b"0" + _get(child))  # POP the parent, fetch the child (now nested) from the memo
                parent = child
            if fill:
                attach(kinds[-1], lambda: emit(leaf))
            out.extend(b"0" + _get(root) if parent != root else b"")
        elif kind == "cycle":
            _, container, leaf = n
            empty(container)
            index = memoize()
            attach(container, lambda: out.extend(_get(index)))
            if leaf is not None:
                attach(container, lambda: emit(leaf))
        else:  # pragma: no cover - a generator bug
            raise AssertionError(f"unknown node {kind!r}")

    def memoize() -> int:
        nonlocal memo
        out.extend(b"\x94")
        memo += 1
        return memo - 1

    def empty(container: str) -> None:
        if container in _COLLECTION:
            out.extend(_enc_global(("collections", _COLLECTION[container]), False, sentinel) + b")R")
        else:
            out.extend({"list": b"]", "dict": b"}", "set": b"\x8f"}[container])

    def attach(container: str, push: Callable[[], None]) -> None:
        """Put what ``push`` pushes (memoized) into the container on the stack, as ``container`` is filled."""
        if container in _KEYED:
            out.extend(b"K" + bytes([memo % 256]))
            push()
            memoize()
            out.extend(b"s")
        elif container == "set":
            out.extend(b"(")
            push()
            memoize()
            out.extend(b"\x90")
        elif container == "Counter-build":  # BUILD with {"k": value} as the state
            out.extend(b"(\x8c\x01k")
            push()
            memoize()
            out.extend(b"db")
        else:  # list, deque: APPEND
            push()
            memoize()
            out.extend(b"a")

    def emit_hashed(how: str, x: Node, count: int, value: Node) -> None:
        """``x`` hashed ``count`` times, repeated through the memo (with ``value`` for a dict, once)."""
        out.extend({"setitem": b"}", "setitems": b"}(", "dict": b"(", "additems": b"\x8f(", "frozenset": b"("}[how])
        emit(x)
        key = memoize()
        if how in ("additems", "frozenset"):
            out.extend(_get(key) * (count - 1) + (b"\x90" if how == "additems" else b"\x91"))
            return
        emit(value)
        held = memoize()
        if how == "setitem":
            out.extend(b"s" + (_get(key) + _get(held) + b"s") * (count - 1))
        else:
            out.extend((_get(key) + _get(held)) * (count - 1) + (b"u" if how == "setitems" else b"d"))

    emit(node)
    out.extend(b".")
    return bytes(out), buffers


def check_program(node: Node, pool: Sequence[bytes], sentinel: Path) -> None:
    """Load ``node`` (with buffers drawn from ``pool``) with the defaults: only success or a ZeroCopyPickleError,
    no sentinel, no change to any watched global. Restores what a load changed, and removes the sentinel."""
    stream, count = write(node, str(sentinel))
    data = as_snapshot(stream, [pool[i % len(pool)] for i in range(count)])
    before = ProcessState()
    try:
        with contextlib.suppress(zp.ZeroCopyPickleError):
            zp.loads(data)
        assert not sentinel.exists(), f"a program wrote the sentinel: {stream!r}"
        changes = before.changes()
        what = sorted({": ".join(change.split(": ")[:2]) for change in changes})  # object and attribute, no names
        assert not changes, f"a program changed the process ({'; '.join(what)}) | {changes}; stream {stream!r}"
    finally:
        before.restore()
        with contextlib.suppress(FileNotFoundError):
            sentinel.unlink()


def make_target(sentinel: Path, max_examples: int) -> Callable[..., None]:
    """The hypothesis test (not collected by pytest: the parent runs it in a child)."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=False,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(node=programs(), pool=st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    def random_programs(node: Node, pool: list[bytes]) -> None:
        check_program(node, pool, sentinel)

    return random_programs  # type: ignore[no-any-return]


CHILD_LIMIT = 2 << 30  # RLIMIT_AS above the child's baseline


def child_main(max_examples: int) -> None:
    """Run the hypothesis loop under RLIMIT_AS (the child's entry point); exit 1 with the finding on failure."""
    import psutil

    base = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (base + CHILD_LIMIT, base + CHILD_LIMIT))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            make_target(Path(tmp) / "PWNED", max_examples)()
        except BaseException:
            sys.__stdout__.write(traceback.format_exc()[-6000:])  # type: ignore[union-attr]
            sys.__stdout__.flush()  # type: ignore[union-attr]
            os._exit(1)
    print("OK", max_examples)


@pytest.mark.slow
def test_random_programs_only_raise_library_errors() -> None:
    """Random programs over the safe set (hypothesis, 300 examples, in a child under RLIMIT_AS and a timeout):
    only success or a ZeroCopyPickleError, no sentinel, no changed global; the child exits 0, not by a signal."""
    code = "import sys; from tests.test_opcode_programs import child_main; child_main(int(sys.argv[1]))"
    # stdin from /dev/null: a program may iterate sys.stdin (the runtime-objects quirk hands it out) and must not
    # block the run on a terminal or an inherited pipe.
    proc = subprocess.run(
        [sys.executable, "-c", code, "300"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode >= 0, f"the child was killed by signal {-proc.returncode}: {proc.stdout[-3000:]}"
    assert proc.returncode == 0, f"a random program broke a rule:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


def test_the_generator_writes_loadable_programs() -> None:
    """Control: the writer's output passes the stream check, and a program of plain containers loads."""
    node: Node = ("dict", [(("prim", "a"), ("list", [("prim", 1), ("memoize", ("prim", "x")), ("memoref", 0)]))])
    stream, count = write(node, "/nonexistent")
    assert count == 0
    assert zp.loads(as_snapshot(stream)) == {"a": [1, "x", "x"]}
    tensor: Node = ("tensor", (2,), (1,), ("torch", "float32"))
    stream, count = write(tensor, "/nonexistent")
    assert zp.loads(as_snapshot(stream, [bytes(8)] * count)).shape == (2,)
    assert ("collections", "OrderedDict") in all_globals()


def _verdict(node: Node) -> Any:
    stream, count = write(node, "/nonexistent")
    try:
        return zp.loads(as_snapshot(stream, [bytes(8)] * count))
    except zp.ZeroCopyPickleError as e:
        return type(e)


def test_the_generator_writes_the_cost_model_s_shapes() -> None:
    """Control: each shape of the cost model is written as meant, on both sides of its bound (so the random
    programs exercise the rules rather than malformed streams)."""
    none: Node = ("prim", None)
    deep_key = ("dag", none, 40, 2, "\x86")
    assert _verdict(("dag", ("prim", 1), 3, 2, "\x86")) == (((1, 1), (1, 1)), ((1, 1), (1, 1)))
    assert _verdict(("dag", ("prim", 1), 2, 3, "l")) == [[1, 1, 1]] * 3
    assert _verdict(("dag", ("prim", 1), 2, 2, "\x91")) == frozenset({frozenset({1})})
    assert _verdict(("list", [deep_key])) is not zp.SnapshotError  # built, never hashed: only its size is known
    for how in HASH_WAYS:
        assert _verdict(("hashed", how, deep_key, 2, none)) is zp.SnapshotError, how
        small = _verdict(("hashed", how, ("prim", "k"), 300, ("prim", 2)))
        assert small in ({"k": 2}, {"k"}, frozenset({"k"})), how
    # 2**13 - 1 elements per key (of strings: hashed with a secret, so never charged as colliding): the floor
    # (2**20) admits about 128 of them.
    key: Node = ("dag", ("prim", "s"), 12, 2, "\x86")
    assert _verdict(("hashed", "setitems", key, 100, none)) is not zp.SnapshotError
    assert _verdict(("hashed", "setitems", key, 300, none)) is zp.SnapshotError
    assert _verdict(("deep", ("prim", 1), tags.MAX_DEPTH, "tuple1")) is not zp.SnapshotError
    assert _verdict(("deep", ("prim", 1), tags.MAX_DEPTH + 1, "tuple1")) is zp.SnapshotError
    assert _verdict(("deep", ("prim", 1), tags.MAX_DEPTH + 1, "list")) is zp.SnapshotError
    for name in ("deque", "defaultdict"):
        for stack in (False, True, "V"):
            assert _verdict(("chain", name, MAX_UNPROTECTED - 2, stack)) is not zp.SnapshotError, (name, stack)
            assert _verdict(("chain", name, MAX_UNPROTECTED + 1, stack)) is zp.SnapshotError, (name, stack)
    for kinds in TOPDOWN_KINDS:
        filled = _verdict(("topdown", [kinds], ("prim", 1), True))  # filled before it is nested: admitted, but
        assert filled not in (zp.SnapshotError, zp.RestrictedLoadError) or kinds == "Counter-build"  # BUILD on it
        assert _verdict(("topdown", [kinds, "list"], ("prim", 1), True)) is zp.RestrictedLoadError, kinds
        assert _verdict(("topdown", ["list", kinds, "dict"], ("prim", 1), False)) is zp.RestrictedLoadError, kinds
        assert _verdict(("cycle", kinds, ("prim", 1))) is zp.RestrictedLoadError, kinds
    assert _verdict(("topdown", ["list", "dict"], ("prim", 1), False)) == [{}]
    assert _verdict(("topdown", ["dict", "list"], ("prim", 1), False)) == {1: []}
    cycle = _verdict(("cycle", "list", None))
    assert cycle == [cycle] and cycle[0] is cycle
    for stack in (False, True, "V"):
        assert _verdict(("call", ("global", ("collections", "OrderedDict"), stack), [])) == {}
        for pair in (("m" * (MAX_NAME + 1), "x"), ("collections", "\u00e9" * (MAX_NAME + 1))):
            assert _verdict(("global", pair, stack)) is zp.SnapshotError, (pair[0][:3], stack)
        # At the bound the name is admitted by the analysis, and refused by the allow-list.
        assert _verdict(("global", ("\u4e2d" * MAX_NAME, "x"), stack)) is zp.RestrictedLoadError
    assert _verdict(("global", ("collections", "\\\n"), "V")) is zp.RestrictedLoadError  # escaped, one name
