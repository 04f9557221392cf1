"""Internal: what a pickle stream does to which value, decided before the C unpickler runs it (restricted loads).

Pickle's opcodes act on values: REDUCE calls the value below its argument tuple, NEWOBJ instantiates a class,
BUILD sets state on an object (its ``__setstate__``, or its ``__dict__`` and attributes), APPEND(S),
SETITEM(S) and ADDITEMS call ``append``/``extend``/``__setitem__``/``add`` on anything that is not an exact
list, dict or set. An allow-list of *names* cannot make that safe: BUILD on an allowed function rewrites its
``__defaults__``, BUILD on an allowed class replaces its methods, and an allowed callable that iterates or calls
its argument runs whatever the stream put there.

:func:`analyze` runs the stream once over *tags* instead of values: the exact stack, mark and memo semantics of
CPython's C unpickler (``Modules/_pickle.c``; ``Lib/pickle.py``'s stack-of-frames model), with each value
replaced by where it came from — a primitive, a string (with its text), a tuple/list/dict/set built by pickle's
own opcodes, an out-of-band buffer, the global ``(module, qualname)`` a GLOBAL named, or the *result* of calling
a named global. Since the C unpickler's data flow is fully determined by the opcodes, the tag of every value it
will hold is known exactly. The analysis refuses, with the byte offset:

* REDUCE, OBJ, INST, NEWOBJ and NEWOBJ_EX on anything but a global named by the stream itself (so a callable can
  only come from the load's allow-list, never from a call's result, a container or the memo's other values),
  and argument tuples not built by pickle's tuple opcodes;
* BUILD on anything but the result of calling a named global — never on a global itself (a class, a function,
  a module-level object), a container or a primitive;
* APPEND(S) except on a list built by opcodes or a call's result, SETITEM(S) except on a dict or a call's
  result, ADDITEMS except on a set or a call's result;
* STACK_GLOBAL whose names are not string literals, extension codes (EXT1/2/4), persistent IDs;
* filling a container, or setting an object's state, after the value was put into another one (see Note [The
  cost model]): what pickle itself writes only for a reference cycle, and what lets a stream nest values
  deeper than any depth it was charged for.

and it enforces the cost model (Note [The cost model]), raising :class:`~zerocopy_pickle.errors.SnapshotError`
for values nested deeper than :data:`MAX_DEPTH` (hashing a deeply nested tuple recurses in C without a limit),
deques and defaultdicts nested deeper than :data:`MAX_UNPROTECTED_DEPTH`, dict keys and set members nested
deeper than :data:`MAX_KEY_DEPTH`, names longer than
:data:`MAX_NAME_LENGTH`, and a stream that makes the unpickler hash more than its budget of elements
(:data:`HASH_FLOOR`, :data:`HASH_PER_BYTE`).

What remains depends on the allow-list and is decided per load by
:meth:`zerocopy_pickle._trust.restricted.AllowList.admit` from the returned :class:`StreamUses`: which globals are
called, instantiated, and which mutating opcodes reach the results of which globals. The analysis depends on
the stream's bytes alone, so :func:`uses` remembers it by the stream's BLAKE2b digest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import RestrictedLoadError, SnapshotError
from . import streamcheck

MAX_DEPTH = 5_000
"""Deepest nesting of values a restricted load accepts. pickle.dump itself stops near the recursion limit
(1,000 by default); hashing a tuple nested 150,000 deep overflows the C stack."""
MAX_UNPROTECTED_DEPTH = 200
"""Deepest nesting of a ``collections.deque`` or ``collections.defaultdict`` (counting every level below it).
CPython frees these two without its "trashcan" (which turns a deep chain of lists, dicts, tuples, sets and
instances into a loop), so freeing a chain of them recurses in C: 100,000 defaultdicts crash an 8 MiB stack,
and a thread's stack can be far smaller."""
MAX_KEY_DEPTH = 100
"""Deepest nesting of a dict key or set member (a value CPython hashes, and compares on a collision). Hashing a
tuple recurses in C, one frame per level, and a thread may run with a small stack (``threading.stack_size``):
a key nested a few thousand deep crashed a 256 KiB thread. Keys that real pickles hold are a few levels deep."""
MAX_NAME_LENGTH = 1_024
"""Longest module name, and longest qualified name, of a global (in characters). The longest in torch,
transformers and diffusers are under 120."""
HASH_FLOOR = 1 << 20
"""Elements the unpickler may hash (dict keys, set and frozenset members, counted expanded: a tuple of n items
costs 1 + theirs) in any restricted load, whatever its stream's size."""
HASH_PER_BYTE = 4
"""Elements it may hash per byte of stream, above :data:`HASH_FLOOR`."""
COLLISION_FLOOR = 1 << 25
"""Comparisons that keys with colliding hashes may cost in any restricted load (see Note [The cost model]):
every key whose hash the stream can choose (a float, an int beyond 2**55, a tuple or frozenset of them or of
small ints, a call's result) costs, on insertion, the number of such keys already in its dict or set times its
expanded size. 2**25 is about half a second of comparisons, and 8,192 such keys in one dict."""
_SIZE_CAP = (1 << 40) - 1  # expanded sizes saturate here: above every budget (the native twin keeps 40 bits)
_UNPROTECTED = frozenset({("collections", "deque"), ("collections", "defaultdict")})

