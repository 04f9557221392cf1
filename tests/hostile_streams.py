"""Helpers shared by the hostile-stream tests: a tiny pickle assembler and snapshot wrappers.

A hostile stream is written by hand, opcode by opcode, because the attacks below are exactly what no pickler
would ever write (BUILD applied to a global, a QuantState's dtype naming ``torch.load``, ...). :func:`program`
assembles a protocol-5 stream from Python values and :class:`Op` fragments; :func:`as_snapshot` wraps a
stream (and optional out-of-band buffers) into a well-formed snapshot so that the load reaches the unpickler.
"""

from __future__ import annotations

import contextlib
import importlib
import struct
import sys
import types
from collections.abc import Sequence
from typing import Any

import zerocopy_pickle as zp
from tests.internals import format as fmt
from tests.internals import safe_globals
from zerocopy_pickle.plugin import default_registry


class Op(bytes):
    """A fragment of opcodes that pushes exactly one value (or, for :data:`MARK` and friends, does what its
    opcode does): :func:`enc` emits it as it is."""


MARK = Op(b"(")
POP = Op(b"0")
DUP = Op(b"2")
NEXT_BUFFER = Op(b"\x97")
STOP = b"."


def enc(value: Any) -> bytes:
    """The opcodes that push ``value`` (containers built with the stream's own opcodes)."""
    if isinstance(value, Op):
        return bytes(value)
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
        if len(raw) < 256:
            return b"\x8a" + bytes([len(raw)]) + raw
        return b"\x8b" + struct.pack("<i", len(raw)) + raw
    if isinstance(value, float):
        return b"G" + struct.pack(">d", value)
    if isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        if len(raw) < 256:
            return b"\x8c" + bytes([len(raw)]) + raw
        return b"X" + struct.pack("<I", len(raw)) + raw
    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
        if len(raw) < 256:
            return b"C" + bytes([len(raw)]) + raw
        return b"B" + struct.pack("<I", len(raw)) + raw
    if isinstance(value, tuple):
        if not value:
            return b")"
        return b"(" + b"".join(enc(v) for v in value) + b"t"
    if isinstance(value, list):
        return b"]" + (b"(" + b"".join(enc(v) for v in value) + b"e" if value else b"")
    if isinstance(value, dict):
        items = b"".join(enc(k) + enc(v) for k, v in value.items())
        return b"}" + (b"(" + items + b"u" if value else b"")
    raise TypeError(f"cannot encode {type(value).__name__}")


def G(module: str, qualname: str) -> Op:
    """GLOBAL ``module qualname`` (the protocol-0 form, valid at every protocol)."""
    return Op(b"c" + module.encode() + b"\n" + qualname.encode() + b"\n")


def SG(module: str, qualname: str) -> Op:
    """STACK_GLOBAL from two pushed strings."""
    return Op(enc(module) + enc(qualname) + b"\x93")


def call(func: Any, *args: Any) -> Op:
    """REDUCE: ``func(*args)``."""
    return Op(enc(func) + enc(tuple(args)) + b"R")


def newobj(cls: Any, *args: Any) -> Op:
    """NEWOBJ: ``cls.__new__(cls, *args)``."""
    return Op(enc(cls) + enc(tuple(args)) + b"\x81")


def build(obj: Any, state: Any) -> Op:
    """BUILD: ``obj.__setstate__(state)``, or ``obj.__dict__.update`` / ``setattr`` for ``(dict, slots)``."""
    return Op(enc(obj) + enc(state) + b"b")


def appends(obj: Any, items: Sequence[Any]) -> Op:
    """APPENDS onto ``obj`` (``obj.extend(items)`` for anything that is not a list)."""
    return Op(enc(obj) + b"(" + b"".join(enc(v) for v in items) + b"e")


def setitems(obj: Any, items: dict[Any, Any]) -> Op:
    """SETITEMS onto ``obj`` (``obj[k] = v``)."""
    return Op(enc(obj) + b"(" + b"".join(enc(k) + enc(v) for k, v in items.items()) + b"u")


def memo_put(value: Any, index: int) -> Op:
    """Push ``value`` and store it in memo ``index`` (LONG_BINPUT)."""
    return Op(enc(value) + b"r" + struct.pack("<I", index))


def memo_get(index: int) -> Op:
    """LONG_BINGET ``index``."""
    return Op(b"j" + struct.pack("<I", index))


