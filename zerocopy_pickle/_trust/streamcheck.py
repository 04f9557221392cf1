"""Internal: A bounds check of a pickle stream, opcode by opcode, before the C unpickler runs it.

The C unpickler trusts its input's arithmetic: a ``LONG_BINPUT`` with index 2**31 makes it grow its memo to
16 GiB; a stream of ``DUP`` opcodes grows its stack by 8 bytes per input byte; a length prefix is allocated
before it is read. :func:`check_stream` walks the opcodes once, without building anything, and rejects what
no pickler writes:

* bytes after ``STOP``, or a stream that ends without one;
* a length or frame that runs past the end of the stream;
* a memo index beyond the number of memo writes so far (picklers number the memo densely), a memo read of an
  index never written;
* a stack deeper than :data:`MAX_STACK`, or ``MARK`` nesting deeper than :data:`MAX_MARKS`; stack underflow;
* more ``NEXT_BUFFER`` opcodes than the snapshot has buffers (the caller compares the count);
* persistent IDs (this format never writes them) and unknown opcodes.

With ``collect_globals`` it also lists the globals the stream names (``GLOBAL``, ``INST``, and ``STACK_GLOBAL``
fed by string opcodes or the memo), which is what :func:`zerocopy_pickle.scan` reports.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import SnapshotError

MAX_STACK = 1 << 20
"""Deepest unpickler stack accepted. Picklers batch container items by the thousand; 1M is far beyond any
real stream and bounds a DUP bomb to 8 MiB of stack."""
MAX_MARKS = 50_000
"""Deepest MARK nesting accepted (a nesting level per container being built; picklers stop near 1000)."""
DYNAMIC = ("<dynamic>", "<dynamic>")
"""Reported for a STACK_GLOBAL whose names are not string literals (only a hand-made stream does that)."""

# Opcode kinds.
_PLAIN, _ARG1, _ARG2, _ARG4, _ARG8, _LEN1, _LEN4, _LEN8, _LINE, _LINE2 = range(10)
# Stack effects: pops, pushes; or a MARK-consuming form.
_TO_MARK_PUSH, _TO_MARK, _MARK = -1, -2, -3

# opcode byte -> (name, argument kind, pops, pushes). pops < 0 selects a MARK-consuming form.
_TABLE: dict[int, tuple[str, int, int, int]] = {
    ord(c): entry
    for c, entry in {
        "(": ("MARK", _PLAIN, _MARK, 0),
        ".": ("STOP", _PLAIN, 1, 0),
        "0": ("POP", _PLAIN, 1, 0),
        "1": ("POP_MARK", _PLAIN, _TO_MARK, 0),
        "2": ("DUP", _PLAIN, 1, 2),
        "N": ("NONE", _PLAIN, 0, 1),
        "a": ("APPEND", _PLAIN, 2, 1),
        "b": ("BUILD", _PLAIN, 2, 1),
        "d": ("DICT", _PLAIN, _TO_MARK_PUSH, 1),
        "}": ("EMPTY_DICT", _PLAIN, 0, 1),
        "e": ("APPENDS", _PLAIN, _TO_MARK, 0),
        "l": ("LIST", _PLAIN, _TO_MARK_PUSH, 1),
        "]": ("EMPTY_LIST", _PLAIN, 0, 1),
        "o": ("OBJ", _PLAIN, _TO_MARK_PUSH, 1),
        "R": ("REDUCE", _PLAIN, 2, 1),
        "s": ("SETITEM", _PLAIN, 3, 1),
        "t": ("TUPLE", _PLAIN, _TO_MARK_PUSH, 1),
        ")": ("EMPTY_TUPLE", _PLAIN, 0, 1),
        "u": ("SETITEMS", _PLAIN, _TO_MARK, 0),
        "Q": ("BINPERSID", _PLAIN, 1, 1),
        "\x81": ("NEWOBJ", _PLAIN, 2, 1),
        "\x85": ("TUPLE1", _PLAIN, 1, 1),
        "\x86": ("TUPLE2", _PLAIN, 2, 1),
        "\x87": ("TUPLE3", _PLAIN, 3, 1),
        "\x88": ("NEWTRUE", _PLAIN, 0, 1),
        "\x89": ("NEWFALSE", _PLAIN, 0, 1),
        "\x8f": ("EMPTY_SET", _PLAIN, 0, 1),
        "\x90": ("ADDITEMS", _PLAIN, _TO_MARK, 0),
        "\x91": ("FROZENSET", _PLAIN, _TO_MARK_PUSH, 1),
        "\x92": ("NEWOBJ_EX", _PLAIN, 3, 1),
        "\x93": ("STACK_GLOBAL", _PLAIN, 2, 1),
        "\x94": ("MEMOIZE", _PLAIN, 1, 1),
        "\x97": ("NEXT_BUFFER", _PLAIN, 0, 1),
        "\x98": ("READONLY_BUFFER", _PLAIN, 1, 1),
        "J": ("BININT", _ARG4, 0, 1),
        "K": ("BININT1", _ARG1, 0, 1),
        "M": ("BININT2", _ARG2, 0, 1),
        "h": ("BINGET", _ARG1, 0, 1),
        "j": ("LONG_BINGET", _ARG4, 0, 1),
        "q": ("BINPUT", _ARG1, 1, 1),
        "r": ("LONG_BINPUT", _ARG4, 1, 1),
        "G": ("BINFLOAT", _ARG8, 0, 1),
        "\x80": ("PROTO", _ARG1, 0, 0),
        "\x82": ("EXT1", _ARG1, 0, 1),
        "\x83": ("EXT2", _ARG2, 0, 1),
        "\x84": ("EXT4", _ARG4, 0, 1),
        "\x95": ("FRAME", _ARG8, 0, 0),
        "U": ("SHORT_BINSTRING", _LEN1, 0, 1),
        "T": ("BINSTRING", _LEN4, 0, 1),
        "C": ("SHORT_BINBYTES", _LEN1, 0, 1),
        "B": ("BINBYTES", _LEN4, 0, 1),
        "\x8e": ("BINBYTES8", _LEN8, 0, 1),
        "\x8c": ("SHORT_BINUNICODE", _LEN1, 0, 1),
        "X": ("BINUNICODE", _LEN4, 0, 1),
        "\x8d": ("BINUNICODE8", _LEN8, 0, 1),
        "\x96": ("BYTEARRAY8", _LEN8, 0, 1),
        "\x8a": ("LONG1", _LEN1, 0, 1),
        "\x8b": ("LONG4", _LEN4, 0, 1),
        "I": ("INT", _LINE, 0, 1),
        "L": ("LONG", _LINE, 0, 1),
        "F": ("FLOAT", _LINE, 0, 1),
        "S": ("STRING", _LINE, 0, 1),
        "V": ("UNICODE", _LINE, 0, 1),
        "P": ("PERSID", _LINE, 0, 1),
        "g": ("GET", _LINE, 0, 1),
        "p": ("PUT", _LINE, 1, 1),
        "c": ("GLOBAL", _LINE2, 0, 1),
        "i": ("INST", _LINE2, _TO_MARK_PUSH, 1),
    }.items()
}
_STRINGS = {ord(c) for c in "UTCB\x8e\x8c\x8dX\x96SV"}
_UNICODE = {ord(c) for c in "\x8c\x8dXV"}
_MEMO_PUT = {ord("q"), ord("r"), ord("p"), ord("\x94")}
_MEMO_GET = {ord("h"), ord("j"), ord("g")}
_STOP, _NEXT_BUFFER, _PERSIDS = ord("."), ord("\x97"), {ord("P"), ord("Q")}
_SIGNED_LENGTHS = {ord("T"), ord("\x8b")}  # BINSTRING, LONG4; the other 4-byte lengths are unsigned
_KEEPS_TOP = {ord("q"), ord("r"), ord("p"), ord("\x94"), ord("\x98")}  # pop one, push it back unchanged
_DUP = ord("2")
_STACK_GLOBAL, _MEMOIZE = ord("\x93"), ord("\x94")


@dataclass(frozen=True)
class StreamFacts:
    """What the check learned: buffers the stream consumes, and (if collected) the globals it names."""

    next_buffers: int
    globals: tuple[tuple[str, str], ...]


def _fail(message: str, pos: int) -> SnapshotError:
    return SnapshotError(f"the pickle stream is malformed at byte {pos}: {message}")


def walk_stream(stream: bytes | bytearray | memoryview, *, collect_globals: bool = False) -> StreamFacts:
    """Walk every opcode of ``stream``, checking the bounds listed in this module's docstring, and (with
    ``collect_globals``) list the globals it names. :func:`check_stream` is the faster twin used on every load;
    the two must accept exactly the same streams (tests compare them).

    Raises:
        SnapshotError: naming the first violation and its byte offset in the stream.
    """
    data = bytes(stream) if not isinstance(stream, bytes) else stream
    return _Walk(data, collect_globals).run()


class _Walk:
    """One run of :func:`walk_stream`. Each opcode is checked in one order: its argument (:meth:`argument`, or
    :meth:`plain` for one without), persistent IDs, its stack effect (:meth:`stack_effect`), the stack's depth,
    and STOP's end of the stream. With ``collect``, a shadow of the stack's top values (strings only) and of
    the memo follows the opcodes, for the names STACK_GLOBAL takes."""

    __slots__ = ("collect", "data", "depth", "end", "found", "marks", "memo_size", "memo_values", "next_buffers",
                 "pos", "shadow")  # fmt: skip

    def __init__(self, data: bytes, collect: bool) -> None:
        self.data = data
        self.end = len(data)
        self.collect = collect
        self.pos = 0
        self.depth = 0
        self.marks: list[int] = []
        self.memo_size = 0  # highest memo index written + 1
        self.next_buffers = 0
        self.found: dict[tuple[str, str], None] = {}
        self.shadow: list[object] = []
        self.memo_values: dict[int, object] = {}

    def run(self) -> StreamFacts:
        data = self.data
        end = self.end
        table = _TABLE
        while self.pos < end:
            op = data[self.pos]
            entry = table.get(op)
            if entry is None:
                raise _fail(f"unknown opcode {op:#04x}", self.pos)
            start = self.pos
            self.pos += 1
            name, kind, pops, pushes = entry
            value = self.argument(op, name, kind, start) if kind != _PLAIN else self.plain(op)
            if op in _PERSIDS:
                raise _fail("persistent IDs are not part of this format", start)
            self.stack_effect(op, name, pops, pushes, value, start)
            if self.depth > MAX_STACK:
                raise _fail(f"the stack grows deeper than {MAX_STACK} items", start)
            if op == _STOP:
                if self.pos != end:
                    raise _fail(f"{end - self.pos} byte(s) after STOP", self.pos)
                if self.marks:
                    raise _fail("STOP inside an unclosed MARK", start)
                return StreamFacts(self.next_buffers, tuple(self.found))
        raise _fail("the stream ends without STOP", end)

    def plain(self, op: int) -> object:
        """What an opcode without an argument does to the memo, the buffer count and the names."""
        if op == _MEMOIZE:
            if self.collect:
                self.memo_values[self.memo_size] = self.shadow[-1] if self.shadow else None
            self.memo_size += 1
        elif op == _NEXT_BUFFER:
            self.next_buffers += 1
        elif op == _STACK_GLOBAL and self.collect:
            top = self.shadow[-2:] if len(self.shadow) >= 2 else []
            if len(top) == 2 and isinstance(top[0], str) and isinstance(top[1], str):
                self.found[top[0], top[1]] = None
            else:
                self.found[DYNAMIC] = None
        return None

    def argument(self, op: int, name: str, kind: int, start: int) -> object:
        """Read the argument of the opcode at ``start`` (moving ``pos`` past it) and check it and its memo index;
        the value it pushes, as far as the shadow follows it (a string, or what a memo read fetches)."""
        end = self.end
        pos = self.pos
        value: object = None
        arg = 0
        width = _WIDTHS.get(kind, 0)
        if pos + width > end:
            raise _fail(f"{name} argument runs past the end of the stream", start)
        if kind in (_ARG1, _ARG2, _ARG4, _ARG8):
            arg, pos = int.from_bytes(self.data[pos : pos + width], "little"), pos + width
        elif kind in (_LEN1, _LEN4, _LEN8):
            pos, value = self.counted(op, name, width, pos, start)
        else:  # newline-terminated argument(s)
            pos, arg, value = self.lines(op, name, kind, pos, start)
        self.pos = pos
        if pos > end:
            raise _fail(f"{name} argument runs past the end of the stream", start)
        if op in _MEMO_PUT:
            if arg > self.memo_size:
                raise _fail(f"{name} index {arg} skips ahead of the memo ({self.memo_size} entries)", start)
            self.memo_size = max(self.memo_size, arg + 1)
            if self.collect:
                self.memo_values[arg] = self.shadow[-1] if self.shadow else None
        elif op in _MEMO_GET:
            if arg >= self.memo_size:
                raise _fail(f"{name} reads memo index {arg}, which was never written", start)
            if self.collect:
                value = self.memo_values.get(arg)
        elif kind == _ARG8 and name == "FRAME" and arg > end - pos:
            raise _fail(f"FRAME of {arg} bytes runs past the end of the stream", start)
        return value

    def counted(self, op: int, name: str, width: int, pos: int, start: int) -> tuple[int, object]:
        """A length-prefixed argument at ``pos``: the offset after it, and its text if the shadow keeps it."""
        data = self.data
        end = self.end
        length = int.from_bytes(data[pos : pos + width], "little", signed=op in _SIGNED_LENGTHS)
        pos += width
        if length < 0 or length > end - pos:
            raise _fail(f"{name} length {length} runs past the end of the stream ({end - pos} bytes left)", start)
        value: object = None
        if self.collect and op in _UNICODE:
            try:
                value = data[pos : pos + length].decode("utf-8", "surrogatepass")
            except UnicodeDecodeError as e:
                raise _fail(f"{name} is not UTF-8 ({e.reason})", start) from None
        return pos + length, value

    def lines(self, op: int, name: str, kind: int, pos: int, start: int) -> tuple[int, int, object]:
        """A newline-terminated argument (two lines for GLOBAL and INST) at ``pos``: the offset after it, its
        memo index (for PUT and GET), and its text if the shadow keeps it; GLOBAL's and INST's names are noted."""
        data = self.data
        lines = 2 if kind == _LINE2 else 1
        line_start = pos
        for _ in range(lines):
            newline = data.find(b"\n", pos)
            if newline < 0:
                raise _fail(f"{name} argument has no terminating newline", start)
            pos = newline + 1
        text = data[line_start : pos - 1]
        arg = 0
        value: object = None
        if op in _MEMO_PUT or op in _MEMO_GET:
            try:
                arg = int(text)
            except ValueError:
                raise _fail(f"{name} index {text[:20]!r} is not an integer", start) from None
        elif kind == _LINE2 and self.collect:
            module, _, qualname = text.decode("utf-8", "replace").partition("\n")
            self.found[module, qualname] = None
        elif self.collect and op in _UNICODE:
            value = text.decode("raw-unicode-escape", "replace")
        return pos, arg, value

    def stack_effect(self, op: int, name: str, pops: int, pushes: int, value: object, start: int) -> None:
        """Pop and push as the opcode does (to its MARK, for the MARK-consuming forms), checking underflow."""
        shadow = self.shadow
        if pops >= 0:
            if self.depth < pops:
                raise _fail(f"{name} needs {pops} stack item(s), the stack has {self.depth}", start)
            self.depth += pushes - pops
            if self.collect and op not in _KEEPS_TOP:
                if op == _DUP:
                    shadow.append(shadow[-1] if shadow else None)
                else:
                    del shadow[len(shadow) - min(pops, len(shadow)) :]
                    shadow.extend([value] * pushes)
        elif pops == _MARK:
            if len(self.marks) >= MAX_MARKS:
                raise _fail(f"MARK nesting deeper than {MAX_MARKS}", start)
            self.marks.append(self.depth)
        else:
            if not self.marks:
                raise _fail(f"{name} without a MARK", start)
            self.depth = self.marks.pop()
            if self.collect:
                del shadow[self.depth :]
            if pops == _TO_MARK_PUSH:
                self.depth += 1
                if self.collect:
                    shadow.append(None)
            elif name in ("APPENDS", "SETITEMS", "ADDITEMS") and self.depth < 1:
                raise _fail(f"{name} has no container below its MARK", start)


# -- the fast check ---------------------------------------------------------------------------------------------
# The same checks as walk_stream, specialised for speed (it runs on every load): one table lookup per opcode
# giving (action, argument width, pops, stack delta), branches ordered by how often snapshot streams use them.
(_A_PLAIN, _A_GET, _A_MEMOIZE, _A_COUNTED, _A_FIXED, _A_MARK, _A_TO_MARK, _A_TO_MARK_PUSH, _A_BUFFER, _A_PUT,
 _A_FRAME, _A_STOP, _A_LINE, _A_PERSID) = range(14)  # fmt: skip
_WIDTHS = {_ARG1: 1, _ARG2: 2, _ARG4: 4, _ARG8: 8, _LEN1: 1, _LEN4: 4, _LEN8: 8}


def _fast_entry(op: int, name: str, kind: int, pops: int, pushes: int) -> tuple[int, int, int, int]:
    width = _WIDTHS.get(kind, 0)
    if op in _PERSIDS:
        return _A_PERSID, 0, 0, 0
    if pops == _MARK:
        return _A_MARK, 0, 0, 0
    if kind in (_LINE, _LINE2):
        return _A_LINE, 0, 0, 0
    if pops == _TO_MARK:
        return _A_TO_MARK, 0, 0, 0
    if pops == _TO_MARK_PUSH:
        return _A_TO_MARK_PUSH, 0, 0, 0
    action = {
        "MEMOIZE": _A_MEMOIZE, "BINPUT": _A_PUT, "LONG_BINPUT": _A_PUT, "BINGET": _A_GET, "LONG_BINGET": _A_GET,
        "NEXT_BUFFER": _A_BUFFER, "STOP": _A_STOP, "FRAME": _A_FRAME,
    }.get(name)  # fmt: skip
    if action is None:
        action = _A_PLAIN if kind == _PLAIN else _A_FIXED if kind in (_ARG1, _ARG2, _ARG4, _ARG8) else _A_COUNTED
    return action, width, pops, pushes - pops


_FAST: list[tuple[int, int, int, int] | None] = [None] * 256
for _op, (_name, _kind, _pops, _pushes) in _TABLE.items():
    _FAST[_op] = _fast_entry(_op, _name, _kind, _pops, _pushes)


def check_stream(stream: bytes | bytearray | memoryview) -> int:
    """Check the bounds listed in this module's docstring; return the number of ``NEXT_BUFFER`` opcodes.

    One loop of about 80 lines, on purpose: every trusted load runs it over the whole stream, and locals bound
    once (the opcode table, ``int.from_bytes``) with no call per opcode make it about 3x as fast as the
    readable walk (:func:`walk_stream`, whose handlers it mirrors and which it asks for the message when a bound
    is broken; ``tests/test_fuzz.py`` keeps the two in agreement).

    Raises:
        SnapshotError: the stream breaks a bound (the message comes from :func:`walk_stream`, which names
            the first violation and its offset).
    """
    data = bytes(stream) if not isinstance(stream, bytes) else stream
    end = len(data)
    pos = depth = memo = buffers = 0
    marks: list[int] = []
    table = _FAST
    from_bytes = int.from_bytes
    try:
        while pos < end:
            entry = table[data[pos]]
            if entry is None:
                break
            action, width, pops, delta = entry
            pos += 1
            if action == _A_PLAIN:
                if depth < pops:
                    break
                depth += delta
            elif action == _A_MEMOIZE:
                if depth < 1:
                    break
                memo += 1
            elif action == _A_GET:
                index = data[pos] if width == 1 else from_bytes(data[pos : pos + 4], "little")
                pos += width
                if index >= memo:
                    break
                depth += 1
            elif action == _A_COUNTED:
                if width == 1:
                    length = data[pos]
                else:
                    length = from_bytes(data[pos : pos + width], "little", signed=data[pos - 1] in _SIGNED_LENGTHS)
                pos += width
                if length < 0 or length > end - pos:
                    break
                pos += length
                depth += 1
            elif action == _A_FIXED:
                pos += width
                if depth < pops:
                    break
                depth += delta
            elif action == _A_MARK:
                if len(marks) >= MAX_MARKS:
                    break
                marks.append(depth)
            elif action == _A_TO_MARK:
                depth = marks.pop()
                op = data[pos - 1]
                if op != _POP_MARK and depth < 1:
                    break
            elif action == _A_TO_MARK_PUSH:
                depth = marks.pop() + 1
            elif action == _A_BUFFER:
                buffers += 1
                depth += 1
            elif action == _A_PUT:
                index = data[pos] if width == 1 else from_bytes(data[pos : pos + 4], "little")
                pos += width
                if index > memo or depth < 1:
                    break
                if index == memo:
                    memo += 1
            elif action == _A_FRAME:
                length = from_bytes(data[pos : pos + 8], "little")
                pos += 8
                if length > end - pos:
                    break
            elif action == _A_STOP:
                if pos != end or marks or depth < 1:
                    break
                return buffers
            else:  # newline arguments and persistent IDs are rare: the thorough walk judges them
                break
            if depth > MAX_STACK or pos > end:
                break
    except IndexError:  # marks.pop() on no MARK, or an argument cut short
        pass
    # Anything unusual: let the thorough walk decide (it accepts what this loop cannot judge quickly,
    # such as protocol-0 opcodes, and otherwise raises the precise error).
    return walk_stream(data).next_buffers


_POP_MARK = ord("1")
T = TypeVar("T")


class DigestCache(Generic[T]):
    """Verdicts on streams, remembered by each stream's BLAKE2b digest (least recently used first out).

    A digest, not a file name, so a changed stream is always checked again; a cryptographic one, so no stream
    can pose as a checked one. Thread-safe; the verdict is computed outside the lock. Bounded in entries and,
    when ``cost`` says what a verdict holds in bytes, in bytes: a stream naming a hundred thousand globals must
    not leave megabytes behind after its load was refused. A verdict costing more than a quarter of
    ``max_bytes`` is not remembered at all.
    """

    def __init__(self, size: int = 512, *, max_bytes: int = 1 << 26, cost: Callable[[T], int] | None = None) -> None:
        self._entries: OrderedDict[bytes, tuple[T, int]] = OrderedDict()
        self._size = size
        self._max_bytes = max_bytes
        self._cost = cost
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, stream: bytes | bytearray | memoryview, compute: Callable[[], T]) -> T:
        """The remembered verdict on ``stream``, or ``compute()``'s (remembered if it returns)."""
        digest = hashlib.blake2b(stream, digest_size=32).digest()
        with self._lock:
            known = self._entries.get(digest)
            if known is not None:
                self._entries.move_to_end(digest)
                return known[0]
        result = compute()
        cost = 64 + (self._cost(result) if self._cost is not None else 0)
        if 4 * cost > self._max_bytes:
            return result
        with self._lock:
            previous = self._entries.pop(digest, None)
            if previous is not None:
                self._bytes -= previous[1]
            self._entries[digest] = (result, cost)
            self._bytes += cost
            while len(self._entries) > self._size or self._bytes > self._max_bytes:
                self._bytes -= self._entries.popitem(last=False)[1][1]
        return result

    @property
    def nbytes(self) -> int:
        """What the remembered verdicts hold, by ``cost`` (64 bytes each without it)."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


_VALIDATED: DigestCache[int] = DigestCache()


def validated(stream: bytes | bytearray | memoryview) -> int:
    """:func:`check_stream`, remembered by the stream's BLAKE2b digest: loading the same snapshot again (the
    common case) costs a hash of its stream (tens of microseconds), not a walk (see :class:`DigestCache`).

    Returns:
        The number of ``NEXT_BUFFER`` opcodes.
    """
    return _VALIDATED.get(stream, lambda: check_stream(stream))
