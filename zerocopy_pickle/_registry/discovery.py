"""Internal: finding plugins through the entry-point group ``zerocopy_pickle.plugins``.

Not a public module. An entry point names a ``register(registrar)`` callable, or a module that has one.
:func:`entry_points` lists what is installed, each with the name of the distribution that provides it (named in
the error when a snapshot needs a plugin that is missing) and whether ``ZEROCOPY_PICKLE_DISABLE_PLUGINS``
(``name,other`` or ``*``) disables it. The registry loads them lazily (the first pickler or load), once, and
reports a plugin that fails with :func:`warn_failed`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._names import GlobalName
from .declarations import PluginInfo, top_package

ENTRY_POINT_GROUP = "zerocopy_pickle.plugins"
DISABLE_ENV = "ZEROCOPY_PICKLE_DISABLE_PLUGINS"


class PluginWarning(UserWarning):
    """A plugin failed to load and was skipped (reported once per plugin and process)."""


@dataclass(frozen=True)
class Found:
    """One installed plugin entry point."""

    name: str
    package: str
    """The distribution that provides it (the entry point's module when no distribution is known)."""
    load: Callable[[], Any]
    home: str
    """Top-level package of its module: where its safe globals must live."""
    disabled: bool


def entry_points(group: str = ENTRY_POINT_GROUP) -> list[Found]:
    """The installed entry points of ``group``, in discovery order."""
    disabled = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    found = []
    for entry_point in importlib.metadata.entry_points(group=group):
        package = entry_point.dist.name if entry_point.dist is not None else entry_point.module
        off = "*" in disabled or entry_point.name in disabled
        found.append(Found(entry_point.name, package, entry_point.load, top_package(entry_point.module), off))
    return found


def warn_failed(info: PluginInfo) -> None:
    """Report a plugin that failed to load (once: the registry keeps the failed record)."""
    warnings.warn(
        f"zerocopy_pickle plugin {info.name!r} (from {info.package}) failed to load and is skipped: {info.error}",
        PluginWarning,
        stacklevel=4,
    )


def resolve_name(name: str) -> Any:
    """Import ``"package.module:Qualified.name"`` and return the object it names (factories, cache loaders); the
    import's or the attribute walk's own error if that fails (``ValueError`` if ``name`` is not of that form)."""
    parsed = GlobalName.parse(name)
    if parsed is None:
        raise ValueError(f"{name!r} is not a 'module:qualname' name")
    return parsed.lookup()
