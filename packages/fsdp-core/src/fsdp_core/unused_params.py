"""Parameters some ranks skip: equal reduce-scatters, and no gradient where no rank used one.

FSDP2 reduce-scatters, per unit, only the parameters that received a gradient on
this rank. When ranks skip different parts of a unit (a text-only batch and the
projector in the root unit, unrouted MoE experts) their reduce-scatters differ in
size and the job crashes or hangs. ``set_reduce_scatter_unused_params(True)``
makes every rank send zeros for what it did not use, which keeps the collectives
equal and gives a parameter used on some ranks the correct average. But it also
turns "no rank used this parameter" into a zero gradient, which AdamW then moves
by weight decay and momentum, unlike one process or plain FSDP.

[`UnusedParamsHook`][fsdp_core.unused_params.UnusedParamsHook] does both halves: it sets the flag on
every unit and records, per FSDP parameter, whether autograd accumulated a gradient into it on
this rank (a post-accumulate hook on the unsharded parameter that finds a gradient there;
autograd calls it without one when the parameter's backward ran with none). When a backward
that reduces gradients ends, one all-reduce (MAX, one byte per trainable
parameter tensor) over the data-parallel mesh tells every rank which parameters
no rank used; their sharded gradients are set back to ``None``. Micro-batches of
gradient accumulation OR their usage together until the syncing backward.

Equal sizes are not enough: the reduce-scatters must also come in the same order.
A unit is reduced early (from autograd) when its inputs require a gradient and late
(at the end of the backward) otherwise, and a module that runs on some ranks only
can make a unit's inputs require one on those ranks alone (LoRA in a tower feeding
the first decoder layer while another rank is text-only). The hook therefore also
makes an input of every non-root trainable unit require a gradient
(``fsdp_core._backward_order``),
so every rank reduces every unit at the same point of its backward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fsdp_core import compat, internals
from fsdp_core._backward_order import make_unit_inputs_require_grad
from fsdp_core.collective_count import CommTally
from fsdp_core.mesh import all_reduce_max_over_mesh, mesh_device
from fsdp_core.runtime import BackwardWatch, HookStep, RuntimeHook

if TYPE_CHECKING:
    from fsdp_core.parallel_dims import ParallelDims

__all__ = ["UnusedParamsHook", "UnusedParamsRuntimeHook", "install_unused_params_hook"]

logger = logging.getLogger(__name__)

NAME = "unused_params"


@dataclass
class _Record:
    unit: FSDPModule
    fsdp_param: Any
    hooked: bool = False


class UnusedParamsHook:
    """The installed hook (see the module docstring), put on the sharded ``model`` by its
    constructor.

    Args:
        model: the sharded model.
        mesh: the data-parallel ranks whose usage flags are combined.
    """

    name: str = NAME

    def __init__(self, model: nn.Module, *, mesh: DeviceMesh) -> None:
        self.model = model
        self.mesh = mesh
        units = internals.distinct_units(model)
        self._handles: list[Any] = list(make_unit_inputs_require_grad(model, units))
        self._records: list[_Record] = []
        for unit in units:
            unit.set_reduce_scatter_unused_params(True, recurse=False)
            for fsdp_param in internals.fsdp_params(unit):
                if internals.sharded_parameter(fsdp_param).requires_grad:
                    self._records.append(_Record(unit, fsdp_param))
        self._used = [False] * len(self._records)
        self._queued = False
        #: Parameter tensors whose gradient the last syncing backward set back to ``None``.
        self.last_unused: tuple[str, ...] = ()
        handle: RemovableHandle = model.register_forward_hook(self._after_forward)
        self._handles.append(handle)
        self._watch: BackwardWatch | None = BackwardWatch(model, self._on_backward)
        self._attach()

    def _attach(self) -> None:
        """Hook every unsharded parameter that exists by now (they appear at a unit's
        first all-gather, so this runs after each forward until all are hooked)."""
        for index, record in enumerate(self._records):
            if record.hooked:
                continue
            unsharded = internals.unsharded_parameter(record.fsdp_param)
            if unsharded is None:
                continue

            def mark(param: torch.Tensor, index: int = index) -> None:
                # Autograd also calls this when the parameter's backward ran with no
                # gradient (an output given None, as the balanced media exchange gives
                # an unread tower output): that is no use.
                if param.grad is not None:
                    self._used[index] = True

            self._handles.append(unsharded.register_post_accumulate_grad_hook(mark))  # type: ignore[no-untyped-call]
            record.hooked = True

    def _after_forward(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if not all(r.hooked for r in self._records):
            self._attach()

    def _on_backward(self) -> None:
        if self._queued:
            return
        self._queued = True
        # Queued from inside backward; re-queued once so that it runs after FSDP's own
        # end-of-backward callback (which may reduce-scatter units that ran no backward).
        internals.queue_end_of_backward(lambda: internals.queue_end_of_backward(self._finish))

    def _finish(self) -> None:
        self._queued = False
        reducing = [internals.reduces_gradients(r.unit) for r in self._records]
        if not any(reducing):
            return  # a no-sync micro-batch: usage accumulates until the syncing backward
        flags = torch.tensor(self._used, dtype=torch.uint8, device=mesh_device(self.mesh))
        all_reduce_max_over_mesh(flags, self.mesh)
        used = flags.tolist()
        dropped = []
        for index, record in enumerate(self._records):
            if not reducing[index]:
                continue
            if not used[index]:
                param = internals.sharded_parameter(record.fsdp_param)
                param.grad = None
                dropped.append(_name(record.fsdp_param, index))
            self._used[index] = False
        self.last_unused = tuple(dropped)
        if dropped:
            logger.debug("no rank used %d parameters; their gradients stay None", len(dropped))

    def remove(self) -> None:
        """Remove the hooks and turn the reduce-scatter of unused parameters off again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        for unit in {id(r.unit): r.unit for r in self._records}.values():
            unit.set_reduce_scatter_unused_params(False, recurse=False)


