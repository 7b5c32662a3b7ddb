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

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from fsdp_core import ShardingPlan
from fsdp_core.containers import is_under
from fsdp_core.internals import GRAPH_TASK, Probe, in_backward
from fsdp_core.runtime import RuntimeHook
from multimodal_fsdp.balance import CallSpec, MediaLayout, exchange_traffic, media_layout_for
from multimodal_fsdp.balance.exchange import Member, Rounds, Ticket
from multimodal_fsdp.balance.targets import balance_targets
from multimodal_fsdp.balance.traffic import SLOT_INTS
from multimodal_fsdp.runtime.joined_layers import (
    DECISION_BYTES,
    JoinedLayers,
    add_anchor,
    add_to_outputs,
)

__all__ = [
    "BalancedTower",
    "JoinedModule",
    "BalanceMedia",
    "BalanceMediaRuntimeHook",
    "BALANCE_GROUPS",
    "balance_group_ranks",
    "check_balance_group",
]

logger = logging.getLogger(__name__)

NAME = "balance_media"

#: Bytes one rank puts into the last round of the join barrier (one slot gather).
BARRIER_BYTES = SLOT_INTS * 8

#: The named balance groups (``balance_media_group=``); a positive int is a block size.
BALANCE_GROUPS = ("all", "shard", "replicate")


def check_balance_group(value: object) -> str | int:
    """``value`` as a balance group: one of ``BALANCE_GROUPS`` or a positive int (blocks of
    that many consecutive data-parallel ranks); a TypeError/ValueError otherwise."""
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


@dataclass(frozen=True)
class BalancedTower:
    """One balanced tower as planned: its module path, the name of its layout adapter
    (``multimodal_fsdp.balance.media_layout_for``), whether it owns FSDP units (then it
    runs on a placeholder on a rank with nothing to encode, and is balanced in every
    forward), whether it has trainable parameters (its output gradients go back
    through the exchange in backward), and what the plan-time probe found for the
    layout. The path is an encoder inside the discovered tower when the tower's own
    calls cannot be cut by item (``multimodal_fsdp.balance.targets``)."""

    path: str
    layout: str
    run_when_empty: bool
    trainable: bool
    #: What the plan-time probe found for the layout (``LayoutChoice.describe``).
    probe: str = ""

    def collectives_per_call(self) -> dict[str, int]:
        """The collectives of one call that moves items (every item staying home costs
        the slot gather alone), by phase and kind
        (``"forward all_gather"``, ``"forward all_to_all"``, ``"backward all_to_all"``), as
        [`exchange_traffic`][multimodal_fsdp.balance.traffic.exchange_traffic] counts them
        (backward: the output gradients of a trainable tower; inputs that need a
        gradient add one more)."""
        moved = [[1, 1], []]  # two items on one rank: one of them moves
        rounds = exchange_traffic(
            moved,
            rank=0,
            spec=CallSpec(fields=("pixel_values",)),
            input_bytes=moved,
            output_bytes=moved,
            output_grad_bytes=moved if self.trainable else None,
            output_tensors=1,
        )
        counts: dict[str, int] = {}
        for collective in rounds:
            key = f"{collective.phase} {collective.kind}"
            counts[key] = counts.get(key, 0) + 1
        return counts


