"""Internal: restricted loading's allow-lists: which globals one load may resolve (``find_class``), and whether a
stream's uses are admitted under them.

Pickle resolves every class and function a stream names through ``Unpickler.find_class``, and then its opcodes
act on what was resolved: REDUCE calls it, NEWOBJ instantiates it, BUILD sets state on whatever is below it. A
restricted load decides both, before the C unpickler runs anything:

* **What a stream does** is worked out by :mod:`zerocopy_pickle._trust.semantics` from the opcodes alone (remembered
  by the stream's digest): which named globals it calls, instantiates, and which results it fills. REDUCE on
  anything but a named global, BUILD on anything but an object the load created, container opcodes on anything
  but containers the stream built are refused there, whatever the allow-list says.
* **What it may name** comes from an :class:`AllowList`: the built-in safe set (:mod:`zerocopy_pickle._trust.safe_set`:
  validating wrappers of torch's and this library's rebuild functions, containers, primitives, dtypes), the
  declared safe globals of the plugins the snapshot's header names (functions that check their arguments), and
  the call's ``allow=`` (its forms: :mod:`zerocopy_pickle._trust.entries`): classes the stream may instantiate
  and fill, objects it may reference as values, and functions it may call only through ``allow_function``.
  :meth:`AllowList.admit` checks each use against that list; a refusal says what would pass
  (:mod:`zerocopy_pickle._trust.advice`).
* Matching is on exact ``(module, qualname)`` pairs. A dotted qualname is resolved only if that exact pair is
  allowed, must resolve to a class, and the object found must carry that same module and qualname: no entry
  can reach through a module's globals (``("pathlib", "os.system")``) or onto a method.
* The blocklist (:mod:`zerocopy_pickle._trust.blocklist`) wins over every allow-list: modules and functions
  that execute code, spawn processes, touch files or the network, or unpickle nested streams. It is matched by
  name *and* by the identity of the resolved object, so an alias in a harmless-looking module is refused too.
* There is no process-global, mutable allow-list anywhere (see Note [Per-call allow-lists]).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Mapping

from .. import rebuild
from ..errors import ArgumentError, MissingGlobalError, PluginError, RestrictedLoadError, SnapshotError
from . import semantics
from .advice import _OPCODE_NAMES, Advice, _by_value_module, advise, refusal_message
from .blocklist import is_blocked
from .entries import (
    _STORAGE_PAIR,
    AllowFunction,
    AllowSpec,
    _constructs_fresh,
    _entry,
    _resolve,
    format_global,
    numpy_machinery,
)
from .safe_set import safe_table
from .semantics import StreamUses
from .streamcheck import walk_stream

# Note [Per-call allow-lists]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's weights_only unpickler keeps its extra safe globals in process-wide state
# (torch.serialization.add_safe_globals); a loader that mutates it around a load races with every other
# thread that loads at the same time. Here an AllowList is an immutable value built per call and held by
# that call's unpickler instance only. The built-in safe set is computed once and never mutated.


def safe_globals() -> Mapping[tuple[str, str], object]:
    """The built-in safe set: every global a stream of tensors, storages and containers needs, mapped to what a
    restricted load pushes for it (a validating function of :mod:`zerocopy_pickle._trust.safe_set` for callables, the
    object itself for values such as dtypes). Read-only; nothing ever adds to it."""
    return _safe_values()


@functools.lru_cache(maxsize=1)
def _safe_values() -> Mapping[tuple[str, str], object]:
    return types.MappingProxyType({pair: entry.value for pair, entry in safe_table().items()})


# How an allowed global may be used: as a value only, called (REDUCE/OBJ/INST), instantiated (NEWOBJ).
_VALUE, _FUNCTION, _CLASS, _SAFE, _STORAGE = range(5)


class AllowList:
    """The globals one load may resolve, and what it may do with each: the built-in safe set, the plugins'
    declared safe globals, and this call's ``allow=``.

    Args:
        allow: classes (matched by their ``__module__`` and ``__qualname__``; the stream may instantiate them
            and fill them with BUILD), other objects admitted as values, ``"module:qualname"`` strings,
            ``(module, qualname)`` tuples, and ``allow_function`` entries for functions the stream may call.
        extra: further pairs (plugins' declared safe globals), mapped to the resolved object or None to resolve
            on first use. Each must be a plain function; the stream may call it.
        storage_builder: what ``zerocopy_pickle.rebuild:rebuild_storage`` resolves to in this load.
        resolve_extra: how a pair of ``extra`` mapped to None is resolved (the registry's
            :meth:`~zerocopy_pickle._registry.registry.Registry.resolve_safe_global`, which imports and checks it);
            by default it is imported and must be a plain function.

    Raises:
        ArgumentError: an entry is not one of the accepted forms.
    """

    __slots__ = ("_allowed", "_extra", "_functions", "_resolve_extra", "_resolved", "_safe", "_storage_builder")

    def __init__(
        self,
        allow: AllowSpec = (),
        extra: Mapping[tuple[str, str], object | None] | None = None,
        *,
        storage_builder: object = None,
        resolve_extra: Callable[[str, str], object] | None = None,
    ):
        self._safe = safe_table()
        self._resolve_extra = resolve_extra
        self._extra: dict[tuple[str, str], object | None] = dict(extra) if extra else {}
        self._storage_builder = storage_builder
        allowed: dict[tuple[str, str], object | None] = {}
        functions: set[tuple[str, str]] = set()
        if isinstance(allow, (str, bytes)) or not isinstance(allow, Iterable):
            raise ArgumentError(f"allow= must be a list of entries, not {type(allow).__name__}: wrap it in [...]")
        for item in allow:
            callable_ = isinstance(item, AllowFunction)
            target = item.target if isinstance(item, AllowFunction) else item
            pair, obj = _entry(target)
            if not callable_ and numpy_machinery(pair):
                continue  # Note [NumPy values]: what torch's safe_globals needs for NumPy values, covered here
            if callable_:
                functions.add(pair)
            if obj is not None or pair not in allowed:
                allowed[pair] = obj
        self._allowed = allowed
        self._functions = frozenset(functions)
        self._resolved: dict[tuple[str, str], tuple[object, int]] = {}

    def __contains__(self, pair: object) -> bool:
        return pair in self._safe or pair in self._allowed or pair in self._extra or pair == _STORAGE_PAIR

    def _lookup(self, pair: tuple[str, str]) -> tuple[object, int]:
        """The object a pair resolves to in this load, and how it may be used."""
        known = self._resolved.get(pair)
        if known is not None:
            return known
        entry = self._safe.get(pair)
        if entry is not None:
            result: tuple[object, int] = (entry.value, _SAFE)
        elif pair == _STORAGE_PAIR:
            result = (self._storage_builder or rebuild.rebuild_storage, _STORAGE)
        else:
            if is_blocked(pair):
                raise _blocked_error(pair)
            if pair in self._extra:  # a plugin's function stays callable even if allow= names it too
                obj = self._extra[pair]
                if obj is None:
                    try:
                        obj = (self._resolve_extra or _resolve)(*pair)
                    except PluginError as e:
                        raise RestrictedLoadError(
                            f"refusing to load global {format_global(pair)!r}: {e}", refused=pair
                        ) from e
                if is_blocked(pair, obj):
                    raise _blocked_error(pair)
                if type(obj) is not types.FunctionType:
                    raise RestrictedLoadError(
                        f"refusing to load global {format_global(pair)!r}: a plugin declared it safe, but it is a "
                        f"{type(obj).__name__}, and a plugin's safe globals must be functions that check their "
                        f"arguments",
                        refused=pair,
                    )
                result = (obj, _FUNCTION)
            elif pair in self._allowed:
                obj = self._allowed[pair]
                if obj is None:
                    obj = _resolve(*pair)
                if is_blocked(pair, obj):
                    raise _blocked_error(pair)
                if isinstance(obj, type):
                    use = _CLASS
                elif pair in self._functions:
                    if not callable(obj):
                        raise ArgumentError(f"allow_function({format_global(pair)!r}) names a non-callable object")
                    use = _FUNCTION
                else:
                    use = _VALUE
                result = (obj, use)
            else:
                raise RestrictedLoadError(
                    f"refusing to load global {format_global(pair)!r}: it is not on this load's allow-list",
                    refused=pair,
                )
        self._resolved[pair] = result
        return result

    def find_class(self, module: str, qualname: str) -> object:
        """Resolve ``module:qualname`` if this list allows exactly that pair and it is not blocked.

        Raises:
            RestrictedLoadError: the pair is blocked, or not allowed.
        """
        return self._lookup((module, qualname))[0]

    def admit(self, uses: StreamUses) -> dict[tuple[str, str], object]:
        """Decide whether a stream may run under this list: every global it names must be allowed, every call
        must be of a function the list lets it call or of an allowed class, every NEWOBJ of an allowed class,
        and every BUILD, SETITEM(S), APPEND(S) or ADDITEMS must act on an object that a safe constructor or an
        allowed class created fresh in this load.

        Returns:
            What each named global resolves to (what the unpickler's ``find_class`` returns).

        Raises:
            RestrictedLoadError: naming every global the stream needs that this call does not allow (with the
                ``allow=`` that would), every blocked one, or the use that is not allowed.
        """
        resolved: dict[tuple[str, str], object] = {}
        refused: RestrictedLoadError | None = None
        for pair in uses.globals:
            try:
                resolved[pair] = self._lookup(pair)[0]
            except RestrictedLoadError as e:
                refused = refused or e
        if refused is None:
            refused = self._use_refusal(uses)
        if refused is not None:
            raise refusal_message(refused, self, uses.globals, uses)
        return resolved

    def _use_refusal(
        self, uses: StreamUses, skip: frozenset[tuple[str, str]] = frozenset()
    ) -> RestrictedLoadError | None:
        """The first use of a resolved global that this list does not permit (every global of ``uses`` but
        ``skip`` must have been looked up), or None."""
        for pair in uses.called - skip:
            obj, use = self._resolved[pair]
            if use == _SAFE:
                if not self._safe[pair].callable:
                    return _use_error(pair, "calls", "a value of the safe set, which no load calls")
            elif use == _VALUE:
                what = "function" if callable(obj) else type(obj).__name__
                return _use_error(
                    pair,
                    "calls",
                    f"a {what} that allow= admits as a value only; a load calls a function only if allow= names "
                    f"it with zerocopy_pickle.allow_function(...), with arguments the stream chooses",
                )
        for pair in uses.instantiated - skip:
            obj, use = self._resolved[pair]
            if use != _CLASS:
                return _use_error(pair, "instantiates (NEWOBJ)", "not a class that allow= names")
        for pair, ops in uses.mutated.items():
            if pair in skip:
                continue
            obj, use = self._resolved[pair]
            if use == _SAFE:
                extra_ops = ops - self._safe[pair].result_ops
                if not extra_ops:
                    continue
            elif use == _CLASS and _constructs_fresh(obj):  # type: ignore[arg-type]
                continue
            opcodes = ", ".join(sorted(_OPCODE_NAMES[op] for op in ops))
            return _use_error(
                pair,
                f"applies {opcodes} to an object made by",
                "which a restricted load does not fill: it fills only objects that a safe constructor or an allowed "
                "class with an ordinary __new__ created in this load",
            )
        return None

    def advice(self, uses: StreamUses) -> Advice:
        """What would make a restricted load of a stream that does ``uses`` pass: the whole ``allow=`` to give
        (this list's own entries and the ones it lacks, each a class or value name or an ``allow_function``),
        or the reasons no ``allow=`` can (:func:`~zerocopy_pickle._trust.advice.advise`).

        The advice follows the rules :meth:`admit` applies, and is then checked by them: a trial list built from
        the suggested entries must admit every use of every global whose kind was known (a global of a module
        not imported yet is never imported here: importing runs the module's code; such names are returned as
        ``unknown``, suggested by how the stream uses them).
        """
        trial = functools.partial(self._trial, uses)
        return advise(uses, self._allowed, self._functions, self._safe, self._extra, trial)

    def _trial(
        self, uses: StreamUses, allow: tuple[str | AllowFunction, ...], skip: frozenset[tuple[str, str]]
    ) -> RestrictedLoadError | MissingGlobalError | None:
        """The refusal a list of ``allow`` (with this list's plugins and storage builder) gives ``uses``, every
        global but those of ``skip`` looked up, or None."""
        trial = AllowList(allow, self._extra, storage_builder=self._storage_builder, resolve_extra=self._resolve_extra)
        try:
            for pair in uses.globals:
                if pair not in skip:
                    trial._lookup(pair)
            return trial._use_refusal(uses, skip)
        except (RestrictedLoadError, MissingGlobalError) as e:
            return e


def _use_error(pair: tuple[str, str], verb: str, reason: str) -> RestrictedLoadError:
    return RestrictedLoadError(
        f"refusing to load: the stream {verb} {format_global(pair)}, {reason}. Only trusted=True loads such a "
        f"stream (do that only if you trust its source)",
        refused=pair,
    )


def _blocked_error(pair: tuple[str, str]) -> RestrictedLoadError:
    return RestrictedLoadError(
        f"refusing to load global {format_global(pair)!r}: it can run code, touch files or the network, or "
        f"unpickle another stream, and is on the blocklist, which no allow= overrides",
        refused=pair,
        blocked=(pair,),
    )


def stream_uses(stream: bytes) -> StreamUses:
    """:func:`zerocopy_pickle._trust.semantics.uses`, with a refusal that also says when the stream holds code
    pickled by value (which only a trusted load runs).

    Raises:
        RestrictedLoadError, SnapshotError: as :func:`zerocopy_pickle._trust.semantics.uses`.
    """
    try:
        return semantics.uses(stream)
    except RestrictedLoadError as e:
        try:
            named = walk_stream(stream, collect_globals=True).globals
        except SnapshotError:
            raise e from None
        by_value = sorted({m for m, _ in named if _by_value_module(m)})
        if not by_value:
            raise
        raise RestrictedLoadError(
            f"{e} It holds functions or classes pickled by value ({', '.join(by_value)}): loading them runs their "
            f"code, so only trusted=True loads it, and only if you trust where it came from.",
            refused=e.refused,
            trusted_only=(*e.trusted_only, f"it holds code pickled by value ({', '.join(by_value)})"),
        ) from None


def scan_stream(stream: bytes | bytearray | memoryview) -> tuple[tuple[str, str], ...]:
    """List the globals a pickle stream references, without running it.

    GLOBAL and INST name their global inline; STACK_GLOBAL takes two strings from the stack, which the scan
    follows through string opcodes and the memo. A STACK_GLOBAL fed any other way (possible only in a
    hand-made stream) is reported as ``("<dynamic>", "<dynamic>")``; the load-time check still applies.

    Returns:
        ``(module, qualname)`` pairs in order of first appearance.

    Raises:
        SnapshotError: the stream is malformed or breaks a bound (see :mod:`zerocopy_pickle._trust.streamcheck`).
    """
    return walk_stream(stream, collect_globals=True).globals
