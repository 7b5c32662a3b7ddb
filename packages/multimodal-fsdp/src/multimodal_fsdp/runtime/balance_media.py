"""Balanced media (``MultimodalParallelizer(balance_media=True)``): each tower call of a
training forward is spread over the data-parallel ranks.

Without it the rank with the most images sets every step's pace, and a tower that owns
FSDP units makes ranks with different media issue different collectives. Each call of
a balanced tower runs through
[`balanced_call`][multimodal_fsdp.balance.exchange.balanced_call] over the mesh's ranks,
and every rank joins the calls it does not make
([`join_remaining_calls`][multimodal_fsdp.balance.exchange.join_remaining_calls]) at the
*join site*: a forward pre-hook on the first decoder unit (or the end of the forward)
that adds the joined calls' zero anchors to its hidden states, so every rank runs the
exchange's backward collectives in the same order.

A call is balanced inside the planned model's forward (not in a backward's recomputation)
and, for a tower that owns units, also in eval and in ``generate()`` (a rank with nothing
to encode runs a placeholder: ``run_when_empty``); other towers only in training
forwards. The hook is the instance ``forward`` of the tower's outermost wrapper (its
``checkpoint_wrapper``, so a checkpoint recomputes what the rank ran), so its class and
module hooks are untouched.
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

#: Bytes one rank puts into the last round of the join barrier (one slot gather).
BARRIER_BYTES = SLOT_INTS * 8

#: The named balance groups (``balance_media_group=``); a positive int is a block size.
#: ``"auto"``, the default, is a block size from the data-parallel size
#: (``auto_group_size``), or every rank where a balanced module owns units.
BALANCE_GROUPS = ("auto", "all", "shard", "replicate")


def check_balance_group(value: object) -> str | int:
    """``value`` as a balance group: one of ``BALANCE_GROUPS`` or a positive block size.

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
    """One process group over every rank of ``mesh`` (collective over the mesh's ranks)."""
    if mesh.ndim == 1:
        return mesh.get_group(0)
    return _group_over(sorted(int(r) for r in mesh.mesh.flatten().tolist()))


def _group_over(ranks: list[int]) -> Any:
    """The default group when ``ranks`` are every rank, else a new group of them."""
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks=ranks, use_local_synchronization=True)


