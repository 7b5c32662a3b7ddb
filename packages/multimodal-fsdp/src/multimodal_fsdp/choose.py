"""Choose the frozen-tower policy from a per-rank memory budget.

Every policy is planned and costed (:func:`~multimodal_fsdp.costs.inspect_model`
with its memory estimate); among those whose predicted per-rank peak fits the
budget, the one that communicates least per step wins (bytes, then number of
collectives). The parallelizer applies one policy to every frozen tower and
projector, so the choice is one policy for all frozen parts.

What to expect: ``replicate`` communicates nothing for frozen parts and keeps
them whole; ``root`` keeps them gathered (in the compute dtype) all step *and*
stores a shard, so it never needs less memory than ``replicate`` and never
communicates less: it is chosen only when ``replicate`` is left out of
``policies`` (e.g. when frozen weights must stay in FSDP's sharded state). ``per_layer``
needs the least memory and communicates the most.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_core import MeshShape
from multimodal_fsdp.activations import ActivationTrace
from multimodal_fsdp.costs import PlanCosts, format_bytes, inspect_model
from multimodal_fsdp.memory import parse_size
from multimodal_fsdp.parallelizer import MultimodalParallelizer
from multimodal_fsdp.policy import (
    VALID_FROZEN_MULTIMODAL_SHARDING,
    normalize_frozen_multimodal_sharding,
)

__all__ = [
    "MemoryBudgetError",
    "PolicyCandidate",
    "PolicyChoice",
    "choose_frozen_policy",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyCandidate:
    """One policy's predicted per-rank peak and communication per step."""

    policy: str
    peak_bytes: int
    comm_bytes: int
    comm_count: int
    fits: bool

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PolicyChoice:
    """The chosen policy, its costs, every candidate and why."""

    policy: str
    budget_bytes: int
    costs: PlanCosts
    candidates: tuple[PolicyCandidate, ...]
    notes: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "budget_bytes": self.budget_bytes,
            "candidates": [c.as_dict() for c in self.candidates],
            "notes": list(self.notes),
        }


class MemoryBudgetError(ValueError):
    """No policy's predicted per-rank peak fits the budget."""

    def __init__(self, budget_bytes: int, smallest: PolicyCandidate, includes_act: bool) -> None:
        self.budget_bytes = budget_bytes
        self.smallest_peak_bytes = smallest.peak_bytes
        self.policy = smallest.policy
        extra = "" if includes_act else " (activations not included: no batch given)"
        super().__init__(
            f"no frozen-tower policy fits a per-rank budget of {format_bytes(budget_bytes)}: "
            f"the smallest predicted peak is {format_bytes(smallest.peak_bytes)} "
            f"({smallest.peak_bytes} B) with policy {smallest.policy!r}{extra}; "
            "raise the budget, add ranks, or freeze or shard more"
        )


def _budget(value: int | str) -> int:
    if isinstance(value, str):
        return parse_size(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"budget must be a positive number of bytes or a size, got {value!r}")
    return value


def _policies(policies: Sequence[str]) -> tuple[str, ...]:
    if isinstance(policies, str) or not policies:
        raise ValueError(
            f"policies must be a non-empty sequence of {VALID_FROZEN_MULTIMODAL_SHARDING}, "
            f"got {policies!r}"
        )
    chosen = tuple(dict.fromkeys(normalize_frozen_multimodal_sharding(p) for p in policies))
    return chosen


def _candidate(policy: str, costs: PlanCosts, budget: int) -> PolicyCandidate:
    assert costs.memory is not None
    peak = costs.memory.peak_bytes
    return PolicyCandidate(
        policy=policy,
        peak_bytes=peak,
        comm_bytes=costs.comm.bytes(),
        comm_count=costs.comm.count(),
        fits=peak <= budget,
    )


def _notes(chosen: PolicyCandidate, candidates: list[PolicyCandidate], budget: int) -> list[str]:
    lines = [
        f"policy {chosen.policy!r} chosen for a per-rank budget of {format_bytes(budget)}: "
        f"predicted peak {format_bytes(chosen.peak_bytes)}, "
        f"{format_bytes(chosen.comm_bytes)} in {chosen.comm_count} collectives per step, "
        "the least communication among the policies that fit"
    ]
    for other in candidates:
        if other.policy == chosen.policy:
            continue
        if not other.fits:
            why = f"needs {format_bytes(other.peak_bytes)}, over the budget"
        else:
            why = (
                f"fits ({format_bytes(other.peak_bytes)}) but communicates more "
                f"({format_bytes(other.comm_bytes)} in {other.comm_count} collectives)"
            )
        lines.append(f"policy {other.policy!r} not chosen: {why}")
    return lines


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
    parallelizer: MultimodalParallelizer | None = None,
    reshard_after_forward: bool | int | None = None,
    prefetch_guard: bool = True,
    optimizer: str = "adamw",
    loss_fn: Callable[[nn.Module], torch.Tensor] | None = None,
    activations: ActivationTrace | int | None = None,
) -> PolicyChoice:
    """The frozen-tower policy with the least communication whose predicted per-rank
    peak fits ``budget`` (bytes, or a size such as ``"40GiB"``).

    Activations come from ``loss_fn`` (one step traced per policy, see
    :func:`~multimodal_fsdp.memory.trace_activations`), or ``activations``, or
    are left out (the notes say so). Raises :class:`MemoryBudgetError` naming the
    smallest achievable peak and its policy when nothing fits.
    """
    limit = _budget(budget)
    names = _policies(policies)
    base = parallelizer if parallelizer is not None else MultimodalParallelizer()
    if loss_fn is not None and activations is not None:
        raise ValueError("give loss_fn (to trace activations) or activations, not both")
    options: dict[str, Any] = {
        "world_size": world_size,
        "dp_replicate": dp_replicate,
        "mesh": mesh,
        "precision": precision,
        "reduce_precision": reduce_precision,
        "parallelizer": base,
        "reshard_after_forward": reshard_after_forward,
        "prefetch_guard": prefetch_guard,
        "optimizer": optimizer,
        "loss_fn": loss_fn,
    }
    costed: dict[str, PlanCosts] = {}
    for policy in names:
        costs = inspect_model(model, policy=policy, **options)
        if activations is not None and costs.memory is not None:
            costs = dataclasses.replace(costs, memory=costs.memory.with_activations(activations))
        costed[policy] = costs
    traced = activations is not None or loss_fn is not None
    candidates = [_candidate(p, costed[p], limit) for p in names]
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.peak_bytes)
        raise MemoryBudgetError(limit, smallest, traced)
    chosen = min(fitting, key=lambda c: (c.comm_bytes, c.comm_count))
    notes = _notes(chosen, candidates, limit)
    if not traced:
        notes.append("peaks leave activations out (no batch given)")
    logger.info("%s", notes[0])
    costs = costed[chosen.policy]
    costs = dataclasses.replace(costs, notes=(*notes, *costs.notes))
    return PolicyChoice(
        policy=chosen.policy,
        budget_bytes=limit,
        costs=costs,
        candidates=tuple(candidates),
        notes=tuple(notes),
    )
