"""What balanced media costs in a step: the exchange's collectives, from the step's media.

A plan made with ``balance_media=True`` spreads every call of its balanced towers over
the data-parallel ranks. The exchange's collectives per call are fixed (see
[`multimodal_fsdp.balance.exchange`][multimodal_fsdp.balance.exchange]), but how many calls
a step makes and what each moves depend on the step's media, which
[`StepMedia`][multimodal_fsdp.estimate.exchange.StepMedia] says: per rank, its calls of
each balanced tower in forward order, with their items' costs and sizes.
[`record_step_media`][multimodal_fsdp.estimate.exchange.record_step_media] records it
from one batch; the cost model itself is the ``balance_media`` hook's
([`BalanceMediaRuntimeHook.collectives`][multimodal_fsdp.runtime.balance_media.BalanceMediaRuntimeHook.collectives]).
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
    """The plan's ``balance_media`` hook object (towers, joined modules, layers, balance
    group), read without importing the hook's module; ``None`` without one."""
    planned = plan.hook(BALANCE_MEDIA)
    hook: object = None if planned is None else planned.hook
    return hook if isinstance(hook, BalancePlanned) else None


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
    """The balanced tower calls of one forward of ``loss_fn``'s batch, on every rank.

    Runs the forward once on an unsharded copy of ``model`` (materialised on the CPU if
    on meta) with the plan's compute dtypes and casts, and splits each call of a balanced
    tower with its layout adapter. For ranks with different media, record each rank's
    batch and build ``StepMedia(ranks=(calls_of_rank_0, ...), rank=...)``.

    Args:
        plan: A plan made with ``balance_media=True`` (else the media are empty).
        model: The model it was made for.
        loss_fn: Runs the forward of one batch.
        world_size: Ranks of the balance group (as the fake process group runs it).
        rank: The rank the media are costed for.

    Returns:
        The same calls on every rank.

    Raises:
        TypeError: ``loss_fn`` is not callable.
    """
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

        module = twin.get_submodule(tower.path)
        # First among the forward hooks: the output as the tower's forward returns it,
        # before a unit's output cast (the exchange carries it so).
        handles.append(module.register_forward_hook(capture, with_kwargs=True, prepend=True))
    for joined in hook.joined:

        def enter(_module: nn.Module, args: Any, kwargs: Any, path: str = joined.path) -> None:
            blob = len(describe_call(tuple(args), dict(kwargs)))
            calls.append(BalancedCall(path, CallSpec(()), (), joined=True, blob_bytes=blob))

        module = twin.get_submodule(joined.path)
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
    """The media a plan is costed for, the same rule wherever a batch may be given.

    Args:
        plan: The plan.
        model: The model it was made for.
        loss_fn: Runs one batch, or ``None``.
        world_size: Ranks of the balance group.
        rank: The rank the media are costed for.
        media: Media given by the caller, used as they are.

    Returns:
        ``media`` when given, else ``loss_fn``'s batch on every rank
        ([`record_step_media`][multimodal_fsdp.estimate.exchange.record_step_media]) when
        the plan balances a tower; ``None`` otherwise.
    """
    hook = None if media is not None or loss_fn is None else balance_hook(plan)
    if loss_fn is None or hook is None or not hook.towers:
        return media
    return record_step_media(plan, model, loss_fn, world_size=world_size, rank=rank)
