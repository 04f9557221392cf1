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
"""

from __future__ import annotations

import contextvars
import importlib
import importlib.metadata
import os
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ArgumentError, PluginError

__all__ = [
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "PluginWarning",
    "Reducer",
    "Registrar",
    "Registry",
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


def _global_pairs(entries: Iterable[object]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in entries:
        if isinstance(item, str):
            module, sep, qualname = item.partition(":")
            if not sep or not module or not qualname:
                raise ArgumentError(f"safe global {item!r} must have the form 'module:qualname'")
            pairs.append((module, qualname))
        elif isinstance(item, tuple) and len(item) == 2 and all(isinstance(p, str) and p for p in item):
            pairs.append((item[0], item[1]))
        elif isinstance(getattr(item, "__module__", None), str) and isinstance(
            getattr(item, "__qualname__", None), str
        ):
            pairs.append((item.__module__, item.__qualname__))  # type: ignore[attr-defined]
        else:
            raise ArgumentError(
                f"safe globals must be classes, functions, 'module:qualname' strings or (module, qualname) "
                f"tuples, not {item!r:.80}"
            )
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


@dataclass
class _Pending:
    """Registrations of one plugin, committed only if its registration completes."""

    reducers: list[Reducer] = field(default_factory=list)
    safe_globals: list[tuple[str, str]] = field(default_factory=list)
    load_hook: Callable[[], None] | None = None
    patch_points: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)


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
        reducer = self._registry._make(target, reduce, self.name, self.package, safe_globals)
        self._registry._check_clobber(reducer, clobber, self._pending)
        self._pending.reducers.append(reducer)

    def add_safe_globals(self, *entries: object) -> None:
        """Declare globals this plugin's streams reference, allowed in every restricted load."""
        self._pending.safe_globals.extend(_global_pairs(entries))

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
        _global_pairs([target])  # validates the 'module:qualname' form
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
        self, target: object, reduce: ReduceFunction, plugin: str | None, package: str | None, safe: Iterable[object]
    ) -> Reducer:
        key, cls = _target_key(target)
        if not callable(reduce):
            raise ArgumentError(f"reduce must be callable, not {reduce!r:.80}")
        return Reducer(key, reduce, plugin, package, _global_pairs(safe), cls)

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
        reducer = self._make(target, reduce, name, package, safe_globals)
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

    def safe_globals(self) -> dict[tuple[str, str], None]:
        """Every safe global declared by an enabled plugin or a reducer (resolved by name when used)."""
        self.ensure_discovered()
        pairs: dict[tuple[str, str], None] = {}
        for info in self._plugins.values():
            if info.state in ("loaded", "registered"):
                pairs.update(dict.fromkeys(info.safe_globals))
        for reducer in self._reducers.values():
            pairs.update(dict.fromkeys(reducer.safe_globals))
        return pairs

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
            info = self._load_plugin(name, package or name, lambda: register, warn=False)
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
                self._load_plugin(name, package, entry_point.load, warn=True)

    def rediscover(self) -> None:
        """Forget entry-point plugins and scan the group again (after installing one at run time)."""
        with self._lock:
            for name, info in list(self._plugins.items()):
                if info.state != "registered":
                    self.remove_plugin(name)
            self._discovered = not self._discover

    def _load_plugin(self, name: str, package: str, load: Callable[[], Any], *, warn: bool) -> PluginInfo:
        pending = _Pending()
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
        )
        self._plugins[name] = info
        self._commit_reducers(pending.reducers)
        return info

    def prepare_load(self, plugins: Iterable[tuple[str, str]]) -> None:
        """Make sure every plugin a snapshot needs is loaded, and run their load hooks.

        Raises:
            PluginError: a plugin is not installed, disabled, or failed to load.
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
            if info.load_hook is not None:
                try:
                    info.load_hook()
                except Exception as e:
                    raise PluginError(
                        f"the load hook of plugin {name!r} failed: {type(e).__name__}: {e}",
                        plugin=name,
                        package=package,
                    ) from e


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
        safe_globals: globals the reduced stream references (its rebuild functions), allowed in restricted
            loads: classes, functions, ``"module:qualname"`` strings or ``(module, qualname)`` tuples.
        clobber: replace an existing registration for the same target instead of raising.

    Raises:
        ArgumentError: a malformed target or entry, or the target is taken and ``clobber`` is False.
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
