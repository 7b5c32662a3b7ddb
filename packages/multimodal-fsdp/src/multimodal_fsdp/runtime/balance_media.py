"""Balanced media: each tower call of a training forward is spread over every
data-parallel rank (``MultimodalParallelizer(balance_media=True)``).

Without it, the rank with the most images sets the pace of every step, and a tower
that owns FSDP units makes ranks with different media issue different collectives.
This hook runs each call of a balanced tower through
[`balanced_call`][multimodal_fsdp.balance.exchange.balanced_call] over all ranks of the
mesh (both dimensions of an HSDP mesh, one flattened group made once at install), and
makes every rank join the calls it does not make itself
([`join_remaining_calls`][multimodal_fsdp.balance.exchange.join_remaining_calls]) at the
*join site*: just before the first decoder unit runs (a forward pre-hook that runs
before FSDP's own), with the zero anchors of the calls it joined and made added to
that unit's hidden states, so every rank runs the exchange's backward collectives, in
the same order, even where its loss reads none of a call's outputs. A model without
such a unit joins at the end of its forward instead.

When a call is balanced (the same decision on every rank):

- inside the forward of the model the plan was applied to, not inside a backward
  (activation-checkpoint recomputation runs the tower locally);
- a tower that owns FSDP units (``per_layer``, a trainable tower): in every such
  forward, training or not, since a local run under uneven media would issue
  different collectives on different ranks; on a rank that gets nothing to encode it
  runs on a placeholder whose output counts zero (``run_when_empty``);
- any other tower: in training forwards only (``model.training`` and grad mode on).
  Eval and ``generate()`` run it locally, as without balancing: nothing can hang there
  and the exchange would only add latency.

Tower calls outside the model's forward (a tower called by hand) run locally, with
one exception: a ``generate()`` call of the model (or of the model inside it, as
``PeftModel`` calls) is one balanced scope for towers that own units. The image
features ``generate()`` computes before its first forward are balanced calls, which
the other ranks join at the join site of that forward (or when ``generate`` returns):
run locally under uneven media, such a tower would issue its units' collectives on
some ranks only (a mismatched collective).

The hook is the tower's instance ``forward`` (its class is never changed, so code that
keys on it, such as transformers' output capture, keeps working): the tower's own
``__call__`` and its module hooks run once per call on the calling rank, and a rank that
joins runs the tower through ``__call__`` too.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import ShardingPlan
from fsdp_core.collective_count import CommTally
from fsdp_core.containers import is_under
from fsdp_core.internals import GRAPH_TASK, Probe
from fsdp_core.runtime import HookStep, RuntimeHook
from multimodal_fsdp.balance._data_group import HEADER_INTS, DataGroup
from multimodal_fsdp.balance._planned import (
    AUTO_GROUP_RANKS,
    BALANCE_MEDIA,
    DECISION_BYTES,
    BalancedTower,
    JoinedModule,
    auto_group_size,
    sharded_on_data_group,
)
from multimodal_fsdp.balance._step_media import (
    StepMedia,
    planned_runs,
    planned_tally,
    shares_encoding,
)
from multimodal_fsdp.balance.targets import balance_targets
from multimodal_fsdp.balance.traffic import SLOT_INTS
from multimodal_fsdp.runtime._balance_installed import BalanceMedia
from multimodal_fsdp.runtime.joined_layers import JoinedLayers

if TYPE_CHECKING:
    from fsdp_core.parallel_dims import ParallelDims

__all__ = [
    "BalancedTower",
    "JoinedModule",
    "BalanceMedia",
    "BalanceMediaRuntimeHook",
    "AUTO_GROUP_RANKS",
    "BALANCE_GROUPS",
    "balance_group_ranks",
    "check_balance_group",
]

logger = logging.getLogger(__name__)

NAME = BALANCE_MEDIA

#: Bytes one rank puts into the last round of the join barrier (one slot gather).
BARRIER_BYTES = SLOT_INTS * 8

#: The named balance groups (``balance_media_group=``); a positive int is a block size.
#: ``"auto"``, the default, is a block size from the data-parallel size
#: (``auto_group_size``), or every rank where a balanced module owns units.
BALANCE_GROUPS = ("auto", "all", "shard", "replicate")


def check_balance_group(value: object) -> str | int:
    """``value`` as a balance group: one of ``BALANCE_GROUPS`` or a positive int (blocks of
    that many consecutive data-parallel ranks); a TypeError/ValueError otherwise.

    Args:
        value: the ``balance_media_group`` option.

    Returns:
        The checked value.

    Raises:
        TypeError: ``value`` is neither a string nor an int.
        ValueError: an unknown name or a non-positive int.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(
            f"balance_media_group must be a str or an int, got {type(value).__name__}; valid "
            f"choices: {list(BALANCE_GROUPS)} or a positive block size"
        )
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"balance_media_group must be a positive block size, got {value}")
        return value
    if value not in BALANCE_GROUPS:
        raise ValueError(
            f"unknown balance_media_group {value!r}; valid choices: {list(BALANCE_GROUPS)} "
            "or a positive block size"
        )
    return value


