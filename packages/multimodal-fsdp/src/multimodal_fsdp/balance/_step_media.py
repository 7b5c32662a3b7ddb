"""What a step's balanced media cost: the step's calls per rank (``StepMedia``), the
rounds the exchange runs for them, and one rank's tally, from the exchange's own decision
(``route_call``) and byte rules (``multimodal_fsdp.balance.traffic``), for the
``balance_media`` hook and the estimates (published in ``multimodal_fsdp.estimate.exchange``).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass, replace

from fsdp_core.collective_count import CommTally
from multimodal_fsdp.balance._data_group import gathered_bytes, share_of_position
from multimodal_fsdp.balance._planned import (
    DECISION_BYTES,
    BalancedTower,
    BalancePlanned,
    JoinedModule,
    blob_words,
    group_size,
)
from multimodal_fsdp.balance.layouts import CallSpec
from multimodal_fsdp.balance.traffic import (
    ExchangeCollective,
    call_traffic,
    metadata_traffic,
    payload_ints,
)

__all__ = [
    "BalancedCall",
    "CallBuffers",
    "ItemSizes",
    "Member",
    "StepMedia",
    "call_buffers",
    "data_group_media",
    "exchange_tally",
    "layer_runs",
    "module_runs",
    "planned_runs",
    "planned_tally",
]


@dataclass(frozen=True)
class ItemSizes:
    """One media item of a balanced call: its ``cost`` (patches or pixels), the bytes of
    its input rows (every field) and output rows (every output tensor), and of those
    the bytes gradients carry back (floating outputs; inputs that require grad)."""

    cost: int
    input_bytes: int
    output_bytes: int
    output_grad_bytes: int = 0
    input_grad_bytes: int = 0


@dataclass(frozen=True)
class BalancedCall:
    """One rank's call of the balanced tower at path ``tower``: its ``spec`` (pickled into
    the metadata; ranks calling together share it), ``items`` in call order and the
    tensors of the tower's output. A *joined* module's call (``joined=True``) has no
    items; ``blob_bytes`` is its description's size (``describe_call``)."""

    tower: str
    spec: CallSpec
    items: tuple[ItemSizes, ...]
    output_tensors: int = 1
    joined: bool = False
    blob_bytes: int = 0

    def payload(self) -> int:
        """Words of its item table and blob in the round's metadata.

        Returns:
            The words (``payload_ints``).
        """
        if self.joined:
            return payload_ints(0, self.blob_bytes)
        return payload_ints(len(self.items), len(pickle.dumps(self.spec)))


