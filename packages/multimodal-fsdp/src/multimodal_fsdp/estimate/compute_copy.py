"""The unsharded copy of a model that the one-process traces run: every parameter in
the dtype it computes in under a plan, with FSDP2's casts at unit boundaries, so that the
activation trace and the record of a step's media see the sizes the sharded model computes.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core import ShardingPlan
from fsdp_core.plan import unit_parameters

__all__ = ["add_cast_hooks", "cast_floats", "compute_copy", "materialise"]

logger = logging.getLogger(__name__)


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Cast the floating tensors of a value.

    Args:
        value: A tensor, or tuples, lists and plain dicts of them (other values pass).
        dtype: The dtype to cast to.

    Returns:
        ``value`` with its floating tensors cast.
    """
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple | list):
        return type(value)(cast_floats(v, dtype) for v in value)
    if type(value) is dict:
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


def add_cast_hooks(module: nn.Module, policy: MixedPrecisionPolicy) -> list[Any]:
    """What FSDP2 does at a unit's boundary: cast inputs to the compute dtype, outputs
    to ``output_dtype``.

    Args:
        module: A member module of the unit.
        policy: The unit's mixed-precision policy.

    Returns:
        The hooks' handles (remove them when done).
    """
    handles = []
    param_dtype, output_dtype = policy.param_dtype, policy.output_dtype
    if policy.cast_forward_inputs and param_dtype is not None:

        def pre(_: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            return cast_floats(args, param_dtype), cast_floats(dict(kwargs), param_dtype)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    if output_dtype is not None:

        def post(_: nn.Module, __: Any, output: Any) -> Any:
            return cast_floats(output, output_dtype)

        handles.append(module.register_forward_hook(post))
    return handles


def materialise(model: nn.Module) -> None:
    """Give a meta-device model real (random) values on the CPU: sizes do not depend on them.

    Args:
        model: The model, changed in place (nothing happens unless it has meta tensors).
    """
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


def compute_copy(model: nn.Module, plan: ShardingPlan) -> nn.Module:
    """An unsharded copy of ``model`` in its compute dtypes.

    Args:
        model: The model (materialised on the CPU if on meta).
        plan: The plan whose units' ``param_dtype`` (and replicated dtypes) apply.

    Returns:
        The copy.
    """
    replicated = dict(plan.replicated_param_dtypes)
    twin = copy.deepcopy(model)
    materialise(twin)
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