def _balanced_group(mesh: DeviceMesh) -> Any:
    """One process group over every rank of ``mesh`` (collective over the mesh's ranks):
    the mesh's own group when it has one dimension, the default group when the mesh
    covers the world, else a new group of the mesh's ranks (public API)."""
    if mesh.ndim == 1:
        return mesh.get_group(0)
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks=ranks, use_local_synchronization=True)


def balance_group_ranks(mesh_ranks: Sequence[Sequence[int]], spec: str | int) -> list[list[int]]:
    """The balance groups of a data-parallel mesh given as its rows of ranks (one row per
    replica of an HSDP mesh, one row for a 1-D mesh), as lists of global ranks:
    ``"all"`` every rank; ``"shard"`` each row (the ranks that shard one replica);
    ``"replicate"`` each column (the ranks holding the same shard); an int ``k`` blocks
    of ``k`` consecutive ranks in row order (``k`` must divide the ranks); ``"auto"``
    blocks of ``auto_group_size`` ranks (every rank up to ``AUTO_GROUP_RANKS``).

    Args:
        mesh_ranks: the data-parallel mesh's ranks, one row per replica.
        spec: the checked ``balance_media_group``.

    Returns:
        The groups, each a list of global ranks.

    Raises:
        ValueError: a block size does not divide the ranks.
    """
    flat = [int(r) for row in mesh_ranks for r in row]
    if spec == "auto":
        spec = auto_group_size(len(flat))
    if spec == "all" or spec == len(flat):
        return [flat]
    if spec == "shard":
        return [[int(r) for r in row] for row in mesh_ranks]
    if spec == "replicate":
        return [[int(row[c]) for row in mesh_ranks] for c in range(len(mesh_ranks[0]))]
    if not isinstance(spec, int) or len(flat) % spec:
        raise ValueError(
            f"balance_media_group={spec!r} must divide the {len(flat)} data-parallel ranks"
        )
    return [flat[i : i + spec] for i in range(0, len(flat), spec)]


def _mesh_rows(mesh: DeviceMesh) -> list[list[int]]:
    ranks = mesh.mesh.tolist()
    if mesh.ndim == 1:
        return [[int(r) for r in ranks]]
    return [[int(r) for r in row] for row in ranks]


def _group_of(mesh: DeviceMesh, spec: str | int) -> tuple[Any, int]:
    """This rank's balance group on ``mesh`` (collective over the group's ranks) and its
    size: the mesh's flattened group for ``"all"``, the mesh dimension's group for
    ``"shard"``/``"replicate"`` of an HSDP mesh, else a new group of this rank's block."""
    groups = balance_group_ranks(_mesh_rows(mesh), spec)
    if len(groups) == 1:
        return _balanced_group(mesh), len(groups[0])
    if mesh.ndim == 2 and spec in ("shard", "replicate"):
        return mesh.get_group(1 if spec == "shard" else 0), len(groups[0])
    me = dist.get_rank()
    mine = next(g for g in groups if me in g)
    return dist.new_group(ranks=mine, use_local_synchronization=True), len(mine)


