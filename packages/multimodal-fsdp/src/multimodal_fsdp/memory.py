"""Per-rank memory of a sharding plan: parameters, gradients, optimizer state, activations.

:func:`~multimodal_fsdp.costs.plan_costs` already gives the parameter figures
(the sharded bytes at rest, the replicated bytes, the peaks of gathered
parameters in forward and in backward). This module adds what a training step
keeps beside them, so that the plan predicts the whole per-rank peak:

- **gradients**: FSDP2 reduces in the reduce dtype but stores each sharded
  gradient in the sharded parameter's dtype (the storage dtype), one padded
  shard per trainable parameter;
- **optimizer state**: per trainable sharded parameter, ``adamw``/``adam`` keep
  two tensors of the parameter's shape and dtype plus a 4-byte ``step``;
  ``sgd_momentum`` keeps one; ``sgd`` and ``none`` keep nothing;
- **activations**: what the forward saves for backward. They do not depend on
  sharding (each rank runs its own batch), so :func:`trace_activations` runs
  the forward once, unsharded, in one process, with the plan's compute dtypes
  and input casts, and adds up the tensors autograd saves.

The peak total is modelled as the largest of three moments (see
docs/memory.md for the measurement behind it):

- the start of backward: resting bytes + every activation + the backward peak
  of gathered parameters (a unit and the one its pre-backward prefetches);
- the end of forward: resting bytes + every activation + the forward peak of
  gathered parameters;
- the end of backward: resting bytes + every gradient.

Resting bytes are the sharded and replicated parameters and the optimizer
state; gradients are assumed freed between steps (``zero_grad()`` sets them
to ``None``, the default).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_core import ShardingPlan, unit_parameters
from multimodal_fsdp.costs import PlanCosts, format_bytes
from multimodal_fsdp.parallelizer import MultimodalParallelizer

__all__ = [
    "OPTIMIZER_STATES",
    "ActivationTrace",
    "MemoryEstimate",
    "check_optimizer",
    "estimate_memory",
    "gradient_bytes",
    "optimizer_state_bytes",
    "parse_size",
    "trace_activations",
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

#: Runs the forward of one batch and returns the scalar loss.
LossFn = Callable[[nn.Module], torch.Tensor]


def check_optimizer(name: str) -> str:
    """``name`` if it is a known optimizer, else a ValueError listing the choices."""
    if not isinstance(name, str) or name not in OPTIMIZER_STATES:
        raise ValueError(
            f"unknown optimizer {name!r}; valid choices: {', '.join(OPTIMIZER_STATES)}"
        )
    return name


_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``"40GiB"``, ``"1.5 GB"``, ``"512MiB"`` or ``"1000"`` (binary and
    decimal units, case-insensitive)."""
    match = _SIZE.match(text) if isinstance(text, str) else None
    unit = match.group("unit").lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"invalid size {text!r}; write a number and a unit, e.g. 40GiB or 1.5GB "
            f"(units: {', '.join(u for u in _SIZE_UNITS if u)})"
        )
    return int(float(match.group("number")) * _SIZE_UNITS[unit])


