"""Choose the frozen-tower policy of each frozen module from a per-rank memory budget.

Every frozen tower and projector may follow its own policy, so the chooser plans and costs
every combination (``len(policies) ** k`` plans for ``k`` frozen modules, at most
[`MAX_COMBINATIONS`][multimodal_fsdp.estimate.choose.MAX_COMBINATIONS]). Among those whose
predicted per-rank peak fits the budget, the one that communicates least wins (bytes, then
collectives, then the lower peak; ties go to the earlier policy in ``policies``), judged
on the whole plan as it will run.

Per module, ``replicate`` communicates nothing and keeps it whole; ``per_layer`` needs the
least memory and communicates most; ``root`` holds it gathered from the start of forward
to the end of the root's backward, so it wins when it fits and ``replicate`` does not
(large trainable embeddings beside a small batch). docs/memory.md has the numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core import ShardingPlan, mixed_precision_policy
from fsdp_core.mesh import MeshShape
from fsdp_core.sharding import check_reshard_after_forward
from fsdp_core.sizes import parse_size
from multimodal_fsdp.estimate.activations import ActivationTrace
from multimodal_fsdp.estimate.costs import PlanCosts, resolve_cost_mesh
from multimodal_fsdp.estimate.exchange import StepMedia
from multimodal_fsdp.estimate.memory import check_optimizer
from multimodal_fsdp.estimate.predict import inspect_model
from multimodal_fsdp.estimate.render import format_bytes
from multimodal_fsdp.model_discovery import Discovery
from multimodal_fsdp.policy import (
    FROZEN_POLICIES,
    VALID_FROZEN_MULTIMODAL_SHARDING,
    FrozenMultimodalSharding,
    FrozenPolicies,
    frozen_policy,
    normalize_frozen_multimodal_sharding,
)
from multimodal_fsdp.record import MultimodalRecord, PlannedPart, plan_record

__all__ = [
    "MAX_COMBINATIONS",
    "MemoryBudgetError",
    "PolicyCandidate",
    "PolicyChoice",
    "PolicyPlanner",
    "choose_frozen_policy",
]

logger = logging.getLogger(__name__)

#: The most plans one choice costs (3 policies for 4 frozen modules); each may
#: trace a step when a batch is given, so the search stays exhaustive but small.
MAX_COMBINATIONS: Final = 81


class PolicyPlanner(Protocol):
    """What the chooser needs of a parallelizer: plans of a model, and a copy with other
    frozen-tower policies (a ``MultimodalParallelizer`` is one). Everything else it
    reads from the plans' records."""

    def plan(
        self,
        model: nn.Module,
        *,
        mp_policy: MixedPrecisionPolicy | None = ...,
        reshard_after_forward: bool | int | None = ...,
    ) -> ShardingPlan:
        """Plan a model.

        Args:
            model: The model.
            mp_policy: The mixed-precision policy of every unit.
            reshard_after_forward: FSDP's setting for every unit.

        Returns:
            The plan, with its multimodal record.
        """
        ...

    def with_options(self, *, frozen_multimodal_sharding: str | Mapping[str, str]) -> PolicyPlanner:
        """A copy with other frozen-tower policies.

        Args:
            frozen_multimodal_sharding: One policy, or ``{path: policy}``.

        Returns:
            The copy.
        """
        ...


@runtime_checkable
class DiscoveringPlanner(PolicyPlanner, Protocol):
    """A planner that can discover a model once and plan it from that discovery (a
    ``MultimodalParallelizer`` is one): the chooser's many plans of one model then share
    one discovery."""

    def discover(self, model: nn.Module) -> Discovery: ...

    def plan(
        self,
        model: nn.Module,
        *,
        mp_policy: MixedPrecisionPolicy | None = ...,
        reshard_after_forward: bool | int | None = ...,
        discovery: Discovery | None = ...,
    ) -> ShardingPlan: ...


def _label(policies: Mapping[str, str], fallback: str) -> str:
    """The policy when every frozen module has the same one, else ``path=policy, ...``."""
    values = set(policies.values())
    if not values:
        return fallback
    if len(values) == 1:
        return next(iter(values))
    return ", ".join(f"{path}={policy}" for path, policy in policies.items())


