"""Internal: the engine of the stream analysis (:mod:`zerocopy_pickle._trust.semantics`, which holds its entry
points and documents what it decides): :class:`_Analysis`, the tag stack, frames and memo of one run, with one
handler per opcode, found in a table by the opcode byte (:data:`_HANDLERS`): one per opcode family (the stack,
frames and memo; numbers, strings and bytes; tuples and the containers pickle builds and fills; globals, calls and
BUILD; out-of-band buffers and what is never run), and :class:`StreamUses`, what a run returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import SnapshotError
from .tags import (
    _BUFFER,
    _BUFFER_TAG,
    _BYTES,
    _BYTES_TAG,
    _CHOSEN,
    _CHOSEN_TAG,
    _DICT,
    _FROZENSET,
    _GLOBAL,
    _HASHK,
    _KNOWN,
    _LIST,
    _PRIM,
    _PRIM_TAG,
    _RESULT,
    _SET,
    _SIZE_CAP,
    _STR,
    _TUPLE,
    _UNKNOWN_STR,
    ADD,
    APPEND,
    BUILD,
    MAX_DEPTH,
    SETITEM,
    _container,
    _grow,
    _Hashing,
    _mutate,
    _name_pair,
    _refuse,
    _result,
    _Tag,
    _too_deep,
)


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


def _line(data: bytes, pos: int) -> tuple[bytes, int]:
    end = data.index(b"\n", pos)
    return data[pos:end], end + 1


class _Analysis:
    """One run of :func:`analyze`: the tag stack, its frames (one per open MARK), the memo, and what the stream
    was seen to do. :meth:`run` reads one opcode at a time and calls its handler (:data:`_HANDLERS`) with the
    opcode and the offset after it; the handler reads the opcode's argument from there, acts on the stack,
    and returns the offset after the argument (the opcode's own is that offset minus one). A handler raises
    where the opcode's check fails; an IndexError, KeyError, ValueError or UnicodeDecodeError it meets (an
    empty frame, a memo index never written, a bad text) is the stream's malformation, worded by :meth:`run`."""

    __slots__ = (
        "buffers", "called", "data", "found", "hashing", "instantiated", "memo", "metastack", "mutated", "stack",
        "strings",
    )  # fmt: skip

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.stack: list[_Tag] = []
        self.metastack: list[list[_Tag]] = []
        self.memo: dict[int, _Tag] = {}
        self.found: dict[tuple[str, str], None] = {}
        self.called: set[tuple[str, str]] = set()
        self.instantiated: set[tuple[str, str]] = set()
        self.mutated: dict[tuple[str, str], set[str]] = {}
        self.buffers = 0
        self.strings: dict[bytes, _Tag] = {}  # one immutable tag per distinct SHORT_BINUNICODE string
        self.hashing = _Hashing(len(data))

    def run(self) -> StreamUses:
        data = self.data
        end = len(data)
        memo = self.memo
        handlers = _HANDLERS
        pos = start = 0
        try:
            while pos < end:
                start = pos
                op = data[pos]
                if op == 0x94:  # MEMOIZE, a third of a snapshot's opcodes: here, without a call
                    memo[len(memo)] = self.stack[-1]
                    pos += 1
                elif op == 0x2E:  # STOP
                    return self.stop(pos + 1, end, start)
                else:
                    pos = handlers[op](self, op, pos + 1)
        except (IndexError, KeyError, ValueError, UnicodeDecodeError) as e:
            if isinstance(e, SnapshotError):
                raise
            raise SnapshotError(
                f"the pickle stream is malformed at byte {start}: {type(e).__name__} ({e}) while checking what it does"
            ) from None
        raise SnapshotError("the pickle stream ends without STOP")

    def stop(self, pos: int, end: int, start: int) -> StreamUses:
        if pos != end or self.metastack or len(self.stack) != 1:
            raise SnapshotError(f"the pickle stream is malformed at byte {start}: STOP with a bad stack")
        return StreamUses(
            globals=tuple(self.found),
            called=frozenset(self.called),
            instantiated=frozenset(self.instantiated),
            mutated={pair: frozenset(ops) for pair, ops in self.mutated.items()},
            next_buffers=self.buffers,
        )

    def frame(self) -> list[_Tag]:
        """Close the innermost MARK: its items, the stack below it becoming the stack again."""
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    # -- the stack, the frames and the memo --------------------------------------------------------------

    def binput(self, op: int, pos: int) -> int:  # BINPUT, LONG_BINPUT
        if op == 0x71:
            index = self.data[pos]
            pos += 1
        else:
            index = int.from_bytes(self.data[pos : pos + 4], "little")
            pos += 4
        self.memo[index] = self.stack[-1]
        return pos

    def binget(self, op: int, pos: int) -> int:  # BINGET
        self.stack.append(self.memo[self.data[pos]])
        return pos + 1

    def long_binget(self, op: int, pos: int) -> int:  # LONG_BINGET
        self.stack.append(self.memo[int.from_bytes(self.data[pos : pos + 4], "little")])
        return pos + 4

    def put_get(self, op: int, pos: int) -> int:  # PUT, GET (text index)
        text, pos = _line(self.data, pos)
        if op == 0x70:
            self.memo[int(text)] = self.stack[-1]
        else:
            self.stack.append(self.memo[int(text)])
        return pos

    def mark(self, op: int, pos: int) -> int:  # MARK
        self.metastack.append(self.stack)
        self.stack = []
        return pos

    def dup(self, op: int, pos: int) -> int:  # DUP
        stack = self.stack
        stack.append(stack[-1])
        return pos

    def pop(self, op: int, pos: int) -> int:  # POP: the top value, or the MARK when the frame is empty (as C does)
        if self.stack:
            self.stack.pop()
        else:
            self.stack = self.metastack.pop()
        return pos

    def pop_mark(self, op: int, pos: int) -> int:  # POP_MARK
        self.stack = self.metastack.pop()
        return pos

    def skip(self, op: int, pos: int) -> int:  # PROTO, FRAME
        return pos + (1 if op == 0x80 else 8)

    # -- numbers, strings and bytes ----------------------------------------------------------------------

    def binint1(self, op: int, pos: int) -> int:  # BININT1
        self.stack.append(_PRIM_TAG)
        return pos + 1

    def binint(self, op: int, pos: int) -> int:  # BININT, BININT2
        self.stack.append(_PRIM_TAG)
        return pos + (4 if op == 0x4A else 2)

    def constant(self, op: int, pos: int) -> int:  # NEWTRUE, NEWFALSE, NONE
        self.stack.append(_PRIM_TAG)
        return pos

    def binfloat(self, op: int, pos: int) -> int:  # BINFLOAT
        self.stack.append(_CHOSEN_TAG)
        return pos + 8

    def long(self, op: int, pos: int) -> int:  # LONG1, LONG4
        if op == 0x8A:
            n = self.data[pos]
            pos += 1 + n
        else:
            n = int.from_bytes(self.data[pos : pos + 4], "little", signed=True)
            pos += 4 + n
        # Up to 7 bytes an int hashes to itself (distinct); a longer one's hash is the stream's to
        # choose, and hashing it reads every digit, every time (ints do not cache their hash).
        self.stack.append(_PRIM_TAG if op == 0x8A and n <= 7 else _Tag(_PRIM, None, 0, 1 + n // 8, _CHOSEN))
        return pos

    def text_number(self, op: int, pos: int) -> int:  # INT, LONG, FLOAT (text)
        text, pos = _line(self.data, pos)
        if op == 0x46:
            self.stack.append(_CHOSEN_TAG)
        else:  # up to 16 characters an int is below 2**55; a longer one as LONG1/LONG4 above
            self.stack.append(_PRIM_TAG if len(text) <= 16 else _Tag(_PRIM, None, 0, 1 + len(text) // 8, _CHOSEN))
        return pos

    def short_binunicode(self, op: int, pos: int) -> int:  # SHORT_BINUNICODE (one immutable tag per string)
        data = self.data
        n = data[pos]
        raw = data[pos + 1 : pos + 1 + n]
        tag = self.strings.get(raw)
        if tag is None:
            tag = self.strings[raw] = _Tag(_STR, raw.decode("utf-8", "surrogatepass"))
        self.stack.append(tag)
        return pos + 1 + n

    def binunicode(self, op: int, pos: int) -> int:  # BINUNICODE, BINUNICODE8
        width = 4 if op == 0x58 else 8
        n = int.from_bytes(self.data[pos : pos + width], "little")
        pos += width
        self.stack.append(_Tag(_STR, self.data[pos : pos + n].decode("utf-8", "surrogatepass")))
        return pos + n

    def unicode(self, op: int, pos: int) -> int:  # UNICODE (raw-unicode-escape text)
        text, pos = _line(self.data, pos)
        self.stack.append(_Tag(_STR, text.decode("raw-unicode-escape")))
        return pos

    def binbytes(self, op: int, pos: int) -> int:  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
        width = 1 if op == 0x43 else 4 if op == 0x42 else 8
        n = int.from_bytes(self.data[pos : pos + width], "little")
        self.stack.append(_BYTES_TAG)
        return pos + width + n

    def binstring(self, op: int, pos: int) -> int:  # SHORT_BINSTRING, BINSTRING (the unpickler's encoding)
        width = 1 if op == 0x55 else 4
        n = int.from_bytes(self.data[pos : pos + width], "little", signed=op == 0x54)
        self.stack.append(_UNKNOWN_STR)
        return pos + width + n

    def string(self, op: int, pos: int) -> int:  # STRING (text)
        _, pos = _line(self.data, pos)
        self.stack.append(_UNKNOWN_STR)
        return pos

    # -- tuples, and the containers pickle builds and fills -----------------------------------------------

    def tuple1(self, op: int, pos: int) -> int:  # TUPLE1
        stack = self.stack
        item = stack[-1]
        if item.depth >= MAX_DEPTH:
            raise _too_deep(pos - 1)
        item.nested = True
        stack[-1] = _Tag(_TUPLE, None, item.depth + 1, min(item.size + 1, _SIZE_CAP), _HASHK[1 << item.hashk])
        return pos

    def tuple2(self, op: int, pos: int) -> int:  # TUPLE2
        stack = self.stack
        second = stack.pop()
        first = stack[-1]
        depth = first.depth
        if second.depth > depth:  # noqa: PLR1730 - cheaper than max() on this hot path
            depth = second.depth
        if depth >= MAX_DEPTH:
            raise _too_deep(pos - 1)
        first.nested = second.nested = True
        stack[-1] = _Tag(
            _TUPLE,
            None,
            depth + 1,
            min(first.size + second.size + 1, _SIZE_CAP),
            _HASHK[(1 << first.hashk) | (1 << second.hashk)],
        )
        return pos

    def tuple3(self, op: int, pos: int) -> int:  # TUPLE3
        stack = self.stack
        if len(stack) < 3:
            raise SnapshotError(f"the pickle stream is malformed at byte {pos - 1}: TUPLE3 needs 3 items")
        stack[-3:] = [_container(_TUPLE, stack[-3:], pos - 1)]
        return pos

    def to_tuple(self, op: int, pos: int) -> int:  # TUPLE
        items = self.frame()
        self.stack.append(_container(_TUPLE, items, pos - 1))
        return pos

    def to_list(self, op: int, pos: int) -> int:  # LIST
        items = self.frame()
        self.stack.append(_container(_LIST, items, pos - 1))
        return pos

    def to_dict(self, op: int, pos: int) -> int:  # DICT
        items = self.frame()
        if len(items) % 2:
            raise SnapshotError(f"the pickle stream is malformed at byte {pos - 1}: odd number of DICT items")
        self.stack.append(_container(_DICT, items, pos - 1))
        self.hashing.charge(items, 2, pos - 1, self.stack[-1])
        return pos

    def to_frozenset(self, op: int, pos: int) -> int:  # FROZENSET
        items = self.frame()
        self.stack.append(_container(_FROZENSET, items, pos - 1))
        self.hashing.charge(items, 1, pos - 1, self.stack[-1])
        return pos

    def empty(self, op: int, pos: int) -> int:  # EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, EMPTY_SET
        if op == 0x7D:
            self.stack.append(_Tag(_DICT, None, 1))
        elif op == 0x5D:
            self.stack.append(_Tag(_LIST, None, 1))
        elif op == 0x29:
            self.stack.append(_Tag(_TUPLE, None, 1, 1, _KNOWN))
        else:
            self.stack.append(_Tag(_SET, None, 1))
        return pos

    def setitems(self, op: int, pos: int) -> int:  # SETITEMS
        items = self.frame()
        if len(items) % 2:
            raise SnapshotError(f"the pickle stream is malformed at byte {pos - 1}: odd number of SETITEMS items")
        _mutate(self.stack[-1], SETITEM, _DICT, items, pos - 1, self.mutated)
        self.hashing.charge(items, 2, pos - 1, self.stack[-1])
        return pos

    def setitem(self, op: int, pos: int) -> int:  # SETITEM
        stack = self.stack
        value = stack.pop()
        key = stack.pop()
        _mutate(stack[-1], SETITEM, _DICT, [key, value], pos - 1, self.mutated)
        self.hashing.charge([key], 1, pos - 1, stack[-1])
        return pos

    def appends(self, op: int, pos: int) -> int:  # APPENDS
        items = self.frame()
        _mutate(self.stack[-1], APPEND, _LIST, items, pos - 1, self.mutated)
        return pos

    def append(self, op: int, pos: int) -> int:  # APPEND
        stack = self.stack
        item = stack.pop()
        _mutate(stack[-1], APPEND, _LIST, [item], pos - 1, self.mutated)
        return pos

    def additems(self, op: int, pos: int) -> int:  # ADDITEMS
        items = self.frame()
        _mutate(self.stack[-1], ADD, _SET, items, pos - 1, self.mutated)
        self.hashing.charge(items, 1, pos - 1, self.stack[-1])
        return pos

    # -- globals, calls, and state set on what they made -------------------------------------------------

    def stack_global(self, op: int, pos: int) -> int:  # STACK_GLOBAL
        stack = self.stack
        name = stack.pop()
        module = stack.pop()
        if module.kind != _STR or name.kind != _STR or module.pair is None or name.pair is None:
            raise _refuse(pos - 1, "STACK_GLOBAL takes its names from values that are not string literals")
        pair = _name_pair(module.pair, name.pair, pos - 1)
        self.found[pair] = None
        stack.append(_Tag(_GLOBAL, pair))
        return pos

    def global_inst(self, op: int, pos: int) -> int:  # GLOBAL, INST: "module\nname\n" inline
        start = pos - 1
        module_text, pos = _line(self.data, pos)
        name_text, pos = _line(self.data, pos)
        pair = _name_pair(module_text.decode("utf-8"), name_text.decode("utf-8"), start)
        self.found[pair] = None
        if op == 0x63:
            self.stack.append(_Tag(_GLOBAL, pair))
        else:
            items = self.frame()
            self.called.add(pair)
            args = _container(_TUPLE, items, start)
            self.stack.append(_result(pair, args.depth, args.size, start))
        return pos

    def reduce(self, op: int, pos: int) -> int:  # REDUCE
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        if func.kind != _GLOBAL:
            raise _refuse(pos - 1, f"REDUCE calls {func.describe()}; only a global the stream names may be called")
        if args.kind != _TUPLE:
            raise _refuse(pos - 1, f"REDUCE passes {args.describe()} as the argument tuple")
        self.called.add(func.pair)
        args.nested = True
        stack[-1] = _result(func.pair, args.depth + 1, args.size + 1, pos - 1)
        return pos

    def obj(self, op: int, pos: int) -> int:  # OBJ: MARK cls arg1 ... argN OBJ
        items = self.frame()
        if not items or items[0].kind != _GLOBAL:
            what = items[0].describe() if items else "nothing"
            raise _refuse(pos - 1, f"OBJ instantiates {what}; only a named class may be")
        self.called.add(items[0].pair)
        args = _container(_TUPLE, items[1:], pos - 1)
        self.stack.append(_result(items[0].pair, args.depth, args.size, pos - 1))
        return pos

    def newobj(self, op: int, pos: int) -> int:  # NEWOBJ, NEWOBJ_EX
        stack = self.stack
        start = pos - 1
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
        self.instantiated.add(cls.pair)
        args.nested = kwargs.nested = True
        depth = args.depth if args.depth > kwargs.depth else kwargs.depth
        size = args.size + 1 + (kwargs.size if op == 0x92 else 0)
        stack.append(_result(cls.pair, depth + 1, size, start))
        return pos

    def build(self, op: int, pos: int) -> int:  # BUILD
        stack = self.stack
        state = stack.pop()
        inst = stack[-1]
        if inst.kind != _RESULT:
            raise _refuse(
                pos - 1,
                f"BUILD sets state on {inst.describe()}; only objects this load created by calling an allowed class "
                f"may receive state",
            )
        if inst.built:
            raise _refuse(pos - 1, f"a second BUILD sets state on {inst.describe()}")
        inst.built = True
        self.mutated.setdefault(inst.pair, set()).add(BUILD)
        _grow(inst, [state], pos - 1, "BUILD")
        return pos

    # -- out-of-band buffers, and what a restricted load never runs --------------------------------------

    def next_buffer(self, op: int, pos: int) -> int:  # NEXT_BUFFER
        self.buffers += 1
        self.stack.append(_BUFFER_TAG)
        return pos

    def readonly_buffer(self, op: int, pos: int) -> int:  # READONLY_BUFFER
        if self.stack[-1].kind not in (_BUFFER, _BYTES):
            raise _refuse(pos - 1, f"READONLY_BUFFER applies to {self.stack[-1].describe()}")
        return pos

    def extension(self, op: int, pos: int) -> int:  # EXT1, EXT2, EXT4
        raise _refuse(pos - 1, "an extension code (EXT1/2/4) names a global through copyreg's registry")

    def persistent_id(self, op: int, pos: int) -> int:  # PERSID, BINPERSID
        raise _refuse(pos - 1, "a persistent ID is not part of this format")

    def unknown(self, op: int, pos: int) -> int:
        raise SnapshotError(f"the pickle stream is malformed at byte {pos - 1}: unknown opcode {op:#04x}")


# Each opcode's handler (MEMOIZE and STOP are the loop's own); every other byte is an unknown opcode.
_BY_OPCODE: dict[int, Callable[[_Analysis, int, int], int]] = {
    0x71: _Analysis.binput, 0x72: _Analysis.binput, 0x68: _Analysis.binget, 0x6A: _Analysis.long_binget,
    0x70: _Analysis.put_get, 0x67: _Analysis.put_get, 0x28: _Analysis.mark, 0x32: _Analysis.dup,
    0x30: _Analysis.pop, 0x31: _Analysis.pop_mark, 0x80: _Analysis.skip, 0x95: _Analysis.skip,
    0x4B: _Analysis.binint1, 0x4A: _Analysis.binint, 0x4D: _Analysis.binint, 0x88: _Analysis.constant,
    0x89: _Analysis.constant, 0x4E: _Analysis.constant, 0x47: _Analysis.binfloat, 0x8A: _Analysis.long,
    0x8B: _Analysis.long, 0x49: _Analysis.text_number, 0x4C: _Analysis.text_number, 0x46: _Analysis.text_number,
    0x8C: _Analysis.short_binunicode, 0x58: _Analysis.binunicode, 0x8D: _Analysis.binunicode,
    0x56: _Analysis.unicode, 0x43: _Analysis.binbytes, 0x42: _Analysis.binbytes, 0x8E: _Analysis.binbytes,
    0x96: _Analysis.binbytes, 0x55: _Analysis.binstring, 0x54: _Analysis.binstring, 0x53: _Analysis.string,
    0x85: _Analysis.tuple1, 0x86: _Analysis.tuple2, 0x87: _Analysis.tuple3, 0x74: _Analysis.to_tuple,
    0x6C: _Analysis.to_list, 0x64: _Analysis.to_dict, 0x91: _Analysis.to_frozenset, 0x7D: _Analysis.empty,
    0x5D: _Analysis.empty, 0x29: _Analysis.empty, 0x8F: _Analysis.empty, 0x75: _Analysis.setitems,
    0x73: _Analysis.setitem, 0x65: _Analysis.appends, 0x61: _Analysis.append, 0x90: _Analysis.additems,
    0x93: _Analysis.stack_global, 0x63: _Analysis.global_inst, 0x69: _Analysis.global_inst,
    0x52: _Analysis.reduce, 0x6F: _Analysis.obj, 0x81: _Analysis.newobj, 0x92: _Analysis.newobj,
    0x62: _Analysis.build, 0x97: _Analysis.next_buffer, 0x98: _Analysis.readonly_buffer,
    0x82: _Analysis.extension, 0x83: _Analysis.extension, 0x84: _Analysis.extension,
    0x50: _Analysis.persistent_id, 0x51: _Analysis.persistent_id,
}  # fmt: skip
_HANDLERS: tuple[Callable[[_Analysis, int, int], int], ...] = tuple(
    _BY_OPCODE.get(op, _Analysis.unknown) for op in range(256)
)


# Note [Where the analysis may differ from the C unpickler]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Only on streams the C unpickler refuses at that very opcode, before running anything after it: a PUT with a
# negative text index (stored here, refused there). TUPLE2 and TUPLE3 over a frame with fewer items are refused
# here as there. The tags of every stream the C unpickler runs to the end are exact. A call's result counts one
# level deeper than its arguments (and may reach MAX_DEPTH + 1 itself); whatever contains it is checked. The
# native twin (csrc/, analyze_stream) reproduces these choices exactly.
