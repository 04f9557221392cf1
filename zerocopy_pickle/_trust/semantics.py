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
  cost model] in :mod:`zerocopy_pickle._trust.tags`): what pickle itself writes only for a reference cycle, and
  what lets a stream nest values deeper than any depth it was charged for.

and it enforces the cost model, whose tags and bounds are :mod:`zerocopy_pickle._trust.tags`'s, raising
:class:`~zerocopy_pickle.errors.SnapshotError` for values nested deeper than ``MAX_DEPTH`` (hashing a deeply
nested tuple recurses in C without a limit), deques and defaultdicts nested deeper than
``MAX_UNPROTECTED_DEPTH``, dict keys and set members nested deeper than ``MAX_KEY_DEPTH``, names longer than
``MAX_NAME_LENGTH``, and a stream that makes the unpickler hash more than its budget of elements
(``HASH_FLOOR``, ``HASH_PER_BYTE``).

:func:`analyze` hands the stream to the engine of :mod:`zerocopy_pickle._trust.handlers`, which reads it one
opcode at a time and hands each to its handler, found in a table by the opcode byte: one per opcode family (the
stack, frames and memo; numbers, strings and bytes; tuples and the containers pickle builds and fills; globals,
calls and BUILD; out-of-band buffers and what is never run). It also defines :class:`StreamUses`, what the
analysis returns (this module re-exports it).

What remains depends on the allow-list and is decided per load by
:meth:`zerocopy_pickle._trust.restricted.AllowList.admit` from the returned :class:`StreamUses`: which globals are
called, instantiated, and which mutating opcodes reach the results of which globals. The analysis depends on
the stream's bytes alone, so :func:`uses` remembers it by the stream's BLAKE2b digest.
"""

from __future__ import annotations

from typing import Any

from . import streamcheck
from .handlers import StreamUses as StreamUses  # noqa: PLC0414 - re-exported: what the analysis returns
from .handlers import _Analysis
from .tags import ADD, APPEND, BUILD, SETITEM


def analyze(stream: bytes) -> StreamUses:
    """Run the stream over tags (see the module docstring). The stream must already have passed
    :func:`zerocopy_pickle._trust.streamcheck.check_stream` (lengths, memo indices, stack and MARK bounds).

    Raises:
        RestrictedLoadError: the stream does something no restricted load allows (naming the opcode and offset).
        SnapshotError: it is malformed, or breaks a bound of the cost model (:mod:`zerocopy_pickle._trust.tags`).
    """
    return _Analysis(stream).run()


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
