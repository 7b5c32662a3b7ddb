"""The measured counterpart of
[`multimodal_fsdp.estimate.memory`][multimodal_fsdp.estimate.memory]: bytes of a real
step, per rank.

[`measure_memory`][multimodal_fsdp.measure.memory.measure_memory] runs warm-up steps of a
sharded model, then one tracked step under torch's ``FSDPMemTracker``, which attributes
every storage to a category (parameters, all-gather buffers, gradients, activations,
temporaries, optimizer state); ignored (``replicate``) parameters are registered with it as
inputs and counted apart.
[`measure_plan_memory`][multimodal_fsdp.measure.memory.measure_plan_memory] predicts,
shards and measures a plan like
[`measure_plan`][multimodal_fsdp.measure.comm.measure_plan]. Only
[`memory_timeline_tracker`][fsdp_core.internals.torch_modules.memory_timeline_tracker]
touches the tracker's private module, and names what a torch without it lacks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from fsdp_core import ShardingPlan, internals
from fsdp_core.internals.torch_modules import memory_timeline_tracker
from fsdp_core.parallel_dims import local_shape
from multimodal_fsdp.estimate.costs import PlanCosts
from multimodal_fsdp.estimate.exchange import LossFn, StepMedia
from multimodal_fsdp.estimate.memory import check_optimizer, memory_figures
from multimodal_fsdp.measure.comm import _costed_and_sharded

__all__ = [
    "MeasuredMemory",
    "MemoryMeasurement",
    "MemoryPoint",
    "make_optimizer",
    "measure_memory",
    "measure_plan_memory",
]

logger = logging.getLogger(__name__)

# The tracker's category names (``_FSDPRefType`` values).
_SHARDED = "Sharded Param"
_UNSHARDED = "Unsharded Param"
_ALL_GATHER = "All Gather"
_GRAD = "Sharded Grad"
_OPT = "OptState"
_ACT = "Activation"
_TEMP = "Temp"
#: What a step holds beside parameters and optimizer state.
_WORKING = (_ACT, _TEMP, "Unsharded Grad", "Reduce Scatter", _GRAD)
_INPUTS = "Inputs"
_TOTAL = "Total"


def _new_tracker(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """An ``FSDPMemTracker`` that also records a timeline point whenever bytes change
    (its ``points``)."""
    points: list[MemoryPoint] = []

    def record(phase: str, snapshot: dict[torch.device, dict[str, int]]) -> None:
        snap = _cpu_or_first(snapshot)
        point = MemoryPoint(
            phase=phase,
            gathered_bytes=snap.get(_UNSHARDED, 0) + snap.get(_ALL_GATHER, 0),
            activation_bytes=sum(snap.get(key, 0) for key in _WORKING),
            total_bytes=snap.get(_TOTAL, 0),
        )
        if not points or points[-1] != point:
            points.append(point)

    tracker = memory_timeline_tracker(
        model, optimizer, on_change=record, user="multimodal_fsdp.measure.memory"
    )
    tracker.points = points
    return tracker


def _cpu_or_first(snapshot: dict[torch.device, dict[str, int]]) -> dict[str, int]:
    """The per-category bytes of the device a rank computes on: its accelerator when the
    snapshot has one (units offloaded to host memory add a CPU entry beside it, in no
    fixed order), else the CPU."""
    if not snapshot:
        return {}
    accelerators = [device for device in snapshot if torch.device(device).type != "cpu"]
    return snapshot[accelerators[0]] if accelerators else next(iter(snapshot.values()))


def _host_of(snapshot: dict[torch.device, dict[str, int]]) -> dict[str, int] | None:
    """The CPU's per-category bytes when the rank computes on an accelerator (what offloaded
    units keep in host memory); ``None`` on a CPU-only rank, where the two are one."""
    devices = [torch.device(device) for device in snapshot]
    if not any(device.type != "cpu" for device in devices):
        return None
    return next((v for d, v in snapshot.items() if torch.device(d).type == "cpu"), {})


def _module_snapshots(tracker: Any) -> Iterator[tuple[str, dict[str, int]]]:
    """(state name, bytes per category) of every snapshot taken at a unit boundary."""
    for stats in tracker.memory_tracking.values():
        for state, snaps in stats.snapshots.items():
            if str(state.value).startswith("Peak"):
                continue  # running maxima, not moments
            for snap in snaps:
                yield str(state.value), _cpu_or_first(snap)


@dataclass(frozen=True)
class MemoryPoint:
    """One moment of the tracked step: the phase, gathered parameter bytes, activations
    with temporaries and gradients, all bytes."""

    phase: str
    gathered_bytes: int
    activation_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class MeasuredMemory:
    """Measured bytes on this rank for one training step (the tracked one)."""

    optimizer: str
    sharded_param_bytes: int
    replicated_param_bytes: int
    #: Largest unsharded-parameter bytes at a unit boundary in forward.
    peak_gathered_forward_bytes: int
    #: Largest unsharded-parameter plus in-flight all-gather bytes at a unit boundary in backward.
    peak_gathered_backward_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    #: Activations alive when backward starts.
    activation_bytes: int
    #: Peak during backward of activations, temporaries and gradients (unsharded,
    #: reduce-scatter buffers, sharded).
    backward_activation_bytes: int
    #: The tracker's peak over the whole step, replicated parameters included.
    peak_bytes: int
    #: The peak broken down by the tracker's categories.
    peak_breakdown: tuple[tuple[str, int], ...] = ()
    timeline: tuple[MemoryPoint, ...] = field(default=(), repr=False)
    #: Sharded parameters in host memory (offloaded units) at rest; ``None`` on a CPU-only
    #: rank, where host and device memory are one and every figure above counts them.
    host_param_bytes: int | None = None
    #: Sharded gradients in host memory after backward (``None``: CPU-only rank).
    host_gradient_bytes: int | None = None
    #: Optimizer state in host memory after the step (``None``: CPU-only rank).
    host_optimizer_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """Every figure, JSON-ready.

        Returns:
            The figures, marked as measured, with the peak and its breakdown.
        """
        return {
            **memory_figures(self, source="measured"),
            "peak_bytes": self.peak_bytes,
            "peak_breakdown": dict(self.peak_breakdown),
            "host_param_bytes": self.host_param_bytes,
            "host_gradient_bytes": self.host_gradient_bytes,
            "host_optimizer_bytes": self.host_optimizer_bytes,
        }


def make_optimizer(
    name: str, params: Iterable[nn.Parameter], *, lr: float = 1e-3
) -> torch.optim.Optimizer | None:
    """The optimizer a name stands for.

    Args:
        name: A key of [`OPTIMIZER_STATES`][multimodal_fsdp.estimate.memory.OPTIMIZER_STATES].
        params: The parameters (only trainable ones are optimized).
        lr: The learning rate.

    Returns:
        The optimizer; ``None`` for ``"none"`` or when nothing is trainable.
    """
    check_optimizer(name)
    trainable = [p for p in params if p.requires_grad]
    if name == "none" or not trainable:
        return None
    if name == "adamw":
        return torch.optim.AdamW(trainable, lr=lr)
    if name == "adam":
        return torch.optim.Adam(trainable, lr=lr)
    momentum = 0.9 if name == "sgd_momentum" else 0.0
    return torch.optim.SGD(trainable, lr=lr, momentum=momentum)


def _loss(model: nn.Module, loss_fn: LossFn) -> torch.Tensor:
    loss = loss_fn(model)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError("loss_fn must return a scalar tensor (the loss of one batch)")
    return loss


def _replicated(model: nn.Module) -> list[nn.Parameter]:
    """Parameters no FSDP unit manages (ignored: kept whole on every rank, or experts an
    EP plan placed, each rank holding its shard)."""
    managed = {
        id(internals.sharded_parameter(record))
        for unit in internals.distinct_units(model)
        for record in internals.fsdp_params(unit)
    }
    return [p for p in model.parameters() if id(p) not in managed]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds (a DTensor's local shard)."""
    return sum(local_shape(t).numel() * t.element_size() for t in tensors)


