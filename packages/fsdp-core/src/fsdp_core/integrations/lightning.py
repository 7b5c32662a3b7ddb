"""Lightning's ``ModelParallelStrategy``: the library as the model's parallelisation.

Lightning hands the user a ``("data_parallel", "tensor_parallel")`` mesh (the Trainer's
``self.device_mesh`` in ``configure_model()``, Fabric's ``parallelize_fn`` argument).
The user applies TP first; ``parallelize_fn`` then shards over the ``data_parallel``
sub-mesh, sliced from that mesh so that
[`ParallelDims`][fsdp_core.parallel_dims.ParallelDims] finds the TP ranks beside it. It
leaves an already sharded model alone: Lightning calls ``configure_model()`` again for
every ``fit``/``validate``/``test``. Lightning's meshes have no expert-parallel
dimension: experts placed over EP need a mesh with one, passed instead. Lightning itself
is not imported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_core.expert_parallel import expert_param_names
from fsdp_core.parallel_dims import ParallelDims
from fsdp_core.parallelizer import ModelParallelizer
from fsdp_core.sharding import is_sharded

__all__ = ["DATA_PARALLEL_DIM", "data_parallel_mesh", "parallelize_fn"]

logger = logging.getLogger(__name__)

#: The mesh dimension Lightning's ``ModelParallelStrategy`` names its data-parallel ranks.
DATA_PARALLEL_DIM = "data_parallel"

#: What ``parallelize_fn`` returns: ``(module, device_mesh) -> module``.
ParallelizeFn = Callable[[nn.Module, DeviceMesh], nn.Module]


def data_parallel_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel ranks of a Lightning ``ModelParallelStrategy`` mesh: its
    ``data_parallel`` sub-mesh, or a 1-D mesh without that name as it is.

    Raises:
        TypeError: ``device_mesh`` is not a ``DeviceMesh``.
        ValueError: a mesh of several dimensions has none named ``data_parallel``.

    Args:
        device_mesh: the strategy's mesh.

    Returns:
        The mesh FSDP shards over.
    """
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    names = tuple(device_mesh.mesh_dim_names or ())
    if DATA_PARALLEL_DIM not in names:
        if device_mesh.ndim == 1:
            return device_mesh
        raise ValueError(
            f"the device mesh has dimensions {names or device_mesh.ndim} and none named "
            f"{DATA_PARALLEL_DIM!r}; pass Lightning's ModelParallelStrategy mesh or a 1-D "
            "data-parallel mesh"
        )
    if names == (DATA_PARALLEL_DIM,):
        return device_mesh
    return device_mesh[DATA_PARALLEL_DIM]


def parallelize_fn(
    parallelizer: ModelParallelizer,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
) -> ParallelizeFn:
    """A ``(module, device_mesh) -> module`` function that shards with ``parallelizer``.

    Fabric takes it as ``ModelParallelStrategy(parallelize_fn=...)``; a
    ``LightningModule`` calls it in ``configure_model()`` with ``self.device_mesh``.
    It shards in place and returns the module (an already sharded one as it is).

    Args:
        parallelizer: plans and applies the sharding.
        mp_policy: the mixed-precision policy (the parallelizer's default if None).
        offload_policy: FSDP2's offload policy.
        reshard_after_forward: as ``fully_shard`` takes it.

    Returns:
        The function Lightning calls.

    Raises:
        TypeError: ``parallelizer`` is not a ``ModelParallelizer``.
    """
    if not isinstance(parallelizer, ModelParallelizer):
        raise TypeError(
            "parallelizer must be a ModelParallelizer (multimodal_fsdp's "
            "MultimodalParallelizer, model_deepseek_v41's PARALLELIZER, ...), got "
            f"{type(parallelizer).__name__}"
        )

    def parallelize(module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if is_sharded(module):
            logger.info("%s is already sharded; leaving it as it is", type(module).__name__)
            return module
        mesh = data_parallel_mesh(device_mesh)
        _check_experts(module, mesh)
        return parallelizer.parallelize(
            module,
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
        )

    return parallelize


def _check_experts(module: nn.Module, mesh: DeviceMesh) -> None:
    """Experts placed over EP need a mesh that shows the EP dimension (every rank alike)."""
    experts = expert_param_names(module)
    if experts and not ParallelDims.from_mesh(mesh).ep_names:
        raise ValueError(
            f"{len(experts)} parameters ({experts[0]}, ...) are placed over expert "
            f"parallelism, but the mesh given ({ParallelDims.from_mesh(mesh).describe()}) has "
            "no expert-parallel dimension (Lightning's ModelParallelStrategy mesh has none): "
            "build the mesh with ('data_parallel', 'expert_parallel') dimensions, place the "
            "experts on its 'expert_parallel' dimension and pass that mesh instead"
        )
