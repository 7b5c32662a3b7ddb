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
[`exchange_traffic`][multimodal_fsdp.balance.traffic.exchange_traffic]'s byte rules:
calls pair across ranks by their order in the forward (round ``k`` holds each rank's
``k``-th call of any balanced or joined module; a rank with fewer calls joins the
others' with none of its own); every training forward ends with the join barrier's last
round (one slot ``all_gather``). Joined decoder layers add their decisions (one
``all_reduce`` each per forward) and, where some ranks run a layer and others skip it,
the ``all_reduce`` that brings the call's shapes (``StepMedia.layers``).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_core import ShardingPlan
from multimodal_fsdp.balance import CallSpec, media_layout_for
from multimodal_fsdp.balance.assign import assign_items
from multimodal_fsdp.balance.placeholder import describe_call
from multimodal_fsdp.balance.traffic import (
    ExchangeCollective,
    call_traffic,
    metadata_traffic,
    payload_ints,
)
from multimodal_fsdp.estimate.collectives import CommTally
from multimodal_fsdp.estimate.compute_copy import add_cast_hooks, compute_copy
from multimodal_fsdp.runtime.balance_media import (
    BalancedTower,
    BalanceMediaRuntimeHook,
    JoinedModule,
)
from multimodal_fsdp.runtime.joined_layers import DECISION_BYTES, blob_words

__all__ = [
    "BalancedCall",
    "CallBuffers",
    "call_buffers",
    "ItemSizes",
    "StepMedia",
    "exchange_tally",
    "balance_group_size",
    "joined_layers",
    "joined_modules",
    "layer_runs",
    "module_runs",
    "members_of",
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
    ``spec`` (its pickled size travels in the metadata; ranks calling together share
    it), its ``items`` in call order, and how many tensors the tower's output holds
    (``output_tensors``; the gradient exchange sends one flag byte per tensor and rank).
    A call of a *joined* module (``joined=True``: a projector with units of its own) has
    no items; ``blob_bytes`` is the size of its call's description
    (``multimodal_fsdp.balance.placeholder.describe_call``)."""

    tower: str
    spec: CallSpec
    items: tuple[ItemSizes, ...]
    output_tensors: int = 1
    joined: bool = False
    blob_bytes: int = 0

    def payload(self) -> int:
        """Words of its item table and blob in the round's metadata."""
        if self.joined:
            return payload_ints(0, self.blob_bytes)
        return payload_ints(len(self.items), len(pickle.dumps(self.spec)))


@dataclass(frozen=True)
class StepMedia:
    """The balanced tower calls of one training step: ``ranks[r]`` is rank ``r``'s calls
    in forward order, of balanced towers and joined modules (one entry per rank of the
    balance group: all data-parallel ranks by default), ``rank`` the rank whose
    collectives are predicted; ``layers`` what each rank does with the joined decoder
    layers."""

    ranks: tuple[tuple[BalancedCall, ...], ...]
    rank: int = 0
    #: Per rank (as ``ranks``; other groups alike), per joined decoder layer in the
    #: hook's order, the description of its call on that rank
    #: (``multimodal_fsdp.balance.placeholder.describe_call``; ``b""``: the rank skips
    #: the layer). Empty: every rank runs every joined layer (no placeholder).
    layers: tuple[tuple[bytes, ...], ...] = ()

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
        cls,
        calls: Sequence[BalancedCall],
        *,
        world_size: int,
        rank: int = 0,
        layers: Sequence[bytes] = (),
    ) -> StepMedia:
        """Every rank makes ``calls`` (what the fake process group runs: every rank looks
        like the calling one) and runs the joined layers ``layers`` describes."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        return cls(
            ranks=tuple(tuple(calls) for _ in range(world_size)),
            rank=rank,
            layers=tuple(tuple(layers) for _ in range(world_size)) if layers else (),
        )

    def towers(self) -> tuple[str, ...]:
        """The tower paths the calls name, in first-call order."""
        seen: dict[str, None] = {}
        for calls in self.ranks:
            for call in calls:
                seen.setdefault(call.tower, None)
        return tuple(seen)


def _hook(plan: ShardingPlan) -> BalanceMediaRuntimeHook | None:
    planned = plan.hook(BalanceMediaRuntimeHook.name)
    if planned is None or not isinstance(planned.hook, BalanceMediaRuntimeHook):
        return None
    return planned.hook


def balanced_towers(plan: ShardingPlan) -> tuple[BalancedTower, ...]:
    """The towers the plan's ``balance_media`` hook balances (none without the hook)."""
    hook = _hook(plan)
    return () if hook is None else hook.towers


def joined_modules(plan: ShardingPlan) -> tuple[JoinedModule, ...]:
    """The modules (projectors with units) the plan's ``balance_media`` hook joins."""
    hook = _hook(plan)
    return () if hook is None else hook.joined


def members_of(plan: ShardingPlan) -> tuple[BalancedTower | JoinedModule, ...]:
    """The balanced towers and joined modules of the plan's hook, in the hook's order."""
    return (*balanced_towers(plan), *joined_modules(plan))


def joined_layers(plan: ShardingPlan) -> tuple[str, ...]:
    """The media-dependent decoder layers the plan's ``balance_media`` hook joins."""
    hook = _hook(plan)
    return () if hook is None else hook.layers


Member = BalancedTower | JoinedModule


def balance_group_size(plan: ShardingPlan, world_size: int, dp_replicate: int = 1) -> int:
    """The ranks of one balance group of the plan's ``balance_media`` hook on a mesh of
    ``world_size`` ranks (``dp_replicate`` replicas): what ``StepMedia`` describes."""
    hook = _hook(plan)
    group = "all" if hook is None else hook.group
    if group == "all":
        return world_size
    if group == "shard":
        return world_size // dp_replicate
    if group == "replicate":
        return dp_replicate
    if not isinstance(group, int) or world_size % group:
        raise ValueError(f"balance_media_group={group!r} must divide the {world_size} ranks")
    return group


def _rounds(
    media: StepMedia, members: Sequence[Member]
) -> list[tuple[list[BalancedCall | None], str]]:
    """The step's rounds as the exchange runs them: per round each rank's pending call
    (``None``: it joins) and the module the round runs, the lowest in the hook's order
    among those called; its callers move on to their next call, the others bring theirs
    again."""
    order = {member.path: index for index, member in enumerate(members)}
    position = [0] * media.world_size
    result: list[tuple[list[BalancedCall | None], str]] = []
    while True:
        heads = [
            calls[position[r]] if position[r] < len(calls) else None
            for r, calls in enumerate(media.ranks)
        ]
        called = [call.tower for call in heads if call is not None]
        if not called:
            return result
        chosen = min(called, key=lambda path: order.get(path, len(order)))
        result.append((heads, chosen))
        for r, call in enumerate(heads):
            if call is not None and call.tower == chosen:
                position[r] += 1


def _subcall_traffic(
    calls: list[BalancedCall | None], *, rank: int, tower: BalancedTower
) -> list[ExchangeCollective]:
    """The collectives of the balanced call of ``tower`` in a round, after its metadata."""
    mine = [call if call is not None and call.tower == tower.path else None for call in calls]
    items = [call.items if call is not None else () for call in mine]
    specs = {call.spec for call in mine if call is not None}
    if len(specs) > 1:
        raise ValueError(
            f"the calls of balanced tower {tower.path!r} made together pass different options "
            f"({sorted(map(repr, specs))}); every rank calls the tower with the same ones"
        )
    inputs_grad = any(item.input_grad_bytes for group in items for item in group)
    tensors = max(
        (call.output_tensors for call in mine if call is not None and call.items), default=1
    )
    return call_traffic(
        [[item.cost for item in group] for group in items],
        rank=rank,
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
        run_when_empty=tower.run_when_empty,
    )


def exchange_rounds(
    media: StepMedia, members: Sequence[Member]
) -> list[list[tuple[str, list[ExchangeCollective]]]]:
    """The collectives ``media.rank`` runs in each round (the barrier's last round not
    included): per round, its metadata (module ``""``), then the call of the module the
    round runs, as [`exchange_traffic`][multimodal_fsdp.balance.traffic.exchange_traffic]
    lists them (a joined module's call exchanges nothing more)."""
    by_path = {member.path: member for member in members}
    result = []
    for heads, chosen in _rounds(media, members):
        payloads = [call.payload() if call is not None else 0 for call in heads]
        member = by_path.get(chosen)
        traffic: list[ExchangeCollective] = []
        if isinstance(member, BalancedTower):
            traffic = _subcall_traffic(heads, rank=media.rank, tower=member)
        result.append([("", metadata_traffic(payloads)), (chosen, traffic)])
    return result


@dataclass(frozen=True)
class CallBuffers:
    """What one of this rank's balanced calls moves, for the memory model: the input
    bytes it sends and receives, the output bytes it sends and receives, the input and
    output bytes of the items it keeps, and the output gradient bytes it sends and
    receives in backward (``None`` without that exchange)."""

    inputs: tuple[int, int]
    outputs: tuple[int, int]
    kept: tuple[int, int]
    grads: tuple[int, int] | None


def call_buffers(
    media: StepMedia, tower: BalancedTower, members: Sequence[Member]
) -> list[CallBuffers | None]:
    """Per call ``media.rank`` makes of ``tower``, in order, what it moves (``None``:
    every item stays home, nothing is exchanged)."""
    result: list[CallBuffers | None] = []
    rounds = _rounds(media, members)
    for parts, (calls, chosen) in zip(exchange_rounds(media, members), rounds, strict=True):
        if chosen != tower.path:
            continue
        own = calls[media.rank]
        if own is None or own.tower != tower.path:
            continue
        traffic = dict(parts).get(tower.path, [])
        a2a = [c for c in traffic if c.kind == "all_to_all"]
        if len(a2a) < 2:
            result.append(None)
            continue
        costs = [
            [i.cost for i in c.items] if c is not None and c.tower == tower.path else []
            for c in calls
        ]
        owners = assign_items(costs)
        kept = [i for i, o in enumerate(owners[media.rank]) if o == media.rank]
        grads = next(((c.sent, c.received) for c in a2a if c.phase == "backward"), None)
        result.append(
            CallBuffers(
                inputs=(a2a[0].sent, a2a[0].received),
                outputs=(a2a[1].sent, a2a[1].received),
                kept=(
                    sum(own.items[i].input_bytes for i in kept),
                    sum(own.items[i].output_bytes for i in kept),
                ),
                grads=grads,
            )
        )
    return result


def module_runs(media: StepMedia, path: str, members: Sequence[Member]) -> int:
    """How often the balanced or joined module at ``path`` runs on each rank in the step
    when it owns FSDP units: once per round that runs it in which some rank has an item
    of it (a balanced tower: a rank encodes its share, or a placeholder) or calls it (a
    joined module: the callers' own calls, a placeholder elsewhere); its units'
    collectives repeat that often (none in a step without its media)."""
    count = 0
    for heads, chosen in _rounds(media, members):
        if chosen != path:
            continue
        mine = [call for call in heads if call is not None and call.tower == path]
        if any(call.joined or call.items for call in mine):
            count += 1
    return count


def layer_runs(media: StepMedia, index: int) -> int:
    """Whether (1) or not (0) the ``index``-th joined decoder layer runs on every rank in
    the step: some rank runs it (the others join it on a placeholder), or none does."""
    if not media.layers:
        return 1
    return int(any(blobs[index] for blobs in media.layers))


def _tally(tally: CommTally, traffic: Sequence[ExchangeCollective]) -> None:
    for collective in traffic:
        if collective.kind == "all_to_all":
            tally.add(
                collective.phase, collective.kind, collective.sent, received=collective.received
            )
        else:  # an all_gather: its bytes are the gathered output
            tally.add(collective.phase, collective.kind, collective.received)


def exchange_tally(
    media: StepMedia,
    towers: Sequence[BalancedTower],
    *,
    world_size: int,
    joined: Sequence[JoinedModule] = (),
    layers: int = 0,
) -> CommTally:
    """The collectives ``media.rank`` runs in one training step's exchanges: each round
    of calls of the balanced ``towers`` and ``joined`` modules, then the join barrier's
    last round; and the decisions of ``layers`` joined decoder layers (with the shapes'
    all_reduce where ``media.layers`` says some ranks run a layer and others skip it).
    ``world_size``: the ranks of the balance group. ``all_gather`` bytes are the gathered
    output (every rank's slot), ``all_to_all`` bytes those this rank sends, with what it
    receives beside them, as [`fsdp_core.CommCounter`][fsdp_core.comm.CommCounter]
    counts them."""
    if not isinstance(media, StepMedia):
        raise TypeError(f"media must be a StepMedia, got {type(media).__name__}")
    if media.world_size != world_size:
        raise ValueError(
            f"media describes {media.world_size} ranks but the plan is costed on {world_size}; "
            "give one entry per rank of the balance group"
        )
    members: list[Member] = [*towers, *joined]
    known = {member.path for member in members}
    unknown = [path for path in media.towers() if path not in known]
    if unknown:
        raise ValueError(
            f"media names towers {unknown} that the plan does not balance; balanced towers: "
            f"{sorted(known)}"
        )
    tally = CommTally()
    if members:
        for parts in exchange_rounds(media, members):
            for _, traffic in parts:
                _tally(tally, traffic)
        _tally(tally, metadata_traffic([0] * world_size))
    for index in range(layers):
        tally.add("forward", "all_reduce", DECISION_BYTES)
        sizes = [len(row[index]) for row in media.layers] if media.layers else []
        if sizes and any(sizes) and not all(sizes):
            tally.add("forward", "all_reduce", blob_words(max(sizes)) * 8)
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
    layers = joined_layers(plan)
    layer_blobs = [b""] * len(layers)
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
    for joined in joined_modules(plan):

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
