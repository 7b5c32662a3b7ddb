"""Per-rank memory of a sharding plan: parameters, gradients, optimizer state, activations.

[`plan_costs`][multimodal_fsdp.estimate.costs.plan_costs] gives the parameter figures;
this module adds what a training step keeps beside them:

- **gradients**: one padded shard per trainable parameter, in its storage dtype (FSDP2
  reduces in the reduce dtype and casts back);
- **optimizer state**: per trainable shard, ``adamw``/``adam`` keep two tensors of its
  shape and dtype plus a 4-byte ``step``; ``sgd_momentum`` one; ``sgd`` and ``none`` none;
- **activations**: from
  [`trace_activations`][multimodal_fsdp.estimate.activations.trace_activations], which
  also replays FSDP2's gathers and gradients, so the peak is the resting bytes (sharded
  and replicated parameters, optimizer state) plus the traced step's peak. Without a
  batch it is the largest of resting bytes plus the forward or backward peak of gathered
  parameters, or plus every gradient. docs/memory.md compares both with a measured step.

A unit the plan offloads (``UnitPlan.offload_policy``) keeps its shards, sharded gradients
and optimizer state in host memory: those count as ``host_*`` figures; what FSDP2 copies
to the device to gather them is counted as before.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from fsdp_core import ShardingPlan
from fsdp_core.parallel_dims import local_shape
from fsdp_core.plan import unit_parameters
from multimodal_fsdp.estimate.activations import ActivationTrace, check_shard
from multimodal_fsdp.estimate.render import format_bytes
from multimodal_fsdp.estimate.units import padded_shard_numel

if TYPE_CHECKING:  # an annotation only: the costs hold a memory estimate, not the reverse
    from multimodal_fsdp.estimate.costs import PlanCosts

__all__ = [
    "OPTIMIZER_STATES",
    "MemoryEstimate",
    "check_optimizer",
    "estimate_memory",
    "gradient_bytes",
    "host_param_bytes",
    "memory_figures",
    "optimizer_state_bytes",
    "with_memory",
]

logger = logging.getLogger(__name__)

#: Tensors of a parameter's shape and dtype that each optimizer keeps per trainable parameter.
OPTIMIZER_STATES: dict[str, int] = {
    "adamw": 2,
    "adam": 2,
    "sgd_momentum": 1,
    "sgd": 0,
    "none": 0,
}
#: Optimizers that keep a ``step`` counter per parameter (a 0-d fp32 tensor).
_STEP_COUNTERS = frozenset({"adamw", "adam"})
_STEP_BYTES = 4


def check_optimizer(name: str) -> str:
    """Check an optimizer name.

    Args:
        name: A key of [`OPTIMIZER_STATES`][multimodal_fsdp.estimate.memory.OPTIMIZER_STATES].

    Returns:
        ``name``.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if not isinstance(name, str) or name not in OPTIMIZER_STATES:
        raise ValueError(
            f"unknown optimizer {name!r}; valid choices: {', '.join(OPTIMIZER_STATES)}"
        )
    return name


#: The figures a predicted and a measured step both report, in their JSON order.
_FIGURES = (
    "optimizer",
    "sharded_param_bytes",
    "replicated_param_bytes",
    "peak_gathered_forward_bytes",
    "peak_gathered_backward_bytes",
    "gradient_bytes",
    "optimizer_bytes",
    "activation_bytes",
    "backward_activation_bytes",
)


