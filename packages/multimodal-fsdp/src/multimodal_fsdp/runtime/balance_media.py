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
from collections.abc import Callable, Mapping, Sequence
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
from multimodal_fsdp.balance import (
    CallSpec,
    MediaLayout,
    balanced_call,
    exchange_traffic,
    join_remaining_calls,
    media_layout_for,
)
from multimodal_fsdp.balance.traffic import HEADER_INTS

__all__ = [
    "BalancedTower",
    "BalanceMedia",
    "BalanceMediaRuntimeHook",
]

logger = logging.getLogger(__name__)

NAME = "balance_media"

#: Bytes one rank puts into the last round of the join barrier (one header gather).
BARRIER_BYTES = HEADER_INTS * 8


@dataclass(frozen=True)
class BalancedTower:
    """One balanced tower as planned: its module path, the name of its layout adapter
    (``multimodal_fsdp.balance.media_layout_for``), whether it owns FSDP units (then it
    runs on a placeholder on a rank with nothing to encode, and is balanced in every
    forward), and whether it has trainable parameters (its output gradients go back
    through the exchange in backward)."""

    path: str
    layout: str
    run_when_empty: bool
    trainable: bool

    def collectives_per_call(self) -> dict[str, int]:
        """The collectives of one call with items on some rank, by phase and kind
        (``"forward all_gather"``, ``"forward all_to_all"``, ``"backward all_to_all"``), as
        [`exchange_traffic`][multimodal_fsdp.balance.traffic.exchange_traffic] counts them
        (backward: the output gradients of a trainable tower; inputs that need a
        gradient add one more)."""
        one = [[1], [1]]
        rounds = exchange_traffic(
            one,
            rank=0,
            spec=CallSpec(fields=("pixel_values",)),
            input_bytes=one,
            output_bytes=one,
            output_grad_bytes=one if self.trainable else None,
            output_tensors=1,
        )
        counts: dict[str, int] = {}
        for collective in rounds:
            key = f"{collective.phase} {collective.kind}"
            counts[key] = counts.get(key, 0) + 1
        return counts


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


def _add_anchor(value: Any, anchor: Tensor) -> tuple[Any, bool]:
    """``value`` with ``anchor`` added to its first floating tensor (walking tuples,
    lists and mappings); whether one was found."""
    if isinstance(value, Tensor):
        if value.is_floating_point():
            return value + anchor.to(device=value.device, dtype=value.dtype), True
        return value, False
    if isinstance(value, (tuple, list)):
        items = list(value)
        for index, item in enumerate(items):
            items[index], done = _add_anchor(item, anchor)
            if done:
                rebuilt = type(value)(items) if type(value) in (tuple, list) else items
                return rebuilt, True
        return value, False
    return value, False


def _add_to_outputs(output: Any, anchor: Tensor) -> Any:
    """``output`` with ``anchor`` added to every floating tensor in it (the end-of-forward
    join: whichever output the loss reads carries the anchor)."""
    if isinstance(output, Tensor):
        if output.is_floating_point():
            return output + anchor.to(device=output.device, dtype=output.dtype)
        return output
    if isinstance(output, Mapping):
        for key in list(output.keys()):
            try:
                output[key] = _add_to_outputs(output[key], anchor)  # type: ignore[index]
            except TypeError:
                return output  # an immutable mapping: leave it
        return output
    if isinstance(output, (tuple, list)) and type(output) in (tuple, list):
        return type(output)(_add_to_outputs(item, anchor) for item in output)
    return output


