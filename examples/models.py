"""The models the demos, the tests and the benchmarks build here, with random weights and no download.

:class:`TinyGPT` (:func:`build_model`): a GPT-style transformer of ``torch.nn`` layers of any size, its output
head tied to its embedding. :func:`build_controlnet_pipeline`: a StableDiffusionControlNetPipeline, two more
ControlNets and (:func:`build_remote_code_model`) a transformers model with its own code, saved with
``save_pretrained``; tiny for the tests and the demo, SD1.5-sized for the benchmarks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn


class TinyGPT(nn.Module):
    """A decoder-only transformer: token embedding, encoder layers with a causal mask, tied output head."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(1, 512, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        x = self.embed(tokens) + self.position[:, :n]
        out: torch.Tensor = self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))
        return out


def build_model(size_mb: int = 256, seed: int = 0) -> TinyGPT:
    """A :class:`TinyGPT` of about ``size_mb`` MiB of float32 weights, deterministic for a seed."""
    torch.manual_seed(seed)
    width, vocab = 1024, 8192
    per_layer = 12 * width * width * 4  # attention 4 w^2 + MLP 8 w^2, float32
    fixed = (vocab + 512) * width * 4
    layers = max(1, round((size_mb * 2**20 - fixed) / per_layer))
    return TinyGPT(vocab, width, layers, heads=16).eval()


def build_controlnet_pipeline(
    directory: str | os.PathLike[str], *, size: str = "tiny", seed: int = 0
) -> dict[str, str]:
    """Build a StableDiffusionControlNetPipeline locally (random weights, no download) and save it.

    Args:
        directory: where to write ``pipeline/`` (the whole pipeline, with one ControlNet),
            ``controlnet-edge/`` and ``controlnet-depth/`` (two more ControlNets) and ``remote-model/`` (a
            transformers model with its own code, :func:`build_remote_code_model`).
        size: ``"tiny"`` (a few MiB, for tests and the demo) or ``"sd15"`` (diffusers' default UNet, two
            ControlNets made from it, a ViT-L text encoder and the default VAE, saved in float16: about 3.6 GB).
        seed: the random seed of the weights.

    Returns:
        The paths: ``{"pipeline": ..., "edge": ..., "depth": ..., "remote": ...}``.
    """
    from diffusers import (
        AutoencoderKL,
        ControlNetModel,
        DDIMScheduler,
        StableDiffusionControlNetPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(seed)
    vocab = {"<|startoftext|>": 0, "!": 1, "<|endoftext|>": 2, **{f"{c}</w>": 3 + i for i, c in enumerate("abcdefgh")}}
    if size == "tiny":
        unet = UNet2DConditionModel(
            block_out_channels=(4, 8), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, norm_num_groups=1,
        )  # fmt: skip
        controlnet_kwargs = {"conditioning_embedding_out_channels": (8, 16)}
        vae = AutoencoderKL(
            block_out_channels=[4, 8], in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=2,
            down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        )  # fmt: skip
        text_config = CLIPTextConfig(
            hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=1000,
            bos_token_id=0, eos_token_id=2, pad_token_id=1,
        )  # fmt: skip
        dtype = torch.float32
    elif size == "sd15":
        unet = UNet2DConditionModel()  # diffusers' defaults: the SD 1.x UNet layout
        controlnet_kwargs = {}
        vae = AutoencoderKL(
            block_out_channels=[128, 256, 512, 512], latent_channels=4, down_block_types=["DownEncoderBlock2D"] * 4,
            up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2,
        )  # fmt: skip
        text_config = CLIPTextConfig(  # ViT-L/14's text tower, as in SD 1.5
            hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
            vocab_size=49408, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu",
        )  # fmt: skip
        dtype = torch.float16
    else:
        raise ValueError(f"size must be 'tiny' or 'sd15', not {size!r}")
    edge = ControlNetModel.from_unet(unet, **controlnet_kwargs)
    depth = ControlNetModel.from_unet(unet, **controlnet_kwargs)
    for module in (edge, depth):  # distinct weights: from_unet copies the UNet's
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.01)
    pipe: Any = StableDiffusionControlNetPipeline(
        vae=vae, text_encoder=CLIPTextModel(text_config), tokenizer=CLIPTokenizer(vocab=vocab, merges=[]), unet=unet,
        controlnet=edge, scheduler=DDIMScheduler(), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )  # fmt: skip
    root = Path(directory)
    paths = {"pipeline": str(root / "pipeline"), "edge": str(root / "controlnet-edge"),
             "depth": str(root / "controlnet-depth")}  # fmt: skip
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # `.to(dtype)` on a ControlNet warns about upcasting: irrelevant here
    # The text encoder's save_pretrained draws a "Writing model shards" bar for its one shard: noise in the demo.
    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        pipe.to(dtype)
        pipe.save_pretrained(paths["pipeline"])
        edge.to(dtype).save_pretrained(paths["edge"])
        depth.to(dtype).save_pretrained(paths["depth"])
    finally:
        diffusers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()
    paths["remote"] = build_remote_code_model(root / "remote-model", size=size, seed=seed)
    return paths


