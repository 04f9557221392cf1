"""The patch points: the loaders the cache routes through itself (``"module:Class.method"`` for a classmethod,
``"module:function"``). Both the client side (``patch.py``) and the loader (which imports their modules ahead of
jobs) need the list; it lives here, below both, so that neither imports the other."""

from __future__ import annotations

from ..registry import default_registry

__all__ = ["DEFAULT_PATCH_POINTS", "all_patch_points"]

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


def all_patch_points() -> list[str]:
    """:data:`DEFAULT_PATCH_POINTS` and every patch point the installed plugins declare."""
    return [*DEFAULT_PATCH_POINTS, *(target for _, target in default_registry().patch_points())]
