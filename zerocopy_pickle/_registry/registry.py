"""Internal: the registry, which composes the parts below into one object a pickler or a load is given.

Not a public module: :class:`Registry`, :func:`default_registry` and the module-level functions are public
through the top-level ``zerocopy_pickle`` namespace and :mod:`zerocopy_pickle.plugin`. The parts, one job each:

* :mod:`~zerocopy_pickle._registry.reducer_table`: the reducer table and its MRO lookup by type name (registering never
  imports the library a reducer is about);
* :mod:`~zerocopy_pickle._registry.discovery`: the entry-point group ``zerocopy_pickle.plugins``, disabling by
  ``ZEROCOPY_PICKLE_DISABLE_PLUGINS``, the warning for a plugin that fails;
* :mod:`~zerocopy_pickle._registry.registrar`: one plugin's registration as a transaction (the :class:`Registrar` a
  plugin's ``register`` receives; committed whole or rolled back);
* :mod:`~zerocopy_pickle._registry.declarations`: safe globals and module claims, the trust rules on them, and whose
  declarations a load sees;
* :mod:`~zerocopy_pickle._registry.preparation`: what a load does with the plugins its header names.

Discovery is lazy (the first pickler or load, not ``import zerocopy_pickle``), cached, and isolated: a plugin
that fails is reported once as a :class:`PluginWarning` naming it, its partial registrations are rolled back, and
everything else goes on. The model cache's patch points are not the registry's: the cache reads its own
entry-point group (:mod:`zerocopy_pickle.cache.points`).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import PluginError
from . import declarations, preparation
from .declarations import PluginInfo, global_pairs, top_package
from .discovery import entry_points, warn_failed
from .reducer_table import ReduceFunction, Reducer, ReducerTable, make_reducer
from .registrar import Registrar, run_registration


class Registry:
    """Reducers, plugins and their declarations. :func:`default_registry` is the one the library uses by default;
    a private ``Registry(discover=False)``, passed as ``registry=`` to ``dump``/``load`` and the pickler, keeps a
    program's (or a test's) registrations to itself."""

    def __init__(self, *, discover: bool = True) -> None:
        self._lock = threading.RLock()
        self._table = ReducerTable()
        self._plugins: dict[str, PluginInfo] = {}
        self._discover = discover
        self._discovered = not discover

    @property
    def version(self) -> int:
        """Bumped on every change of the reducer table."""
        return self._table.version

    # -- reducers --------------------------------------------------------------------------------------------

    def register_reducer(
        self,
        target: type | str,
        reduce: ReduceFunction,
        *,
        name: str | None = None,
        safe_globals: Iterable[object] = (),
        clobber: bool = False,
    ) -> None:
        """See :func:`register_reducer`."""
        package = None
        if name is not None:
            info = self._plugins.get(name)
            package = info.package if info is not None else name
        reducer = make_reducer(target, reduce, name, package, global_pairs(safe_globals, None, name))
        with self._lock:
            self._table.check_free(reducer, clobber)
            self._table.commit([reducer])

    def unregister_reducer(self, target: type | str) -> Reducer:
        """Remove and return the reducer for ``target``.

        Raises:
            ArgumentError: nothing is registered for it.
        """
        with self._lock:
            return self._table.remove(target)

    def reducers(self) -> Mapping[str, Reducer]:
        """A read-only view of the registered reducers, by target (discovering plugins first)."""
        self.ensure_discovered()
        return self._table.view()

    def lookup(self, cls: type) -> Reducer | None:
        """The reducer for ``cls``: the first class of its MRO with a registration (exact beats base)."""
        return self._table.lookup(cls)

    # -- plugins -----------------------------------------------------------------------------------------------

    def plugins(self) -> Mapping[str, PluginInfo]:
        """What discovery found, by plugin name (discovering first)."""
        self.ensure_discovered()
        return types.MappingProxyType(dict(self._plugins))

    def add_plugin(self, name: str, register: Callable[[Registrar], Any], *, package: str | None = None) -> PluginInfo:
        """Register a plugin by hand (as discovery does for an entry point), running ``register(registrar)``.

        Raises:
            PluginError: ``register`` raised; nothing it registered is kept.
        """
        module = getattr(register, "__module__", None)
        home = top_package(module) if isinstance(module, str) else None
        with self._lock:
            info = self._run(name, package or name, lambda: register, home=home)
            if info.state == "failed":
                raise PluginError(f"plugin {name!r} failed to register: {info.error}", plugin=name, package=package)
            info.state = "registered"
            return info

    def remove_plugin(self, name: str) -> None:
        """Forget a plugin and everything it registered."""
        with self._lock:
            self._plugins.pop(name, None)
            self._table.drop_plugin(name)

    def ensure_discovered(self) -> None:
        """Load every plugin of the entry-point group, once per registry (see :meth:`rediscover`)."""
        if self._discovered:
            return
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            for found in entry_points():
                if found.name in self._plugins:
                    continue
                if found.disabled:
                    self._plugins[found.name] = PluginInfo(found.name, found.package, "disabled")
                    continue
                info = self._run(found.name, found.package, found.load, home=found.home)
                if info.state == "failed":
                    warn_failed(info)

    def rediscover(self) -> None:
        """Forget entry-point plugins and scan the group again (after installing one at run time)."""
        with self._lock:
            for name, info in list(self._plugins.items()):
                if info.state != "registered":
                    self.remove_plugin(name)
            self._discovered = not self._discover

    def _run(self, name: str, package: str, load: Callable[[], Any], *, home: str | None) -> PluginInfo:
        """One plugin's registration transaction, committed here if it completed (caller holds the lock)."""
        info, reducers = run_registration(name, package, load, self._table, home=home)
        self._plugins[name] = info
        if info.state != "failed":
            self._table.commit(reducers)
        return info

    # -- declarations ------------------------------------------------------------------------------------------

    def safe_globals(self, plugins: Iterable[str] | None = None) -> dict[tuple[str, str], None]:
        """The safe globals a restricted load may resolve besides the built-in set and its ``allow=``.

        Args:
            plugins: the names of the plugins a snapshot's header lists: only those plugins' declarations (their
                ``add_safe_globals`` and their reducers' ``safe_globals=``) are returned, so that an installed
                plugin a snapshot does not name opens nothing to it. None: every enabled plugin's (the old form).
                Reducers registered in-process without a plugin name (``zp.register_reducer(...)`` without
                ``name=``) are the running program's own declarations, which no header can name: theirs are always
                included.

        Each pair names a function checked at registration or, for a ``"module:function"`` string, when first
        resolved through :meth:`resolve_safe_global`.
        """
        self.ensure_discovered()
        return declarations.safe_globals(self._plugins, self._table.view(), plugins)

    def resolve_safe_global(
        self, module: str, qualname: str, plugins: Iterable[str] | None = None
    ) -> types.FunctionType:
        """The function a declared safe global names, imported (its module belongs to the declaring plugin) and
        checked with :func:`check_safe_global`: what a restricted load calls for ``(module, qualname)``.

        Raises:
            PluginError: the pair is not declared by ``plugins`` (see :meth:`safe_globals`), its module cannot be
                imported, or it does not name a plain module-level function of the declaring plugin's package.
        """
        self.ensure_discovered()
        return declarations.resolve_safe_global(self._plugins, self._table.view(), module, qualname, plugins)

    def module_claims(self) -> tuple[tuple[str, PluginInfo], ...]:
        """``(module prefix, plugin)`` for every module prefix an enabled plugin claims."""
        self.ensure_discovered()
        return declarations.module_claims(self._plugins)

    def claim_for(self, module: str) -> PluginInfo | None:
        """The plugin that claims ``module`` (see :meth:`Registrar.claim_modules`), if any."""
        return declarations.claim_for(self.module_claims(), module)

    # -- loads -------------------------------------------------------------------------------------------------

    def prepare_load(self, plugins: Iterable[tuple[str, str]], *, trusted: bool = False) -> None:
        """Make sure every plugin a snapshot needs is installed and loaded; in a trusted load, run their load hooks.

        A restricted load (``trusted=False``, the default) only checks presence: the plugins named in a header
        an attacker may have written are looked up (discovery imports their registration modules, as any load
        does), but no load hook runs, so nothing is imported or patched because the header says so. A snapshot
        whose stream needs what a hook prepares (``dynamic-modules``' namespaces, ``stable-fast``'s operators)
        then fails in the unpickler, as a global the restricted load refuses or cannot import; load it with
        ``trusted=True`` (or run the plugin's preparation yourself first).

        Raises:
            PluginError: a plugin is not installed, disabled, or failed to load; or its load hook failed.
        """
        needed = list(plugins)
        if not needed:
            return
        self.ensure_discovered()
        preparation.prepare_load(self._plugins, needed, trusted=trusted)


