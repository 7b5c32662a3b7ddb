"""Staged training across runs on 2 ranks (issue 25): each stage a new run with another
freeze set, sharded anew, starting from the previous stage's DCP checkpoint through
``load_stage_checkpoint``; and a model whose shape changed, refused on every rank.

tests/test_staged_distributed.py compares the losses and final parameters with one
process that hands the optimizer state over by parameter name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from framework_cases import (
    STAGE_POLICY,
    STAGES,
    STEPS_PER_STAGE,
    stage_batch,
    stage_model,
    stage_optimizer,
)
from loop_models import DIM
from registry import scenario
from scenarios_core import full
from torch import nn

from fsdp_core import (
    DistributedContext,
    build_mesh,
    load_stage_checkpoint,
    save_checkpoint,
)
from multimodal_fsdp import MultimodalParallelizer


def _sharded(stage: int, ctx: DistributedContext) -> nn.Module:
    model = stage_model(stage).to(ctx.device)
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=STAGE_POLICY)
    return parallelizer.parallelize(model, mesh=build_mesh())


def _gather(value: Any, ctx: DistributedContext) -> list[Any]:
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


@scenario("staged_three_stages")
def three_stages(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    root = out / "staged"
    losses: list[float] = []
    reports: list[dict[str, Any]] = []
    model: nn.Module | None = None
    for stage in range(len(STAGES)):
        model = _sharded(stage, ctx)
        opt = stage_optimizer([p for p in model.parameters() if p.requires_grad])
        if stage:
            report = load_stage_checkpoint(root / f"stage{stage - 1}", model, opt)
            reports.append(
                {
                    "step": report.step,
                    "restored": report.restored,
                    "fresh": report.fresh,
                    "dropped": report.dropped,
                }
            )
        for index in range(STEPS_PER_STAGE):
            step = stage * STEPS_PER_STAGE + index
            loss: torch.Tensor = model(**_on(stage_batch(step, ctx.rank), ctx))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / ctx.world_size)
        save_checkpoint(root / f"stage{stage}", model, opt, step=(stage + 1) * STEPS_PER_STAGE)
    assert model is not None
    return {
        "losses": losses,
        "reports": reports,
        "reports_per_rank": _gather(reports, ctx),
        "params": {n: full(p) for n, p in model.named_parameters()},
    }


@scenario("staged_shape_changed")
def shape_changed(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Stage 1 saved; a stage-2 model whose output head has 3 more rows fails to load."""
    model = _sharded(0, ctx)
    opt = stage_optimizer([p for p in model.parameters() if p.requires_grad])
    save_checkpoint(out / "staged_shape", model, opt, step=0)
    bigger = stage_model(1)
    bigger.lm_head = nn.Linear(DIM, bigger.lm_head.out_features + 3, bias=False)
    bigger.to(ctx.device)
    MultimodalParallelizer(frozen_multimodal_sharding=STAGE_POLICY).parallelize(
        bigger, mesh=build_mesh()
    )
    error = ("", "")
    try:
        load_stage_checkpoint(
            out / "staged_shape",
            bigger,
            stage_optimizer([p for p in bigger.parameters() if p.requires_grad]),
        )
    except Exception as exc:  # recorded per rank: every rank must raise the same
        error = (type(exc).__name__, str(exc))
    return {"errors": _gather(error, ctx)}


def _on(batch: dict[str, Any], ctx: DistributedContext) -> dict[str, Any]:
    return {k: v.to(ctx.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
