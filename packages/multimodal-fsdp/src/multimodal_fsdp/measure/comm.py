"""The measured counterpart of [`multimodal_fsdp.estimate.costs`][multimodal_fsdp.estimate.costs]:
count a real step.

[`measure_step`][multimodal_fsdp.measure.comm.measure_step] runs one step of a sharded
model inside [`fsdp_core.CommCounter`][fsdp_core.collective_count.CommCounter], tagging
each collective with its phase. [`measure_plan`][multimodal_fsdp.measure.comm.measure_plan]
costs a plan, shards the model under the fake process group (or the initialised one), runs
the step and compares: under the fake group the values are meaningless, but the
collectives and their sizes are exactly those of a real job.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import CommCounter, ShardingPlan, build_mesh
from fsdp_core.collective_count import CommTally
from fsdp_core.collective_entry import enter_collective
from fsdp_core.fake_group import current_or_fake_group
from fsdp_core.mesh import MeshShape, resolve_mesh_shape
from fsdp_core.parallel_dims import ParallelDims
from fsdp_core.parallelizer import apply_plan
from multimodal_fsdp.estimate.costs import PlanCosts
from multimodal_fsdp.estimate.exchange import LossFn, StepMedia, step_media
from multimodal_fsdp.estimate.predict import inspect_model
from multimodal_fsdp.runtime.prefetch_guard import (
    backward_prefetch_guard,
    remove_backward_prefetch_guard,
)

__all__ = [
    "Comparison",
    "Measurement",
    "MeasuredStep",
    "compare",
    "measure_plan",
    "measure_step",
    "measured_shape",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeasuredStep:
    """Collectives of one measured step, and the units the prefetch guard kept sharded."""

    comm: CommTally
    blocked_units: tuple[str, ...] = ()


def measure_step(model: nn.Module, loss_fn: LossFn, *, steps: int = 1) -> MeasuredStep:
    """Run ``steps`` forward+backward passes of a sharded ``model``; count the last one.

    Args:
        model: The sharded model.
        loss_fn: Runs the forward of one batch and returns the scalar loss.
        steps: Passes in all; the earlier ones only warm up (their gradients accumulate,
            which does not change the collectives).

    Returns:
        The last pass's collectives and the units the prefetch guard kept sharded.

    Raises:
        TypeError: ``loss_fn`` is not callable or returns no scalar tensor.
        ValueError: ``steps`` is not a positive int.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    for _ in range(steps - 1):
        torch.autograd.backward(loss_fn(model))
    counter = CommCounter()
    with counter:
        with counter.phase("forward"):
            loss = loss_fn(model)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("loss_fn must return a scalar tensor (the loss of one batch)")
        with counter.phase("backward"):
            torch.autograd.backward(loss)
    guard = backward_prefetch_guard(model)
    blocked = tuple(guard.blocked_units()) if guard is not None else ()
    return MeasuredStep(comm=counter.tally(), blocked_units=blocked)


@dataclass(frozen=True)
class Comparison:
    """Expected (analytic) against measured collectives, per phase and kind."""

    expected: CommTally
    measured: CommTally

    @property
    def matches(self) -> bool:
        return self.expected == self.measured

    def differences(self) -> list[str]:
        """What differs.

        Returns:
            One line per differing (phase, kind), empty when they match.
        """
        return self.expected.differences(self.measured)

    def format(self) -> str:
        """Both tallies side by side.

        Returns:
            A table, one row per (phase, kind) seen on either side, with the bytes
            received beside an ``all_to_all``'s.
        """
        plan, seen = self.expected, self.measured
        head = ("phase", "kind", "plan", "measured", "plan B", "measured B")
        lines = ["{:<9} {:<15} {:>6} {:>9} {:>12} {:>12}".format(*head)]
        for key in CommTally(counts={**plan.counts, **seen.counts}).pairs():
            got = (seen.counts.get(key, 0), seen.nbytes.get(key, 0))
            cells: list[tuple[str, int | str, int, int | str, int]] = [
                (key[1], plan.counts.get(key, 0), plan.nbytes.get(key, 0), *got)
            ]
            if key in plan.received or key in seen.received:
                received = (plan.received.get(key, 0), seen.received.get(key, 0))
                cells.append((f"{key[1]} recv", "", received[0], "", received[1]))
            for label, n0, b0, n1, b1 in cells:
                mark = "" if (n0, b0) == (n1, b1) else "  <-- differs"
                lines.append(f"{key[0]:<9} {label:<15} {n0:>6} {n1:>9} {b0:>12} {b1:>12}{mark}")
        return "\n".join(lines)


def compare(expected: CommTally | PlanCosts, measured: CommTally | MeasuredStep) -> Comparison:
    """The plan's (or a tally's) collectives against a measured step's.

    Args:
        expected: The costs, or their tally.
        measured: The measured step, or its tally.

    Returns:
        The comparison.
    """
    return Comparison(
        expected=expected.comm if isinstance(expected, PlanCosts) else expected,
        measured=measured.comm if isinstance(measured, MeasuredStep) else measured,
    )


@dataclass(frozen=True)
class Measurement:
    """One plan, costed and measured."""

    plan: ShardingPlan
    costs: PlanCosts
    measured: MeasuredStep
    comparison: Comparison = field(repr=False)

    @property
    def matches(self) -> bool:
        return self.comparison.matches


