"""Internal: what would make a refused restricted load pass, and the words of its refusal.

:func:`advise` follows the rules :meth:`~zerocopy_pickle._trust.restricted.AllowList.admit` applies to find the
whole ``allow=`` that admits a stream's uses (class and value names, and :func:`allow_function` for what it
calls), or why none can: code pickled by value, a blocked global, a use no allow-list permits.
:func:`refusal_message` turns that into the error a refused load raises: what was refused, and the one thing
that will work (the ``allow=`` to paste, or ``trusted=True`` and why).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import RestrictedLoadError
from .blocklist import _is_blocked_object, is_blocked
from .entries import _STORAGE_PAIR, AllowFunction, _constructs_fresh, allow_function, format_global, numpy_machinery
from .safe_set import SafeGlobal
from .semantics import StreamUses

if TYPE_CHECKING:
    from .restricted import AllowList

_OPCODE_NAMES = {"build": "BUILD", "setitem": "SETITEM(S)", "append": "APPEND(S)", "add": "ADDITEMS"}


class Advice(NamedTuple):
    """What ``AllowList.advice`` found: ``allow`` (the entries to pass, empty when ``trusted_only``),
    ``needed`` (the globals this call's list lacks), ``unknown`` (names whose module is not imported, whose kind
    could not be checked), ``blocked``, and ``trusted_only`` (why no ``allow=`` can admit the stream)."""

    allow: tuple[str | AllowFunction, ...]
    needed: tuple[tuple[str, str], ...]
    unknown: tuple[tuple[str, str], ...]
    blocked: tuple[tuple[str, str], ...]
    trusted_only: tuple[str, ...]


def _by_value_module(module: str) -> bool:
    """Whether a global's module is one whose functions rebuild code pickled by value (cloudpickle, dill)."""
    return module.partition(".")[0] in ("cloudpickle", "dill")


def spell_allow(entries: Iterable[str | AllowFunction]) -> str:
    """``allow=[...]`` as Python source a user can paste: ``allow=['m:C', zerocopy_pickle.allow_function('m:f')]``."""
    spelled = [f"zerocopy_pickle.allow_function({e.target!r})" if isinstance(e, AllowFunction) else repr(e)
               for e in entries]  # fmt: skip
    return f"allow=[{', '.join(spelled)}]"


def _unwrapped(message: str) -> str:
    """A use refusal's reason, for a sentence of another message."""
    message = message.removeprefix("refusing to load: ").removeprefix("refusing to load ")
    return message.split(". Only trusted=True")[0]


def _imported(pair: tuple[str, str]) -> object:
    """The object an already imported module's attribute path names, or None (nothing is imported)."""
    obj: Any = sys.modules.get(pair[0])
    for part in pair[1].split("."):
        obj = vars(obj).get(part) if obj is not None and hasattr(obj, "__dict__") else None
    return obj


def _kind_of(obj: object) -> str:
    if isinstance(obj, type):
        return "class"
    if _is_blocked_object(obj):
        return "blocked"
    return "function" if callable(obj) else "value"


def _classify(pair: tuple[str, str]) -> str:
    """``"class"``, ``"function"`` or ``"unknown"``, without importing anything (a module is looked at only if
    it is imported already: importing a module a hostile stream names runs that module's code)."""
    module = sys.modules.get(pair[0])
    if module is None:
        return "unknown"
    obj: Any = module
    for part in pair[1].split("."):
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
        if obj is None:
            return "unknown"
    if isinstance(obj, type):
        return "class"
    if is_blocked(pair, obj):
        return "blocked"
    return "function" if callable(obj) else "value"


_NUMPY_HINT = (
    "Its NumPy values were pickled by NumPy's own reductions (plain pickle, torch.save, an earlier zerocopy_pickle, "
    "or a dtype restricted loads never rebuild: object, structured, long double): zerocopy_pickle.dump writes "
    "NumPy arrays, scalars and dtypes of numeric and string dtypes with its own checked rebuilds, which load "
    "restricted without allow=, so dumped again from a trusted load of this one, those values load restricted."
)
"""Appended to a trusted-only refusal of a stream that names NumPy (Note [NumPy values] in safeglobals)."""


