"""Random opcode programs over the safe set, loaded with the defaults (hypothesis, bounded for CI).

A generator of *valid-shaped* pickle programs: every value is pushed by opcodes that leave exactly one item on
the stack (primitives, GLOBAL/STACK_GLOBAL of the safe set's and the plugins' safe globals and a few others,
MARK/TUPLE/LIST/DICT, APPENDS, SETITEMS, BUILD, REDUCE, NEWOBJ, DUP, POP, MEMOIZE and memo GET, out-of-band
buffers and tensor views), wrapped into a snapshot with a few small buffers and loaded with the defaults. The
globals are enumerated at test time (``safe_globals()`` and ``default_registry().safe_globals()``), so the
generator follows the code. Strings include attribute names and a sentinel path.

The property: a load returns or raises a ``ZeroCopyPickleError``, nothing else; no sentinel is written; no
watched global or standard stream is changed (:class:`tests.hostile_streams.ProcessState`). The hypothesis loop
runs in a child under ``RLIMIT_AS`` and a timeout; the parent requires exit code 0, not a signal.

``fuzz/fuzz_restricted.py`` runs the same generator under atheris for long runs.
"""

from __future__ import annotations

import contextlib
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

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import zerocopy_pickle as zp
from zerocopy_pickle.plugin import default_registry
from zerocopy_pickle.restricted import safe_globals

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
Node = tuple[Any, ...]


def programs() -> st.SearchStrategy[Node]:
    """Valid-shaped programs over the globals of :func:`all_globals`."""
    pairs = all_globals()
    dtypes = [pair for pair in pairs if pair[0] == "torch" and pair[1][:1].islower()] or [("torch", "float32")]
    plugin = sorted(set(default_registry().safe_globals()) - set(safe_globals())) or OTHER_GLOBALS
    others = [pair for pair in pairs if pair not in dtypes and pair not in plugin] or OTHER_GLOBALS
    # The safe set is mostly dtypes, qschemes and memory formats: draw a kind first, so that functions and classes
    # (the built-in ones, the plugins', the unlisted and blocked ones) come up as often as module-level constants.
    some_global = st.one_of(st.sampled_from(dtypes), st.sampled_from(others), st.sampled_from(plugin))
    globals_ = st.builds(lambda pair, stack: ("global", pair, stack), some_global, st.booleans())
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


def _enc_global(pair: tuple[str, str], stack: bool, sentinel: str) -> bytes:
    if stack:
        return _enc_prim(pair[0], sentinel) + _enc_prim(pair[1], sentinel) + b"\x93"
    return b"c" + pair[0].encode() + b"\n" + pair[1].encode() + b"\n"


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
        else:  # pragma: no cover - a generator bug
            raise AssertionError(f"unknown node {kind!r}")

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