@dataclass(frozen=True)
class PolicyCandidate:
    """One combination's predicted per-rank peak and communication per step.

    ``policies`` maps each frozen multimodal module to its policy (empty when the
    model has none); ``policy`` is that policy when all share one, else
    ``path=policy, ...``.
    """

    policy: str
    peak_bytes: int
    comm_bytes: int
    comm_count: int
    fits: bool
    policies: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The candidate, JSON-ready.

        Returns:
            Its fields by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PolicyChoice:
    """The chosen policies, their costs, every candidate and why.

    ``parallelizer`` is the given one with the chosen policies, ready to apply, and
    ``plan`` its plan (the one ``costs`` describe).
    """

    policy: str
    budget_bytes: int
    costs: PlanCosts
    candidates: tuple[PolicyCandidate, ...]
    notes: tuple[str, ...]
    policies: dict[str, str] = field(default_factory=dict)
    parallelizer: PolicyPlanner | None = None
    plan: ShardingPlan | None = None

    def as_dict(self) -> dict[str, Any]:
        """The choice, JSON-ready (the costs apart).

        Returns:
            The policies, the budget, every candidate and the notes."""
        return {
            "policy": self.policy,
            "policies": dict(self.policies),
            "budget_bytes": self.budget_bytes,
            "candidates": [c.as_dict() for c in self.candidates],
            "notes": list(self.notes),
        }


class MemoryBudgetError(ValueError):
    """No combination's predicted per-rank peak fits the budget.

    ``policy`` and ``policies`` are those of the smallest predicted peak.
    """

    def __init__(self, budget_bytes: int, smallest: PolicyCandidate, includes_act: bool) -> None:
        self.budget_bytes = budget_bytes
        self.smallest_peak_bytes = smallest.peak_bytes
        self.policy = smallest.policy
        self.policies = dict(smallest.policies)
        extra = "" if includes_act else " (activations not included: no batch given)"
        if len(set(smallest.policies.values())) > 1:
            given = f"policies {smallest.policies!r}"
        else:
            given = f"policy {smallest.policy!r}"
        super().__init__(
            f"no frozen-tower policy fits a per-rank budget of {format_bytes(budget_bytes)}: "
            f"the smallest predicted peak is {format_bytes(smallest.peak_bytes)} "
            f"({smallest.peak_bytes} B) with {given}{extra}; "
            "raise the budget, add ranks, or freeze or shard more"
        )


def _budget(value: int | str) -> int:
    if isinstance(value, str):
        return parse_size(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"budget must be a positive number of bytes or a size, got {value!r}")
    return value


def _policies(policies: Sequence[str]) -> tuple[FrozenMultimodalSharding, ...]:
    if isinstance(policies, str) or not policies:
        raise ValueError(
            f"policies must be a non-empty sequence of {VALID_FROZEN_MULTIMODAL_SHARDING}, "
            f"got {policies!r}"
        )
    return tuple(dict.fromkeys(normalize_frozen_multimodal_sharding(p) for p in policies))


def _combinations(
    frozen: list[PlannedPart], names: tuple[FrozenMultimodalSharding, ...]
) -> list[dict[str, FrozenMultimodalSharding]]:
    """Every assignment of ``names`` to the frozen modules; one policy for all when
    there is no frozen module (the plans are then the same)."""
    if not frozen:
        return [{} for _ in names]
    paths = [p.path for p in frozen]
    count = len(names) ** len(frozen)
    if count > MAX_COMBINATIONS:
        raise ValueError(
            f"{len(frozen)} frozen multimodal modules ({', '.join(map(repr, paths))}) under "
            f"{len(names)} policies are {count} plans to cost, more than the "
            f"{MAX_COMBINATIONS} the chooser searches; "
            "restrict policies (e.g. ('per_layer', 'replicate')) or choose per module by hand "
            "with frozen_multimodal_sharding={path: policy}"
        )
    return [
        dict(zip(paths, combo, strict=True))
        for combo in itertools.product(names, repeat=len(paths))
    ]


