"""Restricted loading: which globals a stream may name, and a scan of the globals it needs.

Pickle resolves every class and function a stream names through ``Unpickler.find_class``; anything it
returns can be called. A restricted load answers ``find_class`` from an :class:`AllowList`: the built-in
safe set (tensors, storages, containers, primitives, this library's rebuild functions) plus what the caller
passes for that one call. Matching is on exact ``(module, qualname)`` pairs, so an entry never reaches
further than the one object it names.

There is no process-global, mutable allow-list anywhere: every load builds its own :class:`AllowList`, so
concurrent loads with different lists cannot see each other's entries (see Note [Per-call allow-lists]).
"""

from __future__ import annotations

import collections
import functools
import importlib
import io
import pickletools
import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from . import rebuild
from .errors import ArgumentError, RestrictedLoadError, SnapshotError

__all__ = ["AllowList", "AllowSpec", "format_global", "safe_globals", "scan_stream"]

# Note [Per-call allow-lists]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's weights_only unpickler keeps its extra safe globals in process-wide state
# (torch.serialization.add_safe_globals); a loader that mutates it around a load races with every other
# thread that loads at the same time. Here an AllowList is an immutable value built per call and held by
# that call's unpickler instance only. The built-in safe set is computed once and never mutated.

AllowSpec = Iterable[object]
"""What ``allow=`` accepts: classes or functions, ``"module:qualname"`` strings, or ``(module, qualname)``."""


def format_global(pair: tuple[str, str]) -> str:
    """``("collections", "OrderedDict")`` -> ``"collections:OrderedDict"``, the form ``allow=`` takes."""
    return f"{pair[0]}:{pair[1]}"


def _pair_of(obj: Any) -> tuple[str, str]:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise ArgumentError(
            f"allow= entries must be classes, functions, 'module:qualname' strings or (module, qualname) "
            f"tuples; {obj!r:.80} has no __module__/__qualname__ (pass its 'module:qualname' string instead)"
        )
    return module, qualname


@functools.lru_cache(maxsize=1)
def safe_globals() -> Mapping[tuple[str, str], object]:
    """The built-in safe set: every global a stream of tensors, storages and containers needs.

    Returns:
        A read-only mapping from ``(module, qualname)`` to the object it resolves to. It is computed once;
        nothing ever adds to it.
    """
    objects: list[Any] = [
        # Containers and primitives that pickle by reference rather than by opcode.
        collections.OrderedDict,
        collections.defaultdict,
        collections.deque,
        collections.Counter,
        *(list, dict, set, frozenset, tuple, int, float, complex, bool, str, bytes, bytearray, slice, range),
        # Tensors and parameters (what Tensor.__reduce_ex__ and Parameter.__reduce_ex__ name).
        torch._utils._rebuild_tensor,
        torch._utils._rebuild_tensor_v2,
        torch._utils._rebuild_tensor_v3,
        torch._utils._rebuild_parameter,
        torch._utils._rebuild_parameter_with_state,
        torch._utils._rebuild_qtensor,
        torch._utils._rebuild_sparse_tensor,
        torch._utils._rebuild_nested_tensor,
        torch._utils._rebuild_meta_tensor_no_storage,
        torch._utils._rebuild_wrapper_subclass,
        torch._tensor._rebuild_from_type_v2,
        torch.serialization._get_layout,
        torch.Tensor,
        torch.Size,
        torch.device,
        torch.nn.Parameter,
        torch.nn.Buffer,
        # This library's storage rebuilders.
        rebuild.rebuild_storage,
        rebuild.rebuild_tensor,
        rebuild.rebuild_typed_storage,
        rebuild.rebuild_meta_storage,
    ]
    table: dict[tuple[str, str], object] = {_pair_of(obj): obj for obj in objects}
    # dtypes, qschemes and memory formats pickle as module attributes: ("torch", "float16").
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, (torch.dtype, torch.qscheme, torch.memory_format)):
            table["torch", name] = value
    return types.MappingProxyType(table)


