"""Internal: the model cache's patch points: the loaders it routes through itself, built in and declared by packages.

A patch point is ``"module:Class.method"`` (a classmethod, called on any subclass) or ``"module:function"``.
Besides :data:`DEFAULT_PATCH_POINTS`, any installed distribution may declare more through the entry-point group
:data:`PATCH_POINT_GROUP`; the value of each entry point *is* the patch point, read as a string and never loaded
here (the cache patches a module when it is imported, and must not import it first)::

    [project.entry-points."zerocopy_pickle.cache_patch_points"]
    thermo-pipeline = "thermo.pipelines:Pipeline.from_pretrained"

This is the cache's own declaration: the reducer registry (plugins, reducers, safe globals) knows nothing of
patch points. Standard library only, so the server may import it without torch.
"""

from __future__ import annotations

import importlib.metadata
import warnings

from .._names import GlobalName

PATCH_POINT_GROUP = "zerocopy_pickle.cache_patch_points"

DEFAULT_PATCH_POINTS = (
    "diffusers.pipelines.pipeline_utils:DiffusionPipeline.from_pretrained",
    "diffusers.models.modeling_utils:ModelMixin.from_pretrained",
    "diffusers.schedulers.scheduling_utils:SchedulerMixin.from_pretrained",
    "transformers.modeling_utils:PreTrainedModel.from_pretrained",
    "transformers.tokenization_utils_base:PreTrainedTokenizerBase.from_pretrained",
    "transformers.models.auto.processing_auto:AutoProcessor.from_pretrained",
    "torch.serialization:load",
    "torch:load",
    "safetensors.torch:load_file",
)


def check_patch_point(point: object) -> bool:
    """Whether ``point`` has the form ``"module:qualname"`` (dotted identifiers on both sides)."""
    name = GlobalName.parse(point)
    return name is not None and name.dotted


def split_point(point: str) -> GlobalName:
    """A patch point's module and qualified name (the point was checked when it was declared or given:
    :func:`check_patch_point`; ``ValueError`` otherwise)."""
    name = GlobalName.parse(point)
    if name is None or not name.dotted:
        raise ValueError(f"{point!r} is not a patch point ('module:Class.method' or 'module:function')")
    return name


def declared_patch_points() -> tuple[str, ...]:
    """The patch points installed distributions declare through :data:`PATCH_POINT_GROUP`, in discovery order.

    An entry whose value is not ``"module:qualname"`` is skipped with a warning naming it and its distribution.
    """
    points = []
    for entry_point in importlib.metadata.entry_points(group=PATCH_POINT_GROUP):
        value = entry_point.value.strip()
        if not check_patch_point(value):
            dist = entry_point.dist.name if entry_point.dist is not None else "?"
            warnings.warn(
                f"patch point {entry_point.name!r} (from {dist}) is {value!r}, not 'module:qualname': skipped",
                UserWarning,
                stacklevel=2,
            )
            continue
        points.append(value)
    return tuple(points)


def all_patch_points() -> list[str]:
    """:data:`DEFAULT_PATCH_POINTS` and the declared ones, each once."""
    return list(dict.fromkeys([*DEFAULT_PATCH_POINTS, *declared_patch_points()]))
