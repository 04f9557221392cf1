"""The plugin API: everything a zerocopy_pickle plugin needs, and the only module of the library it should import.

A plugin is a package that teaches the pickler about types plain pickle cannot take (docs/plugins.md). It is
found through the entry-point group ``zerocopy_pickle.plugins``, whose entry point names a
``register(registrar)`` function::

    from zerocopy_pickle.plugin import Registrar, validate

    def register(registrar: Registrar) -> None:
        registrar.register_reducer("thermo.core:Reading", reduce_reading)
        registrar.add_safe_globals(rebuild_reading)

What is here:

* registration: :class:`Registrar` (what ``register`` receives), :class:`Reducer`, :data:`ReduceFunction`,
  :func:`type_key` (the ``"module:QualName"`` key of a class), :class:`Registry` and :func:`default_registry`
  (registering by hand, or a private registry for tests: ``zp.dump(..., registry=...)``), :class:`PluginInfo`;
* safe globals: :func:`check_safe_global` (the rule a declared safe global must pass) and :mod:`validate` (the
  exact-type argument checks every safe global starts with: ``validate.expect_int``, ``validate.fail``...);
* errors a reducer or rebuild function raises: :class:`Unpicklable` (refuse to pickle an object, with a
  message), :class:`DumpError`, :class:`SnapshotError`, :class:`UnsafeArgumentError`, :class:`DeviceError`,
  :class:`PluginError`, :class:`ArgumentError`; :class:`PluginWarning`;
* names: :data:`ENTRY_POINT_GROUP` (``"zerocopy_pickle.plugins"``), :data:`DISABLE_ENV` (the environment
  variable that disables plugins by name);
* helpers: :func:`jit_load_from_buffer` (a TorchScript archive from a bytes-like object, read in place by the
  native helpers when they are active).

The conformance suite a plugin's tests subclass, and the hostile-argument checker, are in
:mod:`zerocopy_pickle.testing`. The patch points of the model cache are declared separately, through the
entry-point group ``zerocopy_pickle.cache_patch_points`` (:mod:`zerocopy_pickle.cache.points`).

Everything here is a stable name; the modules these names come from are internal and may move.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._registry.declarations import PluginInfo, check_safe_global
from ._registry.discovery import DISABLE_ENV, ENTRY_POINT_GROUP, PluginWarning
from ._registry.reducer_table import ReduceFunction, Reducer, type_key
from ._registry.registrar import Registrar
from ._registry.registry import Registry, default_registry
from .errors import (
    ArgumentError,
    DeviceError,
    DumpError,
    PluginError,
    SnapshotError,
    Unpicklable,
    UnsafeArgumentError,
    ZeroCopyPickleError,
)

if TYPE_CHECKING:
    from . import validate

__all__ = [
    "DISABLE_ENV",
    "ENTRY_POINT_GROUP",
    "ArgumentError",
    "DeviceError",
    "DumpError",
    "PluginError",
    "PluginInfo",
    "PluginWarning",
    "ReduceFunction",
    "Reducer",
    "Registrar",
    "Registry",
    "SnapshotError",
    "Unpicklable",
    "UnsafeArgumentError",
    "ZeroCopyPickleError",
    "check_safe_global",
    "default_registry",
    "jit_load_from_buffer",
    "type_key",
    "validate",
]


def jit_load_from_buffer(buffer: Any, map_location: Any = None) -> Any:
    """Load a TorchScript archive (``torch.jit.save`` output) from a bytes-like object: what ``torch.jit.load``
    returns, with the same ``map_location`` (``None``, a device string or a ``torch.device``).

    With the native helpers active the archive is read in place, without the copies ``torch.jit.load`` of a
    ``BytesIO`` makes; nothing in the returned module points into ``buffer``.
    """
    from . import native  # imports torch, and may build the native helpers: on first use only

    return native.jit_load_from_buffer(buffer, map_location)


def __getattr__(name: str) -> Any:
    # validate imports torch; a plugin that needs no torch (a load hook, a module claim) should not pay for it.
    if name == "validate":
        import importlib

        module = importlib.import_module(".validate", __package__)
        globals()["validate"] = module
        return module
    raise AttributeError(f"module 'zerocopy_pickle.plugin' has no attribute {name!r}")
