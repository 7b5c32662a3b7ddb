"""Parameters some ranks skip: equal reduce-scatters, and no gradient where no rank used one.

Ranks that skip different parts of a unit (the projector on a text-only batch, unrouted
experts) would reduce-scatter different sizes; ``set_reduce_scatter_unused_params`` sends
zeros instead, but gives a parameter no rank used a zero gradient that AdamW still moves.
[`UnusedParamsHook`][fsdp_core.unused_params.UnusedParamsHook] records which parameters
got a gradient, and after each syncing backward one all-reduce (MAX, a byte per tensor)
over the data-parallel mesh sets the gradients no rank made back to ``None``. It also
evens the reduce-scatter order (``fsdp_core._backward_order``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

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
    """The installed hook, put on the sharded ``model`` by its constructor.

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
        self._handles.append(model.register_forward_hook(self._attach))
        self._watch: BackwardWatch | None = BackwardWatch(model, self._on_backward)
        self._attach()

    def _attach(self, *_: object) -> None:
        """Hook every unsharded parameter that exists by now (they appear at a unit's
        first all-gather: this runs after each forward)."""
        for index, record in enumerate(self._records):
            unsharded = None if record.hooked else internals.unsharded_parameter(record.fsdp_param)
            if unsharded is None:
                continue

            def mark(param: torch.Tensor, index: int = index) -> None:
                # Autograd also calls this when the parameter's backward got no gradient
                # (an unread tower output of the balanced media exchange): no use.
                if param.grad is not None:
                    self._used[index] = True

            self._handles.append(unsharded.register_post_accumulate_grad_hook(mark))  # type: ignore[no-untyped-call]
            record.hooked = True

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
                internals.sharded_parameter(record.fsdp_param).grad = None
                dropped.append(internals.param_fqn(record.fsdp_param) or f"<parameter {index}>")
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
        """The usage flags are reduced over ``dims.dp_mesh``, the ranks of FSDP's own
        reductions (a TP or CP group's ranks use the same parameters)."""
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