BUILD, SETITEM, APPEND, ADD = "build", "setitem", "append", "add"

# Tag kinds.
_PRIM, _STR, _BYTES, _TUPLE, _LIST, _DICT, _SET, _FROZENSET, _GLOBAL, _RESULT, _BUFFER = range(11)
# How a value hashes (`hashk`): by a secret (str, bytes, buffers; also ids, and unhashable containers), to a
# known distinct value (small ints, None, bools, the empty tuple), or to one the stream can make collide.
_SECRET, _KNOWN, _CHOSEN = range(3)
_KIND_NAMES = (
    "a number or constant",
    "a string",
    "bytes",
    "a tuple",
    "a list",
    "a dict",
    "a set",
    "a frozenset",
    "a global",
    "a call's result",
    "a buffer",
)


class _Tag:
    """Where a stack value came from. Containers' ``depth`` is their nesting so far, ``size`` their expanded
    size so far (1 for a value that holds no other; a container 1 + its items', counting a value every time it
    is referenced), ``nested`` whether it was put into another value (see Note [The cost model])."""

    __slots__ = ("built", "chosen", "depth", "hashk", "kind", "nested", "pair", "size")

    def __init__(self, kind: int, pair: Any = None, depth: int = 0, size: int = 1, hashk: int = _SECRET) -> None:
        self.kind = kind
        self.pair = pair  # a global's (module, qualname); a string's text (None if unknown)
        self.depth = depth
        self.size = size
        self.hashk = hashk
        self.built = False  # BUILD has set state on it (see Note [One BUILD, and nothing appended after it])
        self.nested = False
        self.chosen = 0  # keys of chosen hash this dict or set (or object) received

    def describe(self) -> str:
        if self.kind in (_GLOBAL, _RESULT) and self.pair is not None:
            what = f"{self.pair[0]}:{self.pair[1]}"
            return f"the global {what}" if self.kind == _GLOBAL else f"the result of calling {what}"
        return _KIND_NAMES[self.kind]


_PRIM_TAG = _Tag(_PRIM, hashk=_KNOWN)
_CHOSEN_TAG = _Tag(_PRIM, hashk=_CHOSEN)  # floats
_BYTES_TAG = _Tag(_BYTES)
_BUFFER_TAG = _Tag(_BUFFER)
_UNKNOWN_STR = _Tag(_STR, None)


@dataclass(frozen=True)
class StreamUses:
    """What a stream does, as far as a restricted load's policy is concerned.

    Attributes:
        globals: every ``(module, qualname)`` it names, in order of first appearance.
        called: globals that REDUCE, OBJ or INST call.
        instantiated: globals that NEWOBJ or NEWOBJ_EX instantiate (``cls.__new__(cls, ...)``).
        mutated: for each global, the mutating opcodes (``"build"``, ``"setitem"``, ``"append"``, ``"add"``)
            applied to what calling or instantiating it returned.
        next_buffers: how many out-of-band buffers it consumes.
    """

    globals: tuple[tuple[str, str], ...]
    called: frozenset[tuple[str, str]]
    instantiated: frozenset[tuple[str, str]]
    mutated: Mapping[tuple[str, str], frozenset[str]]
    next_buffers: int


def _refuse(pos: int, message: str) -> RestrictedLoadError:
    return RestrictedLoadError(
        f"refusing to load: at byte {pos} of the pickle stream, {message}. A restricted load never allows this, "
        f"whatever allow= says; only trusted=True loads such a stream (do that only if you trust its source)",
        refused=("<stream>", f"byte {pos}"),
        trusted_only=(f"at byte {pos}, {message}",),
    )


def _too_deep(pos: int) -> SnapshotError:
    return SnapshotError(
        f"the pickle stream nests values more than {MAX_DEPTH} levels deep (at byte {pos}); no pickler writes "
        f"that, and hashing such a value would overflow the C stack"
    )