def _why_not(other: PolicyCandidate, chosen: PolicyCandidate) -> str:
    if not other.fits:
        return f"needs {format_bytes(other.peak_bytes)}, over the budget"
    if (other.comm_bytes, other.comm_count) != (chosen.comm_bytes, chosen.comm_count):
        return (
            f"fits ({format_bytes(other.peak_bytes)}) but communicates more "
            f"({format_bytes(other.comm_bytes)} in {other.comm_count} collectives)"
        )
    if other.peak_bytes != chosen.peak_bytes:
        return (
            f"fits with the same communication but a higher peak ({format_bytes(other.peak_bytes)})"
        )
    return "fits with the same communication and peak; the earlier policy in policies wins"


def _notes(
    chosen: PolicyCandidate,
    candidates: list[PolicyCandidate],
    frozen: list[PlannedPart],
    budget: int,
    balanced: bool,
) -> list[str]:
    fitting = sum(c.fits for c in candidates)
    scope = (
        f" ({fitting} of {len(candidates)} combinations over {len(frozen)} frozen modules fit)"
        if len(frozen) > 1
        else ""
    )
    lines = [
        f"policy {chosen.policy!r} chosen for a per-rank budget of {format_bytes(budget)}: "
        f"predicted peak {format_bytes(chosen.peak_bytes)}, "
        f"{format_bytes(chosen.comm_bytes)} in {chosen.comm_count} collectives per step, "
        f"the least communication among the policies that fit{scope}"
    ]
    if not frozen:
        lines.append("no frozen tower or projector: every policy plans the same")
        return lines
    by_combo = {tuple(c.policies.values()): c for c in candidates}
    mine = tuple(chosen.policies.values())
    context = " with the other modules as chosen" if len(frozen) > 1 else ""
    for index, part in enumerate(frozen):
        path = part.path
        # The same plan with only this module's policy changed.
        others = [
            (policy, by_combo[(*mine[:index], policy, *mine[index + 1 :])])
            for policy in dict.fromkeys(c.policies[path] for c in candidates)
            if policy != mine[index]
        ]
        why = (
            "the only policy that fits"
            if others and not any(other.fits for _, other in others)
            else "the least communication that fits"
        )
        lines.append(
            f"{part.role} {path!r} ({part.modality}): policy {mine[index]!r}, {why}{context}"
        )
        lines.extend(
            f"policy {policy!r} not chosen for {path!r}: {_why_not(other, chosen)}"
            for policy, other in others
        )
        if not balanced and not frozen_policy(mine[index]).uneven_media_safe:
            lines.append(
                f"policy {mine[index]!r} for {path!r} needs even media (every rank calls it "
                "the same number of times in each forward; otherwise every rank raises "
                "UnevenMediaError) or balance_media=True (CLI: --balance-media)"
            )
    return lines


def _check_planner(base: object) -> None:
    """The chooser calls only ``plan`` and ``with_options``; anything else fails here,
    before a plan is made."""
    if not all(callable(getattr(base, name, None)) for name in ("plan", "with_options")):
        raise TypeError(
            "parallelizer must plan models and take with_options(frozen_multimodal_sharding=...) "
            f"(e.g. a MultimodalParallelizer), got {type(base).__name__}"
        )


@dataclass(frozen=True)
class _Planning:
    """Every plan the chooser makes (the given parallelizer's first, then one per
    combination) with the same model, precision and resharding. The one place plans
    are made, so work that all of them share can be done once here."""

    base: PolicyPlanner
    model: nn.Module
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int | None
    #: The model's discovery, made once, when the planner can plan from one.
    discovery: Discovery | None = None

    def plan(
        self, option: str | Mapping[str, str] | None = None
    ) -> tuple[PolicyPlanner, ShardingPlan]:
        """The parallelizer with frozen-tower ``option`` (the given one when ``None``) and
        its plan of the model."""
        planner = (
            self.base
            if option is None
            else self.base.with_options(frozen_multimodal_sharding=option)
        )
        plan_with = planner.plan
        if self.discovery is not None and isinstance(planner, DiscoveringPlanner):
            plan_with = functools.partial(planner.plan, discovery=self.discovery)
        plan = plan_with(
            self.model, mp_policy=self.mp_policy, reshard_after_forward=self.reshard_after_forward
        )
        return planner, plan


def _first_record(planning: _Planning) -> MultimodalRecord:
    """The record of the given parallelizer's own plan: the frozen modules, the default
    policy and ``uneven_media`` the search starts from."""
    _, first = planning.plan()
    record = plan_record(first)
    if record is None:
        raise TypeError(
            f"{type(planning.base).__name__}'s plans carry no multimodal record; "
            "the chooser needs a MultimodalParallelizer (or a subclass)"
        )
    return record


