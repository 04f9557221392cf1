"""zerocopy_pickle: pickle any PyTorch object graph with its tensor storages out of band, and load it back as
views into a shared, copy-on-write mapping.

Quick start::

    import zerocopy_pickle as zp

    zp.dump(model.state_dict(), "weights.zcp")
    state = zp.load("weights.zcp")           # no tensor bytes copied; pages load on first touch

    snap = zp.freeze(model)                  # a sealed memfd, shareable with other processes
    clone = snap.load()                      # a new copy-on-write model, in milliseconds

Loading is restricted by default: only tensors, containers and primitives. Allow more per call with
``allow=[MyClass, "module:qualname"]``, or ``trusted=True`` for snapshots you trust.

The public modules are this namespace, :mod:`zerocopy_pickle.plugin` (for plugins), :mod:`zerocopy_pickle.testing`
(their conformance suite), :mod:`zerocopy_pickle.validate` (argument checks for rebuild functions),
:mod:`zerocopy_pickle.errors`, :mod:`zerocopy_pickle.cache`, :mod:`zerocopy_pickle.multiprocessing` (models for
worker processes), :mod:`zerocopy_pickle.ray` (models in Ray's object store) and :mod:`zerocopy_pickle.native` (the
optional native helpers: which backend is active, building them). Every other module is internal (its docstring
starts with "Internal:") and may change without notice.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from ._registry.discovery import PluginWarning
from ._registry.reducer_table import Reducer
from ._registry.registrar import Registrar
from ._registry.registry import Registry, default_registry, reducers, register_reducer, unregister_reducer
from ._version import __version__
from .errors import (
    ArgumentError,
    DeviceError,
    DumpError,
    IntegrityError,
    MissingGlobalError,
    PluginError,
    RestrictedLoadError,
    SnapshotError,
    TrustedOnlyWarning,
    Unpicklable,
    UnsafeArgumentError,
    ZeroCopyPickleError,
)

if TYPE_CHECKING:
    from ._core.dumping import BACKENDS
    from ._core.loadcore import ZeroCopyUnpickler
    from ._core.pickler import ZeroCopyPickler
    from ._core.snapshot import (
        Snapshot,
        dump,
        dumps,
        freeze,
        load,
        loads,
        prefetch,
        prefetches,
        read_header,
        scan,
    )
    from ._devices.transfer import to_device
    from ._storage.readahead import Prefetch
    from ._trust.entries import allow_function

# The library logs under "zerocopy_pickle" (docs/usage.md, "Logging") and leaves where records go to the
# application: this handler only stops Python's last-resort handler from printing them when none is configured.
logging.getLogger(__name__).addHandler(logging.NullHandler())

# Imported on first use (PEP 562), so that importing a submodule that needs no torch (the model cache's server,
# zerocopy_pickle.errors) does not import torch either.
_LAZY = {
    "allow_function": "_trust.entries",
    "ZeroCopyPickler": "_core.pickler",
    "ZeroCopyUnpickler": "_core.loadcore",
    "BACKENDS": "_core.dumping",
    **dict.fromkeys(("Snapshot", "dump", "dumps", "freeze", "load", "loads", "prefetch", "prefetches",
                     "read_header", "scan"), "_core.snapshot"),
    "Prefetch": "_storage.readahead",
    "to_device": "_devices.transfer",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zerocopy_pickle' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BACKENDS",
    "ArgumentError",
    "DeviceError",
    "DumpError",
    "IntegrityError",
    "MissingGlobalError",
    "PluginError",
    "PluginWarning",
    "Prefetch",
    "Reducer",
    "Registrar",
    "Registry",
    "RestrictedLoadError",
    "Snapshot",
    "SnapshotError",
    "TrustedOnlyWarning",
    "Unpicklable",
    "UnsafeArgumentError",
    "ZeroCopyPickleError",
    "ZeroCopyPickler",
    "ZeroCopyUnpickler",
    "__version__",
    "allow_function",
    "default_registry",
    "dump",
    "dumps",
    "freeze",
    "load",
    "loads",
    "prefetch",
    "prefetches",
    "read_header",
    "reducers",
    "register_reducer",
    "scan",
    "to_device",
    "unregister_reducer",
]