def measure_memory(
    model: nn.Module, loss_fn: LossFn, *, optimizer: str = "adamw", warmup: int = 1
) -> MeasuredMemory:
    """Measure one training step of a sharded ``model`` after ``warmup`` untracked steps
    (which create the optimizer state and FSDP's lazy buffers: a steady-state step).

    Args:
        model: The sharded model.
        loss_fn: Runs the forward of one batch and returns the scalar loss.
        optimizer: The optimizer to step (see ``make_optimizer``).
        warmup: Untracked steps first.

    Returns:
        The step's figures.

    Raises:
        TypeError: ``model`` is not sharded or ``loss_fn`` is not callable.
        ValueError: ``warmup`` is not a positive int.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"model must be sharded (an FSDPModule at the root), got {type(model).__name__}"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(
            f"warmup must be a positive int (steps before the tracked one), got {warmup!r}"
        )
    opt = make_optimizer(optimizer, model.parameters())
    for _ in range(warmup):
        torch.autograd.backward(_loss(model, loss_fn))
        if opt is not None:
            opt.step()
            opt.zero_grad()
    replicated = _replicated(model)
    tracker = _new_tracker(model, opt)
    tracker.track_inputs(tuple(replicated))
    with tracker:
        snapshots = [tracker.get_tracker_snapshot("current")]  # resting
        torch.autograd.backward(_loss(model, loss_fn))
        snapshots.append(tracker.get_tracker_snapshot("current"))  # after backward
        replicated_grads = _nbytes(p.grad for p in replicated if p.grad is not None)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        snapshots.append(tracker.get_tracker_snapshot("current"))  # after the step
    resting, after_backward, after_step = (_cpu_or_first(snap) for snap in snapshots)
    peak = _cpu_or_first(tracker.get_tracker_snapshot("peak"))
    forward = backward = activations = 0
    for state, snap in _module_snapshots(tracker):
        if "Backward" in state:
            gathered = snap.get(_UNSHARDED, 0) + snap.get(_ALL_GATHER, 0)
            backward = max(backward, gathered)
            activations = max(activations, snap.get(_ACT, 0))
        else:
            forward = max(forward, snap.get(_UNSHARDED, 0))
    measured = MeasuredMemory(
        optimizer=optimizer,
        sharded_param_bytes=resting.get(_SHARDED, 0),
        replicated_param_bytes=_nbytes(replicated),
        peak_gathered_forward_bytes=forward,
        peak_gathered_backward_bytes=backward,
        gradient_bytes=after_backward.get(_GRAD, 0) + replicated_grads,
        optimizer_bytes=after_step.get(_OPT, 0),
        activation_bytes=activations,
        backward_activation_bytes=max(
            (p.activation_bytes for p in tracker.points if p.phase == "backward"), default=0
        ),
        peak_bytes=peak.get(_TOTAL, 0),
        peak_breakdown=tuple((str(k), v) for k, v in peak.items() if v and str(k) != _TOTAL),
        timeline=tuple(tracker.points),
    )
    host = [_host_of(snap) for snap in snapshots]
    if host[0] is None or host[1] is None or host[2] is None:
        return measured
    return dataclasses.replace(
        measured,
        host_param_bytes=host[0].get(_SHARDED, 0),
        host_gradient_bytes=host[1].get(_GRAD, 0),
        host_optimizer_bytes=host[2].get(_OPT, 0),
    )


@dataclass(frozen=True)
class MemoryMeasurement:
    """One plan: its predicted memory (``costs.memory``) and the measured step."""

    plan: ShardingPlan
    costs: PlanCosts
    measured: MeasuredMemory


def measure_plan_memory(
    plan: ShardingPlan,
    model: nn.Module,
    loss_fn: LossFn,
    *,
    world_size: int,
    optimizer: str = "adamw",
    warmup: int = 1,
    media: StepMedia | None = None,
    mesh: DeviceMesh | None = None,
    dp_dims: str | Sequence[str] | None = None,
) -> MemoryMeasurement:
    """Predict the memory of ``plan`` (tracing the activations of ``loss_fn`` on an
    unsharded copy of ``model``), apply it to ``model`` from the plan alone and measure a
    step, as [`measure_plan`][multimodal_fsdp.measure.comm.measure_plan] does.

    Args:
        plan: The plan.
        model: The model it was made for.
        loss_fn: Runs the forward of one batch and returns the scalar loss.
        world_size: Ranks of the job.
        optimizer: The optimizer whose state is predicted and measured.
        warmup: Untracked steps before the measured one.
        media: The step's media for balanced towers (by default ``loss_fn``'s batch on
            every rank, what the fake group runs).
        mesh: A mesh the caller built under the initialised group.
        dp_dims: ``mesh``'s data-parallel dimensions.

    Returns:
        The plan, its costs with their ``memory`` and the measured step.
    """
    check_optimizer(optimizer)
    estimate = {"optimizer": optimizer, "loss_fn": loss_fn}
    with _costed_and_sharded(
        "measure_plan_memory",
        plan,
        model,
        loss_fn,
        media=media,
        estimate=estimate,
        world_size=world_size,
        dp_replicate=1,
        mesh=mesh,
        dp_dims=dp_dims,
    ) as costs:
        measured = measure_memory(model, loss_fn, optimizer=optimizer, warmup=warmup)
    return MemoryMeasurement(plan=plan, costs=costs, measured=measured)
