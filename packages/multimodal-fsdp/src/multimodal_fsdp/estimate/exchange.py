"""What balanced media costs in a step: the exchange's collectives, from the step's media.

The cost model itself belongs to the ``balance_media`` hook
([`BalanceMediaRuntimeHook.collectives`][multimodal_fsdp.runtime.balance_media.BalanceMediaRuntimeHook.collectives]),
computed in the balance group below it; its data types and functions are published here,
with the readers of the plan's hook data and the recording of a batch's media.

A plan made with ``balance_media=True`` spreads every call of its balanced towers over
the data-parallel ranks. The exchange's collectives are fixed per call (see
[`multimodal_fsdp.balance.exchange`][multimodal_fsdp.balance.exchange]), but how many
calls a step makes and what each moves depend on the step's images and videos, which a
plan does not know. [`StepMedia`][multimodal_fsdp.estimate.exchange.StepMedia] says it,
small and explicit: per rank of the balanced group, its calls of each balanced tower in
forward order, each with its items' costs and sizes.
[`record_step_media`][multimodal_fsdp.estimate.exchange.record_step_media] fills it in
from one batch, run on an unsharded copy with the plan's compute dtypes, through the
tower's layout adapter.

[`exchange_tally`][multimodal_fsdp.estimate.exchange.exchange_tally] turns it into the
collectives one rank runs, with
[`exchange_traffic`][multimodal_fsdp.balance.traffic.exchange_traffic]'s byte rules:
calls pair across ranks by their order in the forward (round ``k`` holds each rank's
``k``-th call of any balanced or joined module; a rank with fewer calls joins the
others' with none of its own); every training forward ends with the join barrier's last
round (one slot ``all_gather``). Joined decoder layers add their decisions (one
``all_reduce`` each per forward) and, where some ranks run a layer and others skip it,
the ``all_reduce`` that brings the call's shapes (``StepMedia.layers``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_core import ShardingPlan
from multimodal_fsdp.balance import CallSpec, media_layout_for
from multimodal_fsdp.balance._planned import (
    BALANCE_MEDIA,
    BalancedTower,
    BalancePlanned,
)
from multimodal_fsdp.balance._step_media import (
    BalancedCall,
    CallBuffers,
    ItemSizes,
    StepMedia,
    call_buffers,
    exchange_tally,
    layer_runs,
    module_runs,
)
from multimodal_fsdp.balance.placeholder import describe_call
from multimodal_fsdp.estimate.compute_copy import add_cast_hooks, compute_copy

__all__ = [
    "BalancedCall",
    "CallBuffers",
    "call_buffers",
    "ItemSizes",
    "StepMedia",
    "exchange_tally",
    "layer_runs",
    "module_runs",
    "record_step_media",
    "step_media",
]

#: Runs the forward of one batch and returns the scalar loss.
LossFn = Callable[[nn.Module], torch.Tensor]


def balance_hook(plan: ShardingPlan) -> BalancePlanned | None:
    """The plan's ``balance_media`` hook object (its towers, joined modules and layers,
    balance group), read without importing the hook's module; ``None`` without one (a
    hand-built entry without its object balances nothing here, as always)."""
    planned = plan.hook(BALANCE_MEDIA)
    hook: object = None if planned is None else planned.hook
    return hook if isinstance(hook, BalancePlanned) else None


def balanced_towers(plan: ShardingPlan) -> tuple[BalancedTower, ...]:
    """The towers the plan's ``balance_media`` hook balances (none without the hook)."""
    hook = balance_hook(plan)
    return () if hook is None else hook.towers


# --------------------------------------------------------------------------- recording
def _nbytes(tensors: Sequence[torch.Tensor], *, floating: bool = False) -> int:
    return sum(t.nbytes for t in tensors if t.is_floating_point() or not floating)


