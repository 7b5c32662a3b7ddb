"""One call from a model to its plan's costs and memory: plan, cost, predict.

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

from fsdp_core import mixed_precision_policy
from fsdp_core.mesh import MeshShape
from fsdp_core.sharding import check_reshard_after_forward
from multimodal_fsdp.estimate.activations import trace_activations
from multimodal_fsdp.estimate.costs import PlanCosts, plan_costs, resolve_cost_mesh
from multimodal_fsdp.estimate.memory import with_memory
from multimodal_fsdp.parallelizer import MultimodalParallelizer

__all__ = ["inspect_model"]


def inspect_model(
    model: nn.Module,
    *,
    world_size: int | None = None,
    dp_replicate: int = 1,
    mesh: MeshShape | None = None,
    precision: str = "bf16",
    reduce_precision: str | None = "fp32",
    policy: str = "root",
    parallelizer: MultimodalParallelizer | None = None,
    reshard_after_forward: bool | int | None = None,
    prefetch_guard: bool = True,
    no_backward: Iterable[str] | None = None,
    optimizer: str | None = "adamw",
    loss_fn: Callable[[nn.Module], torch.Tensor] | None = None,
) -> PlanCosts:
    """Plan ``model`` with ``parallelizer`` (default
    [`MultimodalParallelizer`][multimodal_fsdp.parallelizer.MultimodalParallelizer]) under
    ``policy`` and ``precision``, then cost the plan (see
    [`plan_costs`][multimodal_fsdp.estimate.costs.plan_costs]).

    Unless ``optimizer`` is ``None``, the costs carry the predicted memory of a
    step with that optimizer
    ([`multimodal_fsdp.estimate.memory`][multimodal_fsdp.estimate.memory]); with ``loss_fn``
    (one batch's loss) the activations are traced and included in the peak."""
    if parallelizer is None:
        parallelizer = MultimodalParallelizer()
    if not isinstance(parallelizer, MultimodalParallelizer):
        raise TypeError(
            f"parallelizer must be a MultimodalParallelizer, got {type(parallelizer).__name__}"
        )
    shape = resolve_cost_mesh(mesh, world_size, dp_replicate)
    check_reshard_after_forward(reshard_after_forward, shape.dp_shard)
    chosen = parallelizer.with_options(frozen_multimodal_sharding=policy)
    mp = mixed_precision_policy(precision, reduce_precision)
    plan = chosen.plan(model, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    costs = plan_costs(
        plan,
        model,
        mesh=shape,
        parallelizer=chosen,
        prefetch_guard=prefetch_guard,
        no_backward=no_backward,
        policy=chosen.frozen_multimodal_sharding,
        precision=f"param={precision} reduce={reduce_precision}",
    )
    if optimizer is None:
        return costs
    traced = (
        None
        if loss_fn is None
        else trace_activations(model, plan, loss_fn, parallelizer=chosen, shard=shape.dp_shard)
    )
    return with_memory(costs, plan, model, optimizer=optimizer, activations=traced)
