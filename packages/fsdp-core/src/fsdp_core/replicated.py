"""Place a plan's replicated parameters before sharding, from the plan alone.

Replicated parameters stay whole on every rank, outside every unit
([`ShardingPlan.replicated_param_names`][fsdp_core.plan.ShardingPlan.replicated_param_names]);
the plan recorded their dtypes and whether ranks synchronise them.
"""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core.mesh import mesh_device
from fsdp_core.plan import ShardingPlan

__all__ = ["place_replicated_params"]

logger = logging.getLogger(__name__)


def place_replicated_params(model: nn.Module, plan: ShardingPlan, *, mesh: DeviceMesh) -> None:
    """Move the replicated parameters to the mesh device in the dtypes the plan recorded
    (else their own), then, when ``plan.sync_replicated``, broadcast them over ``mesh``
    from its first rank. Meta parameters stay on meta.

    Args:
        model: the model about to be sharded.
        plan: its plan (the replicated parameters, their dtypes, ``sync_replicated``).
        mesh: the ranks that hold the model (the lockstep mesh: a pipeline stage's).
    """
    if not plan.replicated_param_names:
        return
    named = dict(model.named_parameters())
    recorded = dict(plan.replicated_param_dtypes)
    device = mesh_device(mesh)
    sync = plan.sync_replicated and dist.is_initialized()
    dtypes = set()
    for name in plan.replicated_param_names:
        param = named[name]
        dtype = recorded.get(name, param.dtype)
        dtypes.add(str(dtype))
        target = param.device if param.device.type == "meta" else device
        if param.device != target or param.dtype != dtype:
            param.data = param.data.to(device=target, dtype=dtype)
        for dim in range(mesh.ndim) if sync and param.device.type != "meta" else ():
            if mesh.size(dim) > 1:  # one dimension after another: all equal the first
                dist.broadcast(param.data, group=mesh.get_group(dim), group_src=0)
    count = len(plan.replicated_param_names)
    logger.info("replicated %d parameters on %s (dtypes %s)", count, device, sorted(dtypes))