def _uneven_media_safe(
    names: tuple[FrozenMultimodalSharding, ...], record: MultimodalRecord, base: PolicyPlanner
) -> tuple[tuple[FrozenMultimodalSharding, ...], str]:
    """``names`` less those the parallelizer refuses, and which were left out ("" when none).

    uneven_media=True refuses, for any module, a policy that makes units only ranks
    with media run (ranks may skip the tower), unless balance_media makes every rank
    join the towers' calls (balanced towers keep their units)."""
    unsafe = [n for n in names if not frozen_policy(n).uneven_media_safe]
    refuses = record.uneven_media and not getattr(base, "balance_media", False)
    left_out = ", ".join(unsafe) if refuses else ""
    if not left_out:
        return names, left_out
    kept = tuple(name for name in names if name not in unsafe)
    if not kept:
        safe = [n for n, p in FROZEN_POLICIES.items() if p.uneven_media_safe]
        raise ValueError(
            f"policies={names!r} but the parallelizer has uneven_media=True, which "
            f"refuses {left_out}; allow {' or '.join(map(repr, safe))}"
        )
    return kept, left_out


@dataclass(frozen=True)
class _Costed:
    """One combination costed: its candidate, and the costs, parallelizer and plan the
    choice hands back when it wins."""

    candidate: PolicyCandidate
    costs: PlanCosts
    planner: PolicyPlanner
    plan: ShardingPlan


def _cost_all(
    planning: _Planning,
    costing: Callable[..., PlanCosts],
    record: MultimodalRecord,
    frozen: list[PlannedPart],
    names: tuple[FrozenMultimodalSharding, ...],
    limit: int,
) -> list[_Costed]:
    """Every combination planned and costed (``costing(plan, policy=label)``), in
    ``_combinations`` order."""
    costed: list[_Costed] = []
    for index, assignment in enumerate(_combinations(frozen, names)):
        fallback = names[index] if not frozen else record.policies.default
        option = (
            FrozenPolicies(record.policies.default, tuple(assignment.items())).option()
            if assignment
            else fallback
        )
        planner, plan = planning.plan(option)
        label = _label(assignment, fallback)
        costs = costing(plan, policy=label)
        assert costs.memory is not None
        peak = costs.memory.peak_bytes
        candidate = PolicyCandidate(
            policy=label,
            peak_bytes=peak,
            comm_bytes=costs.comm.bytes(),
            comm_count=costs.comm.count(),
            fits=peak <= limit,
            policies=dict(assignment),
        )
        costed.append(_Costed(candidate, costs, planner, plan))
    return costed


def _best(candidates: list[PolicyCandidate], limit: int, traced: bool) -> int:
    """The index of the fitting candidate that communicates least (bytes, collectives,
    then peak; the earlier wins ties); MemoryBudgetError when none fits."""
    fitting = [i for i, c in enumerate(candidates) if c.fits]
    if not fitting:
        smallest = min(candidates, key=lambda c: (c.peak_bytes, c.comm_bytes, c.comm_count))
        raise MemoryBudgetError(limit, smallest, traced)
    c = candidates
    return min(fitting, key=lambda i: (c[i].comm_bytes, c[i].comm_count, c[i].peak_bytes, i))


def _choice(
    costed: list[_Costed],
    best: int,
    frozen: list[PlannedPart],
    limit: int,
    left_out: str,
    traced: bool,
    balanced: bool,
) -> PolicyChoice:
    """The winner with the notes that say why (and what a policy that is not safe under
    uneven media needs, unless ``balanced``), also put in front of its costs' notes."""
    candidates = [c.candidate for c in costed]
    chosen = costed[best]
    notes = _notes(chosen.candidate, candidates, frozen, limit, balanced)
    if left_out:
        notes.append(f"{left_out} left out: the parallelizer has uneven_media=True")
    if not traced:
        notes.append("peaks leave activations out (no batch given)")
    logger.info("%s", notes[0])
    costs = dataclasses.replace(chosen.costs, notes=(*notes, *chosen.costs.notes))
    return PolicyChoice(
        policy=chosen.candidate.policy,
        budget_bytes=limit,
        costs=costs,
        candidates=tuple(candidates),
        notes=tuple(notes),
        policies=dict(chosen.candidate.policies),
        parallelizer=chosen.planner,
        plan=chosen.plan,
    )


