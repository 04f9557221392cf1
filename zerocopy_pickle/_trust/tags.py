"""Internal: the tags the stream analysis (:mod:`zerocopy_pickle._trust.semantics`) runs a pickle stream over, and
the cost model's bounds on them (Note [The cost model]).

A tag stands for one value the C unpickler will hold: what kind of value it is (a primitive, a string with its
text, a container built by pickle's own opcodes, a global, a call's result, a buffer), how deep it nests, its
expanded size and how it hashes. Putting tags into containers (:func:`_container`, :func:`_grow`,
:func:`_result`) checks the nesting bounds, :func:`_mutate` what a container opcode may fill, and
:class:`_Hashing` charges what the unpickler will hash against the stream's budgets; the refusals those checks
raise are built here too.
"""

from __future__ import annotations

from typing import Any

from ..errors import RestrictedLoadError, SnapshotError

BUILD, SETITEM, APPEND, ADD = "build", "setitem", "append", "add"
"""What the mutating opcodes do, as :class:`~zerocopy_pickle._trust.semantics.StreamUses` names them."""

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
#   linear in it (zerocopy_pickle._trust.blocklist._module_blocked).
#
# Everything else the analysis does is a constant amount of work per opcode, and its memory is a tag per
# value the stream creates.
