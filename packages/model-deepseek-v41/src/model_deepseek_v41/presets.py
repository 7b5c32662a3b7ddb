"""The DeepSeek-V4.1 reference presets, registered for ``python -m multimodal_fsdp plan``.

``pyproject.toml`` names [`model_presets`][model_deepseek_v41.presets.model_presets] under the
``multimodal_fsdp.cli.presets`` entry-point group, so the command line of the lower package finds
these
models without importing this one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from model_deepseek_v41.config import DeepseekV41Config
from model_deepseek_v41.fsdp import PARALLELIZER
from model_deepseek_v41.modeling import build_deepseek_v41, make_batch
from model_deepseek_v41.moe import shard_experts
from model_deepseek_v41.tensor_parallel import deepseek_v41_tp_plan
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.cli.presets import ModelPreset

__all__ = ["MOE_PRESETS", "PRESET_SIZES", "model_presets"]

#: Command-line name ->
#: [`DeepseekV41Config.preset`][model_deepseek_v41.config.DeepseekV41Config.preset] size.
PRESET_SIZES: dict[str, str] = {
    "deepseek-v41-tiny": "tiny",
    "deepseek-v41-small": "small",
    "deepseek-v41-base": "base",
}
#: Command-line name -> (size, routed experts per language layer) of the MoE presets,
#: each expert a quarter of the size's dense MLP (``plan --ep``).
MOE_PRESETS: dict[str, tuple[str, int]] = {
    "deepseek-v41-moe-tiny": ("tiny", 4),
    "deepseek-v41-moe-base": ("base", 8),
}


def _config(size: str, experts: int = 0) -> DeepseekV41Config:
    config = DeepseekV41Config.preset(size)
    if not experts:
        return config
    return config.replace(num_experts=experts, expert_intermediate=config.text_intermediate // 4)


def _builder(
    size: str, experts: int = 0
) -> Callable[[torch.dtype], tuple[nn.Module, MultimodalParallelizer]]:
    def build(storage: torch.dtype) -> tuple[nn.Module, MultimodalParallelizer]:
        model = build_deepseek_v41(_config(size, experts), dtype=storage, device="meta")
        return model, PARALLELIZER

    return build


def _tp_plan(model: nn.Module, tp_size: int) -> dict[str, ParallelStyle]:
    """The language MLPs' plan (``plan --tp``): what a job applies before the library."""
    return deepseek_v41_tp_plan(model, tp_size=tp_size)


def _batch_loss(
    size: str, experts: int = 0
) -> Callable[[int, int], Callable[[nn.Module], torch.Tensor]]:
    def batch_loss(samples: int, tokens: int) -> Callable[[nn.Module], torch.Tensor]:
        batch = make_batch(_config(size, experts), batch_size=samples, seq_len=tokens)

        def loss(model: nn.Module) -> torch.Tensor:
            value: torch.Tensor = model(**batch)
            return value

        return loss

    return batch_loss


def model_presets() -> list[ModelPreset]:
    """The reference model at each preset size, on the meta device.

    Returns:
        One ``ModelPreset`` per size (and the MoE variants).
    """
    return [
        ModelPreset(
            name,
            f"DeepSeek-V4.1 reference, {size} preset",
            _builder(size),
            _batch_loss(size),
            tp_plan=_tp_plan,
        )
        for name, size in PRESET_SIZES.items()
    ] + [
        ModelPreset(
            name,
            f"DeepSeek-V4.1 reference, {size} preset, {experts} routed experts per layer",
            _builder(size, experts),
            _batch_loss(size, experts),
            ep_plan=shard_experts,
        )
        for name, (size, experts) in MOE_PRESETS.items()
    ]
