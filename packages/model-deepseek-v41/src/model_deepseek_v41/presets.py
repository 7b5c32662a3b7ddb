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
from model_deepseek_v41.tensor_parallel import deepseek_v41_tp_plan
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.cli.presets import ModelPreset

__all__ = ["PRESET_SIZES", "model_presets"]

#: Command-line name ->
#: [`DeepseekV41Config.preset`][model_deepseek_v41.config.DeepseekV41Config.preset] size.
PRESET_SIZES: dict[str, str] = {
    "deepseek-v41-tiny": "tiny",
    "deepseek-v41-small": "small",
    "deepseek-v41-base": "base",
}


def _builder(size: str) -> Callable[[torch.dtype], tuple[nn.Module, MultimodalParallelizer]]:
    def build(storage: torch.dtype) -> tuple[nn.Module, MultimodalParallelizer]:
        config = DeepseekV41Config.preset(size)
        return build_deepseek_v41(config, dtype=storage, device="meta"), PARALLELIZER

    return build


def _tp_plan(model: nn.Module, tp_size: int) -> dict[str, ParallelStyle]:
    """The language MLPs' plan (``plan --tp``): what a job applies before the library."""
    return deepseek_v41_tp_plan(model, tp_size=tp_size)


def _batch_loss(size: str) -> Callable[[int, int], Callable[[nn.Module], torch.Tensor]]:
    def batch_loss(samples: int, tokens: int) -> Callable[[nn.Module], torch.Tensor]:
        batch = make_batch(DeepseekV41Config.preset(size), batch_size=samples, seq_len=tokens)

        def loss(model: nn.Module) -> torch.Tensor:
            value: torch.Tensor = model(**batch)
            return value

        return loss

    return batch_loss


def model_presets() -> list[ModelPreset]:
    """The reference model at each preset size, on the meta device."""
    return [
        ModelPreset(
            name,
            f"DeepSeek-V4.1 reference, {size} preset",
            _builder(size),
            _batch_loss(size),
            tp_plan=_tp_plan,
        )
        for name, size in PRESET_SIZES.items()
    ]