def measured_shape(
    world_size: int,
    *,
    mesh: DeviceMesh | None,
    dp_dims: str | Sequence[str] | None,
    dp_replicate: int = 1,
) -> tuple[ParallelDims | None, MeshShape]:
    """The caller's mesh and the data-parallel shape a measurement shards over.

    Args:
        world_size: Ranks of the job.
        mesh: The caller's mesh, or ``None``.
        dp_dims: The mesh's data-parallel dimensions, as ``parallelize`` takes them.
        dp_replicate: HSDP replicas of ``world_size`` without a mesh.

    Returns:
        ``mesh`` as ``ParallelDims`` (``None`` without one), and its data-parallel shape,
        else ``world_size`` ranks with ``dp_replicate`` replicas.

    Raises:
        ValueError: ``world_size`` is not the mesh's number of ranks.
    """
    if mesh is None:
        return None, resolve_mesh_shape(world_size=world_size, dp_replicate=dp_replicate)
    dims = ParallelDims.from_mesh(mesh, dp_dims=dp_dims)
    if dims.world_size != world_size:
        raise ValueError(
            f"world_size={world_size} does not match the mesh ({dims.describe()}: "
            f"{dims.world_size} ranks)"
        )
    return dims, dims.dp_shape


def measure_plan(
    plan: ShardingPlan,
    model: nn.Module,
    loss_fn: LossFn,
    *,
    world_size: int,
    dp_replicate: int = 1,
    prefetch_guard: bool = True,
    no_backward: Iterable[str] | None = None,
    steps: int = 1,
    media: StepMedia | None = None,
    mesh: DeviceMesh | None = None,
    dp_dims: str | Sequence[str] | None = None,
) -> Measurement:
    """Cost ``plan``, apply it to ``model`` (sharded in place, from the plan alone: see
    [`fsdp_core.parallelizer.apply_plan`][fsdp_core.parallelizer.apply_plan]) and run
    one step, under the initialised process group or else a fake one of ``world_size``.

    Args:
        plan: The plan.
        model: The model it was made for (on meta, or real).
        loss_fn: Runs the forward of one batch and returns the scalar loss.
        world_size: Ranks of the job.
        dp_replicate: HSDP replicas of ``world_size`` (without ``mesh``).
        prefetch_guard: ``False`` removes the guard after sharding, to show what FSDP2
            does by default.
        no_backward: Module paths no gradient reaches, for the costs.
        steps: Steps run; the last is counted.
        media: The step's media for balanced towers (default: ``loss_fn``'s batch on
            every rank, as the fake group runs it; real ranks may give their own).
        mesh: A mesh the caller built under the initialised group (e.g. with TP).
        dp_dims: ``mesh``'s data-parallel dimensions, as ``parallelize`` takes them.

    Returns:
        The plan, its costs, the measured step and their comparison.
    """
    estimate = {"prefetch_guard": prefetch_guard, "no_backward": no_backward, "optimizer": None}
    with _costed_and_sharded(
        "measure_plan",
        plan,
        model,
        loss_fn,
        media=media,
        estimate=estimate,
        world_size=world_size,
        dp_replicate=dp_replicate,
        mesh=mesh,
        dp_dims=dp_dims,
    ) as costs:
        if not prefetch_guard:
            remove_backward_prefetch_guard(model)
        measured = measure_step(model, loss_fn, steps=steps)
    comparison = compare(costs, measured)
    if not comparison.matches:
        logger.warning(
            "plan and measurement differ for %s:\n%s",
            type(model).__name__,
            "\n".join(comparison.differences()),
        )
    return Measurement(plan=plan, costs=costs, measured=measured, comparison=comparison)


@contextlib.contextmanager
def _costed_and_sharded(
    name: str,
    plan: ShardingPlan,
    model: nn.Module,
    loss_fn: LossFn,
    *,
    media: StepMedia | None,
    estimate: dict[str, Any],
    world_size: int,
    dp_replicate: int,
    mesh: DeviceMesh | None,
    dp_dims: str | Sequence[str] | None,
) -> Iterator[PlanCosts]:
    """Under the initialised or a fake group: cost ``plan`` (``inspect_model(**estimate)``),
    apply it to ``model``, yield the costs."""
    dims, dp = measured_shape(world_size, mesh=mesh, dp_dims=dp_dims, dp_replicate=dp_replicate)
    with current_or_fake_group(world_size):
        # Collective on a real group: every rank arrives, and a failure while costing
        # on one rank is raised on all (no-ops under the fake group).
        call = enter_collective(name)
        if mesh is None:
            mesh = build_mesh(dp_replicate=dp.dp_replicate, dp_shard=dp.dp_shard)
        # the balance group is the data-parallel one: FSDP's shard dimension holds CP's
        cp = 1 if dims is None else dims.role_size("cp")

        def prepare() -> PlanCosts:
            rank = dist.get_rank() if dist.is_initialized() else 0
            group = dp.world_size // cp
            costed = step_media(plan, model, loss_fn, world_size=group, rank=rank, media=media)
            return inspect_model(
                plan, model, mesh=dp if dims is None else dims, media=costed, **estimate
            )

        costs = call.run(prepare, step="costing the plan")
        apply_plan(model, plan, mesh=mesh, dp_dims=dp_dims)
        yield costs