def program(value: Any) -> bytes:
    """A protocol-5 stream that pushes ``value`` and stops."""
    return b"\x80\x05" + enc(value) + STOP


def as_snapshot(stream: bytes, buffers: Sequence[bytes] = (), plugins: Sequence[tuple[str, str]] = ()) -> bytes:
    """A well-formed snapshot (valid header, no checksums) whose pickle stream is ``stream``, with ``buffers``
    as its out-of-band buffers (CPU, in order) and ``plugins`` listed as plugins its stream needs."""
    layout = fmt.encode(
        len(stream),
        [fmt.BufferSpec(len(b)) for b in buffers],
        plugins=[fmt.PluginRef(name, package) for name, package in plugins],
    )
    out = bytearray(layout.prefix + stream)
    out += bytes(layout.data_offset - len(out))
    for offset, data in zip(layout.buffer_offsets, buffers, strict=True):
        start = layout.data_offset + offset
        out += bytes(start - len(out))
        out += data
    return bytes(out)


def naming(data: bytes, *plugins: str) -> bytes:
    """The snapshot ``data`` (from ``zp.dumps``) with ``plugins`` listed in its header, as a plugin's own snapshots
    list it: only the plugins a header names contribute safe globals to a restricted load. A stream that calls a
    plugin's safe global is hostile only if its header names the plugin; otherwise it is refused earlier."""
    header = zp.read_header(data)
    stream = data[header.stream_offset : header.stream_offset + header.stream_nbytes]
    buffers = [data[start:stop] for start, stop in map(header.buffer_range, range(len(header.buffers)))]
    return as_snapshot(stream, buffers, [(name, "zerocopy-pickle") for name in plugins])


def storage(index: int = 0) -> Op:
    """An UntypedStorage over out-of-band buffer ``index`` (the buffers are consumed in stream order, so
    ``index`` is informational: call this once per buffer, in order)."""
    del index
    return call(G("zerocopy_pickle.rebuild", "rebuild_storage"), NEXT_BUFFER, "cpu")


def inband_storage(data: bytes) -> Op:
    """An UntypedStorage copied from in-band bytes (no out-of-band buffer needed)."""
    return call(G("zerocopy_pickle.rebuild", "rebuild_storage"), data, "cpu")


def tensor_view(store: Any, size: tuple[int, ...], stride: tuple[int, ...], dtype: str = "float32") -> Op:
    """``zerocopy_pickle.rebuild.rebuild_tensor(store, torch.<dtype>, 0, size, stride, False)``."""
    return call(G("zerocopy_pickle.rebuild", "rebuild_tensor"), store, G("torch", dtype), 0, size, stride, False)


# -- what a load must leave as it found it ---------------------------------------------------------------------

STD_STREAMS = ("stdin", "stdout", "stderr", "__stdin__", "__stdout__", "__stderr__")


