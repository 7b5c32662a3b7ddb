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
  one step of the batch on an unsharded copy in one process, with the plan's
  compute dtypes and input casts, adds up the tensors autograd saves, and
  follows the live bytes through backward.

**The peak total.** With a traced step, the trace also replays what FSDP2 holds
beside the activations, unit by unit: gathered parameters (gathered at a
unit's forward, freed after it if it reshards; in backward gathered when its
output's gradient arrives, with the next unit prefetched, freed when its
gradients are complete), each unit's unsharded gradients and reduce-scatter
input, and the sharded gradients. The predicted peak is the resting bytes plus
the traced step's peak. Without a batch it is the largest of three moments that
leave activations out: resting bytes plus the forward or the backward peak of
gathered parameters, or plus every gradient. docs/memory.md holds both against
a measured step.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_core import ShardingPlan, UnitPlan, unit_parameters
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
    #: Activations, backward temporaries and gradients at their backward peak (``None``: no batch).
    backward_activation_bytes: int | None = None
    #: Peak beyond resting bytes of the traced step with gathers replayed (``None``: not traced).
    step_peak_bytes: int | None = None

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
        """The same estimate with other activations (a trace, a number of bytes or none)."""
        saved, working, step = _activation_figures(activations)
        return dataclasses.replace(
            self,
            activation_bytes=saved,
            backward_activation_bytes=working,
            step_peak_bytes=step,
        )

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
            "step_peak_bytes": self.step_peak_bytes,
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
    #: Peak during backward of saved activations, temporaries (activation gradients)
    #: and gradients (a unit's unsharded ones and reduce-scatter input, sharded ones).
    backward_peak_bytes: int
    #: Peak over the whole step of all that plus the gathered parameters, replayed
    #: unit by unit as FSDP2 gathers and frees them (resting bytes not included).
    step_peak_bytes: int = 0


