"""Internal: preparing a load for the plugins a snapshot's header names, and a dump for accelerate's offloaded
weights.

Not a public module (:meth:`zerocopy_pickle.Registry.prepare_load` is the public door). Every load checks that
each plugin is installed, enabled and loaded; only a trusted load runs their load hooks, since a header is
written by whoever wrote the snapshot.

A dump of a model whose accelerate hooks read weights from files (``disk_offload``, ``dispatch_model`` or
``load_checkpoint_and_dispatch`` with an offload folder, an ``AlignDevicesHook(offload=True, weights_map=...)``
over an ``OffloadedWeightsLoader``) copies those weights into the snapshot, or with ``offloaded='refuse'``
refuses it: a snapshot never depends on files beside it.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import ArgumentError, DumpError, PluginError, Unpicklable
from .declarations import PluginInfo
from .discovery import DISABLE_ENV


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


# -- dumps: accelerate's offloaded weights ------------------------------------------------------------------------

OFFLOADED = ("copy", "refuse")
_LOADER = ("accelerate.utils.offload", "OffloadedWeightsLoader")
_PREFIXED = ("accelerate.utils.offload", "PrefixedDataset")
_HOOK_OPTION = "offloaded='copy' (the default of zerocopy_pickle.dump)"


def _accelerate_class(where: tuple[str, str]) -> type | None:
    """An accelerate class, when this process has imported it (never importing accelerate: no loader can exist
    before it is imported)."""
    cls = getattr(sys.modules.get(where[0]), where[1], None)
    return cls if isinstance(cls, type) else None


def check_offloaded(mode: object) -> str:
    """``mode`` when it is one of :data:`OFFLOADED`.

    Raises:
        ArgumentError: anything else.
    """
    if type(mode) is not str or mode not in OFFLOADED:
        raise ArgumentError(f"offloaded must be 'copy' or 'refuse', not {mode!r:.80}")
    return mode


def _on_disk(loader: Any) -> list[str]:
    """The keys of an ``OffloadedWeightsLoader`` that are read from files (its index), not held in memory."""
    held = loader.state_dict
    return [key for key in loader.index if key not in held]


def _files(loader: Any, keys: list[str]) -> str:
    """Where the weights ``keys`` of ``loader`` live: its offload folder, or the checkpoint file(s) its index
    names."""
    files = sorted(
        {str(info["safetensors_file"]) for key in keys if isinstance(info := loader.index[key], Mapping)
         and info.get("safetensors_file") is not None}
    )  # fmt: skip
    places = [f"the offload folder {os.fsdecode(loader.save_folder)!r}"] if loader.save_folder is not None else []
    if files:
        places.append(("the checkpoint file " if len(files) == 1 else "the checkpoint files ") + ", ".join(
            map(repr, files[:3])) + (f" (and {len(files) - 3} more)" if len(files) > 3 else ""))  # fmt: skip
    return " and ".join(places) or "files outside the snapshot"


def _refusal(where: str, loader: Any, keys: list[str]) -> str:
    return (
        f"{where} has {len(keys)} weight(s) that accelerate offloaded to {_files(loader, keys)} "
        f"({keys[0]!r}{', ...' if len(keys) > 1 else ''}): a snapshot that refers to them would stop working when "
        f"those files move. Dump with {_HOOK_OPTION} to copy the offloaded weights into the snapshot"
    )


def _loader_of(hook: Any) -> tuple[Any, str]:
    """The ``OffloadedWeightsLoader`` behind an accelerate hook's ``weights_map`` (through ``PrefixedDataset``
    and ``SequentialHook``) and the prefix of the hooked module's keys in it, or ``(None, "")``."""
    loader_cls, prefixed_cls = _accelerate_class(_LOADER), _accelerate_class(_PREFIXED)
    inner = getattr(hook, "hooks", None)
    if isinstance(inner, (list, tuple)):
        for one in inner:
            found = _loader_of(one)
            if found[0] is not None:
                return found
        return None, ""
    weights: Any = getattr(hook, "weights_map", None) if getattr(hook, "offload", False) else None
    prefix, depth = "", 0
    while prefixed_cls is not None and type(weights) is prefixed_cls and depth < 16:  # (a cycle stops too)
        depth += 1
        outer = getattr(weights, "prefix", None)
        prefix = f"{outer}{prefix}" if isinstance(outer, str) else prefix
        weights = getattr(weights, "dataset", None)
    return (weights, prefix) if loader_cls is not None and type(weights) is loader_cls else (None, "")


def refuse_offloaded_modules(obj: object) -> None:
    """With ``offloaded='refuse'``: refuse a module whose accelerate hooks read weights from files, naming the
    first such submodule (``model.layers.3.mlp``), where its weights are, and the option that copies them.

    Raises:
        DumpError: such a submodule exists.
    """
    if _accelerate_class(_LOADER) is None:
        return
    import torch  # imported already: accelerate imports it (the registry, which imports this module, must not)

    if not isinstance(obj, torch.nn.Module):
        return
    for name, module in obj.named_modules():
        loader, prefix = _loader_of(module.__dict__.get("_hf_hook"))
        keys = [] if loader is None else _on_disk(loader)
        if keys:
            keys = [key for key in keys if key.startswith(prefix)] or keys  # the module's own first
            where = f"the module at {'model.' + name if name else 'model'} ({type(module).__name__})"
            path = "obj" + "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in name.split(".") if part)
            raise DumpError(_refusal(where, loader, keys), path=path)


def dump_reductions(mode: str) -> dict[type, Callable[[Any], Any]]:
    """Dispatch-table entries a dump adds (``mode``: ``offloaded=``): accelerate's ``OffloadedWeightsLoader``
    with its weights read into the snapshot (``"copy"``) or refused (``"refuse"``); none before accelerate is
    imported."""
    loader_cls = _accelerate_class(_LOADER)
    if loader_cls is None:
        return {}
    return {loader_cls: functools.partial(reduce_offloaded_loader, refuse=mode == "refuse")}


def reduce_offloaded_loader(loader: Any, *, refuse: bool = False) -> tuple[Any, ...]:
    """Reduce an ``OffloadedWeightsLoader`` as itself, but self-contained: every weight its index reads from a
    file (a ``.dat`` file of the offload folder, a safetensors checkpoint) read with accelerate's own
    ``__getitem__`` into its in-memory ``state_dict``, the index and folder dropped. The loaded hooks then serve
    the weights from the snapshot (offloaded from its mapping instead of from the folder).

    Raises:
        Unpicklable: ``refuse``, and the loader reads weights from files; or a weight cannot be read.
    """
    reduced = loader.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    keys = _on_disk(loader)
    if not keys:
        return reduced  # type: ignore[no-any-return]
    if refuse:
        raise Unpicklable(_refusal("an accelerate OffloadedWeightsLoader", loader, keys))
    import torch  # imported already: the loader is accelerate's

    weights = dict(loader.state_dict)
    for key in keys:
        try:
            weight = loader[key]
        except Exception as e:
            raise Unpicklable(
                f"the weight {key!r} that accelerate offloaded to {_files(loader, [key])} cannot be read "
                f"({type(e).__name__}: {e}); dump the model where its offload folder still is"
            ) from e
        if not isinstance(weight, torch.Tensor):
            raise Unpicklable(f"accelerate's offloaded weight {key!r} read as a {type(weight).__name__}, not a tensor")
        weights[key] = weight
    state = dict(vars(loader))
    state.update(state_dict=weights, index={}, save_folder=None)
    return (*reduced[:2], state, *reduced[3:])