def _too_deep_unprotected(pos: int, pair: tuple[str, str]) -> SnapshotError:
    return SnapshotError(
        f"the pickle stream nests values more than {MAX_UNPROTECTED_DEPTH} levels deep below a "
        f"{pair[0]}.{pair[1]} (at byte {pos}); CPython frees that type recursively, so freeing a deep chain of "
        f"them would overflow the C stack"
    )


def _filled_late(pos: int, opcode: str, target: _Tag) -> RestrictedLoadError:
    return _refuse(
        pos,
        f"{opcode} fills {target.describe()} after it was put into another value (pickle writes that only for "
        f"a reference cycle; it would let the stream nest values deeper than the analysis can bound)",
    )


def _long_name(pos: int, what: str, name: str) -> SnapshotError:
    return SnapshotError(
        f"the pickle stream names a global whose {what} is {len(name)} characters long (at byte {pos}); a "
        f"restricted load accepts names of at most {MAX_NAME_LENGTH}"
    )


def _name_pair(module: str, qualname: str, pos: int) -> tuple[str, str]:
    if len(module) > MAX_NAME_LENGTH:
        raise _long_name(pos, "module name", module)
    if len(qualname) > MAX_NAME_LENGTH:
        raise _long_name(pos, "qualified name", qualname)
    return module, qualname


def _container(kind: int, items: list[_Tag], pos: int) -> _Tag:
    depth = 0
    size = 1
    hashk = 0
    for item in items:
        item.nested = True
        if item.depth > depth:  # noqa: PLR1730 - cheaper than max() on this hot path
            depth = item.depth
        size += item.size
        hashk |= 1 << item.hashk
    if depth >= MAX_DEPTH:
        raise _too_deep(pos)
    hashk = _HASHK[hashk] if kind == _TUPLE else _FROZEN_HASHK[hashk] if kind == _FROZENSET else _SECRET
    return _Tag(kind, None, depth + 1, min(size, _SIZE_CAP), hashk)


# A tuple's or frozenset's hashk from the bit set of its items' (1 << hashk): chosen if any item is chosen or
# all are known (their hashes combine into any value the stream wants), secret if a secret one is in it and no
# chosen one, known if empty.
_HASHK = tuple(
    _CHOSEN if bits & (1 << _CHOSEN) or bits == 1 << _KNOWN else _KNOWN if not bits else _SECRET for bits in range(8)
)
# A frozenset's hash XORs its members' (shuffled) hashes, so a secret member common to many sets cancels out:
# chosen if any member is known or chosen.
_FROZEN_HASHK = tuple(
    _CHOSEN if bits & ((1 << _CHOSEN) | (1 << _KNOWN)) else _KNOWN if not bits else _SECRET for bits in range(8)
)


def _result(pair: tuple[str, str], depth: int, size: int, pos: int) -> _Tag:
    """The tag of what calling ``pair`` returns, its arguments ``depth`` deep and ``size`` large (its hash is
    the class's to choose: counted as chosen)."""
    if depth > MAX_UNPROTECTED_DEPTH and pair in _UNPROTECTED:
        raise _too_deep_unprotected(pos, pair)
    return _Tag(_RESULT, pair, depth, min(size, _SIZE_CAP), _CHOSEN)


def _grow(target: _Tag, items: list[_Tag], pos: int, opcode: str) -> None:
    if target.nested:
        raise _filled_late(pos, opcode, target)
    depth = target.depth
    size = target.size
    for item in items:
        item.nested = True
        if item.depth >= depth:
            depth = item.depth + 1
        size += item.size
    if depth > MAX_DEPTH:
        raise _too_deep(pos)
    if target.kind == _RESULT and depth > MAX_UNPROTECTED_DEPTH and target.pair in _UNPROTECTED:
        raise _too_deep_unprotected(pos, target.pair)
    target.depth = depth
    target.size = min(size, _SIZE_CAP)


