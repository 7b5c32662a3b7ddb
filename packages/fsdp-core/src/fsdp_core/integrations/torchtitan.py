"""torchtitan: the library as a ``ModelSpec.parallelize_fn``.

torchtitan builds the model on ``meta``, calls the spec's ``parallelize_fn``, then
``to_empty`` and ``init_weights``. The function made here reads torchtitan's configs
(mixed precision, CPU offload, resharding, activation checkpointing, compile) and meshes
(``dp_shard``/``dp_replicate``; with TP, CP or EP the sub-mesh that shows those ranks),
runs the caller's TP or EP plan first, then plans and applies the library's units on the
``meta`` model and compiles each block after sharding, so that FSDP's and the library's
hooks stay outside the compiled code
([`compile_blocks`][fsdp_core.regional_compile.compile_blocks]). A pipeline stage's part
is sharded like a model of its own. EP beside TP or CP is refused. torchtitan is not
imported: its configs are read by attribute name. The torchtitan guide has the details.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_core.containers import iter_layer_items
from fsdp_core.parallelizer import ModelParallelizer
from fsdp_core.precision import mixed_precision_policy
from fsdp_core.regional_compile import compile_blocks

__all__ = ["data_parallel_mesh", "parallelize_fn", "sharding_mesh"]

logger = logging.getLogger(__name__)

#: What ``parallelize_fn`` returns: torchtitan's ``ModelSpec.parallelize_fn``.
ParallelizeFn = Callable[..., nn.Module]

#: The caller's tensor parallelism: ``fn(model, tp_mesh)`` shards ``model`` in place
#: (torch's ``parallelize_module`` with the model's plan); its return value is ignored.
TensorParallelFn = Callable[[nn.Module, DeviceMesh], object]

#: ``ParallelismConfig.fsdp_reshard_after_forward`` -> the library's option
#: (``None``: the plan's own choice, which is FSDP's default).
_RESHARD: dict[str, bool | None] = {"default": None, "always": True, "never": False}


def _ep_enabled(parallel_dims: Any) -> bool:
    return bool(getattr(parallel_dims, "ep_enabled", False))


def _check_supported(parallel_dims: Any) -> None:
    beside = [d for d in ("tp", "cp") if getattr(parallel_dims, f"{d}_enabled", False)]
    if _ep_enabled(parallel_dims) and beside:
        raise ValueError(
            f"expert parallelism (parallelism.expert_parallel_degree) beside {', '.join(beside)}"
            ": the library plans EP borrowed from the data-parallel ranks only; set "
            f"{' and '.join(f'{d} to 1' for d in beside)}, or expert_parallel_degree to 1"
        )


def _dp_names(parallel_dims: Any) -> tuple[str, ...]:
    """``dp_shard`` (older backends: ``fsdp``, or ``batch`` with CP), after ``dp_replicate``."""
    if not _has_mesh(parallel_dims, "dp_shard") and getattr(parallel_dims, "cp_enabled", False):
        return ("batch",)
    shard = "dp_shard" if _has_mesh(parallel_dims, "dp_shard") else "fsdp"
    if getattr(parallel_dims, "dp_replicate_enabled", False):
        return ("dp_replicate", shard)
    return (shard,)


def _get_mesh(parallel_dims: Any, dims: tuple[str, ...]) -> DeviceMesh:
    mesh = parallel_dims.get_mesh(dims[0] if len(dims) == 1 else list(dims))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"parallel_dims.get_mesh({dims!r}) returned {type(mesh).__name__}")
    return mesh


def data_parallel_mesh(parallel_dims: Any) -> DeviceMesh:
    """The mesh to shard over: ``dp_shard`` (``fsdp`` in older backends), with
    ``dp_replicate`` (HSDP) when it is above 1. With TP, CP or EP pass
    [`sharding_mesh`][fsdp_core.integrations.torchtitan.sharding_mesh] to the library
    instead: this mesh does not show those ranks.

    Args:
        parallel_dims: torchtitan's ``ParallelDims`` (its meshes built).

    Returns:
        The data-parallel mesh.

    Raises:
        ValueError: context or expert parallelism is enabled (with context
            parallelism, shard over ``sharding_mesh``, which shows ``cp``).
    """
    _check_supported(parallel_dims)
    for flag, what in (
        ("cp_enabled", "context parallelism (parallelism.context_parallel_degree)"),
        ("ep_enabled", "expert parallelism (parallelism.expert_parallel_degree)"),
    ):
        if getattr(parallel_dims, flag, False):
            raise ValueError(
                f"{what} is enabled: FSDP must shard over its ranks too, which "
                "this data-parallel mesh does not show; pass sharding_mesh(parallel_dims) "
                "to the library instead"
            )
    return _get_mesh(parallel_dims, _dp_names(parallel_dims))


def sharding_mesh(parallel_dims: Any) -> tuple[DeviceMesh, tuple[str, ...]]:
    """The ``mesh=`` and ``dp_dims=`` of the library's ``parallelize``: the data-parallel
    dimensions plus ``cp`` and ``tp`` when above 1 (EP: the sparse ``efsdp``/``ep`` mesh),
    one sub-mesh of torchtitan's so that the library sees which ranks share a batch.

    Args:
        parallel_dims: torchtitan's ``ParallelDims`` (its meshes built).

    Returns:
        The mesh and its data-parallel dimension names.

    Raises:
        ValueError: expert parallelism beside tensor or context parallelism.
    """
    _check_supported(parallel_dims)
    if _ep_enabled(parallel_dims):
        replicate = getattr(parallel_dims, "dp_replicate_enabled", False)
        efsdp = ("dp_replicate", "efsdp") if replicate else ("efsdp",)
        return _get_mesh(parallel_dims, (*efsdp, "ep")), efsdp
    dp_names = _dp_names(parallel_dims)
    others = tuple(d for d in ("cp", "tp") if getattr(parallel_dims, f"{d}_enabled", False))
    return _get_mesh(parallel_dims, (*dp_names, *others)), dp_names


def _has_mesh(parallel_dims: Any, name: str) -> bool:
    try:
        return parallel_dims.get_optional_mesh(name) is not None
    except ValueError:  # not a dimension of this backend's meshes
        return False


def parallelize_fn(
    parallelizer: ModelParallelizer,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    tensor_parallel: TensorParallelFn | None = None,
    expert_parallel: TensorParallelFn | None = None,
) -> ParallelizeFn:
    """torchtitan's ``parallelize_fn`` sharding with ``parallelizer``.

    Options given here win over torchtitan's configs. The function shards the model
    (on ``meta`` or allocated) in place and returns it. ``tensor_parallel`` (needed when
    ``tp > 1``) and ``expert_parallel`` (when ``ep > 1``) run first, on the TP or EP mesh,
    as torchtitan's own parallelize functions apply TP before the rest.

    Args:
        parallelizer: plans and applies the sharding.
        mp_policy: the mixed-precision policy (torchtitan's config if None).
        offload_policy: FSDP2's offload policy (torchtitan's config if None).
        reshard_after_forward: as ``fully_shard`` takes it (torchtitan's config if None).
        tensor_parallel: ``fn(model, tp_mesh)``, the model's TP plan.
        expert_parallel: ``fn(model, ep_mesh)``, the model's EP plan.

    Returns:
        The function torchtitan calls with ``(model, parallel_dims, job_config)``.

    Raises:
        TypeError: ``parallelizer`` is not a ``ModelParallelizer``, or
            ``tensor_parallel`` or ``expert_parallel`` is not callable.
    """
    if not isinstance(parallelizer, ModelParallelizer):
        raise TypeError(
            "parallelizer must be a ModelParallelizer (multimodal_fsdp's "
            "MultimodalParallelizer, model_deepseek_v41's PARALLELIZER, ...), got "
            f"{type(parallelizer).__name__}"
        )
    for name, fn in (("tensor_parallel", tensor_parallel), ("expert_parallel", expert_parallel)):
        if fn is not None and not callable(fn):
            raise TypeError(
                f"{name} must be a function (model, mesh) -> None, got {type(fn).__name__}"
            )

    def parallelize(
        model: nn.Module,
        *,
        parallel_dims: Any,
        training: Any = None,
        parallelism: Any = None,
        compile_config: Any = None,
        ac_config: Any = None,
        dump_folder: str = "",
        **_unused: Any,
    ) -> nn.Module:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        mesh, dp_dims = sharding_mesh(parallel_dims)
        backend = _compile_backend(model, compile_config)
        if getattr(parallel_dims, "tp_enabled", False):
            if tensor_parallel is None:
                raise ValueError(
                    f"tensor parallelism (parallelism.tensor_parallel_degree="
                    f"{parallel_dims.tp}) is enabled and torchtitan's parallelize_fn applies "
                    "it: pass the model's TP plan as parallelize_fn(..., tensor_parallel=fn), "
                    "fn(model, tp_mesh) (torch's parallelize_module), or set "
                    "tensor_parallel_degree to 1"
                )
            tensor_parallel(model, _get_mesh(parallel_dims, ("tp",)))
        if _ep_enabled(parallel_dims):
            if expert_parallel is None:
                raise ValueError(
                    f"expert parallelism (parallelism.expert_parallel_degree="
                    f"{parallel_dims.ep}) is enabled and torchtitan's parallelize_fn applies "
                    "it: pass the model's EP plan as parallelize_fn(..., expert_parallel=fn), "
                    "fn(model, ep_mesh), or set expert_parallel_degree to 1"
                )
            expert_parallel(model, _get_mesh(parallel_dims, ("ep",)))
        if ac_config is not None:
            _apply_activation_checkpointing(model, ac_config, dump_folder)
        sharded = parallelizer.parallelize(
            model,
            mesh=mesh,
            dp_dims=dp_dims,
            mp_policy=_mp_policy(training) if mp_policy is None else mp_policy,
            offload_policy=_offload_policy(training) if offload_policy is None else offload_policy,
            reshard_after_forward=(
                _reshard(parallelism) if reshard_after_forward is None else reshard_after_forward
            ),
        )
        if backend is not None:
            names = compile_blocks(sharded, backend=backend, fullgraph=True)
            logger.info("compiled %d blocks with torch.compile(backend=%r)", len(names), backend)
        return sharded

    return parallelize


def _mp_policy(training: Any) -> MixedPrecisionPolicy | None:
    if training is None:
        return None
    param = getattr(training, "mixed_precision_param", "float32")
    reduce = getattr(training, "mixed_precision_reduce", "float32")
    return mixed_precision_policy(param, reduce)


def _offload_policy(training: Any) -> OffloadPolicy | None:
    if training is None or not getattr(training, "enable_cpu_offload", False):
        return None
    # Pinned host memory needs an accelerator (FSDP2 fails on a CPU-only host with it).
    return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())


def _reshard(parallelism: Any) -> bool | None:
    if parallelism is None:
        return None
    value = getattr(parallelism, "fsdp_reshard_after_forward", "default")
    if value not in _RESHARD:
        raise ValueError(
            f"parallelism.fsdp_reshard_after_forward is {value!r}; valid values: "
            f"{', '.join(_RESHARD)}"
        )
    return _RESHARD[value]


def _compile_backend(model: nn.Module, compile_config: Any) -> str | None:
    """The backend to compile the blocks with (``None``: no compile), checked up front."""
    if compile_config is None or not getattr(compile_config, "enable", False):
        return None
    if "model" not in getattr(compile_config, "components", ("model",)):
        return None
    backend = getattr(compile_config, "backend", "inductor")
    if not isinstance(backend, str):
        raise TypeError(f"compile.backend must be a string, got {type(backend).__name__}")
    if next(iter_layer_items(model), None) is None:
        raise ValueError(
            f"compile.enable with 'model' in compile.components: {type(model).__name__} has "
            "no layer stack (nn.ModuleList/nn.ModuleDict of blocks) to compile block by "
            "block; remove 'model' from compile.components (or disable compile)"
        )
    return backend


def _apply_activation_checkpointing(model: nn.Module, ac_config: Any, dump_folder: str) -> None:
    """torchtitan's activation checkpointing on ``model.layers``, before planning."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.Module):
        raise ValueError(
            f"activation_checkpoint is configured ({type(ac_config).__qualname__}), and "
            f"torchtitan applies it to model.layers, which {type(model).__name__} does not "
            "have: set activation_checkpoint to none, or wrap the blocks yourself before "
            "torchtitan calls parallelize_fn"
        )
    ac_config.build(dump_folder=dump_folder).apply(model)
    logger.info("applied torchtitan's %s to model.layers", type(ac_config).__qualname__)
