"""The least FSDP communication a sharding plan needs per step, from the plan alone.

Written apart from :mod:`multimodal_fsdp.estimate.costs` on purpose: the benchmark holds
both the measured step and the cost model against it, so it must not share the
cost model's code. It reads only the plan's units, their parameters
(``fsdp_core.unit_parameters``: which parameters ``fully_shard`` gives each unit)
and their mixed-precision policies. The rules (docs/benchmark.md derives them):

1. every unit that holds parameters is all-gathered once in forward;
2. a unit with trainable parameters that reshards after forward is all-gathered
   once more in backward (the root does not reshard unless asked);
3. a frozen unit is gathered once, in forward only (no gradient needs its
   parameters again);
4. parameters kept whole on every rank (``replicate``, FSDP-ignored) are never
   gathered;
5. every unit with trainable parameters reduce-scatters their gradients once.

Bytes are those of the unsharded buffer: each parameter's dim 0 padded up to a
multiple of the shard-group size, in the compute dtype for all-gathers and the
reduce dtype for reduce-scatters.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fsdp_core import ShardingPlan
from fsdp_core.plan import UnitPlan, unit_parameters

Minimum = dict[tuple[str, str], tuple[int, int]]


def _padded(param: nn.Parameter, shard: int) -> int:
    """Elements of the unsharded buffer: dim 0 rounded up to a multiple of ``shard``."""
    rows = math.ceil(param.shape[0] / shard) * shard
    return rows * math.prod(param.shape[1:])


def _reshards(unit: UnitPlan) -> bool:
    """Whether the unit frees its gathered parameters after forward."""
    setting = unit.reshard_after_forward
    if setting is None:
        return not unit.is_root
    return setting is not False and setting != 1


def _add(total: Minimum, key: tuple[str, str], nbytes: int) -> None:
    count, size = total.get(key, (0, 0))
    total[key] = (count + 1, size + nbytes)


def analytic_minimum(plan: ShardingPlan, model: nn.Module, shard: int) -> Minimum:
    """``{(phase, kind): (collectives, bytes)}`` of the FSDP collectives one step needs."""
    total: Minimum = {}
    for unit, params in zip(plan.units, unit_parameters(plan, model), strict=True):
        if not params:
            continue
        policy = unit.mp_policy
        compute = [policy.param_dtype or p.dtype for _, p in params]
        gather = sum(
            _padded(p, shard) * d.itemsize for (_, p), d in zip(params, compute, strict=True)
        )
        _add(total, ("forward", "all_gather"), gather)
        trainable = [p for _, p in params if p.requires_grad]
        if not trainable:
            continue
        if _reshards(unit):
            _add(total, ("backward", "all_gather"), gather)
        reduce: torch.dtype = policy.reduce_dtype or policy.param_dtype or trainable[0].dtype
        _add(
            total,
            ("backward", "reduce_scatter"),
            sum(_padded(p, shard) * reduce.itemsize for p in trainable),
        )
    return total


def minimum_totals(minimum: Minimum) -> tuple[int, int]:
    """(collectives, bytes) over every phase and kind."""
    return sum(c for c, _ in minimum.values()), sum(b for _, b in minimum.values())