@dataclass(frozen=True)
class StepMedia:
    """The balanced calls of one training step: ``ranks[r]`` is rank ``r``'s calls of
    balanced towers and joined modules in forward order (one entry per rank of the
    balance group), ``rank`` the rank whose collectives are predicted, ``layers`` what
    each rank does with the joined decoder layers."""

    ranks: tuple[tuple[BalancedCall, ...], ...]
    rank: int = 0
    #: Per rank, per joined decoder layer (the hook's order), its call's ``describe_call``
    #: (``b""``: the rank skips it); empty: every rank runs every joined layer.
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
        """Every rank makes the same calls (what the fake process group runs).

        Args:
            calls: each rank's calls.
            world_size: the ranks of the balance group.
            rank: the rank whose collectives are predicted.
            layers: each rank's joined decoder layers (as ``StepMedia.layers``' rows).

        Returns:
            The step's media.

        Raises:
            ValueError: ``world_size`` is not a positive int.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        return cls(
            ranks=tuple(tuple(calls) for _ in range(world_size)),
            rank=rank,
            layers=tuple(tuple(layers) for _ in range(world_size)) if layers else (),
        )

    def towers(self) -> tuple[str, ...]:
        """The tower paths the calls name.

        Returns:
            The paths, in first-call order.
        """
        seen: dict[str, None] = {}
        for calls in self.ranks:
            for call in calls:
                seen.setdefault(call.tower, None)
        return tuple(seen)


Member = BalancedTower | JoinedModule


def _rounds(
    media: StepMedia, members: Sequence[Member]
) -> list[tuple[list[BalancedCall | None], str]]:
    """The step's rounds as the exchange runs them: per round each rank's pending call
    (``None``: it joins) and the module run (the lowest called in the hook's order)."""
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

    def sizes(name: str) -> list[list[int]]:
        return [[getattr(item, name) for item in group] for group in items]

    return call_traffic(
        sizes("cost"),
        rank=rank,
        input_bytes=sizes("input_bytes"),
        output_bytes=sizes("output_bytes"),
        output_grad_bytes=sizes("output_grad_bytes") if tower.trainable or inputs_grad else None,
        input_grad_bytes=sizes("input_grad_bytes") if inputs_grad else None,
        output_tensors=tensors,
        run_when_empty=tower.run_when_empty,
    )


@dataclass(frozen=True)
class CallBuffers:
    """What one of this rank's balanced calls moves, for the memory model: input and
    output bytes sent and received, input and output bytes of the items it keeps, and
    output gradient bytes sent and received (``None`` without that exchange)."""

    inputs: tuple[int, int]
    outputs: tuple[int, int]
    kept: tuple[int, int]
    grads: tuple[int, int] | None


def call_buffers(
    media: StepMedia, tower: BalancedTower, members: Sequence[Member]
) -> list[CallBuffers | None]:
    """What each call ``media.rank`` makes of ``tower`` moves.

    Args:
        media: the step's media.
        tower: the balanced tower.
        members: the hook's balanced towers and joined modules, in its order.

    Returns:
        Per call, in order, its buffers (``None``: nothing is exchanged).
    """
    result: list[CallBuffers | None] = []
    for calls, chosen in _rounds(media, members):
        own = calls[media.rank]
        if chosen != tower.path or own is None or own.tower != tower.path:
            continue
        traffic = _subcall_traffic(calls, rank=media.rank, tower=tower)
        a2a = [c for c in traffic if c.kind == "all_to_all"]
        if not a2a:
            result.append(None)
            continue
        inputs, outputs = a2a[0], a2a[1]  # what leaves of its own, what comes back
        result.append(
            CallBuffers(
                inputs=(inputs.sent, inputs.received),
                outputs=(outputs.sent, outputs.received),
                kept=(
                    sum(item.input_bytes for item in own.items) - inputs.sent,
                    sum(item.output_bytes for item in own.items) - outputs.received,
                ),
                grads=next(((c.sent, c.received) for c in a2a if c.phase == "backward"), None),
            )
        )
    return result


def module_runs(media: StepMedia, path: str, members: Sequence[Member]) -> int:
    """How often the balanced or joined module at ``path``, when it owns FSDP units,
    runs on each rank in the step (its units' collectives repeat that often).

    Args:
        media: the step's media.
        path: the module's path.
        members: the hook's balanced towers and joined modules, in its order.

    Returns:
        The rounds that run it in which some rank has an item of it or calls it.
    """
    count = 0
    for heads, chosen in _rounds(media, members):
        if chosen != path:
            continue
        mine = [call for call in heads if call is not None and call.tower == path]
        if any(call.joined or call.items for call in mine):
            count += 1
    return count


def layer_runs(media: StepMedia, index: int) -> int:
    """Whether the ``index``-th joined decoder layer runs on every rank in the step.

    Args:
        media: the step's media.
        index: the layer's position in the hook's order.

    Returns:
        1 when some rank runs it (the others on a placeholder), else 0.
    """
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
    """The collectives ``media.rank`` runs in one step's exchanges: each round, the join
    barrier's last round, and the joined decoder layers' decisions (with the shapes'
    all_reduce where some ranks skip a layer), counted as
    [`fsdp_core.CommCounter`][fsdp_core.collective_count.CommCounter] counts them.

    Args:
        media: the step's media.
        towers: the balanced towers, in the hook's order.
        world_size: the ranks of the balance group.
        joined: the joined modules, after the towers.
        layers: the joined decoder layers.

    Returns:
        The tally.

    Raises:
        TypeError: ``media`` is not a ``StepMedia``.
        ValueError: ``media`` describes another number of ranks, or names a tower the
            plan does not balance.
    """
    if not isinstance(media, StepMedia):
        raise TypeError(f"media must be a StepMedia, got {type(media).__name__}")
    if media.world_size != world_size:
        raise ValueError(
            f"media describes {media.world_size} ranks but the plan is costed on {world_size}; "
            "give one entry per rank of the balance group"
        )
    members: list[Member] = [*towers, *joined]
    by_path = {member.path: member for member in members}
    unknown = [path for path in media.towers() if path not in by_path]
    if unknown:
        raise ValueError(
            f"media names towers {unknown} that the plan does not balance; balanced towers: "
            f"{sorted(by_path)}"
        )
    tally = CommTally()
    for heads, chosen in _rounds(media, members):  # per round its metadata, then its call
        _tally(tally, metadata_traffic([c.payload() if c is not None else 0 for c in heads]))
        member = by_path[chosen]
        if isinstance(member, BalancedTower):  # a joined module's call exchanges nothing
            _tally(tally, _subcall_traffic(heads, rank=media.rank, tower=member))
    if members:
        _tally(tally, metadata_traffic([0] * world_size))
    for index in range(layers):
        tally.add("forward", "all_reduce", DECISION_BYTES)
        sizes = [len(row[index]) for row in media.layers] if media.layers else []
        if sizes and any(sizes) and not all(sizes):
            tally.add("forward", "all_reduce", blob_words(max(sizes)) * 8)
    return tally


def data_group_media(media: StepMedia, size: int) -> StepMedia:
    """``media`` as the rounds see it when data groups of ``size`` ranks share the
    encoding: each rank replaced by its data group's ranks, each with its share of every
    split call; the predicted rank is the first of ``media.rank``'s data group."""

    def share(call: BalancedCall, position: int) -> BalancedCall:
        items = call.items[slice(*share_of_position(len(call.items), position, size))]
        return call if call.joined else replace(call, items=items)

    ranks = [tuple(share(call, p) for call in calls) for calls in media.ranks for p in range(size)]
    layers = tuple(row for row in media.layers for _ in range(size))
    return StepMedia(ranks=tuple(ranks), rank=media.rank * size, layers=layers)


def data_group_tally(media: StepMedia, size: int, *, indexed: bool = False) -> CommTally:
    """The gathers within ``media.rank``'s data group of ``size`` ranks after its calls;
    ``indexed`` (CP): the header with the item masks, then the needed items' all_to_all."""
    tally = CommTally()
    kinds = ("all_gather", "all_to_all" if indexed else "all_gather")
    for call in media.ranks[media.rank]:
        if call.joined:
            continue
        outputs = [item.output_bytes for item in call.items]
        sizes = gathered_bytes(outputs, size, indexed=indexed)
        for kind, nbytes in zip(kinds[: len(sizes)], sizes, strict=True):
            tally.add("forward", kind, nbytes)
    return tally


def shares_encoding(planned: BalancePlanned, data_group: int, *, indexed: bool = False) -> bool:
    """Whether the data groups of ``data_group`` ranks share the encoding: more than one
    rank, no balanced module sharded on a data-group dimension (its TP collectives need
    the same items on the group's ranks), and with CP (``indexed``) nothing trainable
    (a CP rank needs the gradients of the items it reads)."""
    trainable = any(t.trainable for t in planned.towers) or any(m.trainable for m in planned.joined)
    return data_group != 1 and not planned.sharded_on_data_group and not (indexed and trainable)


def planned_tally(
    planned: BalancePlanned,
    media: StepMedia | None,
    *,
    world_size: int,
    dp_replicate: int,
    data_group: int = 1,
    indexed: bool = False,
) -> CommTally:
    """The ``balance_media`` hook's collectives in one step on ``world_size`` ranks: the
    exchange of the step's media, or without media the joined layers' decisions alone.
    ``data_group``: the ranks holding each data-parallel rank's batch (TP x CP); when they
    share the encoding, the rounds run over their shares and each group gathers."""
    layers = len(planned.layers) if world_size > 1 else 0
    if media is None:
        tally = CommTally()
        for _ in range(layers):  # the joined layers' decisions, whatever the media
            tally.add("forward", "all_reduce", DECISION_BYTES)
        return tally
    size = group_size(planned.group, world_size, dp_replicate)
    shared = shares_encoding(planned, data_group, indexed=indexed)
    tally = exchange_tally(
        data_group_media(media, data_group) if shared else media,
        planned.towers,
        world_size=size * data_group if shared else size,
        joined=planned.joined,
        layers=layers,
    )
    if shared:
        tally.merge(data_group_tally(media, data_group, indexed=indexed))
    return tally


def planned_runs(planned: BalancePlanned, media: StepMedia | None) -> dict[str, int]:
    """Per balanced tower or joined module that owns units, and per joined decoder layer,
    how often it runs in the step's media; empty without media (each runs once)."""
    if media is None:
        return {}
    members: tuple[Member, ...] = (*planned.towers, *planned.joined)
    runs = {
        tower.path: module_runs(media, tower.path, members)
        for tower in planned.towers
        if tower.run_when_empty
    }
    runs.update(
        {module.path: module_runs(media, module.path, members) for module in planned.joined}
    )
    runs.update({path: layer_runs(media, i) for i, path in enumerate(planned.layers)})
    return runs
