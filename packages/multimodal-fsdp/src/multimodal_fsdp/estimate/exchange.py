"""What balanced media costs in a step: the exchange's collectives, from the step's media.

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
[`exchange_traffic`][multimodal_fsdp.balance.traffic.exchange_traffic]'s byte rule:
calls pair across ranks by their order per tower; a rank with fewer calls joins the
others' with none of its own; every training forward ends, per balanced tower, with the
join barrier's last round (one header ``all_gather``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_core import ShardingPlan
from multimodal_fsdp.balance import CallSpec, exchange_traffic, media_layout_for
from multimodal_fsdp.balance.traffic import ExchangeCollective
from multimodal_fsdp.estimate.collectives import CommTally
from multimodal_fsdp.estimate.compute_copy import add_cast_hooks, compute_copy
from multimodal_fsdp.runtime.balance_media import BalancedTower, BalanceMediaRuntimeHook

__all__ = [
    "BalancedCall",
    "ItemSizes",
    "StepMedia",
    "exchange_tally",
    "record_step_media",
    "step_media",
]

#: Runs the forward of one batch and returns the scalar loss.
LossFn = Callable[[nn.Module], torch.Tensor]


@dataclass(frozen=True)
class ItemSizes:
    """One media item of a balanced call: its ``cost`` (what the assignment balances,
    patches or pixels), the bytes of its input rows (every field) and of its output rows
    (every output tensor), and of those the bytes that gradients carry back (floating
    outputs; floating inputs that require a gradient, usually none)."""

    cost: int
    input_bytes: int
    output_bytes: int
    output_grad_bytes: int = 0
    input_grad_bytes: int = 0


@dataclass(frozen=True)
class BalancedCall:
    """One call of the balanced tower at ``tower`` (its path) on one rank: the call's
    ``spec`` (its pickled size sets the item-table gather; ranks calling together share
    it), its ``items`` in call order, and how many tensors the tower's output holds
    (``output_tensors``; the gradient exchange sends one flag byte per tensor and rank)."""

    tower: str
    spec: CallSpec
    items: tuple[ItemSizes, ...]
    output_tensors: int = 1


@dataclass(frozen=True)
class StepMedia:
    """The balanced tower calls of one training step: ``ranks[r]`` is rank ``r``'s calls
    in forward order (one entry per rank of the balanced group, all data-parallel
    ranks), ``rank`` the rank whose collectives are predicted."""

    ranks: tuple[tuple[BalancedCall, ...], ...]
    rank: int = 0

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("StepMedia needs the calls of at least one rank")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise TypeError(f"rank must be an int, got {self.rank!r}")
        if not 0 <= self.rank < len(self.ranks):
            raise ValueError(
                f"rank {self.rank} is not one of the {len(self.ranks)} ranks StepMedia describes"
            )

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @classmethod
    def same_on_every_rank(
        cls, calls: Sequence[BalancedCall], *, world_size: int, rank: int = 0
    ) -> StepMedia:
        """Every rank makes ``calls`` (what the fake process group runs: every rank looks
        like the calling one)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        return cls(ranks=tuple(tuple(calls) for _ in range(world_size)), rank=rank)

    def towers(self) -> tuple[str, ...]:
        """The tower paths the calls name, in first-call order."""
        seen: dict[str, None] = {}
        for calls in self.ranks:
            for call in calls:
                seen.setdefault(call.tower, None)
        return tuple(seen)


def balanced_towers(plan: ShardingPlan) -> tuple[BalancedTower, ...]:
    """The towers the plan's ``balance_media`` hook balances (none without the hook)."""
    planned = plan.hook(BalanceMediaRuntimeHook.name)
    if planned is None or not isinstance(planned.hook, BalanceMediaRuntimeHook):
        return ()
    return planned.hook.towers


def _rounds(media: StepMedia, tower: str) -> list[list[BalancedCall | None]]:
    """Per round (call index), each rank's call of ``tower`` (``None``: it joins)."""
    per_rank = [[c for c in calls if c.tower == tower] for calls in media.ranks]
    most = max(len(calls) for calls in per_rank)
    return [[calls[k] if k < len(calls) else None for calls in per_rank] for k in range(most)]