@dataclass(frozen=True)
class JoinedModule:
    """A module with FSDP units of its own that only ranks with media call (a projector
    or connector with layers): its calls go through the rounds of the balanced towers,
    unbalanced, and a rank without the call runs it on a placeholder
    (``multimodal_fsdp.balance.placeholder``) in the same round, so its units' collectives
    match on every rank."""

    path: str
    trainable: bool


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
    of ``k`` consecutive ranks in row order (``k`` must divide the ranks)."""
    flat = [int(r) for row in mesh_ranks for r in row]
    if spec == "all":
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


def _balanced_modules(
    model: nn.Module, towers: Sequence[BalancedTower], joined: Sequence[JoinedModule]
) -> list[tuple[nn.Module, str, MediaLayout | None, bool]]:
    """Each balanced tower's and joined module's module, path, layout and whether it runs
    on a placeholder, every one checked before any is changed: a module that cannot be
    balanced leaves the model as it was."""
    found: list[tuple[nn.Module, str, MediaLayout | None, bool]] = []
    for tower in towers:
        module = model.get_submodule(tower.path)
        layout = media_layout_for(module, name=tower.layout)
        found.append((module, tower.path, layout, tower.run_when_empty))
    for item in joined:
        found.append((model.get_submodule(item.path), item.path, None, True))
    for module, path, _, _ in found:
        if "forward" in vars(module):
            raise ValueError(
                f"balance_media: module {path!r} already has an instance forward "
                "(another hook or a patch); it cannot be balanced"
            )
    return found


class BalanceMedia:
    """The installed hook: the balanced towers' and joined modules' forwards, the join
    site's pre-hook and the joined decoder layers (see the module docstring). ``remove``
    restores the modules' own forwards."""

    name: str = NAME

    def __init__(
        self,
        model: nn.Module,
        towers: tuple[BalancedTower, ...],
        join_site: str,
        group: Any,
        *,
        joined: tuple[JoinedModule, ...] = (),
        layers: tuple[str, ...] = (),
        layer_group: Any = None,
    ) -> None:
        """Check every module before changing any (a refusal leaves the model as it was),
        then install the model's start and end hooks, the join site's pre-hook, each
        member's round entry and forward, the joined layers and the ``generate`` scopes."""
        self.towers = towers
        self.joined = joined
        self.join_site = join_site
        self._group = group
        self._modules: list[tuple[nn.Module, Member]] = []
        self._in_forward = 0
        self._training = False
        self._joined = True
        self._bypass = 0
        self._warned: set[str] = set()
        #: Calls balanced and rounds joined in the last forward (for tests and benchmarks).
        self.last_calls = 0
        self.last_joined = 0
        #: This forward's balanced calls' zero anchors, added at the join site with the
        #: joined calls' ones: every rank then runs every exchange's backward, even when
        #: its loss reads none of a call's outputs.
        self._anchors: list[Tensor] = []
        found = _balanced_modules(model, towers, joined)
        site = model.get_submodule(join_site) if join_site else None
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._start, prepend=True),
            model.register_forward_hook(self._end, always_call=True),
        ]
        if site is not None:
            self._handles.append(
                site.register_forward_pre_hook(self._join_hook, prepend=True, with_kwargs=True)
            )
        #: Per member, the tickets of the calls its pre-hook brought to their round.
        self._tickets: list[list[Ticket]] = [[] for _ in found]
        members = [self._install_member(index, *entry) for index, entry in enumerate(found)]
        self._rounds = Rounds(members, group)
        self._layers = (
            JoinedLayers(
                model, layers, layer_group if layer_group is not None else group, self._live
            )
            if layers
            else None
        )
        #: Modules whose ``generate`` is wrapped: (module, instance attribute it replaced,
        #: the wrapper).
        self._generators: list[tuple[nn.Module, Any, Callable[..., Any]]] = []
        if any(member.run_when_empty for member in members) or layers:
            self._wrap_generators(model)

    def _install_member(
        self, index: int, module: nn.Module, path: str, layout: MediaLayout | None, empty: bool
    ) -> Member:
        """Send one module's calls through the rounds: its round entry runs before its
        own pre-forward hooks, so the round's metadata comes before FSDP's all-gather of
        a module that is a unit on every rank; its instance forward finishes the call."""
        original = module.forward
        kind = layout.name if layout is not None else "joined"
        member = Member(
            module=module,
            identity=f"{path}|{kind}",
            layout=layout,
            run_when_empty=empty,
            runner=original,
            joiner=self._runner(module),
        )
        self._modules.append((module, member))
        self._handles.append(
            module.register_forward_pre_hook(
                self._enter(index, member), prepend=True, with_kwargs=True
            )
        )
        module.forward = self._balanced_forward(module, index, member, path, original)
        return member

    def _wrap_generators(self, model: nn.Module) -> None:
        """Make every ``generate()`` of the model (the model's own, a wrapper's inside it)
        one balanced scope: the tower calls it makes before its first forward would
        otherwise run locally and issue their units' collectives on some ranks only."""
        for module in model.modules():
            if callable(getattr(type(module), "generate", None)):
                self._wrap_generate(module)

    # ------------------------------------------------------------- decisions
    def _live(self) -> bool:
        """Whether the model's forward (or a ``generate()`` call) is running."""
        return bool(self._in_forward)

    def _active(self, member: Member) -> bool:
        """Whether ``member``'s calls go through the rounds in this forward."""
        return member.run_when_empty or self._training

    def _balances(self, member: Member) -> bool:
        if not self._in_forward or self._joined or self._bypass or in_backward():
            return False
        return self._active(member)

    def _start(self, module: nn.Module, _args: Any) -> None:
        self._in_forward += 1
        if self._in_forward == 1:
            self._training = module.training and torch.is_grad_enabled()
            self._joined = in_backward()
            self.last_calls = 0
            self.last_joined = 0
            self._anchors.clear()
            if self._layers is not None:
                self._layers.last_joined = 0
                self._layers.last_decisions = 0

    def _end(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        self._in_forward = max(0, self._in_forward - 1)
        if sys.exc_info()[0] is not None:  # the forward raised: no collective after it
            self._joined = True
            return None
        if self._in_forward or self._joined:
            return None
        anchor = self._join_all()
        if anchor is None:
            return None
        return add_to_outputs(output, anchor)

    # --------------------------------------------------------------- calling
    def _enter(self, index: int, member: Member) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not self._balances(member):
                return
            ticket, anchors = self._rounds.enter(index, args, kwargs)
            self._anchors.extend(anchors)
            self._tickets[index].append(ticket)

        return hook

    def _balanced_forward(
        self,
        module: nn.Module,
        index: int,
        member: Member,
        path: str,
        original: Callable[..., Any],
    ) -> Callable[..., Any]:
        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            tickets = self._tickets[index]
            if self._bypass or not tickets:
                if self._in_forward and self._joined and member.run_when_empty:
                    self._warn_late(path)
                return original(*args, **kwargs)
            self.last_calls += 1
            output, anchor = self._rounds.finish(tickets.pop(), args, kwargs)
            if anchor is not None:
                self._anchors.append(anchor)
            return output

        return forward

    def _warn_late(self, path: str) -> None:
        """A module with units called after the join site (or in a recomputation): it
        runs locally, so ranks that do not call it there would hang."""
        if self._bypass or in_backward() or path in self._warned:
            return
        self._warned.add(path)
        logger.warning(
            "balance_media: module %r was called after %s; it runs locally there, so every "
            "rank must make the same calls of it",
            path,
            repr(self.join_site) if self.join_site else "the end of the forward",
        )

    def _runner(self, module: nn.Module) -> Callable[..., Any]:
        """The module's call for a rank without a call of its own in a round: through its
        ``__call__`` (its module hooks, FSDP's among them, run as on a calling rank), not
        balanced again."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self._bypass += 1
            try:
                return module(*args, **kwargs)
            finally:
                self._bypass -= 1

        return run

    def _wrap_generate(self, module: nn.Module) -> None:
        """Make a ``module.generate(...)`` call one balanced scope (see the module
        docstring): modules with units are balanced until the join site of its first
        forward, or until it returns; a nested call (``PeftModel.generate`` calling the
        wrapped model's) or one inside a forward runs as it is."""
        previous = vars(module).get("generate")
        original: Callable[..., Any] = module.generate  # type: ignore[assignment]

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            if self._in_forward or in_backward():
                return original(*args, **kwargs)
            self._in_forward = 1
            self._training = False
            self._joined = False
            self.last_calls = 0
            self.last_joined = 0
            try:
                output = original(*args, **kwargs)
            except BaseException:
                self._joined = True  # the call raised: no collective after it
                raise
            finally:
                self._in_forward = 0
            if not self._joined:
                self._join_all()
            return output

        object.__setattr__(module, "generate", generate)
        self._generators.append((module, previous, generate))

    # --------------------------------------------------------------- joining
    def _join_all(self) -> Tensor | None:
        """Join every round other ranks still run; the summed anchor of the calls made and
        joined (``None`` when there were none or no module is balanced in this forward)."""
        self._joined = True
        for tickets in self._tickets:
            tickets.clear()  # a call whose forward raised after its round
        made, self._anchors = self._anchors, []
        if in_backward():
            return None
        total: Tensor | None = None
        for anchor in made:  # the calls this rank made
            total = anchor if total is None else total + anchor.to(total.device)
        if not any(self._active(member) for _, member in self._modules):
            return total
        joined_anchor, joined = self._rounds.join()
        self.last_joined += joined
        if joined_anchor is not None:
            total = joined_anchor if total is None else total + joined_anchor.to(total.device)
        return total

    def _join_hook(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._in_forward or self._joined:
            return None
        anchor = self._join_all()
        if anchor is None:
            return None
        new_args, done = add_anchor(args, anchor)
        if done:
            return tuple(new_args), kwargs
        for key, value in kwargs.items():
            new_value, done = add_anchor(value, anchor)
            if done:
                return args, {**kwargs, key: new_value}
        raise RuntimeError(
            f"balance_media: the join site {self.join_site!r} got no floating tensor input to "
            "carry the exchange's zero anchor; plan the hook with another join site"
        )

    @property
    def layers_joined(self) -> int:
        """Media-dependent layers this rank ran on a placeholder in the last forward."""
        return 0 if self._layers is None else self._layers.last_joined

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._layers is not None:
            self._layers.remove()
        for module, _ in self._modules:
            vars(module).pop("forward", None)
        self._modules.clear()
        for module, previous, wrapper in self._generators:
            if vars(module).get("generate") is wrapper:  # not replaced or removed since
                if previous is None:
                    del vars(module)["generate"]
                else:
                    object.__setattr__(module, "generate", previous)
        self._generators.clear()


@dataclass(frozen=True)
class BalanceMediaRuntimeHook(RuntimeHook):
    """The ``balance_media`` runtime hook; its plan data: the balanced towers (path,
    layout, whether each owns units and is trainable), the join site (the module
    whose forward pre-hook joins the calls a rank does not make; ``""``: the end of
    the model's forward), the joined modules (projectors with units of their own), the
    joined decoder layers (media-dependent layers that are units,
    ``multimodal_fsdp.runtime.joined_layers``) and the balance group (``"all"``,
    ``"shard"``, ``"replicate"`` or a block size: see ``balance_group_ranks``)."""

    name: ClassVar[str] = NAME
    reads: ClassVar[tuple[Probe, ...]] = (GRAPH_TASK,)

    towers: tuple[BalancedTower, ...]
    join_site: str
    joined: tuple[JoinedModule, ...] = ()
    layers: tuple[str, ...] = ()
    group: str | int = "all"

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
        group: str | int = "all",
    ) -> BalanceMediaRuntimeHook:
        """The hook balancing ``towers`` of ``plan``: each tower's layout, chosen by the
        plan-time probe (a tower no layout fits, itself or through the encoders it
        calls, is a ValueError naming it and how to register an adapter),
        whether it owns units of ``plan`` and has trainable parameters, and the join site:
        the first non-root unit, in the model's registration order, outside
        ``media_only`` (towers, projectors, decoder layers that run only with media).
        Of ``joined`` (projectors) those that own units of ``plan`` are joined modules,
        of ``layers`` (media-dependent decoder layers) those that are units."""
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
        return cls(
            towers=tuple(planned),
            join_site=join_site,
            joined=joined_modules,
            layers=tuple(path for path in layers if path in members),
            group=check_balance_group(group),
        )

    def cost(self) -> str:
        """The plan's cost line: the collectives of one call of each tower (from
        ``exchange_traffic``), the joined modules and layers, and the join barrier's last
        round per forward."""
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
        )

    def describe(self) -> str:
        """Which towers are balanced, with which layout, which modules and layers are
        joined, and where ranks join."""
        towers = ", ".join(f"{t.path!r} ({t.layout})" for t in self.towers)
        where = f"before {self.join_site!r}" if self.join_site else "at the end of the forward"
        layouts = "; ".join(f"{t.path!r}: {t.probe}" for t in self.towers if t.probe)
        over = (
            "all data-parallel ranks"
            if self.group == "all"
            else f"groups of data-parallel ranks ({self.group!r})"
        )
        joined = ""
        if self.joined or self.layers:
            names = [repr(m.path) for m in self.joined] + [repr(p) for p in self.layers]
            joined = f"; joined by ranks without media: {', '.join(names)}"
        return (
            f"tower calls balanced over {over}: {towers}; ranks join the "
            f"calls they do not make {where}"
            + joined
            + (f"; layouts: {layouts}" if layouts else "")
        )

    def check_group(self, mesh: DeviceMesh) -> None:
        """A ValueError when the balance group is smaller than the data-parallel ranks
        and a balanced or joined module with units communicates beyond it: its units
        would gather on the ranks of a group with media and not on those of a group
        without (frozen units gather over the shard group, trainable ones also reduce
        over every replica)."""
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

    def install(self, model: nn.Module, *, mesh: DeviceMesh) -> BalanceMedia:
        self.check_group(mesh)
        group, size = _group_of(mesh, self.group)
        hook = BalanceMedia(
            model,
            self.towers,
            self.join_site,
            group,
            joined=self.joined,
            layers=self.layers,
            layer_group=_balanced_group(mesh) if self.layers else None,
        )
        logger.info(
            "balance_media on %s over groups of %d ranks, joining at %s",
            [f"{t.path} ({t.layout})" for t in self.towers],
            size,
            self.join_site or "the end of the forward",
        )
        return hook
