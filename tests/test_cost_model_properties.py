"""The restricted load's cost model (zerocopy_pickle/_trust/tags.py, Note [The cost model]) against what a load
really does, measured by operation counters, never by the clock.

* Hashing. A *replay* of the stream by pickle's pure-Python unpickler (``pickle._Unpickler``, the reference
  for the C one's data flow) counts, at every opcode that hashes (SETITEM(S) and DICT: the keys; ADDITEMS and
  FROZENSET: the members), the expanded size of each value hashed, from the real values (a tuple or frozenset
  costs 1 + its items', everything else 1; by a walk memoized by identity, so the counter itself is linear).
  For random hash-heavy streams (memo DAGs of tuples and frozensets over numbers, strings and ``None`` as dict
  keys, set and frozenset members, each repeated through the memo): a restricted load that succeeds hashed at
  most ``max(HASH_FLOOR, HASH_PER_BYTE * len(stream))`` elements; a refusal is a SnapshotError or a
  RestrictedLoadError, and a refusal for the hashing budget of a stream of tuples only is one whose replay
  exceeds it (the model charges tuples exactly).
* The analysis's own work. Lines of zerocopy_pickle/_trust/semantics.py, handlers.py and tags.py executed while
  :func:`semantics.analyze` runs (``sys.settrace``), per byte of stream, stay under one constant for every
  generated stream, from a few bytes to hundreds of kilobytes: each opcode costs a bounded number of steps, and
  each item is visited a bounded number of times (when put into a container, and when hashed), however it is
  referenced.
* Resources. In a child process under ``RLIMIT_AS`` (set before exec), with a generous timeout that only
  guards against a hang: a top-down chain of 100,000 defaultdicts or deques (and a bottom-up one) is refused
  and the child exits normally, also when it keeps the exception and frees it later, and when the load runs in
  a thread with a small stack; a 40-level memo DAG as a dict key is refused; one GLOBAL with a 5 MB dotted
  module name is refused by a load and reported by ``zerocopy-pickle scan``.
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerocopy_pickle as zp
from tests.internals import handlers, semantics, streamcheck, tags
from zerocopy_pickle.errors import RestrictedLoadError, SnapshotError

from .conftest import REPO
from .hostile_streams import as_snapshot

SETTINGS = settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
PROTO = b"\x80\x05"
HASH_BUDGET_WORDS = "hash more elements than its budget allows"


def budget(stream: bytes) -> int:
    return max(tags.HASH_FLOOR, tags.HASH_PER_BYTE * len(stream))


# ---------------------------------------------------------------------------------------------------------
# The counter: a replay by pickle's pure-Python unpickler
# ---------------------------------------------------------------------------------------------------------


class OverBudget(Exception):
    """The replay hashed more than it was allowed to count (it stops there: the rest could be exponential)."""


_PyUnpickler: Any = pickle._Unpickler  # pickle's pure-Python unpickler


class CountingUnpickler(_PyUnpickler):  # type: ignore[misc]
    """``pickle._Unpickler`` that counts the expanded size of every value it hashes, and stops past ``limit``."""

    def __init__(self, stream: bytes, limit: int) -> None:
        super().__init__(io.BytesIO(stream))
        self.limit = limit
        self.hashed = 0
        self._sizes: dict[int, tuple[object, int]] = {}  # id -> (the object, kept alive so its id stays its own)

    def expanded(self, value: object) -> int:
        """1 + the items' expanded sizes for a tuple or frozenset (every reference counted), else 1: iterative
        and memoized by identity, so linear in the distinct objects however often they are referenced."""
        sizes = self._sizes
        todo: list[tuple[object, bool]] = [(value, False)]
        while todo:
            obj, children_done = todo.pop()
            if id(obj) in sizes:
                continue
            if not isinstance(obj, tuple | frozenset):
                sizes[id(obj)] = (obj, 1)
            elif children_done:
                sizes[id(obj)] = (obj, 1 + sum(sizes[id(item)][1] for item in obj))
            else:
                todo.append((obj, True))
                todo.extend((item, False) for item in obj if id(item) not in sizes)
        return sizes[id(value)][1]

    def charge(self, values: Any) -> None:
        for value in values:
            self.hashed += self.expanded(value)
        if self.hashed > self.limit:
            raise OverBudget(self.hashed)

    def load_setitem(self) -> None:
        self.charge([self.stack[-2]])
        super().load_setitem()

    def load_setitems(self) -> None:
        self.charge(self.stack[::2])  # the frame since the MARK: keys and values
        super().load_setitems()

    def load_dict(self) -> None:
        self.charge(self.stack[::2])
        super().load_dict()

    def load_additems(self) -> None:
        self.charge(self.stack)
        super().load_additems()

    def load_frozenset(self) -> None:
        self.charge(self.stack)
        super().load_frozenset()

    dispatch: ClassVar[dict[int, Any]] = dict(_PyUnpickler.dispatch)
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.DICT[0]] = load_dict
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.FROZENSET[0]] = load_frozenset


def replay(stream: bytes, limit: int) -> tuple[int, bool]:
    """(elements hashed, whether the replay stopped past ``limit``)."""
    unpickler = CountingUnpickler(stream, limit)
    try:
        unpickler.load()
    except OverBudget:
        return unpickler.hashed, True
    return unpickler.hashed, False


def test_the_counter_counts_expanded_sizes() -> None:
    """Control: the counter counts each reference, and stops past its limit."""
    t: tuple[Any, ...] = ()
    for _ in range(30):
        t = (t, t)
    stream = pickle.dumps({(1, (2, 3)): None, "k": 1, frozenset({(4,), 5}): 2}, protocol=4)
    # Keys (1, (2, 3)): 5, "k": 1, the frozenset: 1 + 2 + 1; and the frozenset's members when it was built: 3.
    assert replay(stream, 100) == (5 + 1 + 4 + 3, False)
    stream = PROTO + b"}" + DAG(b"N", 30, "tuple2") + b"Ns."
    assert replay(stream, 1 << 20) == ((1 << 31) - 1, True)


# ---------------------------------------------------------------------------------------------------------
# Hash-heavy streams
# ---------------------------------------------------------------------------------------------------------


def get(index: int) -> bytes:
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


BASES = [b"N", b"K\x05", b"\x8c\x01s", b"\x8c\x01t", b"C\x01b", b")", b"M\x00\x01"]
LEVELS = ("tuple2", "tuple3", "mark-tuple", "frozenset")


def DAG(base: bytes, levels: int, op: str, first: int = 0) -> bytes:
    """``base``, then per level: MEMOIZE and combine the value with references to it (TUPLE2, TUPLE3,
    MARK..TUPLE of 4, or MARK..FROZENSET of 2). ``first`` is the memo's size before it."""
    out = bytearray(base)
    for i in range(first, first + levels):
        out += b"\x94"
        out += {
            "tuple2": get(i) + b"\x86",
            "tuple3": get(i) * 2 + b"\x87",
            "mark-tuple": b"0(" + get(i) * 4 + b"t",
            "frozenset": b"0(" + get(i) * 2 + b"\x91",
        }[op]
    return bytes(out)


