"""Pipeline parallelism: two stages of the tiny DeepSeek-V4.1 model, each sharded by the
library over its data-parallel ranks.

4 gloo ranks on a ``('pp', 'dp')`` 2x2 mesh. ``split_stages`` cuts the model (built on
``meta``) into stage 0 (vision tower, aligner, embeddings, decoder layer 0) and stage 1
(decoder layer 1, final norm, head); each rank builds its stage's ``PipelineStage`` and
the library shards the stage module over ``dp`` (``mesh=world, dp_dims='dp'``). Each DP
rank's step batch is two microbatches, some of them text-only (``pipeline_vlm.MEDIA``;
in one layout a DP rank's whole step): a stage-0 rank whose microbatch has no images
skips the tower while its DP peer runs it. Torch's ``ScheduleGPipe`` and
``Schedule1F1B`` drive the steps under each frozen-tower policy and with a trainable
tower. ``tests/test_pipeline_distributed.py`` compares the
losses, first-step gradients and final parameters with one process on the same
microbatches (the mean of the microbatch losses over microbatches and DP ranks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pipeline_vlm import (
    LR,
    MAX_IMAGES,
    MB_SAMPLES,
    MICROBATCHES,
    STEPS,
    first_forward,
    last_forward,
    loss_fn,
    microbatches,
    stage_inputs,
)
from registry import scenario
from scenarios_core import full
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from vlm import CONFIG, SEQ

from fsdp_core import DistributedContext
from fsdp_core.materialize import copy_full_into_
from fsdp_core.runtime import installed_hooks
from model_deepseek_v41 import build_deepseek_v41
from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer
from multimodal_fsdp.pipeline import check_stages, split_stages

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
#: (parallelizer options, whether the tower is frozen)
VARIANTS: dict[str, tuple[dict[str, Any], bool]] = {
    "root": ({"frozen_multimodal_sharding": "root"}, True),
    # Units gathered once per step instead of once per microbatch (apply option).
    "root_gathered": ({"frozen_multimodal_sharding": "root", "reshard_after_forward": False}, True),
    "replicate": ({"frozen_multimodal_sharding": "replicate"}, True),
    "per_layer_balanced": (
        {"frozen_multimodal_sharding": "per_layer", "balance_media": True},
        True,
    ),
    "trainable_balanced": ({"balance_media": True}, False),
}


def pp_cases() -> list[str]:
    """``schedule/variant/media``: every variant on mixed media; the root and the trainable
    balanced variant also with a DP rank whose whole step is text-only."""
    return [
        *(f"{schedule}/{variant}/mixed" for schedule in SCHEDULES for variant in VARIANTS),
        *(f"{s}/{v}/text_rank" for s in SCHEDULES for v in ("root", "trainable_balanced")),
    ]


def _stage_meta(index: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The shapes one microbatch has at stage ``index`` (static metadata: no inference
    forward and backward before the first step)."""
    hidden = torch.empty(MB_SAMPLES, SEQ, CONFIG.text_hidden, device="meta", requires_grad=True)
    if index == 0:
        ids = torch.empty(MB_SAMPLES, SEQ, dtype=torch.long, device="meta")
        pixels = torch.empty(
            MB_SAMPLES, MAX_IMAGES, 3, CONFIG.image_size, CONFIG.image_size, device="meta"
        )
        return (ids, pixels), hidden
    return (hidden,), torch.empty(MB_SAMPLES, SEQ, CONFIG.vocab_size, device="meta")


def _case(ctx: DistributedContext, schedule: str, variant: str, media: str) -> dict[str, Any]:
    world = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = world["pp"].get_local_rank(), world["dp"].get_local_rank()
    options, frozen = dict(VARIANTS[variant][0]), VARIANTS[variant][1]
    reshard = options.pop("reshard_after_forward", None)
    whole = build_deepseek_v41(CONFIG, device="meta")
    if frozen:
        whole.vision.requires_grad_(False)
    parallelizer = DeepseekV41ModelParallelizer(**options)
    stages = split_stages(
        whole, layers="model.layers", num_stages=2, forwards=(first_forward, last_forward)
    )
    check_stages(stages, parallelizer=parallelizer)  # every rank, every stage: same answer
    stage = stages[pp_rank]
    reference = dict(build_deepseek_v41(CONFIG, seed=0).named_parameters())
    stage.to_empty(device=ctx.device)
    for name, param in stage.named_parameters():
        copy_full_into_(param, reference[name].detach())
    parallelizer.parallelize(stage, mesh=world, dp_dims="dp", reshard_after_forward=reshard)
    inputs, outputs = _stage_meta(pp_rank)
    pipeline = PipelineStage(
        stage,
        pp_rank,
        2,
        ctx.device,
        input_args=inputs,
        output_args=outputs,
        group=world["pp"].get_group(),
    )
    runner = SCHEDULES[schedule](pipeline, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for p in stage.parameters() if p.requires_grad], lr=LR)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        input_ids, pixels, labels = stage_inputs(microbatches(step, dp_rank, media))
        step_losses: list[torch.Tensor] = []
        if pp_rank == 0:
            runner.step(input_ids.to(ctx.device), pixels.to(ctx.device))
        else:
            runner.step(target=labels.to(ctx.device), losses=step_losses)
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in stage.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        total = torch.stack(step_losses).mean() if step_losses else torch.zeros(())
        dist.all_reduce(total)  # the last stage's DP ranks hold the losses
        losses.append(total.item() / 2)
    return {
        "losses": losses,
        "grads0": grads0,
        "params": {n: full(p) for n, p in stage.named_parameters()},
        "hooks": sorted(installed_hooks(stage)),
        "arrival_ranks": _arrival_ranks(stage),
    }


def _arrival_ranks(stage: torch.nn.Module) -> list[int]:
    """The ranks the forward check meets (the hook is being renamed from
    ``forward_arrival`` to ``forward_agreement``)."""
    hooks = installed_hooks(stage)
    hook = hooks.get("forward_agreement") or hooks["forward_arrival"]
    return sorted(hook.ranks)  # type: ignore[attr-defined]


def _gather(mine: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


@scenario("pp_dp_stages")
def pp_dp_stages(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Every case of ``pp_cases``; each stage's results merged (they hold disjoint
    parameters)."""
    results: dict[str, Any] = {}
    for name in pp_cases():
        mine = _case(ctx, *name.split("/"))
        merged: dict[str, Any] = {"losses": mine["losses"], "grads0": {}, "params": {}}
        for other in _gather(mine):
            merged["grads0"].update(other["grads0"])
            merged["params"].update(other["params"])
        everyone = _gather({k: mine[k] for k in ("hooks", "arrival_ranks")})
        merged["hooks"] = [other["hooks"] for other in everyone]
        merged["arrival_ranks"] = [other["arrival_ranks"] for other in everyone]
        results[name] = merged
    return results
