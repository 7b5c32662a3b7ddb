"""torchtitan: the library as a ``ModelSpec.parallelize_fn``.

torchtitan builds the model on the ``meta`` device, calls the spec's
``parallelize_fn(model, *, parallel_dims, training, parallelism, compile_config,
ac_config, dump_folder)``, then ``model.to_empty(...)`` and ``model.init_weights(...)``,
and builds the optimizer from the returned model. ``parallelize_fn`` makes such a
function from a parallelizer: it reads the data-parallel mesh from ``ParallelDims``
(``dp_shard``, with ``dp_replicate`` as HSDP), the mixed precision, CPU offload and
``fsdp_reshard_after_forward`` from torchtitan's configs, applies torchtitan's
activation checkpointing when configured, plans and applies the library's units
on the ``meta`` model (planning needs no values), and compiles each block when
``compile.enable`` names the model, as torchtitan's ``apply_compile`` does
(``fullgraph=True``, ``compile.backend``), but after sharding, so that FSDP's and the
library's hooks stay outside the compiled code
([`compile_blocks`][fsdp_core.regional_compile.compile_blocks]).

With ``tensor_parallel_degree > 1`` the function is torchtitan's parallelize_fn in
full: torchtitan's Trainer applies no parallelism itself, each model's parallelize
function applies TP first (``model.parallelize(parallel_dims)`` in torchtitan's own
models), then activation checkpointing, compile and FSDP. The library has no TP plan of
its own for a vision-language model, so the caller passes one as
``parallelize_fn(..., tensor_parallel=fn)``: ``fn(model, tp_mesh)`` runs first, on the
``meta`` model, with ``ParallelDims``' ``tp`` mesh. The library then shards over the
data-parallel dimensions of torchtitan's dense mesh, given as that mesh's
``(dp..., tp)`` sub-mesh with ``dp_dims`` naming the data-parallel ones, so that
[`ParallelDims`][fsdp_core.parallel_dims.ParallelDims] sees the TP dimension (the
ranks that run the forward together, those that hold the same batch).

With ``context_parallel_degree > 1`` the mesh given to the library also has ``cp``:
FSDP then shards over the data-parallel shard dimension and ``cp`` together (torchtitan
folds them into ``fsdp`` too), and a model package's media balancing shares each tower
call among the CP ranks ([`ParallelDims`][fsdp_core.parallel_dims.ParallelDims]). On
torchtitan's legacy
mesh backend, whose ``fsdp`` dimension already folds ``cp``, the library shards over
``batch`` x ``cp`` (its ``dataloading`` mesh), which has no HSDP replicas.

With ``expert_parallel_degree > 1`` (EP borrowed from the data-parallel ranks, tp and
cp 1) the caller's EP plan runs first, ``parallelize_fn(..., expert_parallel=fn)``:
``fn(model, ep_mesh)`` places the routed experts on ``ParallelDims``' ``ep`` mesh. The
library then gets torchtitan's sparse mesh (``efsdp``, ``ep``; HSDP: with
``dp_replicate``) with the data-parallel names: FSDP shards everything but the experts
over ``efsdp`` x ``ep`` (torchtitan's ``fsdp`` ranks), keeps the experts out of its
units with their EP placements and reduces their gradients over ``efsdp``
([`fsdp_core.expert_parallel`][fsdp_core.expert_parallel]).

With ``pipeline_parallel_degree > 1`` torchtitan's ``pipelining_fn`` (``pipeline_llm``,
``pipeline_vlm``) cuts the model into parts, one per local stage, and calls this
``parallelize_fn`` once per part with the same ``ParallelDims``. Each part is sharded
like a model of its own over the data-parallel ranks of this rank's ``pp`` coordinate
(the sub-meshes above hold only those), and its runtime hooks meet over that stage's
ranks; a part without the towers (every stage but the first) is planned as a plain
language model. Pipeline schedules end each step's backwards by hand, which the step
agreement leaves to them ([`fsdp_core.step_agreement`][fsdp_core.step_agreement]).

EP beside TP or CP is refused, naming the option to change,
rather than silently ignored. torchtitan is not
imported here; its configs are read by attribute name, so any object with those
attributes works.
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
    """torchtitan's data-parallel mesh dimensions: ``dp_shard`` (``fsdp`` in older
    backends; ``batch`` there with CP, whose ``fsdp`` folds ``cp``), after
    ``dp_replicate`` for HSDP."""
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
    """The mesh to shard over from a torchtitan ``ParallelDims``: ``dp_shard`` (1-D), or
    ``(dp_replicate, dp_shard)`` (HSDP) when ``dp_replicate > 1``.

    Older torchtitan backends name the shard dimension ``fsdp``: that is used when
    ``dp_shard`` is not a mesh of this ``ParallelDims``. With tensor parallelism, pass
    [`sharding_mesh`][fsdp_core.integrations.torchtitan.sharding_mesh] to the library
    instead: this mesh alone does not show the ``tp`` dimension.

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
    """What the library's ``parallelize(model, mesh=..., dp_dims=...)`` takes from a
    torchtitan ``ParallelDims``: the data-parallel dimensions of its dense mesh plus
    ``cp`` and ``tp`` when they are above 1 (one sub-mesh of torchtitan's, so the
    library sees which ranks run the forward together and hold the same batch), and the
    data-parallel names among them.

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
    """torchtitan's ``parallelize_fn`` sharding with ``parallelizer`` (any
    ``ModelParallelizer``: ``multimodal_fsdp.MultimodalParallelizer(...)`` for a
    vision-language model).

    Options given here win over torchtitan's configs: ``mp_policy`` over
    ``training.mixed_precision_param`` / ``mixed_precision_reduce``, ``offload_policy``
    over ``training.enable_cpu_offload``, ``reshard_after_forward`` over
    ``parallelism.fsdp_reshard_after_forward``. The function accepts the model on
    ``meta`` or allocated, shards it in place and returns it; on ``meta``, fill the
    shards afterwards as torchtitan does (``to_empty`` then ``init_weights``) or with
    the library's ``materialize_from_full`` / ``load_pretrained``.

    ``tensor_parallel`` is required when ``parallel_dims.tp > 1``: ``fn(model,
    tp_mesh)`` applies the model's TP plan (torch's ``parallelize_module``) before
    activation checkpointing and sharding, as torchtitan's own parallelize functions
    do; the library keeps its placements and shards over the data-parallel ranks.
    ``expert_parallel`` is required when ``parallel_dims.ep > 1``: ``fn(model, ep_mesh)``
    places the routed experts on the ``ep`` mesh (``Shard(0)``), before the rest.

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
        tp_enabled = bool(getattr(parallel_dims, "tp_enabled", False))
        if tp_enabled and tensor_parallel is None:
            raise ValueError(
                f"tensor parallelism (parallelism.tensor_parallel_degree={parallel_dims.tp}) "
                "is enabled and torchtitan's parallelize_fn applies it: pass the model's TP "
                "plan as parallelize_fn(..., tensor_parallel=fn), fn(model, tp_mesh) "
                "(torch's parallelize_module), or set tensor_parallel_degree to 1"
            )
        if tp_enabled and tensor_parallel is not None:
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
            mp_policy=mp_policy if mp_policy is not None else _mp_policy(training),
            offload_policy=offload_policy
            if offload_policy is not None
            else _offload_policy(training),
            reshard_after_forward=reshard_after_forward
            if reshard_after_forward is not None
            else _reshard(parallelism),
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
    """The backend to compile the blocks with (``None``: no compile of the model), checked
    before anything is applied."""
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
    """torchtitan's activation checkpointing, as its own parallelize functions apply it:
    every child of ``model.layers`` wrapped, before the units are planned."""
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