class _Hashing:
    """The elements the unpickler will hash, counted against the stream's budget (Note [The cost model])."""

    __slots__ = ("colliding", "left")

    def __init__(self, stream_nbytes: int) -> None:
        self.left = max(HASH_FLOOR, HASH_PER_BYTE * stream_nbytes)
        self.colliding = max(COLLISION_FLOOR, HASH_PER_BYTE * stream_nbytes)

    def charge(self, items: list[_Tag], step: int, pos: int, target: _Tag) -> None:
        """``target`` hashes every ``step``-th of ``items`` (its keys or members)."""
        spent = 0
        chosen = target.chosen
        compared = 0
        for item in items[::step]:
            if item.depth > MAX_KEY_DEPTH:
                raise SnapshotError(
                    f"the pickle stream uses a value nested {item.depth} levels deep as a dict key or set member "
                    f"(at byte {pos}); a restricted load hashes values at most {MAX_KEY_DEPTH} levels deep (hashing "
                    f"recurses in C, and a thread's stack can be small); only trusted=True loads it"
                )
            spent += item.size
            if item.hashk == _CHOSEN:
                compared += chosen * item.size
                chosen += 1
        target.chosen = chosen
        self.colliding -= compared
        if self.colliding < 0:
            raise SnapshotError(
                f"the pickle stream puts more keys whose hashes it can choose into one dict or set than a "
                f"restricted load compares (at byte {pos}: floats, large ints, tuples of numbers or objects as "
                f"keys or members; if they all collided, inserting them would take time quadratic in their "
                f"number); a restricted load allows max({COLLISION_FLOOR}, {HASH_PER_BYTE} x the stream's size) "
                f"comparisons, about {_keys_allowed()} such keys in one dict; only trusted=True loads it"
            )
        self.left -= spent
        if self.left < 0:
            raise SnapshotError(
                f"the pickle stream makes the unpickler hash more elements than its budget allows (at byte {pos}: "
                f"dict keys and set members, counted with everything they hold, each time a memo reference "
                f"repeats them); a restricted load hashes at most max({HASH_FLOOR}, {HASH_PER_BYTE} x the "
                f"stream's size in bytes)"
            )


def _keys_allowed() -> int:
    return int((2 * COLLISION_FLOOR) ** 0.5)


def _line(data: bytes, pos: int) -> tuple[bytes, int]:
    end = data.index(b"\n", pos)
    return data[pos:end], end + 1