def advise(
    uses: StreamUses,
    allowed: Mapping[tuple[str, str], object],
    functions: frozenset[tuple[str, str]],
    safe_set: Mapping[tuple[str, str], SafeGlobal],
    extra: Mapping[tuple[str, str], object],
    trial: Callable[[tuple[str | AllowFunction, ...], frozenset[tuple[str, str]]], Exception | None],
) -> Advice:
    """What would make a restricted load of a stream that does ``uses`` pass under a list of ``allowed`` entries
    (``functions`` among them by :func:`allow_function`), the built-in ``safe_set`` and the plugins' ``extra``:
    the whole ``allow=`` to give (the list's own entries and the ones it lacks, each a class or value name or an
    :func:`allow_function`), or the reasons no ``allow=`` can (see ``AllowList.advice``). ``trial(allow, skip)``
    is the refusal a list of those entries gives every use but those of ``skip``'s globals, or None.
    """
    entries: dict[tuple[str, str], bool] = {pair: pair in functions for pair in allowed}
    needed: list[tuple[str, str]] = []
    unknown: list[tuple[str, str]] = []
    blocked: list[tuple[str, str]] = []
    reasons: list[str] = []
    by_value = sorted({m for m, _ in uses.globals if _by_value_module(m)})
    if by_value:
        reasons.append(f"it holds code pickled by value ({', '.join(by_value)}), and loading it runs that code")
    for pair in uses.globals:
        name = repr(format_global(pair))
        called, made = pair in uses.called, pair in uses.instantiated
        ops = uses.mutated.get(pair, frozenset())
        fills = ", ".join(sorted(_OPCODE_NAMES[op] for op in ops))
        if _by_value_module(pair[0]):
            continue
        safe = safe_set.get(pair)
        if safe is not None or pair == _STORAGE_PAIR:
            reasons += _safe_set_reasons(safe, name, called, made, ops, fills)
            continue
        if is_blocked(pair):
            blocked.append(pair)
            continue
        if numpy_machinery(pair) and pair not in functions:
            reasons.append(f"it uses {name}, NumPy's own pickle machinery, which allow= does not admit")
            continue
        if pair in extra:  # a plugin's safe function: callable, its result never filled
            if made or ops:
                reasons.append(f"it {'instantiates' if made else 'applies ' + fills + ' to what'} {name} "
                               f"{'' if made else 'returns '}(a plugin's safe function)")  # fmt: skip
            continue
        obj = allowed.get(pair)
        kind = _kind_of(obj) if obj is not None else _classify(pair)
        if kind == "blocked":
            blocked.append(pair)
        elif kind in ("class", "function", "value"):
            reason = _kind_refusal(kind, pair, obj, name, called, made, ops, fills)
            if reason is not None:
                reasons.append(reason)
            elif kind == "class":
                entries.setdefault(pair, False)
            else:
                entries[pair] = entries.get(pair, False) or called
        else:  # not imported: allow_function admits a class as a class, and a function to be called
            unknown.append(pair)
            entries[pair] = entries.get(pair, False) or (called and not made and not ops)
        if pair in entries and (pair not in allowed or entries[pair] != (pair in functions)):
            needed.append(pair)  # missing, or admitted as a value and called
    reasons += [f"{format_global(g)!r} is on the blocklist (it can run code, touch files or the network, or "
                f"unpickle another stream): no allow= can permit it" for g in blocked]  # fmt: skip
    allow = tuple(allow_function(":".join(pair)) if call else ":".join(pair) for pair, call in entries.items())
    if not reasons:
        refused = trial(allow, frozenset(unknown))
        if refused is not None:
            reasons.append(f"even with those entries, {_unwrapped(str(refused))}")
    return Advice(
        allow=() if reasons else allow,
        needed=tuple(needed),
        unknown=tuple(unknown),
        blocked=tuple(blocked),
        trusted_only=tuple(dict.fromkeys(reasons)),
    )


