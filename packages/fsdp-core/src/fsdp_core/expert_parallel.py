"""Expert parallelism: experts the caller's EP plan sharded, kept out of FSDP.

The caller's EP plan (``model_deepseek_v41.moe.shard_experts``, torchtitan's
``ExpertParallel``) makes each expert weight a ``DTensor`` on a mesh dimension named for
EP. A plan makes these [`expert_param_names`][fsdp_core.expert_parallel.expert_param_names]
ignored parameters, which FSDP leaves as they are; the ``replica_grad_reduce`` hook
([`fsdp_core.replica_grad`][fsdp_core.replica_grad]) reduces their gradients.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_core.parallel_dims import dimension_role

__all__ = ["expert_param_names"]


def expert_param_names(model: nn.Module) -> tuple[str, ...]:
    """The parameters an EP plan sharded: ``DTensor``s on a mesh with an EP dimension.

    Args:
        model: the model, after its EP plan.

    Returns:
        Their qualified names.
    """
    return tuple(
        name
        for name, param in model.named_parameters()
        if isinstance(param, DTensor)
        and any(dimension_role(d) == "ep" for d in param.device_mesh.mesh_dim_names or ())
    )
