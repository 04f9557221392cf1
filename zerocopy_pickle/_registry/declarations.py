"""Internal: what plugins declare besides reducers, the trust rules on it, and whose declarations a load sees.

Not a public module: plugins reach :func:`check_safe_global` through :mod:`zerocopy_pickle.plugin`.

Trust rules (docs/plugins.md): a safe global must be a plain module-level Python function
(:func:`check_safe_global`), of the registering plugin's own top-level package, that validates its arguments
(:mod:`zerocopy_pickle.validate`); a restricted load allows only the safe globals of the plugins its header names
(:func:`safe_globals`). A plugin may also claim module prefixes (:func:`claim_for`): snapshots that pickle
classes from those modules record the plugin.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import cast

from .._names import GlobalName
from ..errors import ArgumentError, PluginError
from .reducer_table import Reducer

ENABLED = ("loaded", "registered")
"""The states of a plugin whose declarations count."""


@dataclass
class PluginInfo:
    """What the registry knows about one plugin."""

    name: str
    package: str
    state: str  # "loaded", "disabled", "failed", or "registered" (added without an entry point)
    error: str | None = None
    load_hook: Callable[[], None] | None = None
    safe_globals: tuple[tuple[str, str], ...] = ()
    modules: tuple[str, ...] = ()
    home: str | None = None
    """Top-level package of the plugin's registration module: its safe globals must live there."""


def top_package(module: str) -> str:
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
    if home is not None and top_package(module) != home:
        raise PluginError(
            f"safe global {name} is not in the plugin's own package {home!r}: a plugin may only declare its own "
            f"rebuild functions as safe",
            plugin=plugin or home,
        )
    return cast(types.FunctionType, obj)


def _split_pair(item: str) -> tuple[str, str]:
    name = GlobalName.parse(item)
    if name is None or not name.qualname.isidentifier() or name.module.startswith("."):
        raise ArgumentError(
            f"safe global {item!r} must have the form 'module:function' (a module-level function's name)"
        )
    return name.pair


def global_pairs(
    entries: Iterable[object], home: str | None = None, plugin: str | None = None
) -> tuple[tuple[str, str], ...]:
    """The ``(module, qualname)`` pairs of safe-global declarations, each checked (:func:`check_safe_global`);
    strings and pairs are checked when first resolved (:func:`resolve_safe_global`), and must name a module of
    ``home`` already."""
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
        if home is not None and top_package(pair[0]) != home:
            raise PluginError(
                f"safe global {pair[0]}:{pair[1]} is not in the plugin's own package {home!r}: a plugin may only "
                f"declare its own rebuild functions as safe",
                plugin=home,
            )
        pairs.append(pair)
    return tuple(pairs)


def check_module_prefix(prefix: object) -> str:
    """``prefix`` if it is a dotted module name a plugin may claim.

    Raises:
        ArgumentError: it is not.
    """
    if not isinstance(prefix, str) or not prefix or prefix.startswith(".") or prefix.endswith("."):
        raise ArgumentError(f"a module prefix must be a dotted module name, not {prefix!r:.80}")
    return prefix


def plugin_names(plugins: Iterable[object]) -> frozenset[str]:
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


def safe_globals(
    plugins: Mapping[str, PluginInfo], reducers: Mapping[str, Reducer], named: Iterable[object] | None
) -> dict[tuple[str, str], None]:
    """The safe globals of the enabled plugins ``named`` (None: all), their reducers' included, and of every
    reducer registered without a plugin (see :meth:`zerocopy_pickle.Registry.safe_globals`)."""
    wanted = None if named is None else plugin_names(named)
    pairs: dict[tuple[str, str], None] = {}
    for info in plugins.values():
        if info.state in ENABLED and (wanted is None or info.name in wanted):
            pairs.update(dict.fromkeys(info.safe_globals))
    for reducer in reducers.values():
        if wanted is None or reducer.plugin is None or reducer.plugin in wanted:
            pairs.update(dict.fromkeys(reducer.safe_globals))
    return pairs


def _owner_of(plugins: Mapping[str, PluginInfo], reducers: Mapping[str, Reducer], pair: tuple[str, str]) -> str | None:
    for info in plugins.values():
        if pair in info.safe_globals:
            return info.name
    for reducer in reducers.values():
        if pair in reducer.safe_globals:
            return reducer.plugin
    return None


def resolve_safe_global(
    plugins: Mapping[str, PluginInfo],
    reducers: Mapping[str, Reducer],
    module: str,
    qualname: str,
    named: Iterable[object] | None,
) -> types.FunctionType:
    """The function a declared safe global names, imported and checked (see
    :meth:`zerocopy_pickle.Registry.resolve_safe_global`).

    Raises:
        PluginError: not declared by ``named``, not importable, or not a plain module-level function of the
            declaring plugin's package.
    """
    pair = (module, qualname)
    if pair not in safe_globals(plugins, reducers, named):
        raise PluginError(f"{module}:{qualname} is not a declared safe global", plugin="?")
    owner = _owner_of(plugins, reducers, pair)
    try:
        imported = importlib.import_module(module)
    except Exception as e:
        raise PluginError(
            f"safe global {module}:{qualname} cannot be imported: {type(e).__name__}: {e}", plugin=owner or "?"
        ) from e
    obj = imported.__dict__.get(qualname)
    home = plugins[owner].home if owner is not None and owner in plugins else None
    return check_safe_global(obj, home, plugin=owner)


def module_claims(plugins: Mapping[str, PluginInfo]) -> tuple[tuple[str, PluginInfo], ...]:
    """``(module prefix, plugin)`` for every module prefix an enabled plugin claims."""
    return tuple((prefix, info) for info in plugins.values() if info.state in ENABLED for prefix in info.modules)


def claim_for(claims: Iterable[tuple[str, PluginInfo]], module: str) -> PluginInfo | None:
    """The plugin among ``claims`` that claims ``module``, if any."""
    for prefix, info in claims:
        if module == prefix or module.startswith(prefix + "."):
            return info
    return None