def _safe_set_reasons(
    safe: SafeGlobal | None, name: str, called: bool, made: bool, ops: frozenset[str], fills: str
) -> list[str]:
    """Why no ``allow=`` admits these uses of a global of the safe set (``safe``; None for the storage builder)."""
    reasons = []
    if safe is not None and called and not safe.callable:
        reasons.append(f"it calls {name}, a value of the safe set")
    if made:
        reasons.append(f"it instantiates {name} (NEWOBJ), which the safe set only calls")
    if safe is not None and ops - safe.result_ops:
        reasons.append(f"it applies {fills} to what {name} returns")
    return reasons


def _kind_refusal(
    kind: str, pair: tuple[str, str], obj: object, name: str, called: bool, made: bool, ops: frozenset[str], fills: str
) -> str | None:
    """Why no ``allow=`` admits these uses of a class, function or value (``kind``), or None if an entry does."""
    if kind == "class":
        cls = obj if obj is not None else _imported(pair)
        if ops and not (isinstance(cls, type) and _constructs_fresh(cls)):
            return (
                f"it applies {fills} to what {name} makes, and that class has its own __new__ (or "
                f"metaclass __call__), so the object may not be one this load created"
            )
        return None
    if made:
        return f"it instantiates {name} (NEWOBJ), which is not a class"
    if ops:
        return f"it applies {fills} to what {name} returns, and a restricted load fills only objects it created"
    if called and kind == "value":
        return f"it calls {name}, which is not callable"
    return None


def refusal_message(
    error: RestrictedLoadError,
    allow_list: AllowList,
    stream_globals: Iterable[tuple[str, str]],
    uses: StreamUses | None = None,
) -> RestrictedLoadError:
    """The error a refused load raises: what was refused, and the one thing that will work — the whole ``allow=``
    to pass (copy-pasteable: class and value names, :func:`allow_function` for what the stream calls), or, at
    once, that only ``trusted=True`` loads the stream and why (code pickled by value, a blocked global, a use
    no allow-list permits). See ``AllowList.advice``; without ``uses`` (``scan``), every global counts as
    named only."""
    if uses is None:
        uses = StreamUses(tuple(dict.fromkeys(stream_globals)), frozenset(), frozenset(), {}, 0)
    advice = allow_list.advice(uses)
    parts = [f"{error} (restricted load)."]
    if advice.trusted_only:
        parts.append(
            f"No allow= can admit this stream: {'; '.join(advice.trusted_only)}. Only trusted=True loads it: do "
            f"that only if you made this snapshot or trust its source completely."
        )
        if any(module == "numpy" or module.startswith("numpy.") for module, _ in uses.globals):
            parts.append(_NUMPY_HINT)
    elif advice.needed:
        names = ", ".join(repr(format_global(g)) for g in advice.needed)
        functions = {e.target for e in advice.allow if isinstance(e, AllowFunction)}
        calls = [g for g in advice.needed if ":".join(g) in functions]
        caveat = (
            f" ({', '.join(repr(format_global(g)) for g in advice.unknown)} could not be checked without importing "
            f"their modules: make sure each is a class or function you trust)"
            if advice.unknown
            else ""
        )
        called = (
            f"; the stream calls {', '.join(repr(format_global(g)) for g in calls)} with arguments it chooses, so "
            f"allow_function admits only a function that checks them"
            if calls
            else ""
        )
        parts.append(
            f"This snapshot needs {len(advice.needed)} global(s) this call does not allow: {names}. If you trust "
            f"where it came from, load it with {spell_allow(advice.allow)} (exactly those, for this call){caveat}"
            f"{called}, or pass trusted=True to unpickle without restrictions."
        )
    else:
        parts.append("Pass trusted=True to unpickle without restrictions (only if you trust its source).")
    return RestrictedLoadError(
        " ".join(parts),
        refused=error.refused,
        needed=advice.needed,
        blocked=advice.blocked,
        allow=advice.allow if not advice.trusted_only else None,
        trusted_only=advice.trusted_only,
    )