@dataclass(frozen=True)
class BalanceMediaRuntimeHook(RuntimeHook):
    """The ``balance_media`` runtime hook; its plan data: the balanced towers (path,
    layout, whether each owns units and is trainable), the join site (the module
    whose forward pre-hook joins the calls a rank does not make; ``""``: the end of
    the model's forward), the joined modules (projectors with units of their own), the
    joined decoder layers (media-dependent layers that are units,
    ``multimodal_fsdp.runtime.joined_layers``), the balance group (``"auto"``,
    ``"all"``, ``"shard"``, ``"replicate"`` or a block size: see ``balance_group_ranks``)
    and the balanced towers and joined modules whose parameters are sharded on a
    data-group dimension (``sharded_on_data_group``: then the ranks of a data group run
    the same items, the group does not share the encoding)."""

    name: ClassVar[str] = NAME
    reads: ClassVar[tuple[Probe, ...]] = (GRAPH_TASK,)

    towers: tuple[BalancedTower, ...]
    join_site: str
    joined: tuple[JoinedModule, ...] = ()
    layers: tuple[str, ...] = ()
    group: str | int = "all"
    sharded_on_data_group: tuple[str, ...] = ()

    @classmethod
    def from_plan(
        cls,
        model: nn.Module,
        plan: ShardingPlan,
        *,
        towers: Sequence[str],
        media_only: Sequence[str],
        joined: Sequence[str] = (),
        layers: Sequence[str] = (),
        group: str | int = "auto",
    ) -> BalanceMediaRuntimeHook:
        """The hook balancing ``towers`` of ``plan``: each tower's layout, chosen by the
        plan-time probe (a tower no layout fits, itself or through the encoders it
        calls, is a ValueError naming it and how to register an adapter),
        whether it owns units of ``plan`` and has trainable parameters, and the join site:
        the first non-root unit, in the model's registration order, outside
        ``media_only`` (towers, projectors, decoder layers that run only with media).
        Of ``joined`` (projectors) those that own units of ``plan`` are joined modules,
        of ``layers`` (media-dependent decoder layers) those that are units. ``group``
        ``"auto"`` becomes ``"all"`` when a balanced tower or joined module owns units
        (they gather over every rank, so every rank must join their calls). A tower or
        joined module whose parameters are DTensors on a TP or CP dimension (the caller
        tensor-parallelised it) is recorded in ``sharded_on_data_group``: the ranks of a
        data group then run the same items (``shares_encoding``).

        Args:
            model: the planned model.
            plan: the finished plan.
            towers: the discovered towers' paths.
            media_only: the paths of modules that run only with media.
            joined: the projectors' paths.
            layers: the media-dependent decoder layers' paths.
            group: the ``balance_media_group`` option.

        Returns:
            The hook with its plan data.

        Raises:
            ValueError: a tower has no layout that fits it.
        """
        members = [path for unit in plan.units if not unit.is_root for path in unit.paths]
        planned = []
        for path in towers:
            try:
                targets = balance_targets(model, path, members)
            except ValueError as error:
                raise ValueError(
                    f"balance_media=True cannot balance tower {path!r}: {error}"
                ) from None
            for target, choice in targets:
                module = model.get_submodule(target) if target else model
                planned.append(
                    BalancedTower(
                        path=target,
                        layout=choice.layout.name,
                        run_when_empty=any(is_under(member, target) for member in members),
                        trainable=any(p.requires_grad for p in module.parameters()),
                        probe=choice.describe(),
                    )
                )
        index = {name: i for i, (name, _) in enumerate(model.named_modules())}
        candidates = [p for p in members if not any(is_under(p, m) for m in media_only)]
        join_site = min(candidates, key=index.__getitem__, default="")
        joined_modules = tuple(
            JoinedModule(
                path=path,
                trainable=any(
                    p.requires_grad
                    for p in (model.get_submodule(path) if path else model).parameters()
                ),
            )
            for path in joined
            if any(is_under(member, path) for member in members)
        )
        spec = check_balance_group(group)
        if spec == "auto" and (joined_modules or any(t.run_when_empty for t in planned)):
            spec = "all"  # their units gather over every rank: see check_group
        return cls(
            towers=tuple(planned),
            join_site=join_site,
            joined=joined_modules,
            layers=tuple(path for path in layers if path in members),
            group=spec,
            sharded_on_data_group=sharded_on_data_group(
                model, [*towers, *(m.path for m in joined_modules)]
            ),
        )

    def cost(self) -> str:
        """The plan's cost line: the collectives of one call of each tower (from
        ``exchange_traffic``), the joined modules and layers, and the join barrier's last
        round per forward.

        Returns:
            The line.
        """
        parts = []
        for tower in self.towers:
            counts = tower.collectives_per_call()
            backward = counts.get("backward all_to_all", 0)
            extra = " (+1 when inputs need a gradient)" if backward else ""
            parts.append(
                f"{tower.path!r} per call: {counts.get('forward all_gather', 0)} all_gathers "
                f"and {counts.get('forward all_to_all', 0)} all_to_all in forward when items "
                f"move (1 all_gather when every item stays home), {backward} all_to_all in "
                f"backward{extra}"
            )
        for module in self.joined:
            parts.append(
                f"{module.path!r} (joined) per call: 1 all_gather; ranks without the call run "
                "it on a placeholder"
            )
        if self.layers:
            parts.append(
                f"{len(self.layers)} joined decoder layers: 1 all_reduce of {DECISION_BYTES} "
                "bytes each per forward (+1 carrying the call's shapes when some ranks skip "
                "one that others run)"
            )
        return (
            "; ".join(parts)
            + f"; per forward one more all_gather of {BARRIER_BYTES} bytes per rank "
            "(the join barrier's last round)"
            + self._data_group_clause(
                "; on a mesh with TP or CP ranks the rounds span the balance group's data "
                "groups, and after each call of at least as many items as a data group has "
                f"ranks, 2 all_gathers on the data group ({HEADER_INTS} int64 per rank, "
                "then the shares' outputs padded to the longest); with CP, after every call "
                f"a header of {HEADER_INTS + 1} + items int64 per rank (each rank's item "
                "mask) and, on a split call, an all_to_all of the items each rank needs"
            )
        )

    def _data_group_clause(self, clause: str) -> str:
        """``clause`` where the ranks of a data group would share the encoding (on TP
        always, on CP with frozen towers and joined modules), else nothing."""
        return clause if shares_encoding(self, 2) else ""

    def collectives(self, step: HookStep) -> CommTally:
        """The hook's cost model: with the step's media (a
        [`StepMedia`][multimodal_fsdp.estimate.exchange.StepMedia]), the exchange of every
        round, the join barrier's last round and the joined layers' decisions, for
        ``media.rank``; without, the joined layers' decisions alone (the rest depends on
        the media)."""
        cp = 1 if step.parallel is None else step.parallel.role_size("cp")
        return planned_tally(
            self,
            _media(step),
            world_size=step.world_size // cp,  # FSDP's shard dimension holds CP's ranks
            dp_replicate=step.mesh.dp_replicate,
            data_group=_data_group_size(step.parallel),
            indexed=cp > 1,  # CP ranks name their items: a header mask, an all_to_all
        )

    def unit_runs(self, step: HookStep) -> Mapping[str, int]:
        """How often each balanced tower with units, joined module and joined layer runs
        in the step's media (its units' collectives repeat that often); empty without
        media."""
        return planned_runs(self, _media(step))

    def replay_layers(self, model: nn.Module, media: StepMedia) -> JoinedLayers | None:
        """The joined layers on ``model``, a one-process copy (the memory model's trace):
        where ``media`` says this rank skips a layer that another rank runs, it runs the
        layer on the same placeholder as the step, each decision read from ``media.layers``
        instead of a collective; ``None`` without joined layers or layer media.

        Args:
            model: the one-process copy of the model.
            media: the step's media per rank.

        Returns:
            The installed joined layers, or None.
        """
        if not self.layers or not media.layers:
            return None
        rows = media.layers

        def agree(index: int, blob: bytes | None, _device: torch.device) -> bytes | None:
            ran = [row[index] for row in rows if row[index]]
            if not ran or all(row[index] for row in rows):
                return None
            return ran[0]

        return JoinedLayers(model, self.layers, None, lambda: True, agree=agree)

    def describe(self) -> str:
        """Which towers are balanced, with which layout, which modules and layers are
        joined, and where ranks join.

        Returns:
            The text.
        """
        towers = ", ".join(f"{t.path!r} ({t.layout})" for t in self.towers)
        where = f"before {self.join_site!r}" if self.join_site else "at the end of the forward"
        layouts = "; ".join(f"{t.path!r}: {t.probe}" for t in self.towers if t.probe)
        if self.group == "all":
            over = "all data-parallel ranks"
        elif self.group == "auto":
            over = f"groups of at most {AUTO_GROUP_RANKS} consecutive data-parallel ranks ('auto')"
        else:
            over = f"groups of data-parallel ranks ({self.group!r})"
        joined = ""
        if self.joined or self.layers:
            names = [repr(m.path) for m in self.joined] + [repr(p) for p in self.layers]
            joined = f"; joined by ranks without media: {', '.join(names)}"
        shared = self._data_group_clause(
            " (on a mesh with TP or CP ranks, with the ranks of their data groups, each "
            "bringing its share of every call: each item is encoded once)"
        )
        if self.sharded_on_data_group:
            shared = (
                f" (not shared with the TP or CP ranks of a data group: "
                f"{list(self.sharded_on_data_group)} have parameters sharded over it, whose "
                "collectives pair its ranks, so each of them runs the same items and their "
                "gradients are not summed over it)"
            )
        return (
            f"tower calls balanced over {over}{shared}: {towers}; ranks join the "
            f"calls they do not make {where}"
            + joined
            + (f"; layouts: {layouts}" if layouts else "")
        )

    def check_group(self, mesh: DeviceMesh) -> None:
        """A ValueError when the balance group is smaller than the data-parallel ranks
        and a balanced or joined module with units communicates beyond it: its units
        would gather on the ranks of a group with media and not on those of a group
        without (frozen units gather over the shard group, trainable ones also reduce
        over every replica).

        Args:
            mesh: the data-parallel mesh the hook is installed on.

        Raises:
            ValueError: naming the module and the group to use.
        """
        groups = balance_group_ranks(_mesh_rows(mesh), self.group)
        if len(groups) == 1:
            return
        rows = _mesh_rows(mesh)
        bad = []
        for path, trainable, units in [
            *((t.path, t.trainable, t.run_when_empty) for t in self.towers),
            *((m.path, m.trainable, True) for m in self.joined),
        ]:
            if not units:
                continue
            fits = not trainable and all(
                any(set(row) <= set(group) for group in groups) for row in rows
            )
            if not fits:
                bad.append(path)
        if bad:
            raise ValueError(
                f"balance_media_group={self.group!r} balances within {len(groups)} groups, but "
                f"{bad} own FSDP units that communicate beyond a group (a group without media "
                "would skip their collectives); use balance_media_group='all', keep those "
                "modules without units (frozen_multimodal_sharding='root' or 'replicate'), or "
                "on an HSDP mesh freeze them and balance within 'shard'"
            )

    def install(self, model: nn.Module, *, dims: ParallelDims) -> BalanceMedia:
        """Balances within groups of ``dims.batch_mesh``: the ranks that hold different
        batches (the data-parallel ranks, and with EP the ``ep`` ranks too). The ranks of
        a TP or CP group (a *data group*) hold the same one: each brings its share of
        every call and the rounds run over the balance group's data groups together, so
        each image is encoded once (``multimodal_fsdp.balance._data_group``; a trainable
        tower's gradients are then summed over the group by ``replica_grad_reduce``).
        With CP and a trainable tower or joined module each rank balances with its own
        data-parallel peers instead (same media, same route)."""
        mesh = dims.batch_mesh
        self.check_group(mesh)
        group, size = _group_of(mesh, self.group)
        data = _data_group(dims, self)
        if data is not None:
            group, size = _spanning(dims, mesh, self.group)
        hook = BalanceMedia(
            model,
            self.towers,
            self.join_site,
            group,
            joined=self.joined,
            layers=self.layers,
            layer_group=_balanced_group(mesh) if self.layers else None,
            data=data,
        )
        logger.info(
            "balance_media on %s over groups of %d ranks, joining at %s",
            [f"{t.path} ({t.layout})" for t in self.towers],
            size,
            self.join_site or "the end of the forward",
        )
        return hook