_DEFAULT = Registry()


def default_registry() -> Registry:
    """The registry every pickler and load of this process uses unless given ``registry=``."""
    return _DEFAULT


def register_reducer(
    target: type | str,
    reduce: ReduceFunction,
    *,
    name: str | None = None,
    safe_globals: Iterable[object] = (),
    clobber: bool = False,
) -> None:
    """Register ``reduce`` as the reducer for ``target`` and its subclasses, in the default registry.

    ``reduce(obj)`` returns what ``obj.__reduce__()`` would: ``(callable, args[, state[, listitems[,
    dictitems[, state_setter]]]])``, or NotImplemented to let pickle reduce ``obj`` as usual. Tensors inside the
    returned arguments still go out of band.

    Args:
        target: a type, or ``"module:QualName"`` of one. A string is only ever compared with the names of the
            types being pickled, so registering never imports the library it names.
        reduce: the reducing function.
        name: the plugin this reducer belongs to; snapshots that use it record the plugin, and loading them
            needs it. (A plugin's own registration goes through the :class:`Registrar` its ``register`` receives.)
        safe_globals: the functions the reduced stream calls, allowed in restricted loads: module-level Python
            functions that validate their arguments (docs/plugins.md), or their ``"module:function"`` strings or
            ``(module, function)`` tuples. With ``name``, only loads of snapshots whose header names that plugin
            allow them; without, every restricted load in this process does.
        clobber: replace an existing registration for the same target instead of raising.

    Raises:
        ArgumentError: a malformed target or entry, or the target is taken and ``clobber`` is False.
        PluginError: a safe global is not a plain module-level function (a class, builtin, method, lambda...).

    Examples:
        ```python
        import zerocopy_pickle as zp
        from zerocopy_pickle.validate import expect_float
        from mypkg import Interval  # holds a generator: plain pickle refuses it


        def rebuild_interval(lo, hi):  # module-level; a restricted load calls it with what the stream chose
            where = "mypkg.rebuild_interval"
            return Interval(expect_float(lo, where, "lo"), expect_float(hi, where, "hi"))


        zp.register_reducer(Interval, lambda i: (rebuild_interval, (i.lo, i.hi)), safe_globals=[rebuild_interval])
        zp.dump(Interval(0.0, 1.5), "interval.zcp")
        zp.load("interval.zcp")  # restricted: rebuild_interval is a declared safe global
        ```

        A plugin registers the same way through its :class:`Registrar` (docs/plugins.md).
    """
    _DEFAULT.register_reducer(target, reduce, name=name, safe_globals=safe_globals, clobber=clobber)


def unregister_reducer(target: type | str) -> Reducer:
    """Remove the reducer registered for ``target`` in the default registry and return it.

    Raises:
        ArgumentError: nothing is registered for ``target``.
    """
    return _DEFAULT.unregister_reducer(target)


def reducers() -> Mapping[str, Reducer]:
    """A read-only view of the default registry's reducers, keyed by ``"module:QualName"`` of their target."""
    return _DEFAULT.reducers()
