"""Internal: preparing a load for the plugins a snapshot's header names.

Not a public module (:meth:`zerocopy_pickle.Registry.prepare_load` is the public door). Every load checks that
each plugin is installed, enabled and loaded; only a trusted load runs their load hooks, since a header is
written by whoever wrote the snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .declarations import PluginInfo
from .discovery import DISABLE_ENV
from .errors import PluginError

__all__ = ["check_present", "prepare_load", "run_load_hooks"]


def check_present(plugins: Mapping[str, PluginInfo], needed: Iterable[tuple[str, str]]) -> None:
    """Raise :class:`PluginError` for the first plugin of ``needed`` that is not installed, disabled, or failed."""
    for name, package in needed:
        info = plugins.get(name)
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


def run_load_hooks(plugins: Mapping[str, PluginInfo], needed: Iterable[tuple[str, str]]) -> None:
    """Run the load hook of each plugin of ``needed`` (all present: :func:`check_present` first).

    Raises:
        PluginError: a hook raised (chained to what it raised).
    """
    for name, package in needed:
        hook = plugins[name].load_hook
        if hook is not None:
            try:
                hook()
            except Exception as e:
                raise PluginError(
                    f"the load hook of plugin {name!r} failed: {type(e).__name__}: {e}", plugin=name, package=package
                ) from e


def prepare_load(plugins: Mapping[str, PluginInfo], needed: Iterable[tuple[str, str]], *, trusted: bool) -> None:
    """Check that every plugin of ``needed`` is present; in a trusted load, then run their load hooks."""
    pairs = list(needed)
    check_present(plugins, pairs)
    if trusted:
        run_load_hooks(plugins, pairs)