class _LiveBytes(TorchDispatchMode):
    """Follows the bytes of storages created under it (and those handed to :meth:`add`)
    until they are freed, plus bytes no traced tensor holds (:meth:`bump`), and keeps
    the peak of everything and of everything but gathered parameters."""

    def __init__(self, skip: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.skip = skip
        self.live = 0
        self.gathered = 0
        self.peak = 0
        self.working_peak = 0
        self.seen: set[int] = set()

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or key in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(key)
        self.bump(storage.nbytes())
        weakref.finalize(storage, self._free, key, storage.nbytes())

    def bump(self, nbytes: int, *, gathered: bool = False) -> None:
        """Bytes that no traced tensor holds (FSDP's buffers, sharded gradients and,
        with ``gathered``, unsharded parameters)."""
        self.live += nbytes
        if gathered:
            self.gathered += nbytes
        self.peak = max(self.peak, self.live)
        self.working_peak = max(self.working_peak, self.live - self.gathered)

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
    shard: int = 1,
) -> ActivationTrace:
    """What one training step of one batch needs beside parameters, per rank, under ``plan``.

    Runs ``loss_fn`` and its backward once on an unsharded copy of ``model``
    (materialised on the CPU if it is on meta) whose parameters are in the
    plan's compute dtypes and whose units cast inputs and outputs as FSDP2 does.
    Forward: each storage that autograd saves counts once, parameters excluded
    (they are in the gathered figures), plus the loss. Backward: the live bytes
    of those activations and of every tensor backward creates, with each unit's
    gradients handled as FSDP2 does on a shard group of ``shard`` ranks: the
    unit's unsharded gradients stay until its last one is accumulated, then its
    reduce-scatter input (reduce dtype) exists beside them, then both give way to
    the unit's sharded gradients. Activations themselves do not depend on
    sharding: every rank runs its own batch through the whole model.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    _check_shard(shard)
    twin = _compute_copy(model, plan, parallelizer)
    live = _LiveBytes({p.untyped_storage().data_ptr() for p in twin.parameters()})
    handles = []
    for unit in plan.units:
        for path in unit.paths:
            handles += _add_cast_hooks(twin.get_submodule(path), unit.mp_policy)
    gathers = _Gathers(plan, model, twin, live, shard)
    handles += gathers.hooks
    handles += _GradStaging(plan, model, twin, live, shard, gathers).hooks
    try:
        with torch.autograd.graph.saved_tensors_hooks(_packer(live), lambda tensor: tensor):
            loss = loss_fn(twin)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("loss_fn must return a scalar tensor (the loss of one batch)")
        live.add(loss)
        saved = live.live - live.gathered
        live.working_peak = saved
        if loss.requires_grad:
            with live:
                torch.autograd.backward(loss)
    finally:
        for handle in handles:
            handle.remove()
    return ActivationTrace(
        saved_bytes=saved, backward_peak_bytes=live.working_peak, step_peak_bytes=live.peak
    )


class _Gathers:
    """Replays FSDP2's gathered parameters on the traced copy: a unit is gathered at its
    first member's pre-forward and, if it reshards, freed after its last member's
    forward. In backward a unit with trainable parameters is gathered when the
    gradient of its output arrives (its pre-backward), together with the next unit
    in reverse forward order (the implicit prefetch), and freed when its gradients
    are complete. Units that keep their parameters (the root) stay gathered until
    then. Frozen units are not gathered in backward."""

    def __init__(
        self, plan: ShardingPlan, model: nn.Module, twin: nn.Module, live: _LiveBytes, shard: int
    ) -> None:
        self.live = live
        self.hooks: list[Any] = []
        self.size: dict[int, int] = {}
        self.kept: dict[int, int] = {}
        self.held: dict[int, int] = {}
        self.members: dict[int, int] = {}
        self.done: dict[int, int] = {}
        self.trainable: set[int] = set()
        self.order: list[int] = []
        self.started: set[int] = set()
        for index, (unit, params) in enumerate(
            zip(plan.units, unit_parameters(plan, model), strict=True)
        ):
            if not params:
                continue
            size = sum(
                _padded_shard_numel(p, shard) * shard * _compute_itemsize(p, unit.mp_policy)
                for _, p in params
            )
            self.size[index] = size
            self.kept[index] = _kept_after_forward(unit, size, shard)
            self.held[index] = 0
            self.members[index] = len(unit.paths)
            if any(p.requires_grad for _, p in params):
                self.trainable.add(index)
            for path in unit.paths:
                module = twin.get_submodule(path)
                self.hooks.append(module.register_forward_pre_hook(self._pre(index)))
                self.hooks.append(module.register_forward_hook(self._post(index)))

    def _set(self, index: int, nbytes: int) -> None:
        self.live.bump(nbytes - self.held[index], gathered=True)
        self.held[index] = nbytes

    def _pre(self, index: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if self.done.get(index, 0) == 0:
                self._set(index, self.size[index])

        return hook

    def _post(self, index: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_: nn.Module, __: Any, output: Any) -> None:
            self.done[index] = self.done.get(index, 0) + 1
            if self.done[index] < self.members[index]:
                return
            self.done[index] = 0
            self._set(index, self.kept[index])
            if index not in self.trainable:
                return
            if index not in self.order:
                self.order.append(index)
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward(index))  # type: ignore[no-untyped-call]

        return hook

    def _pre_backward(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            if index in self.started:
                return
            self.started.add(index)
            self._set(index, self.size[index])
            later = self.order[: self.order.index(index)]
            waiting = [i for i in reversed(later) if i not in self.started]
            if waiting:
                self._set(waiting[0], self.size[waiting[0]])

        return hook

    def finished(self, index: int) -> None:
        """A unit's gradients are complete: it reshards."""
        if index in self.size:
            self._set(index, 0)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a module output (tensors, tuples, lists, mappings such as
    transformers' ``ModelOutput``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _compute_itemsize(param: nn.Parameter, policy: MixedPrecisionPolicy) -> int:
    if policy.param_dtype is not None and param.is_floating_point():
        return policy.param_dtype.itemsize
    return param.dtype.itemsize


def _kept_after_forward(unit: UnitPlan, size: int, shard: int) -> int:
    """Gathered bytes a unit keeps after forward (FSDP2: the root keeps all by default)."""
    setting = unit.reshard_after_forward
    if setting is None:
        return size if unit.is_root else 0
    if setting is True or setting == shard:
        return 0
    if setting is False or setting == 1:
        return size
    return size // int(setting)


class _GradStaging:
    """Post-accumulate hooks that give the traced copy FSDP2's per-unit gradient lifetimes."""

    def __init__(
        self,
        plan: ShardingPlan,
        model: nn.Module,
        twin: nn.Module,
        live: _LiveBytes,
        shard: int,
        gathers: _Gathers,
    ) -> None:
        self.live = live
        self.gathers = gathers
        self.hooks: list[Any] = []
        self.pending: dict[int, set[str]] = {}
        self.members: dict[int, list[nn.Parameter]] = {}
        self.reduce_bytes: dict[int, int] = {}
        self.sharded_bytes: dict[int, int] = {}
        named = dict(twin.named_parameters())
        for index, (unit, params) in enumerate(
            zip(plan.units, unit_parameters(plan, model), strict=True)
        ):
            trainable = [(n, p) for n, p in params if p.requires_grad]
            if not trainable:
                continue
            policy = unit.mp_policy
            self.pending[index] = {n for n, _ in trainable}
            self.members[index] = [named[n] for n, _ in trainable]
            self.reduce_bytes[index] = sum(
                _padded_shard_numel(p, shard) * shard * _reduce_itemsize(p, policy)
                for _, p in trainable
            )
            self.sharded_bytes[index] = sum(
                _padded_shard_numel(p, shard) * p.dtype.itemsize for _, p in trainable
            )
            for name, _ in trainable:
                hook = named[name].register_post_accumulate_grad_hook
                self.hooks.append(hook(self._accumulated(index, name)))  # type: ignore[no-untyped-call]

    def _accumulated(self, index: int, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            waiting = self.pending[index]
            waiting.discard(name)
            if waiting:
                return
            self.gathers.finished(index)
            self.live.bump(self.reduce_bytes[index])  # reduce-scatter input beside the grads
            for param in self.members[index]:
                param.grad = None
            self.live.bump(self.sharded_bytes[index] - self.reduce_bytes[index])

        return hook


def _reduce_itemsize(param: nn.Parameter, policy: MixedPrecisionPolicy) -> int:
    """Bytes per element of a gradient on the wire: the reduce dtype, else the compute dtype."""
    dtype = policy.reduce_dtype or policy.param_dtype or param.dtype
    return dtype.itemsize


def _packer(live: _LiveBytes) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        live.add(tensor)
        return tensor

    return pack


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
    saved, working, step = _activation_figures(activations)
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
        step_peak_bytes=step,
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
    """``costs`` with its :attr:`~multimodal_fsdp.costs.PlanCosts.memory` filled in."""
    estimate = estimate_memory(costs, plan, model, optimizer=optimizer, activations=activations)
    return dataclasses.replace(costs, memory=estimate)
