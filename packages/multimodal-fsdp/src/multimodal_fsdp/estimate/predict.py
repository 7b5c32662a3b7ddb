"""One path from a plan to its costs and memory, for every reader of the estimates.

[`inspect_model`][multimodal_fsdp.estimate.predict.inspect_model] resolves the step's
media, costs the plan, traces a batch's activations and predicts the memory, for the
command line, the chooser and the measurements alike; it sits above the costs and the
memory so that neither imports the other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from fsdp_core import ShardingPlan
from fsdp_core.mesh import MeshShape
from fsdp_core.parallel_dims import ParallelDims
from multimodal_fsdp.estimate.activations import ActivationTrace, trace_activations
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
    activations: ActivationTrace | int | None = None,
    precision: str | None = None,
    policy: str | None = None,
    media: StepMedia | None = None,
) -> PlanCosts:
    """Cost ``plan`` for ``model`` (see
    [`plan_costs`][multimodal_fsdp.estimate.costs.plan_costs]) and predict its memory.

    Args:
        plan: The plan, as ``plan()`` made it.
        model: The model it was made for (the meta device is enough without ``loss_fn``).
        world_size: Ranks of a data-parallel mesh, with ``dp_replicate`` replicas; or
            give ``mesh``.
        dp_replicate: HSDP replicas of ``world_size``.
        mesh: The mesh shape, or the job's ``ParallelDims`` when it has other dimensions.
        prefetch_guard: Whether the plan's prefetch guard is installed.
        no_backward: Module paths no gradient reaches (default: the plan's judgement).
        optimizer: The optimizer whose state the memory counts; ``None``: costs only.
        loss_fn: One batch's loss: its activations are traced and included in the peak.
            With CP, one CP rank's batch: each sequence cut to ``1/cp`` of its tokens,
            holding every sample's media tokens (its exchange an upper bound).
        activations: Activations given instead (a trace or bytes), applied after a trace.
        precision: A label for the report (e.g. ``"param=bf16 reduce=fp32"``).
        policy: A label for the report (default: the plan's policy).
        media: The step's media for the towers the plan balances (``balance_media=True``),
            so that their exchange is counted and its buffers traced; by default that of
            ``loss_fn``'s batch on every rank (see
            [`step_media`][multimodal_fsdp.estimate.exchange.step_media]).

    Returns:
        The costs, with their ``memory`` unless ``optimizer`` is ``None``.
    """
    shape = resolve_cost_mesh(mesh, world_size, dp_replicate)
    # FSDP's shard dimension holds CP's ranks; the balance group is the data-parallel one
    dims = mesh if isinstance(mesh, ParallelDims) else None
    cp = 1 if dims is None else dims.role_size("cp")
    media = step_media(plan, model, loss_fn, world_size=shape.world_size // cp, media=media)
    costs = plan_costs(
        plan,
        model,
        mesh=shape if dims is None else dims,
        prefetch_guard=prefetch_guard,
        no_backward=no_backward,
        policy=policy,
        precision=precision,
        media=media,
    )
    if optimizer is None:
        return costs
    traced = None
    if loss_fn is not None:  # the TP and CP ranks holding a batch share its towers' encoding
        group = 1 if dims is None else math.prod(dims.size(n) for n in dims.data_group_names)
        indexed = dims is not None and bool(dims.cp_names)
        traced = trace_activations(
            plan,
            model,
            loss_fn,
            shard=shape.dp_shard,
            media=media,
            data_group=group,
            indexed=indexed,
        )
    costs = with_memory(costs, plan, model, optimizer=optimizer, activations=traced)
    if activations is None or costs.memory is None:
        return costs
    return dataclasses.replace(costs, memory=costs.memory.with_activations(activations))
