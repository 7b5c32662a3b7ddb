"""Tensor parallelism the way a user applies it before the library: torch's
``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on the language
model's MLPs of the tiny DeepSeek-V4.1 reference model (``model.layers.<i>.mlp``)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def tensor_parallel_mlps(model: nn.Module, tp_mesh: DeviceMesh) -> list[str]:
    """Shard every language-model MLP over ``tp_mesh``; returns the MLP paths.

    The MLP's fused ``gate_up`` output is chunked into gate and up, so it stays a DTensor
    (``use_local_output=False``): the chunk then sees the whole feature dimension and the
    model computes what it computes in one process."""
    paths = [
        path
        for path, _ in model.named_modules()
        if path.startswith("model.layers.") and path.endswith(".mlp")
    ]
    plan = {}
    for path in paths:
        plan[f"{path}.gate_up"] = ColwiseParallel(use_local_output=False)
        plan[f"{path}.down"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    return paths