# The code of the remote-code model that build_remote_code_model writes: transformers imports it from the
# repository folder (``trust_remote_code=True``) into its dynamic ``transformers_modules`` namespace.
_REMOTE_CONFIGURATION = """from transformers import PretrainedConfig


class ZcpRemoteConfig(PretrainedConfig):
    model_type = "zcp-remote"

    def __init__(self, vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_layers = num_layers
        super().__init__(**kwargs)
"""
_REMOTE_MODELING = """import torch
from transformers import PreTrainedModel

from .configuration_zcp_remote import ZcpRemoteConfig


class ZcpRemoteModel(PreTrainedModel):
    config_class = ZcpRemoteConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(config.hidden_size, config.intermediate_size),
                torch.nn.GELU(),
                torch.nn.Linear(config.intermediate_size, config.hidden_size),
            )
            for _ in range(config.num_layers)
        )
        self.post_init()

    def forward(self, input_ids):
        hidden = self.embed(input_ids)
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return hidden
"""


def build_remote_code_model(directory: str | os.PathLike[str], *, size: str = "tiny", seed: int = 0) -> str:
    """Write a transformers model repository with its own code (``configuration_zcp_remote.py``,
    ``modeling_zcp_remote.py``, a ``config.json`` whose ``auto_map`` names them, random weights), loaded with
    ``AutoModel.from_pretrained(path, trust_remote_code=True)``. No download: the code is written here.

    Args:
        directory: the repository folder to create.
        size: ``"tiny"`` (a few KiB) or ``"sd15"`` (a text model of about 300 MB in float16, the size of a
            pipeline's extra encoder).
        seed: the random seed of the weights.

    Returns:
        The repository's path.
    """
    import json

    from safetensors.torch import save_file

    if size == "tiny":
        config = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_layers": 2}
        dtype = torch.float32
    elif size == "sd15":
        config = {"vocab_size": 49408, "hidden_size": 1024, "intermediate_size": 4096, "num_layers": 12}
        dtype = torch.float16
    else:
        raise ValueError(f"size must be 'tiny' or 'sd15', not {size!r}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    (root / "configuration_zcp_remote.py").write_text(_REMOTE_CONFIGURATION)
    (root / "modeling_zcp_remote.py").write_text(_REMOTE_MODELING)
    auto_map = {
        "AutoConfig": "configuration_zcp_remote.ZcpRemoteConfig",
        "AutoModel": "modeling_zcp_remote.ZcpRemoteModel",
    }
    (root / "config.json").write_text(
        json.dumps(
            {"model_type": "zcp-remote", "auto_map": auto_map, "torch_dtype": str(dtype).split(".")[1], **config}
        )
    )
    generator = torch.Generator().manual_seed(seed)
    hidden, inner = config["hidden_size"], config["intermediate_size"]

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(dtype)

    weights = {"embed.weight": randn(config["vocab_size"], hidden)}
    for i in range(config["num_layers"]):
        weights |= {f"layers.{i}.0.weight": randn(inner, hidden), f"layers.{i}.0.bias": randn(inner),
                    f"layers.{i}.2.weight": randn(hidden, inner), f"layers.{i}.2.bias": randn(hidden)}  # fmt: skip
    save_file(weights, str(root / "model.safetensors"))
    return str(root)
