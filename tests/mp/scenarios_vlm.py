"""multimodal-fsdp and DeepSeek-V4.1 scenarios: frozen-tower policies on a small VLM."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from vlm import LR, build_vlm, to_device, vlm_batches, vlm_loss

from fsdp_core import DistributedContext, build_mesh, mixed_precision_policy
from model_deepseek_v41 import PARALLELIZER
from multimodal_fsdp import MultimodalParallelizer

STEPS = 3


def train_vlm(
    model: nn.Module,
    ctx: DistributedContext,
    batches: list[list[Any]],
    *,
    lr: float = LR,
    on_step: Callable[[int], object] | None = None,
) -> dict[str, Any]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=lr)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step, per_rank in enumerate(batches):
        loss = vlm_loss(model, to_device(per_rank[ctx.rank], ctx.device))  # type: ignore[arg-type]
        loss.backward()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
        if on_step is not None:
            on_step(step)
    params = {n: full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads0": grads0, "params": params}


def _replicated_report(model: nn.Module, names: tuple[str, ...]) -> dict[str, Any]:
    named = dict(model.named_parameters())
    plain = all(not isinstance(named[n], DTensor) for n in names)
    equal = True
    for n in names:
        local = named[n].detach().float().clone()
        low, high = local.clone(), local.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        equal = equal and bool(torch.equal(low, high))
    dtypes = {n: named[n].dtype for n in names}
    return {"replicated_plain": plain, "replicated_equal": equal, "replicated_dtypes": dtypes}


def _units_in(model: nn.Module, prefix: str) -> list[str]:
    return [
        n for n, m in model.named_modules() if n.startswith(prefix) and isinstance(m, FSDPModule)
    ]


def _run_policy(ctx: DistributedContext, policy: str, *, deepseek: bool) -> dict[str, Any]:
    mesh = build_mesh()
    dtype = torch.bfloat16 if deepseek else torch.float32
    model = build_vlm(dtype=dtype, frozen_tower=True).to(ctx.device)
    if deepseek:
        parallelizer: MultimodalParallelizer = PARALLELIZER.with_options(
            frozen_multimodal_sharding=policy
        )
    else:
        parallelizer = MultimodalParallelizer(
            frozen_multimodal_sharding=policy, extra_tower_names=("vision",)
        )
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("bf16", "fp32"))
    parallelizer.apply_plan(model, plan, mesh=mesh)
    result = train_vlm(model, ctx, vlm_batches(STEPS, ctx.world_size))
    result.update(_replicated_report(model, plan.replicated_param_names))
    result["vision_units"] = _units_in(model, "vision")
    result["roles"] = plan.role_counts()
    return result


for _policy in ("root", "per_layer", "replicate"):

    def _mm(ctx: DistributedContext, out: Path, _p: str = _policy) -> dict[str, Any]:
        return _run_policy(ctx, _p, deepseek=False)

    def _ds(ctx: DistributedContext, out: Path, _p: str = _policy) -> dict[str, Any]:
        return _run_policy(ctx, _p, deepseek=True)

    scenario(f"mm_frozen_{_policy}")(_mm)
    scenario(f"ds_frozen_{_policy}")(_ds)


@scenario("ds_trainable")
def ds_trainable(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """bf16 DeepSeek-V4.1 with fp32 vision norms and a trainable tower."""
    model = build_vlm(dtype=torch.bfloat16, frozen_tower=False).to(ctx.device)
    plan = PARALLELIZER.plan(model, mp_policy=mixed_precision_policy("bf16", "fp32"))
    PARALLELIZER.apply_plan(model, plan, mesh=build_mesh())
    result = train_vlm(model, ctx, vlm_batches(STEPS, ctx.world_size))
    result["roles"] = plan.role_counts()
    result["vision_units"] = _units_in(model, "vision")
    return result
