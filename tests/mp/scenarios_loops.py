"""Every loop of :mod:`loops` as a torchrun scenario: shard, run the loop, report.

A case that must train reports losses (mean over ranks), first-step gradients,
final parameters and, per step, the trainable parameters whose gradient stayed
``None``. A case that must stop reports, from every rank, whether it raised
``UnevenMediaError``, its message and how many steps completed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loops import CASES, LoopCase
from registry import scenario
from scenarios_core import full
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import DistributedContext, build_mesh, mixed_precision_policy
from multimodal_fsdp import MultimodalParallelizer, UnevenMediaError


def _parallelizer(case: LoopCase) -> MultimodalParallelizer:
    options: dict[str, Any] = {"frozen_multimodal_sharding": case.policy}
    if case.uneven_media:
        options["uneven_media"] = True
    if case.balance_media:
        options["balance_media"] = True
    if case.parallelizer == "deepseek":
        from model_deepseek_v41 import DeepseekV41ModelParallelizer

        return DeepseekV41ModelParallelizer(**options)
    return MultimodalParallelizer(**options)


def run_case(
    case: LoopCase, ctx: DistributedContext, *, mesh: DeviceMesh | None = None
) -> dict[str, Any]:
    """``mesh``: the data-parallel mesh (default: ``build_mesh`` over the default group)."""
    model = case.build_model().to(ctx.device)
    precision = ("bf16", "fp32") if case.precision == "bf16" else ("fp32", "fp32")
    parallelizer = _parallelizer(case)
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy(*precision))
    if mesh is None:
        mesh = build_mesh(dp_replicate=case.dp_replicate)
    parallelizer.apply_plan(model, plan, mesh=mesh)
    case.after_sharding(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    opt = case.optimizer_fn()(trainable)
    step_fn = case.step_fn(ctx.device)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    unused: list[list[str]] = []
    steps_done = 0
    error = ""
    try:
        for step in range(case.steps):
            loss = step_fn(model, step, ctx.rank)
            loss.backward()
            unused.append(sorted(names[id(p)] for p in trainable if p.grad is None))
            if step == 0:
                grads0 = {
                    n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None
                }
            opt.step()
            opt.zero_grad(set_to_none=True)
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(total.item() / ctx.world_size)
            steps_done += 1
    except UnevenMediaError as exc:
        error = str(exc)
    errors: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(errors, (error, steps_done))
    result: dict[str, Any] = {
        "errors": errors,
        "hooks": plan.hook_names(),
        "units": [u.label for u in plan.units],
        "replicated": list(plan.replicated_param_names),
    }
    if not error:
        result.update(
            losses=losses,
            grads0=grads0,
            params={n: full(p) for n, p in model.named_parameters()},
            unused=unused,
        )
    return result


for _name in CASES:

    def _run(ctx: DistributedContext, out: Path, _case: str = _name) -> dict[str, Any]:
        return run_case(CASES[_case], ctx)

    scenario(f"loop_{_name}")(_run)