def _round_traffic(
    calls: list[BalancedCall | None], *, rank: int, tower: BalancedTower
) -> list[ExchangeCollective]:
    items = [call.items if call is not None else () for call in calls]
    specs = {call.spec for call in calls if call is not None}
    if len(specs) > 1:
        raise ValueError(
            f"the calls of balanced tower {tower.path!r} made together pass different options "
            f"({sorted(map(repr, specs))}); every rank calls the tower with the same ones"
        )
    inputs_grad = any(item.input_grad_bytes for group in items for item in group)
    tensors = max(
        (call.output_tensors for call in calls if call is not None and call.items), default=1
    )
    return exchange_traffic(
        [[item.cost for item in group] for group in items],
        rank=rank,
        spec=specs.pop(),
        input_bytes=[[item.input_bytes for item in group] for group in items],
        output_bytes=[[item.output_bytes for item in group] for group in items],
        output_grad_bytes=(
            [[item.output_grad_bytes for item in group] for group in items]
            if tower.trainable or inputs_grad
            else None
        ),
        input_grad_bytes=(
            [[item.input_grad_bytes for item in group] for group in items] if inputs_grad else None
        ),
        output_tensors=tensors,
    )


def exchange_rounds(media: StepMedia, tower: BalancedTower) -> list[list[ExchangeCollective]]:
    """The collectives ``media.rank`` runs in each round of calls of ``tower`` (the
    barrier's last round not included), as
    [`exchange_traffic`][multimodal_fsdp.balance.traffic.exchange_traffic] lists them."""
    return [
        _round_traffic(calls, rank=media.rank, tower=tower) for calls in _rounds(media, tower.path)
    ]


def tower_runs(media: StepMedia, tower: str) -> int:
    """How often the balanced tower at ``tower`` runs on each rank in the step: once per
    round of its calls in which some rank has an item (a rank encodes its share, or a
    placeholder when the tower owns FSDP units), so its units' collectives repeat that
    often (none in a step without its media)."""
    return sum(
        1
        for calls in _rounds(media, tower)
        if any(call is not None and call.items for call in calls)
    )


def exchange_tally(
    media: StepMedia, towers: Sequence[BalancedTower], *, world_size: int
) -> CommTally:
    """The collectives ``media.rank`` runs in one training step's exchanges: each round
    of calls of each tower in ``towers``, then the join barrier's last round per tower.
    ``all_gather`` bytes are the gathered output (every rank's slot), ``all_to_all``
    bytes those this rank sends, with what it receives beside them, as
    [`fsdp_core.CommCounter`][fsdp_core.comm.CommCounter] counts them."""
    if not isinstance(media, StepMedia):
        raise TypeError(f"media must be a StepMedia, got {type(media).__name__}")
    if media.world_size != world_size:
        raise ValueError(
            f"media describes {media.world_size} ranks but the plan is costed on {world_size}; "
            "give one entry per data-parallel rank"
        )
    known = {tower.path for tower in towers}
    unknown = [path for path in media.towers() if path not in known]
    if unknown:
        raise ValueError(
            f"media names towers {unknown} that the plan does not balance; balanced towers: "
            f"{sorted(known)}"
        )
    tally = CommTally()
    for tower in towers:
        rounds = [
            *exchange_rounds(media, tower),
            exchange_traffic(
                [[] for _ in range(world_size)],
                rank=media.rank,
                spec=None,
                input_bytes=[[] for _ in range(world_size)],
                output_bytes=[[] for _ in range(world_size)],
            ),
        ]
        for traffic in rounds:
            for collective in traffic:
                if collective.kind == "all_to_all":
                    tally.add(
                        collective.phase,
                        collective.kind,
                        collective.sent,
                        received=collective.received,
                    )
                else:  # an all_gather: its bytes are the gathered output
                    tally.add(collective.phase, collective.kind, collective.received)
    return tally


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
    towers = balanced_towers(plan)
    if not towers:
        return StepMedia.same_on_every_rank((), world_size=world_size, rank=rank)
    twin = compute_copy(model, plan)
    calls: list[BalancedCall] = []
    handles = []
    for unit in plan.units:
        for path in unit.paths:
            handles += add_cast_hooks(twin.get_submodule(path), unit.mp_policy)
    for tower in towers:

        def capture(
            module: nn.Module, args: Any, kwargs: Any, output: Any, tower: BalancedTower = tower
        ) -> None:
            calls.append(_recorded_call(module, tower.path, tower.layout, args, kwargs, output))

        module = twin.get_submodule(tower.path) if tower.path else twin
        # First among the forward hooks: the output as the tower's forward returns it,
        # before a unit's output cast (the exchange carries it so).
        handles.append(module.register_forward_hook(capture, with_kwargs=True, prepend=True))
    try:
        loss_fn(twin)  # grad mode as in training: which inputs require a gradient
    finally:
        for handle in handles:
            handle.remove()
    return StepMedia.same_on_every_rank(calls, world_size=world_size, rank=rank)


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
