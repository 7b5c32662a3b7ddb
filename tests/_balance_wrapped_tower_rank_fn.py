"""Run on spawned gloo ranks by ``test_balance_wrapped_tower`` (importable by the children).

Each rank builds the tiny DeepSeek-V4.1 VLM with its vision tower under torch's
``checkpoint_wrapper`` (``form``: the whole tower, or each of its blocks) before
planning, parallelizes it with ``balance_media=True`` (``per_layer``: the tower owns
units), runs one training step on its own batch (rank 0 every image, rank 1 none) and
writes its loss and full gradients, or the error it raised; one launch runs every case.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from fsdp_core import build_mesh
from model_deepseek_v41 import DeepseekV41Config, build_deepseek_v41, make_batch
from multimodal_fsdp import MultimodalParallelizer

CONFIG = DeepseekV41Config.tiny()
#: (what is wrapped, checkpoint implementation) per case.
CASES = {
    "whole": ("whole", CheckpointImpl.NO_REENTRANT),
    "whole_reentrant": ("whole", CheckpointImpl.REENTRANT),
    "blocks": ("blocks", CheckpointImpl.NO_REENTRANT),
    "blocks_reentrant": ("blocks", CheckpointImpl.REENTRANT),
}


def build(case: str) -> nn.Module:
    """The model, its tower wrapped as ``case`` says."""
    model = build_deepseek_v41(CONFIG, seed=0, dtype=torch.float32)
    form, impl = CASES[case]
    wrap = functools.partial(checkpoint_wrapper, checkpoint_impl=impl)
    if form == "whole":
        model.vision = wrap(model.vision)
    else:
        for index, block in enumerate(model.vision.blocks):  # type: ignore[arg-type]
            model.vision.blocks[index] = wrap(block)  # type: ignore[index]
    return model


def batch(rank: int) -> dict[str, torch.Tensor]:
    images = 2 if rank == 0 else 0
    return dict(
        make_batch(CONFIG, batch_size=2, seq_len=16, num_images_per_sample=images, seed=rank)
    )


def plain_name(name: str) -> str:
    return name.replace("._checkpoint_wrapped_module", "").replace(
        "_checkpoint_wrapped_module.", ""
    )


def run_cases(rank: int, _world: int, out: str) -> None:
    """Every case in one launch, one result file per case and rank."""
    for case in CASES:
        _run_case(rank, case, out)


def _run_case(rank: int, case: str, out: str) -> None:
    result: dict[str, object]
    try:
        model = build(case)
        parallelizer = MultimodalParallelizer(
            frozen_multimodal_sharding="per_layer",
            extra_tower_names=("vision",),
            balance_media=True,
        )
        parallelizer.parallelize(model, mesh=build_mesh())
        loss = model(**batch(rank))
        loss.backward()
        grads = {
            plain_name(name): param.grad.full_tensor().tolist()  # type: ignore[union-attr]
            for name, param in model.named_parameters()
            if param.grad is not None
        }
        result = {"loss": loss.item(), "grads": grads}
    except Exception as error:  # recorded for the test to show
        result = {"error": f"{type(error).__name__}: {error}"[:2000]}
    Path(out, f"{case}_rank{rank}.json").write_text(json.dumps(result))
