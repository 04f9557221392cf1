"""The configs and weights of the two local repositories with their own code that the dynamic-module tests load
(the code itself is in ``tests/fixtures/dynamic_modules``): called by the tests' child interpreters."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def write_repositories(root: str) -> tuple[str, str]:
    """Write ``tiny-remote-model`` (a transformers model whose config.json's ``auto_map`` names its code) and
    ``tiny-pipeline`` (a diffusers pipeline whose model_index.json names a custom pipeline class and a custom
    component) under ``root``, which already holds their code. Returns their paths."""
    torch.manual_seed(0)
    model_dir = os.path.join(root, "tiny-remote-model")
    auto_map = {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModel": "modeling_tiny.TinyModel"}
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({"model_type": "zcp-tiny", "vocab_size": 16, "hidden_size": 8, "auto_map": auto_map}, f)
    weights = {"embed.weight": torch.randn(16, 8), "proj.weight": torch.randn(8, 8), "proj.bias": torch.randn(8)}
    save_file(weights, os.path.join(model_dir, "model.safetensors"))

    pipe_dir = os.path.join(root, "tiny-pipeline")
    os.makedirs(os.path.join(pipe_dir, "scheduler"))
    with open(os.path.join(pipe_dir, "model_index.json"), "w") as f:
        json.dump({"_class_name": ["my_pipeline", "TinyPipeline"], "_diffusers_version": "0.42.1",
                   "unet": ["my_unet", "TinyUNet"], "scheduler": ["diffusers", "DDIMScheduler"]}, f)  # fmt: skip
    with open(os.path.join(pipe_dir, "unet", "config.json"), "w") as f:
        json.dump({"_class_name": "TinyUNet", "_diffusers_version": "0.42.1", "channels": 4}, f)
    save_file({"mix.weight": torch.randn(4, 4), "mix.bias": torch.randn(4)},
              os.path.join(pipe_dir, "unet", "diffusion_pytorch_model.safetensors"))  # fmt: skip
    with open(os.path.join(pipe_dir, "scheduler", "scheduler_config.json"), "w") as f:
        json.dump({"_class_name": "DDIMScheduler", "_diffusers_version": "0.42.1", "clip_sample": False}, f)
    return model_dir, pipe_dir