def _name(fsdp_param: Any, index: int) -> str:
    name = internals.param_fqn(fsdp_param)
    return name if name is not None else f"<parameter {index}>"


def install_unused_params_hook(model: nn.Module, *, mesh: DeviceMesh) -> UnusedParamsHook | None:
    """Install the hook on a sharded ``model``; ``None`` when this torch cannot
    reduce-scatter unused parameters (a warning says what that risks).

    Args:
        model: the sharded model.
        mesh: the data-parallel ranks whose usage flags are combined.

    Returns:
        The hook, or None.
    """
    if not compat.REDUCE_SCATTER_UNUSED_PARAMS:
        logger.warning(
            "this torch cannot reduce-scatter unused parameters; ranks that skip part of "
            "a unit may disagree on reduce-scatter sizes"
        )
        return None
    return UnusedParamsHook(model, mesh=mesh)


@dataclass(frozen=True)
class UnusedParamsRuntimeHook(RuntimeHook):
    """The ``unused_params`` runtime hook (no plan data beyond its targets)."""

    name: ClassVar[str] = NAME
    reads: ClassVar[tuple[internals.Probe, ...]] = (
        internals.STATE_GROUPS,
        internals.GROUP_PARAMS,
        internals.GROUP_REDUCE,
        internals.PARAM_UNSHARDED,
        internals.PARAM_SHARDED,
        internals.QUEUE_CALLBACK,
    )

    def install(self, model: nn.Module, *, dims: ParallelDims) -> UnusedParamsHook | None:
        """The usage flags are reduced over ``dims.dp_mesh``: they decide what FSDP's
        reduce-scatter and all-reduce send, which run over the data-parallel ranks only
        (the ranks of a TP or CP group hold the same batch and use the same parameters;
        where they do not, their collectives in the forward already differ)."""
        return install_unused_params_hook(model, mesh=dims.dp_mesh)

    def collectives(self, step: HookStep) -> CommTally:
        """The usage flags: one byte per trainable parameter tensor a unit manages,
        all-reduced per mesh dimension in backward (a single rank skips it)."""
        tally = CommTally()
        if step.world_size > 1:
            flags = sum(1 for params in step.owned for _, p in params if p.requires_grad)
            for _ in range(step.dims):
                tally.add("backward", "all_reduce", flags)
        return tally