def _recorded_call(
    module: nn.Module, tower: str, layout_name: str, args: Any, kwargs: Any, output: Any
) -> BalancedCall:
    layout = media_layout_for(module, name=layout_name)
    call = layout.split_call(module, tuple(args), dict(kwargs))
    if not call.items:
        return BalancedCall(tower=tower, spec=call.spec, items=())
    out_spec, pieces = layout.split_output(output, [item.fields[0].shape[0] for item in call.items])
    sizes = []
    for item, piece in zip(call.items, pieces, strict=True):
        grads = [t for t in item.fields if t.is_floating_point() and t.requires_grad]
        sizes.append(
            ItemSizes(
                cost=item.cost,
                input_bytes=_nbytes(item.fields),
                output_bytes=_nbytes(piece),
                output_grad_bytes=_nbytes(piece, floating=True),
                input_grad_bytes=_nbytes(grads),
            )
        )
    return BalancedCall(
        tower=tower, spec=call.spec, items=tuple(sizes), output_tensors=len(out_spec.dtypes)
    )


def record_step_media(
    plan: ShardingPlan,
    model: nn.Module,
    loss_fn: LossFn,
    *,
    world_size: int,
    rank: int = 0,
) -> StepMedia:
    """The balanced tower calls of one forward of ``loss_fn``'s batch, on every one of
    ``world_size`` ranks (as the fake process group runs it).

    Runs the forward once on an unsharded copy of ``model`` (materialised on the CPU if
    it is on meta) with the plan's compute dtypes and FSDP2's casts at unit boundaries,
    and splits each call of a balanced tower with its layout adapter. For ranks with
    different media, record each rank's batch and build
    ``StepMedia(ranks=(calls_of_rank_0, calls_of_rank_1, ...), rank=...)``."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    hook = balance_hook(plan)
    if hook is None or not hook.towers:
        return StepMedia.same_on_every_rank((), world_size=world_size, rank=rank)
    twin = compute_copy(model, plan)
    calls: list[BalancedCall] = []
    layers = hook.layers
    layer_blobs = [b""] * len(layers)
    handles = []
    for unit in plan.units:
        for path in unit.paths:
            handles += add_cast_hooks(twin.get_submodule(path), unit.mp_policy)
    for tower in hook.towers:

        def capture(
            module: nn.Module, args: Any, kwargs: Any, output: Any, tower: BalancedTower = tower
        ) -> None:
            calls.append(_recorded_call(module, tower.path, tower.layout, args, kwargs, output))

        module = twin.get_submodule(tower.path) if tower.path else twin
        # First among the forward hooks: the output as the tower's forward returns it,
        # before a unit's output cast (the exchange carries it so).
        handles.append(module.register_forward_hook(capture, with_kwargs=True, prepend=True))
    for joined in hook.joined:

        def enter(_module: nn.Module, args: Any, kwargs: Any, path: str = joined.path) -> None:
            blob = describe_call(tuple(args), dict(kwargs))
            calls.append(
                BalancedCall(
                    tower=path,
                    spec=CallSpec(fields=()),
                    items=(),
                    joined=True,
                    blob_bytes=len(blob),
                )
            )

        module = twin.get_submodule(joined.path) if joined.path else twin
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
    for index, path in enumerate(layers):

        def ran(_module: nn.Module, args: Any, kwargs: Any, index: int = index) -> None:
            layer_blobs[index] = describe_call(tuple(args), dict(kwargs))

        handles.append(twin.get_submodule(path).register_forward_pre_hook(ran, with_kwargs=True))
    try:
        loss_fn(twin)  # grad mode as in training: which inputs require a gradient
    finally:
        for handle in handles:
            handle.remove()
    return StepMedia.same_on_every_rank(calls, world_size=world_size, rank=rank, layers=layer_blobs)


def step_media(
    plan: ShardingPlan,
    model: nn.Module,
    loss_fn: LossFn | None,
    *,
    world_size: int,
    rank: int = 0,
    media: StepMedia | None = None,
) -> StepMedia | None:
    """The media a plan is costed for, the same rule everywhere a batch may be given:
    ``media`` when given, else, when the plan balances a tower and ``loss_fn`` runs a
    batch, that batch's media on every rank
    ([`record_step_media`][multimodal_fsdp.estimate.exchange.record_step_media]);
    ``None`` otherwise (no exchange to count, or nothing to count it from)."""
    if media is not None or loss_fn is None or not balanced_towers(plan):
        return media
    return record_step_media(plan, model, loss_fn, world_size=world_size, rank=rank)
