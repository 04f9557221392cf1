"""Internal: the plugin transaction: what one plugin registers, committed whole or not at all.

Not a public module: the :class:`Registrar` type is public as ``zerocopy_pickle.plugin.Registrar``.

A plugin's registration runs against a :class:`PluginDraft`, through the :class:`Registrar` handed to its
``register(registrar)`` function, and nothing else: there is no ambient "current plugin". Registrations made
through the module-level functions (``zerocopy_pickle.register_reducer``) while a plugin registers are the
running program's own, not the plugin's. :func:`run_registration` returns what to commit, or a failed
:class:`~zerocopy_pickle._registry.declarations.PluginInfo` with nothing to commit.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from ..errors import ArgumentError
from .declarations import PluginInfo, check_module_prefix, global_pairs
from .reducer_table import ReduceFunction, Reducer, ReducerTable, make_reducer


@dataclass
class PluginDraft:
    """Registrations of one plugin, committed only if its registration completes."""

    reducers: list[Reducer] = field(default_factory=list)
    safe_globals: list[tuple[str, str]] = field(default_factory=list)
    load_hook: Callable[[], None] | None = None
    modules: list[str] = field(default_factory=list)
    home: str | None = None  # top-level package of the plugin's registration module: where its safe globals live


class Registrar:
    """What a plugin's ``register(registrar)`` receives: registration on behalf of one named plugin.

    Everything it registers is recorded under the plugin's name, and is rolled back if ``register`` raises.

    Examples:
        A plugin module, named by an entry point of the group ``zerocopy_pickle.plugins`` (in the plugin's
        ``pyproject.toml``: ``[project.entry-points."zerocopy_pickle.plugins"]`` ``interval = "interval_zcp"``):

        ```python
        # interval_zcp.py
        from interval import Interval  # a class plain pickle refuses (it holds a generator)
        from zerocopy_pickle.plugin import Registrar, validate


        def rebuild_interval(lo, hi):  # a restricted load calls this with what the stream chose: check it all
            where = "interval_zcp.rebuild_interval"
            return Interval(validate.expect_float(lo, where, "lo"), validate.expect_float(hi, where, "hi"))


        def register(registrar: Registrar) -> None:
            registrar.register_reducer(
                Interval, lambda i: (rebuild_interval, (i.lo, i.hi)), safe_globals=[rebuild_interval]
            )
        ```

        Snapshots of an ``Interval`` then record the plugin (``zp.read_header(f).plugins``), and restricted
        loads accept them without ``allow=``.
    """

    def __init__(self, table: ReducerTable, draft: PluginDraft, name: str, package: str) -> None:
        self._table = table
        self._draft = draft
        self.name = name
        self.package = package

    def register_reducer(
        self,
        target: type | str,
        reduce: ReduceFunction,
        *,
        safe_globals: Iterable[object] = (),
        clobber: bool = False,
    ) -> None:
        """Register ``reduce`` for ``target`` (see :func:`zerocopy_pickle.register_reducer`) as part of this
        plugin."""
        reducer = make_reducer(
            target, reduce, self.name, self.package, global_pairs(safe_globals, self._draft.home, self.name)
        )
        self._table.check_free(reducer, clobber, self._draft.reducers)
        self._draft.reducers.append(reducer)

    def add_safe_globals(self, *entries: object) -> None:
        """Declare functions this plugin's streams call, allowed in restricted loads of snapshots whose header
        names this plugin.

        Each entry is a module-level function of the plugin's own top-level package, or its ``"module:function"``
        string or ``(module, function)`` pair (checked when first resolved). Each must validate its arguments
        before doing anything with them (docs/plugins.md; :func:`zerocopy_pickle.testing.check_hostile_arguments`).

        Raises:
            PluginError: an entry is a class, builtin, method, lambda, closure or other callable, or lies outside
                the plugin's package.
            ArgumentError: a malformed string entry.
        """
        self._draft.safe_globals.extend(global_pairs(entries, self._draft.home, self.name))

    def set_load_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` before a trusted load unpickles any snapshot whose header lists this plugin."""
        if not callable(hook):
            raise ArgumentError(f"a load hook must be callable, not {hook!r:.80}")
        self._draft.load_hook = hook

    def claim_modules(self, *prefixes: str) -> None:
        """Record this plugin in every snapshot that pickles a class (or an instance of one) from a module
        under one of ``prefixes`` (``"diffusers_modules"`` covers ``diffusers_modules.local.x``), so that its
        load hook prepares those modules before such a snapshot is unpickled. Pickling itself is unchanged."""
        self._draft.modules.extend(check_module_prefix(prefix) for prefix in prefixes)


def _register_function(target: Any) -> Callable[[Registrar], Any]:
    """The ``register`` an entry point's target names: the target itself, or a module's ``register``."""
    register = getattr(target, "register", None) if isinstance(target, types.ModuleType) else target
    if register is None:
        raise TypeError(f"its entry point names module {target.__name__}, which has no register(registrar) function")
    if not callable(register):
        raise TypeError(f"its entry point names {target!r:.80}, which is not callable")
    return cast(Callable[[Registrar], Any], register)


def run_registration(
    name: str, package: str, load: Callable[[], Any], table: ReducerTable, *, home: str | None
) -> tuple[PluginInfo, list[Reducer]]:
    """Load a plugin's entry point and run its ``register(registrar)`` against a fresh draft.

    Returns the plugin's record and the reducers to commit. Any exception (isolation: a broken plugin must never
    break pickling) gives a ``"failed"`` record, with the error, and nothing to commit.
    """
    draft = PluginDraft(home=home)
    try:
        _register_function(load())(Registrar(table, draft, name, package))
        for reducer in draft.reducers:
            table.check_free(reducer, False)
    except Exception as e:
        return PluginInfo(name, package, "failed", error=f"{type(e).__name__}: {e}"), []
    info = PluginInfo(
        name,
        package,
        "loaded",
        load_hook=draft.load_hook,
        safe_globals=tuple(draft.safe_globals),
        modules=tuple(draft.modules),
        home=draft.home,
    )
    return info, draft.reducers