def resolve(module: str, qualname: str) -> object:
    """The object ``module:qualname`` denotes (imported here, independently of the library)."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def watched_objects() -> dict[str, object]:
    """Every object a restricted load can reach by name: the safe set's values, the real objects its names
    denote, each plugin's declared safe globals, and the standard streams (computed now, so it follows the
    code)."""
    watched: dict[str, object] = {}
    pairs = [*safe_globals().items(), *((pair, None) for pair in default_registry().safe_globals())]
    for (module, qualname), value in pairs:
        if value is not None:
            watched[f"safe-set value {module}:{qualname}"] = value
        try:
            watched[f"{module}:{qualname}"] = resolve(module, qualname)
        except (ImportError, AttributeError):
            continue
        if module in sys.modules:
            watched[f"module {module}"] = sys.modules[module]
    for name in STD_STREAMS:
        watched[f"sys.{name}"] = getattr(sys, name)
    return watched


def _items(mapping: Any) -> dict[str, object]:
    return dict(mapping.items()) if mapping is not None else {}


def fingerprint(obj: object, names: Sequence[str] = ()) -> dict[str, object]:
    """What can change about ``obj``: for a function its defaults, code, ``__dict__`` and globals; for a class
    every ``vars(cls)`` item; for a module the entries ``names``; for anything else ``vars(obj)`` and ``repr``.
    Values are kept as the objects themselves and compared by identity."""
    out: dict[str, object] = {}
    if isinstance(obj, types.FunctionType):
        out["__defaults__"] = obj.__defaults__
        out["__kwdefaults__"] = obj.__kwdefaults__
        out["__kwdefaults__ items"] = _Items(_items(obj.__kwdefaults__))
        out["__code__"] = obj.__code__
        out["__globals__"] = obj.__globals__
        out["__dict__ items"] = _Items(_items(obj.__dict__))
    elif isinstance(obj, type):
        # copyreg caches __slotnames__ on a class the first time one of its instances is *pickled* (a dump,
        # not a load): that cache is not a change a load made.
        out["vars"] = _Items({k: v for k, v in vars(obj).items() if k != "__slotnames__"})
    elif isinstance(obj, types.ModuleType):
        out["entries"] = _Items({name: vars(obj).get(name, _MISSING) for name in names})
    else:
        with contextlib.suppress(TypeError):
            out["vars"] = _Items(dict(vars(obj)))
        out["repr"] = _Repr(repr(obj))
    return out


_MISSING = object()


class _Items(dict):  # type: ignore[type-arg]
    """A mapping compared item by item, by identity."""

    def same(self, other: _Items) -> list[str]:
        changes = [f"{k!r} added" for k in other.keys() - self.keys()]
        changes += [f"{k!r} removed" for k in self.keys() - other.keys()]
        changes += [f"{k!r} replaced" for k in self.keys() & other.keys() if self[k] is not other[k]]
        return changes


class _Repr(str):
    """A repr, compared by value."""


class ProcessState:
    """A snapshot of :func:`watched_objects` (plus which objects ``sys.std*`` are), to compare and restore."""

    def __init__(self) -> None:
        self.objects = watched_objects()
        names: dict[str, list[str]] = {}
        for key in self.objects:
            module, sep, qualname = key.partition(":")
            if sep and " " not in module:
                names.setdefault(module, []).append(qualname.split(".")[0])
        self.prints = {
            key: fingerprint(obj, names.get(key.removeprefix("module "), ())) for key, obj in self.objects.items()
        }

    def changes(self) -> list[str]:
        """What differs now from when this snapshot was taken."""
        now = watched_objects()
        out = [f"{key} is now another object" for key, obj in self.objects.items() if now.get(key) is not obj]
        for key, before in self.prints.items():
            obj = self.objects[key]
            names = list(before["entries"]) if "entries" in before else []
            after = fingerprint(obj, names)
            for attr, old in before.items():
                new = after.get(attr, _MISSING)
                if isinstance(old, _Items) and isinstance(new, _Items):
                    out += [f"{key}: {attr}: {change}" for change in old.same(new)]
                elif isinstance(old, _Repr):
                    if old != new:
                        out.append(f"{key}: repr changed from {old!r:.60} to {new!r:.60}")
                elif old is not new:
                    out.append(f"{key}: {attr} replaced")
        return out

    def restore(self) -> None:
        """Undo what a load that should have been refused did (so one failing test cannot poison the next)."""
        for name in STD_STREAMS:
            setattr(sys, name, self.objects[f"sys.{name}"])
        for key, before in self.prints.items():
            obj: Any = self.objects[key]
            with contextlib.suppress(Exception):
                if isinstance(obj, types.FunctionType):
                    obj.__defaults__ = before["__defaults__"]  # type: ignore[assignment]
                    obj.__kwdefaults__ = before["__kwdefaults__"]  # type: ignore[assignment]
                    if obj.__kwdefaults__ is not None:
                        obj.__kwdefaults__.clear()
                        obj.__kwdefaults__.update(before["__kwdefaults__ items"])  # type: ignore[arg-type]
                    obj.__code__ = before["__code__"]  # type: ignore[assignment]
                    obj.__dict__.clear()
                    obj.__dict__.update(before["__dict__ items"])  # type: ignore[arg-type]
                elif isinstance(obj, type):
                    old: Any = before["vars"]
                    for name in set(vars(obj)) - set(old):
                        with contextlib.suppress(Exception):
                            delattr(obj, name)
                    for name, value in old.items():
                        if vars(obj).get(name, _MISSING) is not value:
                            with contextlib.suppress(Exception):
                                setattr(obj, name, value)
                elif isinstance(obj, types.ModuleType):
                    for name, value in before["entries"].items():  # type: ignore[attr-defined]
                        if value is _MISSING:
                            vars(obj).pop(name, None)
                        else:
                            vars(obj)[name] = value
                elif "vars" in before:
                    state = vars(obj)
                    state.clear()
                    state.update(before["vars"])  # type: ignore[arg-type]