def analyze(stream: bytes) -> StreamUses:
    """Run the stream over tags (see the module docstring). The stream must already have passed
    :func:`zerocopy_pickle._trust.streamcheck.check_stream` (lengths, memo indices, stack and MARK bounds).

    Raises:
        RestrictedLoadError: the stream does something no restricted load allows (naming the opcode and offset).
        SnapshotError: it is malformed, or nests values deeper than :data:`MAX_DEPTH`.
    """
    data = stream
    end = len(data)
    pos = 0
    stack: list[_Tag] = []
    metastack: list[list[_Tag]] = []
    memo: dict[int, _Tag] = {}
    found: dict[tuple[str, str], None] = {}
    called: set[tuple[str, str]] = set()
    instantiated: set[tuple[str, str]] = set()
    mutated: dict[tuple[str, str], set[str]] = {}
    buffers = 0
    from_bytes = int.from_bytes
    strings: dict[bytes, _Tag] = {}
    hashing = _Hashing(end)
    start = 0
    try:
        while pos < end:
            start = pos
            op = data[pos]
            pos += 1
            # Ordered by how often snapshot streams use each opcode.
            if op == 0x94:  # MEMOIZE
                memo[len(memo)] = stack[-1]
            elif op == 0x4B:  # BININT1
                pos += 1
                stack.append(_PRIM_TAG)
            elif op == 0x68:  # BINGET
                stack.append(memo[data[pos]])
                pos += 1
            elif op == 0x8C:  # SHORT_BINUNICODE (one immutable tag per distinct string)
                n = data[pos]
                raw = data[pos + 1 : pos + 1 + n]
                tag = strings.get(raw)
                if tag is None:
                    tag = strings[raw] = _Tag(_STR, raw.decode("utf-8", "surrogatepass"))
                stack.append(tag)
                pos += 1 + n
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                func = stack[-1]
                if func.kind != _GLOBAL:
                    raise _refuse(
                        start, f"REDUCE calls {func.describe()}; only a global the stream names may be called"
                    )
                if args.kind != _TUPLE:
                    raise _refuse(start, f"REDUCE passes {args.describe()} as the argument tuple")
                called.add(func.pair)
                args.nested = True
                stack[-1] = _result(func.pair, args.depth + 1, args.size + 1, start)
            elif op == 0x85:  # TUPLE1
                item = stack[-1]
                if item.depth >= MAX_DEPTH:
                    raise _too_deep(start)
                item.nested = True
                stack[-1] = _Tag(_TUPLE, None, item.depth + 1, min(item.size + 1, _SIZE_CAP), _HASHK[1 << item.hashk])
            elif op == 0x28:  # MARK
                metastack.append(stack)
                stack = []
            elif op == 0x97:  # NEXT_BUFFER
                buffers += 1
                stack.append(_BUFFER_TAG)
            elif op == 0x86:  # TUPLE2
                second = stack.pop()
                first = stack[-1]
                depth = first.depth
                if second.depth > depth:  # noqa: PLR1730 - cheaper than max() on this hot path
                    depth = second.depth
                if depth >= MAX_DEPTH:
                    raise _too_deep(start)
                first.nested = second.nested = True
                stack[-1] = _Tag(
                    _TUPLE,
                    None,
                    depth + 1,
                    min(first.size + second.size + 1, _SIZE_CAP),
                    _HASHK[(1 << first.hashk) | (1 << second.hashk)],
                )
            elif op in (0x88, 0x89, 0x4E):  # NEWTRUE, NEWFALSE, NONE
                stack.append(_PRIM_TAG)
            elif op == 0x74:  # TUPLE
                items = stack
                stack = metastack.pop()
                stack.append(_container(_TUPLE, items, start))
            elif op == 0x87:  # TUPLE3
                if len(stack) < 3:
                    raise SnapshotError(f"the pickle stream is malformed at byte {start}: TUPLE3 needs 3 items")
                stack[-3:] = [_container(_TUPLE, stack[-3:], start)]
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                module = stack.pop()
                if module.kind != _STR or name.kind != _STR or module.pair is None or name.pair is None:
                    raise _refuse(start, "STACK_GLOBAL takes its names from values that are not string literals")
                pair = _name_pair(module.pair, name.pair, start)
                found[pair] = None
                stack.append(_Tag(_GLOBAL, pair))
            elif op in (0x71, 0x72):  # BINPUT, LONG_BINPUT
                if op == 0x71:
                    index = data[pos]
                    pos += 1
                else:
                    index = from_bytes(data[pos : pos + 4], "little")
                    pos += 4
                memo[index] = stack[-1]
            elif op == 0x6A:  # LONG_BINGET
                stack.append(memo[from_bytes(data[pos : pos + 4], "little")])
                pos += 4
            elif op in (0x4A, 0x4D):  # BININT, BININT2
                pos += 4 if op == 0x4A else 2
                stack.append(_PRIM_TAG)
            elif op == 0x47:  # BINFLOAT
                pos += 8
                stack.append(_CHOSEN_TAG)
            elif op in (0x8A, 0x8B):  # LONG1, LONG4
                if op == 0x8A:
                    n = data[pos]
                    pos += 1 + n
                else:
                    n = from_bytes(data[pos : pos + 4], "little", signed=True)
                    pos += 4 + n
                # Up to 7 bytes an int hashes to itself (distinct); a longer one's hash is the stream's to
                # choose, and hashing it reads every digit, every time (ints do not cache their hash).
                stack.append(_PRIM_TAG if op == 0x8A and n <= 7 else _Tag(_PRIM, None, 0, 1 + n // 8, _CHOSEN))
            elif op in (0x58, 0x8D):  # BINUNICODE, BINUNICODE8
                width = 4 if op == 0x58 else 8
                n = from_bytes(data[pos : pos + width], "little")
                pos += width
                stack.append(_Tag(_STR, data[pos : pos + n].decode("utf-8", "surrogatepass")))
                pos += n
            elif op in (0x43, 0x42, 0x8E, 0x96):  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
                width = 1 if op == 0x43 else 4 if op == 0x42 else 8
                n = from_bytes(data[pos : pos + width], "little")
                pos += width + n
                stack.append(_BYTES_TAG)
            elif op in (0x55, 0x54):  # SHORT_BINSTRING, BINSTRING (decoded with the unpickler's encoding)
                width = 1 if op == 0x55 else 4
                n = from_bytes(data[pos : pos + width], "little", signed=op == 0x54)
                pos += width + n
                stack.append(_UNKNOWN_STR)
            elif op == 0x7D:  # EMPTY_DICT
                stack.append(_Tag(_DICT, None, 1))
            elif op == 0x5D:  # EMPTY_LIST
                stack.append(_Tag(_LIST, None, 1))
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(_Tag(_TUPLE, None, 1, 1, _KNOWN))
            elif op == 0x8F:  # EMPTY_SET
                stack.append(_Tag(_SET, None, 1))
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = metastack.pop()
                if len(items) % 2:
                    raise SnapshotError(f"the pickle stream is malformed at byte {start}: odd number of SETITEMS items")
                _mutate(stack[-1], SETITEM, _DICT, items, start, mutated)
                hashing.charge(items, 2, start, stack[-1])
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                _mutate(stack[-1], SETITEM, _DICT, [key, value], start, mutated)
                hashing.charge([key], 1, start, stack[-1])
            elif op == 0x65:  # APPENDS
                items = stack
                stack = metastack.pop()
                _mutate(stack[-1], APPEND, _LIST, items, start, mutated)
            elif op == 0x61:  # APPEND
                item = stack.pop()
                _mutate(stack[-1], APPEND, _LIST, [item], start, mutated)
            elif op == 0x90:  # ADDITEMS
                items = stack
                stack = metastack.pop()
                _mutate(stack[-1], ADD, _SET, items, start, mutated)
                hashing.charge(items, 1, start, stack[-1])
            elif op == 0x62:  # BUILD
                state = stack.pop()
                inst = stack[-1]
                if inst.kind != _RESULT:
                    raise _refuse(
                        start,
                        f"BUILD sets state on {inst.describe()}; only objects this load created by calling an "
                        f"allowed class may receive state",
                    )
                if inst.built:
                    raise _refuse(start, f"a second BUILD sets state on {inst.describe()}")
                inst.built = True
                mutated.setdefault(inst.pair, set()).add(BUILD)
                _grow(inst, [state], start, "BUILD")
            elif op in (0x81, 0x92):  # NEWOBJ, NEWOBJ_EX
                kwargs = _PRIM_TAG
                if op == 0x92:
                    kwargs = stack.pop()
                    if kwargs.kind != _DICT:
                        raise _refuse(start, f"NEWOBJ_EX passes {kwargs.describe()} as its keyword arguments")
                args = stack.pop()
                cls = stack.pop()
                if cls.kind != _GLOBAL:
                    raise _refuse(start, f"NEWOBJ instantiates {cls.describe()}; only a named class may be")
                if args.kind != _TUPLE:
                    raise _refuse(start, f"NEWOBJ passes {args.describe()} as the argument tuple")
                instantiated.add(cls.pair)
                args.nested = kwargs.nested = True
                depth = args.depth if args.depth > kwargs.depth else kwargs.depth
                size = args.size + 1 + (kwargs.size if op == 0x92 else 0)
                stack.append(_result(cls.pair, depth + 1, size, start))
            elif op == 0x64:  # DICT
                items = stack
                stack = metastack.pop()
                if len(items) % 2:
                    raise SnapshotError(f"the pickle stream is malformed at byte {start}: odd number of DICT items")
                stack.append(_container(_DICT, items, start))
                hashing.charge(items, 2, start, stack[-1])
            elif op == 0x6C:  # LIST
                items = stack
                stack = metastack.pop()
                stack.append(_container(_LIST, items, start))
            elif op == 0x91:  # FROZENSET
                items = stack
                stack = metastack.pop()
                stack.append(_container(_FROZENSET, items, start))
                hashing.charge(items, 1, start, stack[-1])
            elif op == 0x6F:  # OBJ: MARK cls arg1 ... argN OBJ
                items = stack
                stack = metastack.pop()
                if not items or items[0].kind != _GLOBAL:
                    what = items[0].describe() if items else "nothing"
                    raise _refuse(start, f"OBJ instantiates {what}; only a named class may be")
                called.add(items[0].pair)
                args = _container(_TUPLE, items[1:], start)
                stack.append(_result(items[0].pair, args.depth, args.size, start))
            elif op in (0x63, 0x69):  # GLOBAL, INST: "module\nname\n" inline
                module_text, pos = _line(data, pos)
                name_text, pos = _line(data, pos)
                pair = _name_pair(module_text.decode("utf-8"), name_text.decode("utf-8"), start)
                found[pair] = None
                if op == 0x63:
                    stack.append(_Tag(_GLOBAL, pair))
                else:
                    items = stack
                    stack = metastack.pop()
                    called.add(pair)
                    args = _container(_TUPLE, items, start)
                    stack.append(_result(pair, args.depth, args.size, start))
            elif op == 0x32:  # DUP
                stack.append(stack[-1])
            elif op == 0x30:  # POP: the top value, or the MARK when the frame is empty (as the C unpickler does)
                if stack:
                    stack.pop()
                else:
                    stack = metastack.pop()
            elif op == 0x31:  # POP_MARK
                stack = metastack.pop()
            elif op == 0x98:  # READONLY_BUFFER
                if stack[-1].kind not in (_BUFFER, _BYTES):
                    raise _refuse(start, f"READONLY_BUFFER applies to {stack[-1].describe()}")
            elif op in (0x80, 0x95):  # PROTO, FRAME
                pos += 1 if op == 0x80 else 8
            elif op in (0x49, 0x4C, 0x46):  # INT, LONG, FLOAT (text)
                text, pos = _line(data, pos)
                if op == 0x46:
                    stack.append(_CHOSEN_TAG)
                else:  # up to 16 characters an int is below 2**55; a longer one as LONG1/LONG4 above
                    stack.append(_PRIM_TAG if len(text) <= 16 else _Tag(_PRIM, None, 0, 1 + len(text) // 8, _CHOSEN))
            elif op == 0x53:  # STRING (text)
                _, pos = _line(data, pos)
                stack.append(_UNKNOWN_STR)
            elif op == 0x56:  # UNICODE (raw-unicode-escape text)
                text, pos = _line(data, pos)
                stack.append(_Tag(_STR, text.decode("raw-unicode-escape")))
            elif op in (0x70, 0x67):  # PUT, GET (text index)
                text, pos = _line(data, pos)
                if op == 0x70:
                    memo[int(text)] = stack[-1]
                else:
                    stack.append(memo[int(text)])
            elif op in (0x82, 0x83, 0x84):  # EXT1, EXT2, EXT4
                raise _refuse(start, "an extension code (EXT1/2/4) names a global through copyreg's registry")
            elif op in (0x50, 0x51):  # PERSID, BINPERSID
                raise _refuse(start, "a persistent ID is not part of this format")
            elif op == 0x2E:  # STOP
                if pos != end or metastack or len(stack) != 1:
                    raise SnapshotError(f"the pickle stream is malformed at byte {start}: STOP with a bad stack")
                return StreamUses(
                    globals=tuple(found),
                    called=frozenset(called),
                    instantiated=frozenset(instantiated),
                    mutated={pair: frozenset(ops) for pair, ops in mutated.items()},
                    next_buffers=buffers,
                )
            else:
                raise SnapshotError(f"the pickle stream is malformed at byte {start}: unknown opcode {op:#04x}")
    except (IndexError, KeyError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, SnapshotError):
            raise
        raise SnapshotError(
            f"the pickle stream is malformed at byte {start}: {type(e).__name__} ({e}) while checking what it does"
        ) from None
    raise SnapshotError("the pickle stream ends without STOP")


# Note [One BUILD, and nothing appended after it]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# BUILD without a __setstate__ writes the state into the instance's __dict__, and the C unpickler looks up
# instance attributes afterwards: a second BUILD calls inst.__setstate__, APPEND(S) calls inst.extend or
# inst.append, ADDITEMS calls inst.add. If the first BUILD had put those names in the instance's __dict__, the
# stream would call whatever value it stored there (say, a function allow= admits as a value only). Pickle
# writes list items, dict items and then the state, and BUILD once per object, so a restricted load refuses a
# second BUILD and APPEND(S)/ADDITEMS after BUILD. SETITEM(S) is safe: __setitem__ is looked up on the type.


def _mutate(
    target: _Tag, op: str, own_kind: int, items: list[_Tag], pos: int, mutated: dict[tuple[str, str], set[str]]
) -> None:
    if target.kind == _RESULT:
        if target.built and op != SETITEM:
            opcode = "APPEND(S)" if op == APPEND else "ADDITEMS"
            raise _refuse(pos, f"{opcode} follows BUILD on {target.describe()}")
        mutated.setdefault(target.pair, set()).add(op)
    elif target.kind != own_kind:
        raise _refuse(
            pos,
            f"{_OPCODES[op]} applies to {target.describe()}; pickle's containers are filled only when they are "
            f"{_KIND_NAMES[own_kind]} built by the stream or an object this load created",
        )
    _grow(target, items, pos, _OPCODES[op])


_OPCODES = {SETITEM: "SETITEM(S)", APPEND: "APPEND(S)", ADD: "ADDITEMS"}


# The native helper reports mutated ops as bits (csrc/zerocopy_native.cpp, analyze_stream).
_OPS_BY_BITS = tuple(
    frozenset(op for bit, op in ((1, BUILD), (2, SETITEM), (4, APPEND), (8, ADD)) if bits & bit) for bits in range(16)
)


def _native_uses(stream: bytes) -> StreamUses | None:
    """:func:`zerocopy_pickle._trust.streamcheck.check_stream` + :func:`analyze` by the native helper when the native
    backend is active; ``None`` when it is not, or when the stream is refused or malformed (or holds what the
    helper leaves to Python): the Python checks then run and raise the precise error."""
    from .. import native  # imported on first use, as the rest of the library does (it may build the helpers)

    analyzer = native.stream_analyzer()
    if analyzer is None:
        return None
    code, _offset, payload = analyzer(stream)
    return None if code else _from_native(payload)


def _from_native(payload: tuple[Any, ...]) -> StreamUses:
    """The :class:`StreamUses` of a successful native analysis's payload."""
    found, called, instantiated, mutated, buffers = payload
    return StreamUses(
        globals=found,
        called=frozenset(called),
        instantiated=frozenset(instantiated),
        mutated={pair: _OPS_BY_BITS[bits] for pair, bits in mutated},
        next_buffers=buffers,
    )


# Note [Where the analysis may differ from the C unpickler]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Only on streams the C unpickler refuses at that very opcode, before running anything after it: a PUT with a
# negative text index (stored here, refused there). TUPLE2 and TUPLE3 over a frame with fewer items are refused
# here as there. The tags of every stream the C unpickler runs to the end are exact. A call's result counts one
# level deeper than its arguments (and may reach MAX_DEPTH + 1 itself); whatever contains it is checked. The
# native twin (csrc/, analyze_stream) reproduces these choices exactly.


# Note [The cost model]
# ~~~~~~~~~~~~~~~~~~~~~
# What a restricted load may cost is linear in its input (docs/security.md, "What a load may cost"). Three
# things in what the C unpickler does are not linear in the stream by themselves, and the analysis bounds each:
#
# * Nesting. Freeing, hashing and comparing a value recurse in C over its nesting. A container's depth is
#   known when it is put into another only if nothing is added to it afterwards, so a container that was put
#   into another value (`nested`) may not be filled or receive state any more (pickle writes that only for
#   a reference cycle: the object is referenced from inside itself before its own items follow). With that
#   rule every depth is exact, bounded by MAX_DEPTH, by MAX_UNPROTECTED_DEPTH below the two types CPython
#   frees recursively, and by MAX_KEY_DEPTH for what is hashed (tuple hashing recurses in C, in whatever
#   stack the loading thread has).
# * Expansion. A memo reference costs two bytes and repeats a whole value: t1 = (t0, t0), t2 = (t1, t1), ...
#   is 2**k elements from 5k bytes. Each tag carries its expanded `size` (exact by the rule above; saturating
#   at _SIZE_CAP), and every value the unpickler hashes (dict keys, set and frozenset members, whatever
#   SETITEM(S) and ADDITEMS hand an object's __setitem__ and add) is charged its size against one budget per
#   stream: HASH_FLOOR, or HASH_PER_BYTE per byte of stream. (Comparing happens only between keys of equal
#   hash, and costs at most what hashing the smaller one did.) The safe set's functions charge what they walk
#   or copy to the load's other budget (zerocopy_pickle.validate.charge).
# * Names. GLOBAL and STACK_GLOBAL names are at most MAX_NAME_LENGTH characters, and every check of a name is
#   linear in it (zerocopy_pickle._trust.restricted._module_blocked).
#
# Everything else the analysis does is a constant amount of work per opcode, and its memory is a tag per
# value the stream creates.


def _held(found: StreamUses) -> int:
    """About what a remembered analysis holds, in bytes (a tuple and two strings per global, a set entry per
    use): what bounds the analysis cache (:data:`ANALYSIS_CACHE_BYTES`)."""
    names = sum(len(module) + len(qualname) for module, qualname in found.globals)
    entries = len(found.globals) + len(found.called) + len(found.instantiated) + 2 * len(found.mutated)
    return names + 200 * entries


ANALYSIS_CACHE_BYTES = 32 << 20
"""What the analyses remembered for streams loaded again hold at most, all together (and at most 512 of them);
an analysis over a quarter of it is not remembered."""
_ANALYSED: streamcheck.DigestCache[StreamUses] = streamcheck.DigestCache(max_bytes=ANALYSIS_CACHE_BYTES, cost=_held)


def uses(stream: bytes) -> StreamUses:
    """:func:`zerocopy_pickle._trust.streamcheck.check_stream` then :func:`analyze`, remembered by the stream's BLAKE2b
    digest (a cryptographic digest, so no other stream can pose as an analysed one): loading the same snapshot
    again costs a hash of its stream.

    When the native backend is active (:func:`zerocopy_pickle.native.backend`), the native helper runs both
    checks in one pass (``analyze_stream`` in ``csrc/zerocopy_native.cpp``) and the Python ones run only when it
    reports an error, to raise it with the exact message. CPU time of the two checks (``time.process_time``,
    medians, ``benchmarks/semantics.py``, three runs on a shared machine): a 1000-tensor state dict stream (57 KB)
    19 to 28 ms in Python, 0.76 to 0.85 ms native; a GPT-ish module stream (25 KB) 10.6 to 16.2 ms against 0.40
    to 0.59 ms. A process's first restricted load of the state dict takes 1.1x to 1.4x a trusted load with the
    native helper, 2.8x to 3.4x without.

    Raises:
        SnapshotError, RestrictedLoadError: as the two checks do.
    """
    return _ANALYSED.get(stream, lambda: _analysed(stream))


def _analysed(stream: bytes) -> StreamUses:
    found = _native_uses(stream)  # None when the helper is not active or has a verdict the Python twin must word
    if found is not None:
        return found
    streamcheck.check_stream(stream)
    return analyze(stream)


def forget() -> None:
    """Drop every remembered analysis (benchmarks use it to time a stream's first restricted load)."""
    _ANALYSED.clear()