def balance_group_ranks(mesh_ranks: Sequence[Sequence[int]], spec: str | int) -> list[list[int]]:
    """The balance groups of a data-parallel mesh: ``"all"`` every rank; ``"shard"`` each
    row (one replica); ``"replicate"`` each column; an int ``k`` blocks of ``k``
    consecutive ranks; ``"auto"`` blocks of ``auto_group_size`` ranks.

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
    rows: list[list[int]] = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()
    return rows


def _group_of(mesh: DeviceMesh, spec: str | int) -> tuple[Any, int]:
    """This rank's balance group on ``mesh`` (collective over its ranks) and its size."""
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
    """The ``balance_media`` runtime hook. Plan data: the balanced towers, the join site
    (``""``: the end of the forward), the joined projectors and decoder layers, the
    balance group, and the modules sharded on a data-group dimension (whose data group
    then runs the same items instead of sharing the encoding)."""

    name: ClassVar[str] = BALANCE_MEDIA
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
        """The hook balancing ``towers`` of ``plan``, each with the layout the plan-time
        probe chose. The join site is the first non-root unit outside ``media_only``;
        ``"auto"`` becomes ``"all"`` when a balanced module owns units (every rank must
        join their gathers).

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
                planned.append(
                    BalancedTower(
                        path=target,
                        layout=choice.layout.name,
                        run_when_empty=any(is_under(member, target) for member in members),
                        trainable=_trainable(model, target),
                        probe=choice.describe(),
                    )
                )
        index = {name: i for i, (name, _) in enumerate(model.named_modules())}
        candidates = [p for p in members if not any(is_under(p, m) for m in media_only)]
        join_site = min(candidates, key=index.__getitem__, default="")
        joined_modules = tuple(
            JoinedModule(path=path, trainable=_trainable(model, path))
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
        """The plan's cost line: collectives per tower call, joined module and layer, and
        the join barrier's last round.

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
        """``clause`` where the ranks of a data group share the encoding, else nothing."""
        return clause if shares_encoding(self, 2) else ""

    def collectives(self, step: HookStep) -> CommTally:
        """The exchange's rounds, the join barrier and the joined layers' decisions for
        the step's media; without media, the joined layers' decisions alone."""
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
        """How often each balanced or joined module with units runs in the step's media."""
        return planned_runs(self, _media(step))

    def replay_layers(self, model: nn.Module, media: StepMedia) -> JoinedLayers | None:
        """The joined layers on a one-process copy of the model (the memory trace), each
        decision read from ``media.layers`` instead of a collective.

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
        """Which towers are balanced (layouts), what is joined, and where.

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
        """Refuse a balance group smaller than the data-parallel ranks when a balanced or
        joined module's units communicate beyond it.

        Args:
            mesh: the data-parallel mesh the hook is installed on.

        Raises:
            ValueError: naming the module and the group to use.
        """
        rows = _mesh_rows(mesh)
        groups = balance_group_ranks(rows, self.group)
        if len(groups) == 1:
            return
        # Frozen units gather over a replica's row: fine when each row lies in one group.
        rows_fit = all(any(set(row) <= set(group) for group in groups) for row in rows)
        modules = [
            *((t.path, t.trainable, t.run_when_empty) for t in self.towers),
            *((m.path, m.trainable, True) for m in self.joined),
        ]
        bad = [path for path, trainable, units in modules if units and (trainable or not rows_fit)]
        if bad:
            raise ValueError(
                f"balance_media_group={self.group!r} balances within {len(groups)} groups, but "
                f"{bad} own FSDP units that communicate beyond a group (a group without media "
                "would skip their collectives); use balance_media_group='all', keep those "
                "modules without units (frozen_multimodal_sharding='root' or 'replicate'), or "
                "on an HSDP mesh freeze them and balance within 'shard'"
            )

    def install(self, model: nn.Module, *, dims: ParallelDims) -> BalanceMedia:
        """Balances within groups of ``dims.batch_mesh``; the ranks of a TP/CP data group
        each bring a share of every call, so each image is encoded once."""
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


def _trainable(model: nn.Module, path: str) -> bool:
    return any(p.requires_grad for p in model.get_submodule(path).parameters())


def _data_group_size(dims: ParallelDims | None) -> int:
    """The ranks of a data group (TP x CP) of ``dims``; 1 on a data-parallel mesh."""
    if dims is None:
        return 1
    return math.prod(dims.size(name) for name in dims.data_group_names)


def _data_group(dims: ParallelDims, hook: BalanceMediaRuntimeHook) -> DataGroup | None:
    """This rank's data group when its ranks share the encoding (collective over it)."""
    ranks = tuple(sorted(dims.data_group_ranks()))
    if not shares_encoding(hook, len(ranks), indexed=bool(dims.cp_names)):
        return None
    group = dist.new_group(ranks=list(ranks), use_local_synchronization=True)
    position = ranks.index(dist.get_rank())
    return DataGroup(group=group, ranks=ranks, position=position, indexed=bool(dims.cp_names))


def _data_groups(dims: ParallelDims) -> list[list[int]]:
    """Every data group (TP x CP ranks) of the job's mesh, as sorted global ranks."""
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
    """The group of this rank's balance group plus its members' data groups, and its size."""
    me = dist.get_rank()
    mine = next(g for g in balance_group_ranks(_mesh_rows(mesh), spec) if me in g)
    spanned = sorted(r for group in _data_groups(dims) if set(group) & set(mine) for r in group)
    return _group_over(spanned), len(spanned)


def _media(step: HookStep) -> StepMedia | None:
    """The step's media, checked: a ``StepMedia`` or none."""
    if step.media is not None and not isinstance(step.media, StepMedia):
        raise TypeError(f"media must be a StepMedia, got {type(step.media).__name__}")
    return step.media
