"""One call from a plan to its costs and memory: cost, then predict.

[`inspect_model`][multimodal_fsdp.cli.inspection.inspect_model] sits above
[`multimodal_fsdp.estimate.costs`][multimodal_fsdp.estimate.costs] and
[`multimodal_fsdp.estimate.memory`][multimodal_fsdp.estimate.memory] (which builds on the costs),
so that
neither of them has to import the other back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from fsdp_core import ShardingPlan
from fsdp_core.mesh import MeshShape
from fsdp_core.parallel_dims import ParallelDims
from multimodal_fsdp.estimate.activations import trace_activations
from multimodal_fsdp.estimate.costs import PlanCosts, plan_costs, resolve_cost_mesh
from multimodal_fsdp.estimate.exchange import StepMedia, step_media
from multimodal_fsdp.estimate.memory import with_memory

__all__ = ["inspect_model"]


def inspect_model(
    plan: ShardingPlan,
    model: nn.Module,
    *,
    world_size: int | None = None,
    dp_replicate: int = 1,
    mesh: MeshShape | ParallelDims | None = None,
    prefetch_guard: bool = True,
    no_backward: Iterable[str] | None = None,
    optimizer: str | None = "adamw",
    loss_fn: Callable[[nn.Module], torch.Tensor] | None = None,
    precision: str | None = None,
    media: StepMedia | None = None,
) -> PlanCosts:
    """Cost ``plan`` for ``model`` (see
    [`plan_costs`][multimodal_fsdp.estimate.costs.plan_costs]) and predict its memory.

    Unless ``optimizer`` is ``None``, the costs carry the predicted memory of a
    step with that optimizer
    ([`multimodal_fsdp.estimate.memory`][multimodal_fsdp.estimate.memory]); with ``loss_fn``
    (one batch's loss) the activations are traced and included in the peak.
    ``precision`` labels the report (e.g. ``"param=bf16 reduce=fp32"``). ``media``: the
    step's media for the towers the plan balances (``balance_media=True``), so that their
    exchange is counted and its buffers traced; by default that of ``loss_fn``'s batch on
    every rank (see [`step_media`][multimodal_fsdp.estimate.exchange.step_media], the
    rule the chooser follows too)."""
    shape = resolve_cost_mesh(mesh, world_size, dp_replicate)
    media = step_media(plan, model, loss_fn, world_size=shape.world_size, media=media)
    costs = plan_costs(
        plan,
        model,
        mesh=mesh if isinstance(mesh, ParallelDims) else shape,
        prefetch_guard=prefetch_guard,
        no_backward=no_backward,
        precision=precision,
        media=media,
    )
    if optimizer is None:
        return costs
    traced = (
        None
        if loss_fn is None
        else trace_activations(plan, model, loss_fn, shard=shape.dp_shard, media=media)
    )
    return with_memory(costs, plan, model, optimizer=optimizer, activations=traced)