class AllowList:
    """The globals one load may resolve: the built-in safe set plus this call's ``allow=``.

    Args:
        allow: classes or functions (matched by their ``__module__`` and ``__qualname__``), strings
            ``"module:qualname"``, or ``(module, qualname)`` tuples.
        extra: further pairs to allow (plugins' declared safe globals), mapped to the resolved object or
            None to import on first use.

    Raises:
        ArgumentError: an entry is not one of the accepted forms.
    """

    __slots__ = ("_allowed", "_safe")

    def __init__(self, allow: AllowSpec = (), extra: Mapping[tuple[str, str], object | None] | None = None):
        self._safe = safe_globals()
        allowed: dict[tuple[str, str], object | None] = dict(extra) if extra else {}
        if isinstance(allow, (str, bytes)) or not isinstance(allow, Iterable):
            raise ArgumentError(f"allow= must be a list of entries, not {type(allow).__name__}: wrap it in [...]")
        for item in allow:
            if isinstance(item, str):
                module, sep, qualname = item.partition(":")
                if not sep or not module or not qualname or ":" in qualname:
                    raise ArgumentError(
                        f"allow= string {item!r} must have the form 'module:qualname', e.g. 'collections:OrderedDict'"
                    )
                allowed.setdefault((module, qualname), None)
            elif isinstance(item, tuple):
                if len(item) != 2 or not all(isinstance(p, str) and p for p in item):
                    raise ArgumentError(f"allow= tuple {item!r:.80} must be (module, qualname), two non-empty strings")
                allowed.setdefault((item[0], item[1]), None)
            else:
                allowed[_pair_of(item)] = item
        self._allowed = allowed

    def __contains__(self, pair: object) -> bool:
        return pair in self._safe or pair in self._allowed

    def find_class(self, module: str, qualname: str) -> object:
        """Resolve ``module:qualname`` if this list allows exactly that pair.

        Raises:
            RestrictedLoadError: the pair is not allowed (the caller adds the full list of what the stream
                needs; see :func:`scan_stream`).
        """
        pair = (module, qualname)
        try:
            return self._safe[pair]
        except KeyError:
            pass
        try:
            obj = self._allowed[pair]
        except KeyError:
            raise RestrictedLoadError(
                f"refusing to load global {format_global(pair)!r}: it is not on this load's allow-list",
                refused=pair,
            ) from None
        if obj is None:
            # Allowed by name: import only now. The exact pair was allowed, so walking the dotted qualname
            # reaches nothing the caller did not name.
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        return obj


_STRING_OPS = frozenset(
    {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
)
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_NEUTRAL_OPS = frozenset({"PROTO", "FRAME"})
DYNAMIC = ("<dynamic>", "<dynamic>")
"""Reported by :func:`scan_stream` for a STACK_GLOBAL whose names are computed at load time."""


def scan_stream(stream: bytes | bytearray | memoryview) -> tuple[tuple[str, str], ...]:
    """List the globals a pickle stream references, without running it.

    GLOBAL and INST name their global inline; STACK_GLOBAL takes two strings from the stack, which this
    scan follows through string opcodes and the memo. A STACK_GLOBAL fed any other way (possible only in a
    hand-made stream) is reported as ``("<dynamic>", "<dynamic>")``; the load-time check still applies.

    Args:
        stream: a pickle stream (the bytes up to and including STOP are scanned).

    Returns:
        ``(module, qualname)`` pairs in order of first appearance.

    Raises:
        SnapshotError: the stream is not a well-formed pickle.
    """
    found: dict[tuple[str, str], None] = {}
    memo: dict[int, object] = {}
    recent: collections.deque[object] = collections.deque([None, None], maxlen=2)
    try:
        for opcode, arg, _pos in pickletools.genops(io.BytesIO(stream)):
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                module, _, qualname = str(arg).partition(" ")
                found[module, qualname] = None
                recent.append(None)
            elif name == "STACK_GLOBAL":
                top = tuple(recent)
                if isinstance(top[0], str) and isinstance(top[1], str):
                    found[top[0], top[1]] = None
                else:
                    found[DYNAMIC] = None
                recent.append(None)
            elif name in _STRING_OPS:
                recent.append(arg if isinstance(arg, str) else None)
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1]
            elif name in _PUT_OPS:
                memo[int(arg)] = recent[-1]  # type: ignore[arg-type]
            elif name in _GET_OPS:
                recent.append(memo.get(int(arg)))  # type: ignore[arg-type]
            elif name not in _NEUTRAL_OPS:
                recent.append(None)
    except (ValueError, TypeError, IndexError) as e:  # pickletools' errors for malformed input
        raise SnapshotError(f"the pickle stream is malformed: {e}") from e
    return tuple(found)