# --------------------------------------------------------------------------- result
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
    #: Activations plus backward temporaries at their backward peak (``None``: no batch).
    backward_activation_bytes: int | None = None

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
        """The predicted per-rank peak of the step (activations only if estimated)."""
        return max(self.peak_forward_bytes, self.peak_backward_bytes)

    def with_activations(self, activations: ActivationTrace | int | None) -> MemoryEstimate:
        """The same estimate with other activations (a trace, a number of bytes or none)."""
        saved, working = _activation_figures(activations)
        return dataclasses.replace(self, activation_bytes=saved, backward_activation_bytes=working)

    def format_lines(self) -> list[str]:
        """Lines for the plan's totals, each marked as predicted."""
        act = (
            "not estimated (no batch given)"
            if self.activation_bytes is None
            else format_bytes(self.activation_bytes)
        )
        peak = format_bytes(self.peak_bytes)
        if self.activation_bytes is None:
            peak += " (without activations)"
        return [
            f"  gradients (predicted)     {format_bytes(self.gradient_bytes)}",
            f"  optimizer (predicted)     {format_bytes(self.optimizer_bytes)} ({self.optimizer})",
            f"  activations (predicted)   {act}",
            f"  peak total (predicted)    {peak}",
        ]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, every figure marked as predicted."""
        return {
            "source": "predicted",
            "optimizer": self.optimizer,
            "sharded_param_bytes": self.sharded_param_bytes,
            "replicated_param_bytes": self.replicated_param_bytes,
            "peak_gathered_forward_bytes": self.peak_gathered_forward_bytes,
            "peak_gathered_backward_bytes": self.peak_gathered_backward_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activation_bytes": self.activation_bytes,
            "backward_activation_bytes": self.backward_activation_bytes,
            "resting_bytes": self.resting_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_includes_activations": self.activation_bytes is not None,
        }


# --------------------------------------------------------------------------- parameters
def _padded_shard_numel(param: nn.Parameter, shard: int) -> int:
    """Elements of one rank's shard after FSDP pads dim 0 to a multiple of ``shard``."""
    if param.dim() == 0:
        return 1
    return -(-param.shape[0] // shard) * math.prod(param.shape[1:])


def _trainable_shards(plan: ShardingPlan, model: nn.Module, shard: int) -> list[int]:
    """Bytes of each trainable parameter one rank holds: FSDP shards and replicated ones."""
    sizes: list[int] = []
    for params in unit_parameters(plan, model):
        sizes += [
            _padded_shard_numel(p, shard) * p.dtype.itemsize for _, p in params if p.requires_grad
        ]
    named = dict(model.named_parameters())
    for name in plan.ignored_param_names:
        param = named.get(name)
        if param is not None and param.requires_grad:
            sizes.append(param.numel() * param.dtype.itemsize)
    return sizes


def _check_shard(shard: int) -> None:
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1:
        raise ValueError(f"shard must be a positive int (the shard-group size), got {shard!r}")


def gradient_bytes(plan: ShardingPlan, model: nn.Module, *, shard: int) -> int:
    """Per-rank gradient bytes after backward: one padded shard per trainable parameter,
    in the parameter's storage dtype (FSDP2 casts the reduced gradient back to it)."""
    _check_shard(shard)
    return sum(_trainable_shards(plan, model, shard))


def optimizer_state_bytes(
    plan: ShardingPlan, model: nn.Module, *, shard: int, optimizer: str = "adamw"
) -> int:
    """Per-rank optimizer state: :data:`OPTIMIZER_STATES` tensors per trainable shard,
    plus Adam's 4-byte ``step`` per parameter."""
    _check_shard(shard)
    states = OPTIMIZER_STATES[check_optimizer(optimizer)]
    sizes = _trainable_shards(plan, model, shard)
    steps = _STEP_BYTES * len(sizes) if optimizer in _STEP_COUNTERS else 0
    return states * sum(sizes) + steps


# --------------------------------------------------------------------------- activations
def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors cast (tensors, tuples, lists, plain dicts)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if type(value) is dict:
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _add_cast_hooks(module: nn.Module, policy: MixedPrecisionPolicy) -> list[Any]:
    """What FSDP2 does at a unit's boundary: cast inputs to the compute dtype, outputs
    to ``output_dtype``."""
    handles = []
    param_dtype, output_dtype = policy.param_dtype, policy.output_dtype
    if policy.cast_forward_inputs and param_dtype is not None:

        def pre(_: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            return _cast_floats(args, param_dtype), _cast_floats(dict(kwargs), param_dtype)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    if output_dtype is not None:

        def post(_: nn.Module, __: Any, output: Any) -> Any:
            return _cast_floats(output, output_dtype)

        handles.append(module.register_forward_hook(post))
    return handles


def _materialise(model: nn.Module) -> None:
    """Give a meta-device copy real (random) values: sizes do not depend on them."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    logger.info("activation trace: materialising a meta-device copy on the CPU")
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.02)
            else:
                tensor.zero_()


def _compute_copy(
    model: nn.Module, plan: ShardingPlan, parallelizer: MultimodalParallelizer | None
) -> nn.Module:
    """An unsharded copy with every parameter in the dtype it computes in under ``plan``."""
    replicated = parallelizer.replicated_param_dtypes(model, plan) if parallelizer else {}
    twin = copy.deepcopy(model)
    _materialise(twin)
    with torch.no_grad():
        for unit, params in zip(plan.units, unit_parameters(plan, twin), strict=True):
            target = unit.mp_policy.param_dtype
            for _, param in params:
                if target is not None and param.is_floating_point():
                    param.data = param.data.to(target)
        named = dict(twin.named_parameters())
        for name, dtype in replicated.items():
            if name in named:
                named[name].data = named[name].data.to(dtype)
    return twin


@dataclass(frozen=True)
class ActivationTrace:
    """What one batch needs beside the parameters, from :func:`trace_activations`."""

    #: Bytes saved for backward when the forward ends (the loss included).
    saved_bytes: int
    #: Peak of saved activations plus backward temporaries (activation gradients,
    #: unsharded weight gradients until they are consumed) during backward.
    backward_peak_bytes: int


class _LiveBytes(TorchDispatchMode):
    """Follows the bytes of storages created under it (and those handed to :meth:`add`)
    until they are freed, and keeps the peak."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.skip = skip
        self.live = 0
        self.peak = 0
        self.seen: set[int] = set()

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or key in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(key)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, tuple | list) else (out,):
            if isinstance(item, torch.Tensor):
                self.add(item)
        return out


def trace_activations(
    model: nn.Module,
    plan: ShardingPlan,
    loss_fn: LossFn,
    *,
    parallelizer: MultimodalParallelizer | None = None,
) -> ActivationTrace:
    """What one training step of one batch needs beside parameters, per rank, under ``plan``.

    Runs ``loss_fn`` and its backward once on an unsharded copy of ``model``
    (materialised on the CPU if it is on meta) whose parameters are in the
    plan's compute dtypes and whose units cast inputs and outputs as FSDP2 does.
    Forward: each storage that autograd saves counts once, parameters excluded
    (they are in the gathered figures), plus the loss. Backward: the live bytes
    of those activations and of every tensor backward creates, weight gradients
    freed once accumulated (FSDP2 reduce-scatters and frees them). Sharding does
    not change these bytes: every rank runs its own batch through the whole model.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    twin = _compute_copy(model, plan, parallelizer)
    handles = []
    for unit in plan.units:
        for path in unit.paths:
            handles += _add_cast_hooks(twin.get_submodule(path), unit.mp_policy)
    for param in twin.parameters():
        if param.requires_grad:
            hook = param.register_post_accumulate_grad_hook
            handles.append(hook(_drop_grad))  # type: ignore[no-untyped-call]
    live = _LiveBytes({p.untyped_storage().data_ptr() for p in twin.parameters()})
    try:
        with torch.autograd.graph.saved_tensors_hooks(_packer(live), lambda tensor: tensor):
            loss = loss_fn(twin)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("loss_fn must return a scalar tensor (the loss of one batch)")
        live.add(loss)
        saved = live.live
        live.peak = live.live
        if loss.requires_grad:
            with live:
                torch.autograd.backward(loss)
    finally:
        for handle in handles:
            handle.remove()
    return ActivationTrace(saved_bytes=saved, backward_peak_bytes=live.peak)


def _packer(live: _LiveBytes) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        live.add(tensor)
        return tensor

    return pack


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


# --------------------------------------------------------------------------- one call
def estimate_memory(
    costs: PlanCosts,
    plan: ShardingPlan,
    model: nn.Module,
    *,
    optimizer: str = "adamw",
    activations: ActivationTrace | int | None = None,
) -> MemoryEstimate:
    """The whole per-rank memory estimate of ``plan`` (costed as ``costs``) for ``model``.

    ``activations`` comes from :func:`trace_activations`, or is a number of
    bytes (taken for the end of forward and for backward alike), or ``None``
    (the peak then leaves activations out and says so).
    """
    check_optimizer(optimizer)
    if not isinstance(costs, PlanCosts):
        raise TypeError(f"costs must be a PlanCosts, got {type(costs).__name__}")
    saved, working = _activation_figures(activations)
    shard = costs.mesh.dp_shard
    return MemoryEstimate(
        optimizer=optimizer,
        sharded_param_bytes=costs.sharded_param_bytes,
        replicated_param_bytes=costs.replicated_param_bytes,
        peak_gathered_forward_bytes=costs.peak_gathered_forward_bytes,
        peak_gathered_backward_bytes=costs.peak_gathered_backward_bytes,
        gradient_bytes=gradient_bytes(plan, model, shard=shard),
        optimizer_bytes=optimizer_state_bytes(plan, model, shard=shard, optimizer=optimizer),
        activation_bytes=saved,
        backward_activation_bytes=working,
    )


def _activation_figures(activations: ActivationTrace | int | None) -> tuple[int | None, int | None]:
    """(end of forward, backward peak) bytes from what :func:`estimate_memory` was given."""
    if activations is None or isinstance(activations, ActivationTrace):
        if activations is None:
            return None, None
        return activations.saved_bytes, activations.backward_peak_bytes
    if isinstance(activations, bool) or not isinstance(activations, int) or activations < 0:
        raise ValueError(
            "activations must be an ActivationTrace, a non-negative number of bytes or None, "
            f"got {activations!r}"
        )
    return activations, activations


def with_memory(
    costs: PlanCosts,
    plan: ShardingPlan,
    model: nn.Module,
    *,
    optimizer: str = "adamw",
    activations: ActivationTrace | int | None = None,
) -> PlanCosts:
    """``costs`` with its :attr:`~multimodal_fsdp.costs.PlanCosts.memory` filled in."""
    estimate = estimate_memory(costs, plan, model, optimizer=optimizer, activations=activations)
    return dataclasses.replace(costs, memory=estimate)
