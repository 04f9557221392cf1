"""The reducer registry: how plugins teach the pickler about types plain pickle cannot take.

A reducer is registered for a *type name* (``"bitsandbytes.nn.modules:Params4bit"``) or a type. Lookup walks the
type of each pickled object's MRO and compares names, so registering a reducer never imports the library it is
about: no object of a type can exist before its module is imported, and the registry never imports it either
(the lesson of lazy imports in fsspec's registry and in Ultralytics' checkpoint loader).

Plugins are discovered through the entry-point group ``zerocopy_pickle.plugins``. An entry point names a
``register(registry)`` callable, or a module that has one (or that registers at import). Discovery is lazy
(the first pickler or load, not ``import zerocopy_pickle``), cached, and isolated: a plugin that fails is
reported once as a :class:`PluginWarning` naming it, its partial registrations are rolled back, and everything
else goes on. ``ZEROCOPY_PICKLE_DISABLE_PLUGINS=name,other`` (or ``*``) disables plugins by name.

A plugin may also declare *safe globals* (what its reducers' streams reference, allowed in restricted loads),
a *load hook* (run before a snapshot that used the plugin is unpickled, to prepare the process), and *patch
points* for the model cache.

Trust rules (docs/plugins.md): a safe global must be a plain module-level Python function
(:func:`check_safe_global`), of the registering plugin's own top-level package, that validates its arguments
(:mod:`zerocopy_pickle.validate`); a restricted load allows only the safe globals of the plugins its header names
(:meth:`Registry.safe_globals`), and runs no load hook (:meth:`Registry.prepare_load`).
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.metadata
import os
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from .errors import ArgumentError, PluginError

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "PluginWarning",
    "Reducer",
    "Registrar",
    "Registry",
    "check_safe_global",
    "default_registry",
    "reducers",
    "register_reducer",
    "resolve_name",
    "unregister_reducer",
]

ENTRY_POINT_GROUP = "zerocopy_pickle.plugins"
DISABLE_ENV = "ZEROCOPY_PICKLE_DISABLE_PLUGINS"

ReduceFunction = Callable[[Any], Any]
"""``reduce(obj)`` returns what ``__reduce__`` would (a tuple, or a global name), or NotImplemented."""


class PluginWarning(UserWarning):
    """A plugin failed to load and was skipped (reported once per plugin and process)."""


def type_key(cls: type) -> str:
    """``"module:QualName"`` of a class, the key reducers are registered under."""
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_name(name: str) -> Any:
    """Import ``"package.module:Qualified.name"`` and return the object it names (patch points, factories)."""
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _target_key(target: object) -> tuple[str, type | None]:
    if isinstance(target, str):
        module, sep, qualname = target.partition(":")
        if not sep or not module or not qualname or ":" in qualname:
            raise ArgumentError(
                f"reducer target {target!r} must be a type or a 'module:QualName' string, "
                f"e.g. 'bitsandbytes.nn.modules:Params4bit'"
            )
        return target, None
    if isinstance(target, type):
        return type_key(target), target
    raise ArgumentError(f"reducer target must be a type or a 'module:QualName' string, not {target!r:.80}")


def _top(module: str) -> str:
    return module.partition(".")[0]


def check_safe_global(obj: object, home: str | None = None, *, plugin: str | None = None) -> types.FunctionType:
    """``obj`` if it may be a plugin's safe global, else raise :class:`PluginError`.

    A safe global is called by restricted loads with arguments a hostile stream chose, so it must be code the
    plugin wrote to be called that way: a plain Python function (``types.FunctionType``: not a class, a builtin,
    a bound method, a ``functools.partial`` or another callable object), defined at module level (its
    ``__qualname__`` is a plain identifier, so no lambda, closure or method) and reachable under that name
    (``module.<qualname> is obj``). With ``home``, its module must also lie in that top-level package (the
    registering plugin's own).
    """
    name = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', '?')}"
    if type(obj) is not types.FunctionType:
        kind = "a class" if isinstance(obj, type) else f"a {type(obj).__qualname__}"
        raise PluginError(
            f"safe global {name} is {kind}, not a plain Python function: restricted loads call safe globals with "
            f"arguments the stream chose, so declare a module-level rebuild function that validates them "
            f"(zerocopy_pickle.validate) instead",
            plugin=plugin or home or "?",
        )
    module, qualname = obj.__module__, obj.__qualname__
    if not isinstance(module, str) or not qualname.isidentifier():
        raise PluginError(
            f"safe global {name} is not a module-level function (a lambda, a closure or a method); "
            f"define it at the top level of a module of the plugin",
            plugin=plugin or home or "?",
        )
    if getattr(sys.modules.get(module), qualname, None) is not obj:
        raise PluginError(f"safe global {name} is not reachable as {module}.{qualname}", plugin=plugin or home or "?")
    if home is not None and _top(module) != home:
        raise PluginError(
            f"safe global {name} is not in the plugin's own package {home!r}: a plugin may only declare its own "
            f"rebuild functions as safe",
            plugin=plugin or home,
        )
    return cast(types.FunctionType, obj)


def _split_pair(item: str) -> tuple[str, str]:
    module, sep, qualname = item.partition(":")
    if not sep or not module or not qualname or not qualname.isidentifier() or module.startswith("."):
        raise ArgumentError(
            f"safe global {item!r} must have the form 'module:function' (a module-level function's name)"
        )
    return module, qualname


def _global_pairs(
    entries: Iterable[object], home: str | None = None, plugin: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The ``(module, qualname)`` pairs of safe-global declarations, each checked (:func:`check_safe_global`);
    strings and pairs are checked when first resolved (:meth:`Registry.resolve_safe_global`), and must name a
    module of ``home`` already."""
    pairs = []
    for item in entries:
        if isinstance(item, str):
            pair = _split_pair(item)
        elif isinstance(item, tuple) and len(item) == 2 and all(isinstance(p, str) and p for p in item):
            pair = _split_pair(f"{item[0]}:{item[1]}")
        elif callable(item) or isinstance(item, type):
            fn = check_safe_global(item, home, plugin=plugin)
            pair = (fn.__module__, fn.__qualname__)
        else:
            raise ArgumentError(
                f"safe globals must be module-level functions, 'module:function' strings or (module, function) "
                f"tuples, not {item!r:.80}"
            )
        if home is not None and _top(pair[0]) != home:
            raise PluginError(
                f"safe global {pair[0]}:{pair[1]} is not in the plugin's own package {home!r}: a plugin may only "
                f"declare its own rebuild functions as safe",
                plugin=home,
            )
        pairs.append(pair)
    return tuple(pairs)


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


@dataclass
class PluginInfo:
    """What discovery knows about one plugin."""

    name: str
    package: str
    state: str  # "loaded", "disabled", "failed", or "registered" (added without an entry point)
    error: str | None = None
    load_hook: Callable[[], None] | None = None
    safe_globals: tuple[tuple[str, str], ...] = ()
    patch_points: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    home: str | None = None
    """Top-level package of the plugin's registration module: its safe globals must live there."""


@dataclass
class _Pending:
    """Registrations of one plugin, committed only if its registration completes."""

    reducers: list[Reducer] = field(default_factory=list)
    safe_globals: list[tuple[str, str]] = field(default_factory=list)
    load_hook: Callable[[], None] | None = None
    patch_points: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    home: str | None = None  # top-level package of the plugin's registration module: where its safe globals live


_current_plugin: contextvars.ContextVar[tuple[_Pending, str, str] | None] = contextvars.ContextVar(
    "zerocopy_pickle_current_plugin", default=None
)


class Registrar:
    """What a plugin's ``register(registry)`` receives: registration on behalf of one named plugin.

    Everything it registers is recorded under the plugin's name, and is rolled back if ``register`` raises.
    """

    def __init__(self, registry: Registry, pending: _Pending, name: str, package: str) -> None:
        self._registry = registry
        self._pending = pending
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
        """Register ``reduce`` for ``target`` (see :func:`register_reducer`) as part of this plugin."""
        reducer = self._registry._make(
            target, reduce, self.name, self.package, _global_pairs(safe_globals, self._pending.home, self.name)
        )
        self._registry._check_clobber(reducer, clobber, self._pending)
        self._pending.reducers.append(reducer)

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
        self._pending.safe_globals.extend(_global_pairs(entries, self._pending.home, self.name))

    def set_load_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` before unpickling any snapshot whose header lists this plugin."""
        if not callable(hook):
            raise ArgumentError(f"a load hook must be callable, not {hook!r:.80}")
        self._pending.load_hook = hook

    def claim_modules(self, *prefixes: str) -> None:
        """Record this plugin in every snapshot that pickles a class (or an instance of one) from a module
        under one of ``prefixes`` (``"diffusers_modules"`` covers ``diffusers_modules.local.x``), so that its
        load hook prepares those modules before such a snapshot is unpickled. Pickling itself is unchanged."""
        for prefix in prefixes:
            if not isinstance(prefix, str) or not prefix or prefix.startswith(".") or prefix.endswith("."):
                raise ArgumentError(f"a module prefix must be a dotted module name, not {prefix!r:.80}")
        self._pending.modules.extend(prefixes)

    def add_patch_point(self, target: str) -> None:
        """Name a callable the model cache should route through itself (``"module:Class.from_pretrained"``)."""
        module, sep, qualname = target.partition(":") if isinstance(target, str) else ("", "", "")
        if not sep or not module or not qualname:
            raise ArgumentError(f"a patch point must have the form 'module:qualname', not {target!r:.80}")
        self._pending.patch_points.append(target)


class Registry:
    """Reducers, plugins and their declarations. :func:`default_registry` is the one the library uses."""

    def __init__(self, *, discover: bool = True) -> None:
        self._lock = threading.RLock()
        self._reducers: Mapping[str, Reducer] = types.MappingProxyType({})
        self._plugins: dict[str, PluginInfo] = {}
        self._discover = discover
        self._discovered = not discover
        self.version = 0  # bumped on every change; picklers cache lookups per version

    # -- reducers --------------------------------------------------------------------------------------------

    def _make(
        self,
        target: object,
        reduce: ReduceFunction,
        plugin: str | None,
        package: str | None,
        safe: tuple[tuple[str, str], ...],
    ) -> Reducer:
        key, cls = _target_key(target)
        if not callable(reduce):
            raise ArgumentError(f"reduce must be callable, not {reduce!r:.80}")
        return Reducer(key, reduce, plugin, package, safe, cls)

    def _check_clobber(self, reducer: Reducer, clobber: bool, pending: _Pending | None = None) -> None:
        existing = self._reducers.get(reducer.target)
        if existing is None and pending is not None:
            existing = next((r for r in pending.reducers if r.target == reducer.target), None)
        if existing is not None and not clobber:
            owner = f"plugin {existing.plugin!r}" if existing.plugin else "a direct registration"
            raise ArgumentError(
                f"a reducer for {reducer.target} is already registered (by {owner}); pass clobber=True to replace it"
            )

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
        context = _current_plugin.get()
        if context is not None and name in (None, context[1]):
            # A plugin module registering at import time through the module-level API.
            Registrar(self, context[0], context[1], context[2]).register_reducer(
                target, reduce, safe_globals=safe_globals, clobber=clobber
            )
            return
        package = None
        if name is not None:
            info = self._plugins.get(name)
            package = info.package if info is not None else name
        reducer = self._make(target, reduce, name, package, _global_pairs(safe_globals, None, name))
        with self._lock:
            self._check_clobber(reducer, clobber)
            self._commit_reducers([reducer])

    def unregister_reducer(self, target: type | str) -> Reducer:
        """Remove and return the reducer for ``target``.

        Raises:
            ArgumentError: nothing is registered for it.
        """
        key, _ = _target_key(target)
        with self._lock:
            if key not in self._reducers:
                raise ArgumentError(f"no reducer is registered for {key}")
            table = dict(self._reducers)
            removed = table.pop(key)
            self._reducers = types.MappingProxyType(table)
            self.version += 1
        return removed

    def _commit_reducers(self, reducers: Iterable[Reducer]) -> None:
        table = dict(self._reducers)
        for reducer in reducers:
            table[reducer.target] = reducer
        self._reducers = types.MappingProxyType(table)
        self.version += 1

    def reducers(self) -> Mapping[str, Reducer]:
        """A read-only view of the registered reducers, by target (discovering plugins first)."""
        self.ensure_discovered()
        return self._reducers

    def lookup(self, cls: type) -> Reducer | None:
        """The reducer for ``cls``: the first class of its MRO with a registration (exact beats base)."""
        table = self._reducers
        if not table:
            return None
        for klass in cls.__mro__:
            reducer = table.get(type_key(klass))
            if reducer is not None and (reducer.cls is None or reducer.cls is klass):
                return reducer
        return None

    # -- plugins -----------------------------------------------------------------------------------------------

    def plugins(self) -> Mapping[str, PluginInfo]:
        """What discovery found, by plugin name (discovering first)."""
        self.ensure_discovered()
        return types.MappingProxyType(dict(self._plugins))

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
        wanted = None if plugins is None else _names(plugins)
        pairs: dict[tuple[str, str], None] = {}
        for info in self._plugins.values():
            if info.state in ("loaded", "registered") and (wanted is None or info.name in wanted):
                pairs.update(dict.fromkeys(info.safe_globals))
        for reducer in self._reducers.values():
            if wanted is None or reducer.plugin is None or reducer.plugin in wanted:
                pairs.update(dict.fromkeys(reducer.safe_globals))
        return pairs

    def resolve_safe_global(
        self, module: str, qualname: str, plugins: Iterable[str] | None = None
    ) -> types.FunctionType:
        """The function a declared safe global names, imported (its module belongs to the declaring plugin) and
        checked with :func:`check_safe_global`: what a restricted load calls for ``(module, qualname)``.

        Raises:
            PluginError: the pair is not declared by ``plugins`` (see :meth:`safe_globals`), its module cannot be
                imported, or it does not name a plain module-level function of the declaring plugin's package.
        """
        pair = (module, qualname)
        if pair not in self.safe_globals(plugins):
            raise PluginError(f"{module}:{qualname} is not a declared safe global", plugin="?")
        owner = self._owner_of(pair)
        try:
            imported = importlib.import_module(module)
        except Exception as e:
            raise PluginError(
                f"safe global {module}:{qualname} cannot be imported: {type(e).__name__}: {e}", plugin=owner or "?"
            ) from e
        obj = imported.__dict__.get(qualname)
        home = None
        if owner is not None and owner in self._plugins:
            home = self._plugins[owner].home
        return check_safe_global(obj, home, plugin=owner)

    def _owner_of(self, pair: tuple[str, str]) -> str | None:
        for info in self._plugins.values():
            if pair in info.safe_globals:
                return info.name
        for reducer in self._reducers.values():
            if pair in reducer.safe_globals:
                return reducer.plugin
        return None

    def module_claims(self) -> tuple[tuple[str, PluginInfo], ...]:
        """``(module prefix, plugin)`` for every module prefix an enabled plugin claims."""
        self.ensure_discovered()
        return tuple(
            (prefix, info)
            for info in self._plugins.values()
            if info.state in ("loaded", "registered")
            for prefix in info.modules
        )

    def claim_for(self, module: str) -> PluginInfo | None:
        """The plugin that claims ``module`` (see :meth:`Registrar.claim_modules`), if any."""
        for prefix, info in self.module_claims():
            if module == prefix or module.startswith(prefix + "."):
                return info
        return None

    def patch_points(self) -> tuple[tuple[str, str], ...]:
        """``(plugin, target)`` for every patch point declared by an enabled plugin."""
        self.ensure_discovered()
        return tuple(
            (info.name, target)
            for info in self._plugins.values()
            if info.state in ("loaded", "registered")
            for target in info.patch_points
        )

    def add_plugin(self, name: str, register: Callable[[Registrar], Any], *, package: str | None = None) -> PluginInfo:
        """Register a plugin by hand (as discovery does for an entry point), running ``register(registrar)``.

        Raises:
            PluginError: ``register`` raised; nothing it registered is kept.
        """
        with self._lock:
            module = getattr(register, "__module__", None)
            home = _top(module) if isinstance(module, str) else None
            info = self._load_plugin(name, package or name, lambda: register, warn=False, home=home)
            if info.state == "failed":
                raise PluginError(f"plugin {name!r} failed to register: {info.error}", plugin=name, package=package)
            info.state = "registered"
            return info

    def remove_plugin(self, name: str) -> None:
        """Forget a plugin and everything it registered."""
        with self._lock:
            self._plugins.pop(name, None)
            remaining = {k: r for k, r in self._reducers.items() if r.plugin != name}
            self._reducers = types.MappingProxyType(remaining)
            self.version += 1

    def ensure_discovered(self) -> None:
        """Load every plugin of the entry-point group, once per process (see :meth:`rediscover`)."""
        if self._discovered:
            return
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            disabled = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
            for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                name = entry_point.name
                if name in self._plugins:
                    continue
                package = entry_point.dist.name if entry_point.dist is not None else entry_point.module
                if "*" in disabled or name in disabled:
                    self._plugins[name] = PluginInfo(name, package, "disabled")
                    continue
                self._load_plugin(name, package, entry_point.load, warn=True, home=_top(entry_point.module))

    def rediscover(self) -> None:
        """Forget entry-point plugins and scan the group again (after installing one at run time)."""
        with self._lock:
            for name, info in list(self._plugins.items()):
                if info.state != "registered":
                    self.remove_plugin(name)
            self._discovered = not self._discover

    def _load_plugin(
        self, name: str, package: str, load: Callable[[], Any], *, warn: bool, home: str | None = None
    ) -> PluginInfo:
        pending = _Pending(home=home)
        token = _current_plugin.set((pending, name, package))
        try:
            target = load()
            register = getattr(target, "register", None) if isinstance(target, types.ModuleType) else target
            if register is not None:
                if not callable(register):
                    raise TypeError(f"its entry point names {target!r:.80}, which is not callable")
                register(Registrar(self, pending, name, package))
            for reducer in pending.reducers:
                self._check_clobber(reducer, False)
        except Exception as e:  # isolation: a broken plugin must never break pickling
            info = PluginInfo(name, package, "failed", error=f"{type(e).__name__}: {e}")
            self._plugins[name] = info
            if warn:
                warnings.warn(
                    f"zerocopy_pickle plugin {name!r} (from {package}) failed to load and is skipped: "
                    f"{type(e).__name__}: {e}",
                    PluginWarning,
                    stacklevel=2,
                )
            return info
        finally:
            _current_plugin.reset(token)
        info = PluginInfo(
            name,
            package,
            "loaded",
            load_hook=pending.load_hook,
            safe_globals=tuple(pending.safe_globals),
            patch_points=tuple(pending.patch_points),
            modules=tuple(pending.modules),
            home=pending.home,
        )
        self._plugins[name] = info
        self._commit_reducers(pending.reducers)
        return info

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
        for name, package in needed:
            info = self._plugins.get(name)
            if info is None:
                raise PluginError(
                    f"this snapshot needs the zerocopy_pickle plugin {name!r}, which is not installed: "
                    f"pip install {package}",
                    plugin=name,
                    package=package,
                )
            if info.state == "disabled":
                raise PluginError(
                    f"this snapshot needs the zerocopy_pickle plugin {name!r}, which {DISABLE_ENV} disables",
                    plugin=name,
                    package=package,
                )
            if info.state == "failed":
                raise PluginError(
                    f"this snapshot needs the zerocopy_pickle plugin {name!r} (from {info.package}), which failed "
                    f"to load: {info.error}",
                    plugin=name,
                    package=package,
                )
        if not trusted:
            return
        for name, package in needed:
            hook = self._plugins[name].load_hook
            if hook is not None:
                try:
                    hook()
                except Exception as e:
                    raise PluginError(
                        f"the load hook of plugin {name!r} failed: {type(e).__name__}: {e}",
                        plugin=name,
                        package=package,
                    ) from e


def _names(plugins: Iterable[object]) -> frozenset[str]:
    """Plugin names from names, ``(name, package)`` pairs or ``PluginRef``s (what a header holds)."""
    names = set()
    for item in plugins:
        name = item if isinstance(item, str) else getattr(item, "name", None)
        if name is None and isinstance(item, tuple) and item:
            name = item[0]
        if not isinstance(name, str):
            raise ArgumentError(f"plugins must be plugin names, not {item!r:.80}")
        names.add(name)
    return frozenset(names)


_DEFAULT = Registry()


def default_registry() -> Registry:
    """The registry every pickler and load of this process uses."""
    return _DEFAULT


def register_reducer(
    target: type | str,
    reduce: ReduceFunction,
    *,
    name: str | None = None,
    safe_globals: Iterable[object] = (),
    clobber: bool = False,
) -> None:
    """Register ``reduce`` as the reducer for ``target`` and its subclasses.

    ``reduce(obj)`` returns what ``obj.__reduce__()`` would: ``(callable, args[, state[, listitems[,
    dictitems[, state_setter]]]])``, or NotImplemented to let pickle reduce ``obj`` as usual. Tensors inside the
    returned arguments still go out of band.

    Args:
        target: a type, or ``"module:QualName"`` of one. A string is only ever compared with the names of the
            types being pickled, so registering never imports the library it names.
        reduce: the reducing function.
        name: the plugin this reducer belongs to; snapshots that use it record the plugin, and loading them
            needs it. Inside a plugin's registration it defaults to that plugin.
        safe_globals: the functions the reduced stream calls, allowed in restricted loads: module-level Python
            functions that validate their arguments (docs/plugins.md), or their ``"module:function"`` strings or
            ``(module, function)`` tuples. With ``name``, only loads of snapshots whose header names that plugin
            allow them; without, every restricted load in this process does.
        clobber: replace an existing registration for the same target instead of raising.

    Raises:
        ArgumentError: a malformed target or entry, or the target is taken and ``clobber`` is False.
        PluginError: a safe global is not a plain module-level function (a class, builtin, method, lambda...).
    """
    _DEFAULT.register_reducer(target, reduce, name=name, safe_globals=safe_globals, clobber=clobber)


def unregister_reducer(target: type | str) -> Reducer:
    """Remove the reducer registered for ``target`` and return it.

    Raises:
        ArgumentError: nothing is registered for ``target``.
    """
    return _DEFAULT.unregister_reducer(target)


def reducers() -> Mapping[str, Reducer]:
    """A read-only view of the registered reducers, keyed by ``"module:QualName"`` of their target."""
    return _DEFAULT.reducers()
