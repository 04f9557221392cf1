"""Internal: the reducer table (what a pickler asks "how do I reduce this type?").

Not a public module: plugins use :mod:`zerocopy_pickle.plugin`, programs the top-level ``zerocopy_pickle``
namespace. :class:`ReducerTable` keeps reducers by *type name* (``"module:QualName"``); a lookup walks the MRO of
the pickled object's type and compares names, so registering never imports the library a reducer is about (no
object of a type can exist before its module is imported). The table is copy-on-write: readers (every pickler,
on every object) see a read-only mapping that writers replace whole under the registry's lock.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._names import GlobalName
from ..errors import ArgumentError

ReduceFunction = Callable[[Any], Any]
"""``reduce(obj)`` returns what ``__reduce__`` would (a tuple, or a global name), or NotImplemented."""


def type_key(cls: type) -> str:
    """``"module:QualName"`` of a class, the key reducers are registered under (``str(GlobalName(...))``, written
    out: every pickled object's lookup calls this for each class of its MRO)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def target_key(target: object) -> tuple[str, type | None]:
    """The table key of a reducer target (a type or its ``"module:QualName"``), and the type if one was given."""
    if isinstance(target, str):
        if GlobalName.parse(target) is None:
            raise ArgumentError(
                f"reducer target {target!r} must be a type or a 'module:QualName' string, "
                f"e.g. 'bitsandbytes.nn.modules:Params4bit'"
            )
        return target, None
    if isinstance(target, type):
        return type_key(target), target
    raise ArgumentError(f"reducer target must be a type or a 'module:QualName' string, not {target!r:.80}")


@dataclass(frozen=True)
class Reducer:
    """A registered reducer.

    Attributes:
        target: ``"module:QualName"`` of the type it reduces (and its subclasses).
        reduce: the reducing function.
        plugin: the plugin it belongs to (recorded in the header of every snapshot that used it), or None.
        package: the distribution that provides the plugin, named in the error when it is missing.
        safe_globals: what its streams reference, allowed in restricted loads.
        cls: the type, when it was registered with one (matched by identity as well as by name).
    """

    target: str
    reduce: ReduceFunction
    plugin: str | None = None
    package: str | None = None
    safe_globals: tuple[tuple[str, str], ...] = ()
    cls: type | None = None


def make_reducer(
    target: object,
    reduce: ReduceFunction,
    plugin: str | None,
    package: str | None,
    safe: tuple[tuple[str, str], ...],
) -> Reducer:
    """A :class:`Reducer`, its target and function checked.

    Raises:
        ArgumentError: a malformed target, or ``reduce`` is not callable.
    """
    key, cls = target_key(target)
    if not callable(reduce):
        raise ArgumentError(f"reduce must be callable, not {reduce!r:.80}")
    return Reducer(key, reduce, plugin, package, safe, cls)


class ReducerTable:
    """Reducers by target; not locked itself (the registry that owns it serialises writers)."""

    def __init__(self) -> None:
        self._table: Mapping[str, Reducer] = types.MappingProxyType({})
        self.version = 0  # bumped on every change

    def view(self) -> Mapping[str, Reducer]:
        """The current reducers, read-only (a snapshot: later changes replace it)."""
        return self._table

    def lookup(self, cls: type) -> Reducer | None:
        """The reducer for ``cls``: the first class of its MRO with a registration (exact beats base)."""
        table = self._table
        if not table:
            return None
        for klass in cls.__mro__:
            reducer = table.get(type_key(klass))
            if reducer is not None and (reducer.cls is None or reducer.cls is klass):
                return reducer
        return None

    def check_free(self, reducer: Reducer, clobber: bool, pending: Iterable[Reducer] = ()) -> None:
        """Refuse ``reducer`` if its target is taken (here or in ``pending``) and ``clobber`` is False.

        Raises:
            ArgumentError: the target is taken.
        """
        existing = self._table.get(reducer.target)
        if existing is None:
            existing = next((r for r in pending if r.target == reducer.target), None)
        if existing is not None and not clobber:
            owner = f"plugin {existing.plugin!r}" if existing.plugin else "a direct registration"
            raise ArgumentError(
                f"a reducer for {reducer.target} is already registered (by {owner}); pass clobber=True to replace it"
            )

    def commit(self, reducers: Iterable[Reducer]) -> None:
        """Add (or replace) ``reducers``."""
        table = dict(self._table)
        for reducer in reducers:
            table[reducer.target] = reducer
        self._replace(table)

    def remove(self, target: type | str) -> Reducer:
        """Remove and return the reducer for ``target``.

        Raises:
            ArgumentError: nothing is registered for it.
        """
        key, _ = target_key(target)
        if key not in self._table:
            raise ArgumentError(f"no reducer is registered for {key}")
        table = dict(self._table)
        removed = table.pop(key)
        self._replace(table)
        return removed

    def drop_plugin(self, name: str) -> None:
        """Remove every reducer of plugin ``name``."""
        self._replace({k: r for k, r in self._table.items() if r.plugin != name})

    def _replace(self, table: dict[str, Reducer]) -> None:
        self._table = types.MappingProxyType(table)
        self.version += 1