def choose_frozen_policy(
    model: nn.Module,
    budget: int | str,
    *,
    policies: Sequence[str] = VALID_FROZEN_MULTIMODAL_SHARDING,
    world_size: int | None = None,
    dp_replicate: int = 1,
    mesh: MeshShape | None = None,
    precision: str = "bf16",
    reduce_precision: str | None = "fp32",
    parallelizer: PolicyPlanner,
    reshard_after_forward: bool | int | None = None,
    prefetch_guard: bool = True,
    optimizer: str = "adamw",
    loss_fn: Callable[[nn.Module], torch.Tensor] | None = None,
    activations: ActivationTrace | int | None = None,
    media: StepMedia | None = None,
) -> PolicyChoice:
    """For each frozen tower and projector, the policy such that the whole plan
    communicates least while its predicted per-rank peak fits ``budget``.

    The frozen modules, the default policy and ``uneven_media`` are read from
    ``parallelizer``'s plan record; its per-module policies are replaced by the choice.
    With ``uneven_media=True`` (and no ``balance_media``) ``per_layer`` is never chosen.

    Args:
        model: The model (the meta device is enough without ``loss_fn``).
        budget: Bytes per rank, or a size such as ``"40GiB"``.
        policies: The policies to combine.
        world_size: Ranks of a data-parallel mesh; or give ``mesh``.
        dp_replicate: HSDP replicas of ``world_size``.
        mesh: The mesh shape.
        precision: The compute (all-gather) dtype.
        reduce_precision: The gradient reduction dtype.
        parallelizer: Plans each combination (with ``balance_media=True`` its exchange is
            counted in every plan, as ``inspect_model`` counts it).
        reshard_after_forward: FSDP's setting for every unit.
        prefetch_guard: Whether the prefetch guard is installed.
        optimizer: The optimizer whose state is counted.
        loss_fn: One batch's loss, its step traced for each combination.
        activations: Activations given instead (a trace or bytes); with neither, peaks
            leave them out and the notes say so.
        media: The step's media for balanced towers (default: ``loss_fn``'s batch).

    Returns:
        The chosen policies, their costs, every candidate and the notes that say why.

    Raises:
        MemoryBudgetError: nothing fits (it names the smallest peak and its policies).
        TypeError: ``parallelizer`` cannot plan or its plans carry no multimodal record.
        ValueError: more than ``MAX_COMBINATIONS`` plans, or an invalid argument.
    """
    limit = _budget(budget)
    names = _policies(policies)
    _check_planner(parallelizer)
    shape = resolve_cost_mesh(mesh, world_size, dp_replicate)
    check_reshard_after_forward(reshard_after_forward, shape.dp_shard)
    mp = mixed_precision_policy(precision, reduce_precision)
    found = None  # one discovery for every plan, when the planner can plan from one
    if isinstance(parallelizer, DiscoveringPlanner) and isinstance(model, nn.Module):
        found = parallelizer.discover(model)
    planning = _Planning(parallelizer, model, mp, reshard_after_forward, found)
    record = _first_record(planning)
    names, left_out = _uneven_media_safe(names, record, parallelizer)
    if loss_fn is not None and activations is not None:
        raise ValueError("give loss_fn (to trace activations) or activations, not both")
    check_optimizer(optimizer)
    frozen = [part for part in record.parts if part.frozen]
    costing = functools.partial(
        inspect_model,
        model=model,
        mesh=shape,
        prefetch_guard=prefetch_guard,
        optimizer=optimizer,
        loss_fn=loss_fn,
        activations=activations,
        precision=f"param={precision} reduce={reduce_precision}",
        media=media,
    )
    costed = _cost_all(planning, costing, record, frozen, names, limit)
    traced = activations is not None or loss_fn is not None
    best = _best([c.candidate for c in costed], limit, traced)
    balanced = bool(getattr(parallelizer, "balance_media", False))
    return _choice(costed, best, frozen, limit, left_out, traced, balanced)
