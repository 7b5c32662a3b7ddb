"""multimodal-fsdp and DeepSeek-V4.1 scenarios: frozen-tower policies on a small VLM."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor
from vlm import LR, build_vlm, to_device, vlm_batches, vlm_loss

from fsdp_core import DistributedContext, build_mesh, internals, mixed_precision_policy
from model_deepseek_v41 import PARALLELIZER
from multimodal_fsdp import MultimodalParallelizer, plan_costs
from multimodal_fsdp.estimate.memory import estimate_memory

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


def _device_bytes(device: torch.device) -> int:
    """Bytes the caching allocator holds for live tensors on ``device`` (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    gc.collect()
    return int(torch.cuda.memory_allocated(device))


def _sharded_on(model: nn.Module, device: torch.device) -> tuple[list[str], list[str]]:
    """Parameters whose local shard is (is not) on ``device``'s type."""
    on, off = [], []
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        (on if local.device.type == device.type else off).append(name)
    return on, off


@scenario("mm_offload_tower")
def mm_offload_tower(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """The frozen tower offloaded (``offload={"tower": CPUOffloadPolicy()}``, per_layer)
    while the language model stays on the device: trains as one process does; on CUDA
    also the device memory the sharded model takes, with and without the offload."""
    mesh = build_mesh()
    policy = mixed_precision_policy("bf16", "fp32")
    results: dict[str, Any] = {}
    for offload in (False, True):
        parallelizer = MultimodalParallelizer(
            frozen_multimodal_sharding="per_layer",
            extra_tower_names=("vision",),
            offload={"tower": CPUOffloadPolicy()} if offload else None,
        )
        before = _device_bytes(ctx.device)
        model = build_vlm(dtype=torch.float32, frozen_tower=True)
        plan = parallelizer.plan(model, mp_policy=policy)
        parallelizer.apply_plan(model, plan, mesh=mesh)
        key = "offloaded" if offload else "plain"
        results[f"{key}_device_bytes"] = _device_bytes(ctx.device) - before
        estimate = estimate_memory(
            plan_costs(plan, model, world_size=ctx.world_size), plan, model, optimizer="sgd"
        )
        results[f"{key}_predicted_device_param_bytes"] = (
            estimate.sharded_param_bytes + estimate.replicated_param_bytes
        )
        results[f"{key}_predicted_host_param_bytes"] = estimate.host_param_bytes
        if offload:
            on_host = sorted(
                label for label, unit in _unit_offloads(model).items() if unit is not None
            )
            results["offloaded_units"] = on_host
            results["device_params"], results["host_params"] = (
                _sharded_on(model, ctx.device) if ctx.device.type == "cuda" else ([], [])
            )
            results.update(train_vlm(model, ctx, vlm_batches(STEPS, ctx.world_size)))
        del model
    return results


def _unit_offloads(model: nn.Module) -> dict[str, CPUOffloadPolicy | None]:
    names = {id(m): n for n, m in model.named_modules()}
    found: dict[str, CPUOffloadPolicy | None] = {}
    for unit in internals.distinct_units(model):
        (group,) = internals.param_groups(unit)
        policy = group.offload_policy
        found[names[id(unit)] or "<root>"] = (
            policy if isinstance(policy, CPUOffloadPolicy) else None
        )
    return found