def dag_size(levels: int, op: str) -> int:
    """The expanded size of :func:`DAG` over a base of size 1, as the analysis counts it."""
    width = {"tuple2": 2, "tuple3": 3, "mark-tuple": 4, "frozenset": 2}[op]
    return int((width ** (levels + 1) - 1) // (width - 1))


HOW = ("setitem", "setitems", "dict", "additems", "frozenset", "ordered")


@st.composite
def hash_heavy(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A list of up to 4 containers, each hashing one DAG key ``repeats`` times through the memo (by SETITEM,
    SETITEMS, DICT, ADDITEMS, FROZENSET or an OrderedDict's SETITEM), with repeats often picked so the total is
    near the hashing budget. Returns the stream and whether it is made of tuples only (no frozenset level)."""
    out = bytearray(PROTO + b"(")
    memo = 0
    tuples_only = True
    containers = draw(st.integers(1, 4))
    for _ in range(containers):
        op = draw(st.sampled_from(LEVELS))
        small = st.integers(0, 6)
        levels = draw(st.one_of(small, small, st.integers(9, 13), st.integers(15, 19), st.integers(30, 40)))
        if op in ("mark-tuple", "tuple3"):
            levels = min(levels, 12)
        size = dag_size(levels, op)
        near = max(1, tags.HASH_FLOOR // (size * containers))  # this container's share of the floor
        edge = st.integers(max(1, near - 2), near + 2)
        repeats = draw(st.one_of(st.integers(1, 4), edge, edge, st.integers(1, 60)))
        repeats = min(repeats, 5000)
        tuples_only &= op != "frozenset"
        key = DAG(draw(st.sampled_from(BASES)), levels, op, memo)
        memo += levels
        how = draw(st.sampled_from(HOW))
        at = memo
        memo += 1  # the key's own MEMOIZE
        if how in ("additems", "frozenset"):
            body = key + b"\x94" + get(at) * (repeats - 1)
            out += b"\x8f(" + body + b"\x90" if how == "additems" else b"(" + body + b"\x91"
        elif how == "dict":
            out += b"(" + key + b"\x94N" + (get(at) + b"N") * (repeats - 1) + b"d"
        elif how == "setitems":
            out += b"}(" + key + b"\x94N" + (get(at) + b"N") * (repeats - 1) + b"u"
        else:
            head = b"}" if how == "setitem" else b"ccollections\nOrderedDict\n)R"
            out += head + key + b"\x94Ns" + (get(at) + b"Ns") * (repeats - 1)
    return bytes(out + b"l."), tuples_only


@SETTINGS
@given(case=hash_heavy())
def test_accepted_loads_hash_within_the_budget(case: tuple[bytes, bool]) -> None:
    stream, tuples_only = case
    allowed = budget(stream)
    try:
        zp.loads(as_snapshot(stream))
    except (SnapshotError, RestrictedLoadError) as e:
        if tuples_only and HASH_BUDGET_WORDS in str(e):
            hashed, stopped = replay(stream, allowed)
            assert stopped, f"refused for hashing {hashed} <= {allowed} elements: {stream[:200]!r}"
        return
    hashed, stopped = replay(stream, allowed)
    assert not stopped and hashed <= allowed, (hashed, allowed, stream[:200])


def test_the_hashing_bound_is_tight_for_tuples() -> None:
    """Control: the same key, one repeat below and one above the floor, accepted then refused."""
    key = DAG(b"\x8c\x01s", 12, "tuple2")  # 8191 elements, strings: no collision charge
    size = dag_size(12, "tuple2")
    fits = tags.HASH_FLOOR // size

    def stream(repeats: int) -> bytes:
        return PROTO + b"}(" + key + b"\x94N" + (get(12) + b"N") * (repeats - 1) + b"u."

    zp.loads(as_snapshot(stream(fits)))
    assert replay(stream(fits), budget(stream(fits))) == (fits * size, False)
    with pytest.raises(SnapshotError, match=HASH_BUDGET_WORDS):
        zp.loads(as_snapshot(stream(fits + 1)))
    assert replay(stream(fits + 1), budget(stream(fits + 1)))[1]


# ---------------------------------------------------------------------------------------------------------
# The analysis's own work: lines executed per byte
# ---------------------------------------------------------------------------------------------------------

ANALYSIS_FILES = frozenset({semantics.__file__, handlers.__file__, tags.__file__})  # the opcode handlers, and the tags


def lines_executed(function: Callable[[], object]) -> int:
    """Lines of zerocopy_pickle/_trust/semantics.py, handlers.py and tags.py that ``function()`` executes (an
    operation counter)."""
    count = 0

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code.co_filename in ANALYSIS_FILES else None

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        function()
    except (SnapshotError, RestrictedLoadError):
        pass
    finally:
        sys.settrace(old)
    return count


# One opcode costs the loop's few lines and those of its one handler (a table lookup finds it), and each item
# costs a few lines where it is put into a container and where it is hashed. 120 lines a byte is about six
# times the most seen (about 20, for deep TUPLE1 nesting; about 40, for a frame of DUP and POP, when an if/elif
# chain of about 60 tests dispatched the opcodes).
LINES_PER_BYTE = 120


@st.composite
def big_streams(draw: st.DrawFn) -> bytes:
    """Streams whose every byte makes the analysis work: many items in one frame, items referenced through the
    memo thousands of times, hashed keys repeated, deep nesting, long names, containers filled by the thousand."""
    n = draw(st.one_of(st.integers(1, 50), st.integers(2_000, 8_000)))
    kind = draw(st.sampled_from(["frame", "aliases", "hashed", "deep", "names", "appends", "dags", "dispatch"]))
    if kind == "frame":
        body = b"(" + draw(st.sampled_from([b"N", b")", b"]", b"\x8c\x01a"])) * n + b"t"
    elif kind == "aliases":
        body = b"]\x94(" + b"h\x00" * n + b"l"
    elif kind == "hashed":
        body = b"}(" + DAG(b"\x8c\x01s", 3, "tuple2") + b"\x94N" + b"h\x03N" * n + b"u"
    elif kind == "deep":
        body = b")" + b"\x85" * min(n, tags.MAX_DEPTH + 5)
    elif kind == "names":
        body = b"(" + b"cm\n" + b"x" * 1000 + b"\n" + b"\x94" + b"h\x00" * n + b"l"
    elif kind == "dispatch":  # one-byte opcodes from the end of the dispatch chain
        body = b"N" + draw(st.sampled_from([b"20", b"(1", b"(0", b"\x88\x850"])) * n
    elif kind == "appends":
        body = b"]" + b"Na" * n
    else:
        body = b"(" + b"".join(DAG(b"N", 5, "tuple2", 5 * i) for i in range(min(n, 40))) + b"l"
    return PROTO + body + b"."


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(stream=big_streams())
def test_the_analysis_does_a_bounded_amount_of_work_per_byte(stream: bytes) -> None:
    try:
        streamcheck.check_stream(stream)
    except SnapshotError:
        return
    lines = lines_executed(lambda: semantics.analyze(stream))
    assert lines <= LINES_PER_BYTE * len(stream) + 500, (lines, len(stream), stream[:80])


def test_the_work_counter_counts_the_helpers_loops() -> None:
    """Control: the counter counts the lines of the helpers' loops over items too (so a walk over the whole
    stack at every opcode would show), here _container over a frame of 1,000 items."""
    counted = lines_executed(lambda: tags._container(tags._TUPLE, [tags._PRIM_TAG] * 1000, 0))
    assert counted >= 3 * 1000


# ---------------------------------------------------------------------------------------------------------
# Resources: in a child under RLIMIT_AS, a timeout only as a hang guard
# ---------------------------------------------------------------------------------------------------------

CHILD_AS = 6 << 30  # address space for the whole child (an interpreter, torch imported, a refused load)
HANG_GUARD_S = 600  # never the assertion: a child that needs it has hung


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS, CHILD_AS))


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=_limit,
    )


def assert_exited(proc: subprocess.CompletedProcess[str], code: int = 0) -> None:
    assert proc.returncode >= 0, f"killed by signal {-proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    assert proc.returncode == code, f"exit {proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-3000:]}"


def chain(kind: str, n: int, top_down: bool) -> bytes:
    """n collections.deque or defaultdict levels. Top-down: each new one memoized, put into the one before,
    which is popped, and fetched back from the memo to receive the next (late fills). Bottom-up: as pickle
    writes it (each filled before it is nested), n levels deep."""
    cls = b"\x8c\x0bcollections" + (b"\x8c\x05deque" if kind == "deque" else b"\x8c\x0bdefaultdict") + b"\x93"
    if not top_down:
        if kind == "deque":
            return PROTO + (cls + b")R") * n + cls + b")R" + b"a" * n + b"."  # APPEND: no MARK per level
        made = cls + b"N\x85R"
        return PROTO + (made + b"K\x00") * n + made + b"s" * n + b"."
    out = bytearray(PROTO + cls + b"\x94" + b")R\x94")  # memo 0: the class, memo 1: the first level
    for i in range(1, n):
        key = b"" if kind == "deque" else b"K\x00"
        out += key + b"j\x00\x00\x00\x00)R" + b"r" + struct.pack("<I", i + 1) + (b"a" if kind == "deque" else b"s")
        out += b"0" + b"j" + struct.pack("<I", i + 1)
    out += b"0j\x01\x00\x00\x00."
    return bytes(out)


CHAIN_CHILD = """
    import gc, sys, threading
    from pathlib import Path
    import zerocopy_pickle as zp
    data = Path(sys.argv[1]).read_bytes()
    kept = []

    def load():
        try:
            zp.loads(data)
        except zp.ZeroCopyPickleError as e:
            kept.append(e)  # the caller keeps the exception (and its traceback), and frees it later
            print("REFUSED", type(e).__name__, str(e)[:300], flush=True)
        else:
            print("LOADED", flush=True)

    if sys.argv[2] == "thread":  # a thread's stack can be far smaller than the main one's
        threading.stack_size(256 << 10)
        worker = threading.Thread(target=load)
        worker.start()
        worker.join()
    else:
        load()
    del kept[:]
    gc.collect()
    print("FREED", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.parametrize("top_down", [True, False], ids=["top-down", "bottom-up"])
@pytest.mark.parametrize("kind", ["defaultdict", "deque"])
def test_a_chain_of_100000_unprotected_values_is_refused_without_a_crash(
    tmp_path: Path, kind: str, top_down: bool, where: str
) -> None:
    path = tmp_path / "chain.zcp"
    path.write_bytes(as_snapshot(chain(kind, 100_000, top_down)))
    proc = run_child(CHAIN_CHILD, str(path), where)
    assert_exited(proc)
    error = "RestrictedLoadError" if top_down else "SnapshotError"
    assert f"REFUSED {error}" in proc.stdout, proc.stdout[-2000:]
    assert ("after it was put into another value" if top_down else "levels deep below a collections.") in proc.stdout
    assert proc.stdout.rstrip().endswith("FREED")


def test_the_chains_are_what_they_say() -> None:
    """Control: short chains load as nested deques and defaultdicts, top-down ones are refused at the second
    level (the first late fill)."""
    for kind in ("deque", "defaultdict"):
        value = zp.loads(as_snapshot(chain(kind, 5, top_down=False)))
        depth = 0
        while value:
            value = value[0]
            depth += 1
        assert depth == 5, kind
        outer = zp.loads(as_snapshot(chain(kind, 2, top_down=True)))  # the first level is filled once: admitted
        assert type(outer).__name__ == kind and len(outer) == 1 and len(outer[0]) == 0
        with pytest.raises(RestrictedLoadError, match="after it was put into another value"):
            zp.loads(as_snapshot(chain(kind, 3, top_down=True)))


LOAD_CHILD = """
    import sys
    from pathlib import Path
    import zerocopy_pickle as zp
    try:
        zp.loads(Path(sys.argv[1]).read_bytes())
    except zp.ZeroCopyPickleError as e:
        print("REFUSED", type(e).__name__, str(e)[:300], flush=True)
    else:
        print("LOADED", flush=True)
"""


@pytest.mark.slow
def test_a_40_level_memo_dag_as_a_dict_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "dag.zcp"
    path.write_bytes(as_snapshot(PROTO + b"}" + DAG(b")", 40, "tuple2") + b"Ns."))
    proc = run_child(LOAD_CHILD, str(path))
    assert_exited(proc)
    assert "REFUSED SnapshotError" in proc.stdout and HASH_BUDGET_WORDS in proc.stdout, proc.stdout


@pytest.mark.slow
def test_a_5_mb_dotted_module_name_is_refused_and_scanned(tmp_path: Path) -> None:
    name = ("torch.nn." * (5_000_000 // 9 + 1))[:5_000_000].rstrip(".")
    path = tmp_path / "name.zcp"
    path.write_bytes(as_snapshot(PROTO + b"c" + name.encode() + b"\nLinear\n)R."))
    proc = run_child(LOAD_CHILD, str(path))
    assert_exited(proc)
    assert "REFUSED SnapshotError" in proc.stdout and "names a global whose module name is" in proc.stdout
    # zerocopy-pickle scan reports it (an error, exit 1), and prints no 5 MB name.
    script = "import sys; from zerocopy_pickle._cli import main; sys.exit(main())"
    proc = run_child(script, "scan", str(path))
    assert_exited(proc, 1)
    assert "names a global whose module name is" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stdout) + len(proc.stderr) < 10_000
    proc = run_child(script, "scan", "--json", str(path))
    assert_exited(proc, 1)
    assert '"exit_code": 1' in proc.stdout and len(proc.stdout) < 10_000


@pytest.mark.slow
@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_deep_tuple_key_is_refused_without_a_crash_even_in_a_small_thread(tmp_path: Path, where: str) -> None:
    """A dict key nested MAX_DEPTH (5,000) deep: hashing it recursed in C and crashed a 256 KiB thread; keys are
    now refused deeper than MAX_KEY_DEPTH, and one just within it loads in that thread."""
    deep = b"}" + b")" + b"\x85" * (tags.MAX_DEPTH - 2) + b"Ns."
    path = tmp_path / "deep-key.zcp"
    path.write_bytes(as_snapshot(PROTO + deep))
    proc = run_child(CHAIN_CHILD, str(path), where)
    assert_exited(proc)
    assert "REFUSED SnapshotError" in proc.stdout and "as a dict key or set member" in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith("FREED")
    within = b"}" + b")" + b"\x85" * (tags.MAX_KEY_DEPTH - 1) + b"Ns."
    path.write_bytes(as_snapshot(PROTO + within))
    proc = run_child(CHAIN_CHILD, str(path), where)
    assert_exited(proc)
    assert "LOADED" in proc.stdout and proc.stdout.rstrip().endswith("FREED"), proc.stdout
