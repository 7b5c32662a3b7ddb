"""fsdp-core scenarios: ModelParallelizer training on 1-D and HSDP meshes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from toy import build_toy, toy_batches, toy_loss

from fsdp_core import DistributedContext, ModelParallelizer, build_mesh, mixed_precision_policy

STEPS = 3
LR = 0.05


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def train(
    model: torch.nn.Module, ctx: DistributedContext, *, steps: int = STEPS, lr: float = LR
) -> dict[str, Any]:
    """SGD on the toy batches; losses averaged over ranks, step-0 grads, final params."""
    batches = toy_batches(steps, ctx.world_size)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step in range(steps):
        x, y = batches[step][ctx.rank]
        loss = toy_loss(model, (x.to(ctx.device), y.to(ctx.device)))
        loss.backward()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    params = {n: full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads0": grads0, "params": params}


def _run(
    ctx: DistributedContext, *, dp_replicate: int, policy: MixedPrecisionPolicy, **kw: Any
) -> dict[str, Any]:
    mesh = build_mesh(dp_replicate=dp_replicate)
    model = build_toy(0, **kw).to(ctx.device)
    ModelParallelizer().parallelize(model, mesh=mesh, mp_policy=policy)
    return train(model, ctx)


@scenario("core_fp32_1d")
def core_fp32_1d(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _run(ctx, dp_replicate=1, policy=MixedPrecisionPolicy())


@scenario("core_bf16_1d")
def core_bf16_1d(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _run(ctx, dp_replicate=1, policy=mixed_precision_policy("bf16", "fp32"))


@scenario("core_fp32_hsdp")
def core_fp32_hsdp(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _run(ctx, dp_replicate=2, policy=MixedPrecisionPolicy())


@scenario("core_bf16_hsdp")
def core_bf16_hsdp(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _run(ctx, dp_replicate=2, policy=mixed_precision_policy("bf16", "fp32"))


@scenario("core_bf16_fp32_norms")
def core_bf16_fp32_norms(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """bf16 weights with trainable fp32 norms: plain units fail, dtype-safe units train."""
    mesh = build_mesh()
    policy = mixed_precision_policy("bf16", "fp32")
    plain = build_toy(0, dtype=torch.bfloat16, fp32_norms=True).to(ctx.device)
    ModelParallelizer(dtype_safe=False).parallelize(plain, mesh=mesh, mp_policy=policy)
    plain_error = ""
    try:
        toy_loss(plain, toy_batches(1, ctx.world_size)[0][ctx.rank]).backward()
    except AssertionError as exc:  # FSDP2's own check, raised at the first forward
        plain_error = str(exc)
    dist.barrier()
    model = build_toy(0, dtype=torch.bfloat16, fp32_norms=True).to(ctx.device)
    plan = ModelParallelizer().plan(model, mp_policy=policy)
    ModelParallelizer().apply_plan(model, plan, mesh=mesh)
    result = train(model, ctx)
    result["plain_error"] = plain_error
    result["roles"] = plan.role_counts()
    return result