class BalanceMedia:
    """The installed hook: the balanced towers' forwards and the join site's pre-hook
    (see the module docstring). ``remove`` restores the towers' own forwards."""

    name: str = NAME

    def __init__(
        self, model: nn.Module, towers: tuple[BalancedTower, ...], join_site: str, group: Any
    ) -> None:
        self.towers = towers
        self.join_site = join_site
        self._group = group
        self._modules: list[tuple[nn.Module, BalancedTower, MediaLayout]] = []
        self._in_forward = 0
        self._training = False
        self._joined = True
        self._bypass = 0
        self._warned: set[str] = set()
        #: Calls balanced and calls joined in the last forward (for tests and benchmarks).
        self.last_calls = 0
        self.last_joined = 0
        #: This forward's balanced calls' zero anchors, added at the join site with the
        #: joined calls' ones: every rank then runs every exchange's backward, even when
        #: its loss reads none of a call's outputs.
        self._anchors: list[Tensor] = []
        found = []  # every check before anything is installed
        for tower in towers:
            module = model.get_submodule(tower.path)
            if "forward" in vars(module):
                raise ValueError(
                    f"balance_media: tower {tower.path!r} already has an instance forward "
                    "(another hook or a patch); it cannot be balanced"
                )
            found.append((module, tower, media_layout_for(module, name=tower.layout)))
        site = model.get_submodule(join_site) if join_site else None
        handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._start, prepend=True),
            model.register_forward_hook(self._end, always_call=True),
        ]
        if site is not None:
            handles.append(
                site.register_forward_pre_hook(self._join_hook, prepend=True, with_kwargs=True)
            )
        self._handles = handles
        for module, tower, layout in found:
            module.forward = self._balanced_forward(module, tower, layout)
            self._modules.append((module, tower, layout))
        #: Modules whose ``generate`` is wrapped: (module, instance attribute it replaced,
        #: the wrapper).
        self._generators: list[tuple[nn.Module, Any, Callable[..., Any]]] = []
        if any(tower.run_when_empty for tower in towers):
            for module in model.modules():
                if callable(getattr(type(module), "generate", None)):
                    self._wrap_generate(module)

    # ------------------------------------------------------------- decisions
    def _balances(self, tower: BalancedTower) -> bool:
        if not self._in_forward or self._joined or self._bypass or in_backward():
            return False
        return tower.run_when_empty or self._training

    def _start(self, module: nn.Module, _args: Any) -> None:
        self._in_forward += 1
        if self._in_forward == 1:
            self._training = module.training and torch.is_grad_enabled()
            self._joined = in_backward()
            self.last_calls = 0
            self.last_joined = 0
            self._anchors.clear()

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
        return _add_to_outputs(output, anchor)

    # --------------------------------------------------------------- calling
    def _balanced_forward(
        self, module: nn.Module, tower: BalancedTower, layout: MediaLayout
    ) -> Callable[..., Any]:
        original = module.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self._balances(tower):
                if self._in_forward and self._joined and tower.run_when_empty:
                    self._warn_late(tower)
                return original(*args, **kwargs)
            self.last_calls += 1
            return balanced_call(
                module,
                args,
                kwargs,
                layout=layout,
                group=self._group,
                run_when_empty=tower.run_when_empty,
                runner=original,
                anchors=self._anchors,
            )

        return forward

    def _warn_late(self, tower: BalancedTower) -> None:
        """A tower with units called after the join site (or in a recomputation): it
        runs locally, so ranks that do not call it there would hang."""
        if self._bypass or in_backward() or tower.path in self._warned:
            return
        self._warned.add(tower.path)
        logger.warning(
            "balance_media: tower %r was called after %s; it runs locally there, so every "
            "rank must make the same calls of it",
            tower.path,
            repr(self.join_site) if self.join_site else "the end of the forward",
        )

    def _runner(self, module: nn.Module) -> Callable[..., Any]:
        """The tower's call for a joining rank: through its ``__call__`` (its module hooks
        run as on a calling rank), not balanced again."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self._bypass += 1
            try:
                return module(*args, **kwargs)
            finally:
                self._bypass -= 1

        return run

    def _wrap_generate(self, module: nn.Module) -> None:
        """Make a ``module.generate(...)`` call one balanced scope (see the module
        docstring): towers with units are balanced until the join site of its first
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
        """Join every call other ranks still make, tower by tower; the summed anchor of
        the calls made and joined (``None`` when there were none or balancing is off in
        this forward)."""
        self._joined = True
        made, self._anchors = self._anchors, []
        if in_backward():
            return None
        total: Tensor | None = None
        for anchor in made:  # the calls this rank made
            total = anchor if total is None else total + anchor.to(total.device)
        for module, tower, layout in self._modules:
            if not (tower.run_when_empty or self._training):
                continue
            anchor, joined = join_remaining_calls(
                module,
                layout=layout,
                group=self._group,
                run_when_empty=tower.run_when_empty,
                runner=self._runner(module),
            )
            self.last_joined += joined
            if joined:
                total = anchor if total is None else total + anchor.to(total.device)
        return total

    def _join_hook(
        self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self._in_forward or self._joined:
            return None
        anchor = self._join_all()
        if anchor is None:
            return None
        new_args, done = _add_anchor(args, anchor)
        if done:
            return tuple(new_args), kwargs
        for key, value in kwargs.items():
            new_value, done = _add_anchor(value, anchor)
            if done:
                return args, {**kwargs, key: new_value}
        raise RuntimeError(
            f"balance_media: the join site {self.join_site!r} got no floating tensor input to "
            "carry the exchange's zero anchor; plan the hook with another join site"
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, _, _ in self._modules:
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
    layout, whether each owns units and is trainable) and the join site (the module
    whose forward pre-hook joins the calls a rank does not make; ``""``: the end of
    the model's forward)."""

    name: ClassVar[str] = NAME
    reads: ClassVar[tuple[Probe, ...]] = (GRAPH_TASK,)

    towers: tuple[BalancedTower, ...]
    join_site: str

    @classmethod
    def from_plan(
        cls,
        model: nn.Module,
        plan: ShardingPlan,
        *,
        towers: Sequence[str],
        media_only: Sequence[str],
    ) -> BalanceMediaRuntimeHook:
        """The hook balancing ``towers`` of ``plan``: each tower's layout (a tower no
        layout adapter understands is a ValueError naming it and how to register one),
        whether it owns units of ``plan`` and has trainable parameters, and the join site:
        the first non-root unit, in the model's registration order, outside
        ``media_only`` (towers, projectors, decoder layers that run only with media)."""
        members = [path for unit in plan.units if not unit.is_root for path in unit.paths]
        planned = []
        for path in towers:
            module = model.get_submodule(path) if path else model
            try:
                layout = media_layout_for(module)
            except ValueError as error:
                raise ValueError(
                    f"balance_media=True cannot balance tower {path!r}: {error}"
                ) from None
            planned.append(
                BalancedTower(
                    path=path,
                    layout=layout.name,
                    run_when_empty=any(is_under(member, path) for member in members),
                    trainable=any(p.requires_grad for p in module.parameters()),
                )
            )
        index = {name: i for i, (name, _) in enumerate(model.named_modules())}
        candidates = [p for p in members if not any(is_under(p, m) for m in media_only)]
        join_site = min(candidates, key=index.__getitem__, default="")
        return cls(towers=tuple(planned), join_site=join_site)

    def cost(self) -> str:
        """The plan's cost line: the collectives of one call of each tower (from
        ``exchange_traffic``) and the join barrier's last round per forward."""
        parts = []
        for tower in self.towers:
            counts = tower.collectives_per_call()
            backward = counts.get("backward all_to_all", 0)
            extra = " (+1 when inputs need a gradient)" if backward else ""
            parts.append(
                f"{tower.path!r} per call: {counts.get('forward all_gather', 0)} all_gathers "
                f"and {counts.get('forward all_to_all', 0)} all_to_all in forward, "
                f"{backward} all_to_all in backward{extra}"
            )
        return (
            "; ".join(parts)
            + f"; per forward and tower one more all_gather of {BARRIER_BYTES} bytes per rank "
            "(the join barrier's last round)"
        )

    def describe(self) -> str:
        """Which towers are balanced, with which layout, and where ranks join."""
        towers = ", ".join(f"{t.path!r} ({t.layout})" for t in self.towers)
        where = f"before {self.join_site!r}" if self.join_site else "at the end of the forward"
        return (
            f"tower calls balanced over all data-parallel ranks: {towers}; ranks join the "
            f"calls they do not make {where}"
        )

    def install(self, model: nn.Module, *, mesh: DeviceMesh) -> BalanceMedia:
        group = _balanced_group(mesh)
        hook = BalanceMedia(model, self.towers, self.join_site, group)
        logger.info(
            "balance_media on %s, joining at %s",
            [f"{t.path} ({t.layout})" for t in self.towers],
            self.join_site or "the end of the forward",
        )
        return hook