def memory_figures(memory: Any, *, source: str) -> dict[str, Any]:
    """The figures a predicted and a measured step share, so the two read side by side.

    Args:
        memory: A ``MemoryEstimate`` or a ``MeasuredMemory``.
        source: ``"predicted"`` or ``"measured"``.

    Returns:
        The figures, JSON-ready, with their ``source``.
    """
    return {"source": source, **{name: getattr(memory, name) for name in _FIGURES}}


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes per rank for one training step (see the module doc)."""

    optimizer: str
    sharded_param_bytes: int
    replicated_param_bytes: int
    peak_gathered_forward_bytes: int
    peak_gathered_backward_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    #: Saved activations of one batch at the end of forward; ``None`` when no batch was given.
    activation_bytes: int | None = None
    #: Activations, backward temporaries and gradients at their backward peak (``None``: no batch).
    backward_activation_bytes: int | None = None
    #: Peak beyond resting bytes of the traced step with gathers replayed (``None``: not traced).
    step_peak_bytes: int | None = None
    #: Sharded parameters of offloaded units, in host memory (not in ``sharded_param_bytes``).
    host_param_bytes: int = 0
    #: Sharded gradients of offloaded units, in host memory (not in ``gradient_bytes``).
    host_gradient_bytes: int = 0
    #: Optimizer state of offloaded units, in host memory (not in ``optimizer_bytes``).
    host_optimizer_bytes: int = 0

    @property
    def host_bytes(self) -> int:
        """Host memory of offloaded units at the end of a step: parameters, gradients and
        optimizer state."""
        return self.host_param_bytes + self.host_gradient_bytes + self.host_optimizer_bytes

    @property
    def resting_bytes(self) -> int:
        """What stays between steps: parameters (sharded and replicated) and optimizer state."""
        return self.sharded_param_bytes + self.replicated_param_bytes + self.optimizer_bytes

    @property
    def peak_forward_bytes(self) -> int:
        """The end of forward: every activation alive, forward-peak parameters gathered."""
        return self.resting_bytes + self.peak_gathered_forward_bytes + (self.activation_bytes or 0)

    @property
    def peak_backward_bytes(self) -> int:
        """Early backward (activations and temporaries at their peak, backward-peak
        gathers) or its end (every gradient), whichever is larger."""
        working = self.backward_activation_bytes
        if working is None:
            working = self.activation_bytes or 0
        start = self.peak_gathered_backward_bytes + working
        return self.resting_bytes + max(start, self.gradient_bytes)

    @property
    def peak_bytes(self) -> int:
        """The predicted per-rank peak of the step (activations only if estimated).

        With a traced step, resting bytes plus the traced peak (never below the
        parameter-only moments); otherwise the larger of the forward and backward
        moments, which add activation and parameter peaks that may not coincide."""
        if self.step_peak_bytes is not None:
            floor = max(
                self.peak_gathered_forward_bytes,
                self.peak_gathered_backward_bytes,
                self.gradient_bytes,
            )
            return self.resting_bytes + max(self.step_peak_bytes, floor)
        return max(self.peak_forward_bytes, self.peak_backward_bytes)

    def with_activations(self, activations: ActivationTrace | int | None) -> MemoryEstimate:
        """The same estimate with other activations.

        Args:
            activations: A trace, a number of bytes or ``None``.

        Returns:
            The new estimate.
        """
        saved, working, step = _activation_figures(activations)
        return dataclasses.replace(
            self,
            activation_bytes=saved,
            backward_activation_bytes=working,
            step_peak_bytes=step,
        )

    def format_lines(self) -> list[str]:
        """The estimate as the plan's totals print it.

        Returns:
            Lines, each marked as predicted.
        """
        act = (
            "not estimated (no batch given)"
            if self.activation_bytes is None
            else format_bytes(self.activation_bytes)
        )
        peak = format_bytes(self.peak_bytes)
        if self.activation_bytes is None:
            peak += " (without activations)"
        lines = [
            f"  gradients (predicted)     {format_bytes(self.gradient_bytes)}",
            f"  optimizer (predicted)     {format_bytes(self.optimizer_bytes)} ({self.optimizer})",
            f"  activations (predicted)   {act}",
            f"  peak total (predicted)    {peak}",
        ]
        if self.host_bytes:
            lines.append(
                f"  host (offloaded)          {format_bytes(self.host_bytes)} (parameters "
                f"{format_bytes(self.host_param_bytes)}, gradients "
                f"{format_bytes(self.host_gradient_bytes)}, optimizer "
                f"{format_bytes(self.host_optimizer_bytes)}; not in the device figures)"
            )
        return lines

    def as_dict(self) -> dict[str, Any]:
        """Every figure, JSON-ready.

        Returns:
            The figures, marked as predicted, with the resting bytes and the peak.
        """
        return {
            **memory_figures(self, source="predicted"),
            "step_peak_bytes": self.step_peak_bytes,
            "resting_bytes": self.resting_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_includes_activations": self.activation_bytes is not None,
            "host_param_bytes": self.host_param_bytes,
            "host_gradient_bytes": self.host_gradient_bytes,
            "host_optimizer_bytes": self.host_optimizer_bytes,
        }


def _trainable_shards(
    plan: ShardingPlan, model: nn.Module, shard: int, *, offloaded: bool, frozen: bool = False
) -> list[int]:
    """Bytes of each trainable (or, ``frozen``, any) parameter one rank holds on the device
    (shards of units kept there, replicated ones) or, ``offloaded``, in host memory."""
    sizes = [
        padded_shard_numel(p, shard) * p.dtype.itemsize
        for unit, params in zip(plan.units, unit_parameters(plan, model), strict=True)
        if isinstance(unit.offload_policy, CPUOffloadPolicy) == offloaded
        for _, p in params
        if p.requires_grad or frozen
    ]
    if offloaded:
        return sizes
    named = dict(model.named_parameters())
    for name in plan.ignored_param_names:
        param = named.get(name)
        if param is not None and param.requires_grad:
            sizes.append(local_shape(param).numel() * param.dtype.itemsize)
    return sizes


def host_param_bytes(plan: ShardingPlan, model: nn.Module, *, shard: int) -> int:
    """Per-rank bytes of the sharded parameters of offloaded units (in host memory).

    Args:
        plan: The plan.
        model: The model it was made for.
        shard: The shard-group size.

    Returns:
        The bytes.
    """
    check_shard(shard)
    return sum(_trainable_shards(plan, model, shard, offloaded=True, frozen=True))


def gradient_bytes(
    plan: ShardingPlan, model: nn.Module, *, shard: int, offloaded: bool = False
) -> int:
    """Per-rank gradient bytes after backward: one padded shard per trainable parameter,
    in its storage dtype (FSDP2 casts the reduced gradient back to it).

    Args:
        plan: The plan.
        model: The model it was made for.
        shard: The shard-group size.
        offloaded: Count the offloaded units' gradients (in host memory), not the device's.

    Returns:
        The bytes.
    """
    check_shard(shard)
    return sum(_trainable_shards(plan, model, shard, offloaded=offloaded))


def optimizer_state_bytes(
    plan: ShardingPlan,
    model: nn.Module,
    *,
    shard: int,
    optimizer: str = "adamw",
    offloaded: bool = False,
) -> int:
    """Per-rank optimizer state:
    [`OPTIMIZER_STATES`][multimodal_fsdp.estimate.memory.OPTIMIZER_STATES] tensors per
    trainable shard, plus Adam's 4-byte ``step`` per parameter.

    Args:
        plan: The plan.
        model: The model it was made for.
        shard: The shard-group size.
        optimizer: The optimizer's name.
        offloaded: Count the offloaded units' state (in host memory), not the device's.

    Returns:
        The bytes.
    """
    check_shard(shard)
    states = OPTIMIZER_STATES[check_optimizer(optimizer)]
    sizes = _trainable_shards(plan, model, shard, offloaded=offloaded)
    steps = _STEP_BYTES * len(sizes) if optimizer in _STEP_COUNTERS else 0
    return states * sum(sizes) + steps


#: What the estimate reads of a plan's costs (``PlanCosts`` has them; no import needed).
_PARAMETER_FIGURES = (
    "mesh",
    "sharded_param_bytes",
    "replicated_param_bytes",
    "peak_gathered_forward_bytes",
    "peak_gathered_backward_bytes",
)


def estimate_memory(
    costs: PlanCosts,
    plan: ShardingPlan,
    model: nn.Module,
    *,
    optimizer: str = "adamw",
    activations: ActivationTrace | int | None = None,
) -> MemoryEstimate:
    """The per-rank memory of ``plan``: device bytes, and host bytes of offloaded units.

    Args:
        costs: The plan's costs.
        plan: The plan.
        model: The model it was made for.
        optimizer: The optimizer whose state is counted.
        activations: A trace from
            [`trace_activations`][multimodal_fsdp.estimate.activations.trace_activations],
            bytes (for the end of forward and backward alike), or ``None`` (the peak leaves
            activations out and says so).

    Returns:
        The estimate.

    Raises:
        TypeError: ``costs`` is not a ``PlanCosts``.
        ValueError: an unknown optimizer or invalid ``activations``.
    """
    check_optimizer(optimizer)
    if not all(hasattr(costs, name) for name in _PARAMETER_FIGURES):
        raise TypeError(f"costs must be a PlanCosts, got {type(costs).__name__}")
    saved, working, step = _activation_figures(activations)
    shard = costs.mesh.dp_shard
    host_params = host_param_bytes(plan, model, shard=shard)
    return MemoryEstimate(
        optimizer=optimizer,
        sharded_param_bytes=costs.sharded_param_bytes - host_params,
        replicated_param_bytes=costs.replicated_param_bytes,
        peak_gathered_forward_bytes=costs.peak_gathered_forward_bytes,
        peak_gathered_backward_bytes=costs.peak_gathered_backward_bytes,
        gradient_bytes=gradient_bytes(plan, model, shard=shard),
        optimizer_bytes=optimizer_state_bytes(plan, model, shard=shard, optimizer=optimizer),
        activation_bytes=saved,
        backward_activation_bytes=working,
        step_peak_bytes=step,
        host_param_bytes=host_params,
        host_gradient_bytes=gradient_bytes(plan, model, shard=shard, offloaded=True),
        host_optimizer_bytes=optimizer_state_bytes(
            plan, model, shard=shard, optimizer=optimizer, offloaded=True
        ),
    )


def _activation_figures(
    activations: ActivationTrace | int | None,
) -> tuple[int | None, int | None, int | None]:
    """(end of forward, backward peak, traced step peak) from what was given."""
    if activations is None:
        return None, None, None
    if isinstance(activations, ActivationTrace):
        trace = activations
        return trace.saved_bytes, trace.backward_peak_bytes, trace.step_peak_bytes
    if isinstance(activations, bool) or not isinstance(activations, int) or activations < 0:
        raise ValueError(
            "activations must be an ActivationTrace, a non-negative number of bytes or None, "
            f"got {activations!r}"
        )
    return activations, activations, None


def with_memory(
    costs: PlanCosts,
    plan: ShardingPlan,
    model: nn.Module,
    *,
    optimizer: str = "adamw",
    activations: ActivationTrace | int | None = None,
) -> PlanCosts:
    """``costs`` with its [`memory`][multimodal_fsdp.estimate.costs.PlanCosts.memory] filled in.

    Args:
        costs: The plan's costs.
        plan: The plan.
        model: The model it was made for.
        optimizer: As [`estimate_memory`][multimodal_fsdp.estimate.memory.estimate_memory].
        activations: As ``estimate_memory``.

    Returns:
        The costs with their memory.
    """
    estimate = estimate_memory(costs, plan, model, optimizer=optimizer, activations=activations)
    return dataclasses.replace(costs, memory=estimate)