def _data_group_size(dims: ParallelDims | None) -> int:
    """The ranks of a data group (TP x CP) of ``dims``; 1 on a data-parallel mesh."""
    if dims is None:
        return 1
    return math.prod(dims.size(name) for name in dims.data_group_names)


def _data_group(dims: ParallelDims, hook: BalanceMediaRuntimeHook) -> DataGroup | None:
    """This rank's data group, when its ranks share the encoding (``shares_encoding``;
    collective over the data group)."""
    ranks = tuple(sorted(dims.data_group_ranks()))
    if not shares_encoding(hook, len(ranks), indexed=bool(dims.cp_names)):
        return None
    group = dist.new_group(ranks=list(ranks), use_local_synchronization=True)
    position = ranks.index(dist.get_rank())
    return DataGroup(group=group, ranks=ranks, position=position, indexed=bool(dims.cp_names))


def _data_groups(dims: ParallelDims) -> list[list[int]]:
    """Every data group of the job's mesh (global ranks, sorted): the ranks along its
    TP and CP dimensions at each coordinate of the others."""
    mesh = dims.mesh
    if mesh is None:  # pragma: no cover - a data group needs the job's mesh
        raise RuntimeError("balance_media: a data group without the job's mesh")
    names = list(dims.names)
    inner = [names.index(n) for n in dims.data_group_names]
    order = [i for i in range(len(names)) if i not in inner] + inner
    size = math.prod(dims.sizes[i] for i in inner)
    ranks = mesh.mesh.permute(order).reshape(-1, size)
    return [sorted(int(r) for r in row.tolist()) for row in ranks]


def _spanning(dims: ParallelDims, mesh: DeviceMesh, spec: str | int) -> tuple[Any, int]:
    """The process group of this rank's balance group together with the data groups of
    its members (collective over those ranks) and its size."""
    me = dist.get_rank()
    mine = next(g for g in balance_group_ranks(_mesh_rows(mesh), spec) if me in g)
    spanned = sorted(r for group in _data_groups(dims) if set(group) & set(mine) for r in group)
    if spanned == list(range(dist.get_world_size())):
        return dist.group.WORLD, len(spanned)
    return dist.new_group(ranks=spanned, use_local_synchronization=True), len(spanned)


def _media(step: HookStep) -> StepMedia | None:
    """The step's media, checked: a ``StepMedia`` or none."""
    if step.media is not None and not isinstance(step.media, StepMedia):
        raise TypeError(f"media must be a StepMedia, got {type(step.media).__name__}")
    return step.media
