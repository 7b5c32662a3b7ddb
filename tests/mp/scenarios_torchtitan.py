"""torchtitan on 2 ranks (issue 25): ``fsdp_core.integrations.torchtitan.parallelize_fn``
called the way torchtitan's Trainer calls a ``ModelSpec.parallelize_fn``: on a model
built on ``meta``, with ``ParallelDims``' mesh and torchtitan's configs, then
``to_empty`` and ``init_weights``, then the optimizer.

``init_weights`` here writes the seeded single-process values into each rank's shards
(``copy_full_into_``), so the runs compare with one process. torchtitan assumes an
accelerator: its mesh device type is set to this rank's device here, in the test only.
Without torchtitan installed the scenarios report ``skipped``.

``torchtitan_dp_tp`` (4 ranks, issue 34): ``ParallelDims(dp_shard=2, tp=2)``; the
adapter applies the caller's TP plan (``tensor_parallel.tensor_parallel_mlps`` on the
tiny DeepSeek-V4.1 model's language MLPs) on torchtitan's ``tp`` mesh, then the library
shards over ``dp_shard`` of torchtitan's dense mesh. The two ranks of a TP group train
their DP coordinate's batch, so the run compares with ``scenarios_nd``'s reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from framework_cases import TORCHTITAN, FrameworkCase
from registry import scenario
from scenarios_core import full
from scenarios_loops import _parallelizer
from torch import nn

from fsdp_core import DistributedContext
from fsdp_core.integrations.torchtitan import parallelize_fn
from fsdp_core.materialize import copy_full_into_
from fsdp_core.runtime import installed_hooks


def _torchtitan() -> Any:
    try:
        import torchtitan.distributed.parallel_dims as parallel_dims
    except ImportError:
        return None
    return parallel_dims


def _init_weights(model: nn.Module, case: FrameworkCase) -> None:
    """What a torchtitan model's ``init_weights`` does after ``to_empty``: its initial
    values (here the case's seeded model), each rank keeping its shard."""
    values = dict(case.loop.build_model().named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            copy_full_into_(param, values[name])


def run_torchtitan(case: FrameworkCase, ctx: DistributedContext, out: Path) -> dict[str, Any]:
    parallel_dims_module = _torchtitan()
    if parallel_dims_module is None:
        return {"skipped": "torchtitan is not installed"}
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig

    parallel_dims_module.device_type = ctx.device.type  # torchtitan assumes an accelerator
    parallel_dims = parallel_dims_module.ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=ctx.world_size
    )
    with torch.device("meta"):
        model = case.loop.build_model()
    fn = parallelize_fn(_parallelizer(case.loop))
    model = fn(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(),
        compile_config=_compile_config(CompileConfig, case),
        ac_config=None,
        dump_folder=str(out),
    )
    on_meta = all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device=ctx.device)
    _init_weights(model, case)
    optimizer = case.loop.optimizer_fn()([p for p in model.parameters() if p.requires_grad])
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step in range(case.loop.steps):
        batch = case.batch(step, ctx.rank)
        loss = case.loss(model, {k: _to(v, ctx) for k, v in batch.items()})
        loss.backward()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        if case.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.grad is not None], case.max_norm
            )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    return {
        "losses": losses,
        "grads0": grads0,
        "params": {n: full(p) for n, p in model.named_parameters()},
        "on_meta_after_parallelize": on_meta,
        "mesh": str(parallel_dims.get_mesh("dp_shard")),
        "compiled": _compiled_blocks(model),
    }


def _compile_config(config_class: Any, case: FrameworkCase) -> Any:
    if case.compile_backend is None:
        return config_class()
    return config_class(enable=True, components=["model"], backend=case.compile_backend)


def _compiled_blocks(model: nn.Module) -> list[str]:
    """The modules whose ``forward`` the compile replaced on the instance (balance_media
    wraps a tower's ``forward`` too: not a compiled one)."""
    return [
        name
        for name, module in model.named_modules()
        if hasattr(vars(module).get("forward"), "_torchdynamo_orig_callable")
    ]


def _to(value: Any, ctx: DistributedContext) -> Any:
    return value.to(ctx.device) if isinstance(value, torch.Tensor) else value


for _name in TORCHTITAN:

    def _run(ctx: DistributedContext, out: Path, _case: str = _name) -> dict[str, Any]:
        return run_torchtitan(TORCHTITAN[_case], ctx, out)

    scenario(_name)(_run)


@scenario("torchtitan_dp_tp")
def torchtitan_dp_tp(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """dp_shard=2 x tp=2 through the adapter (see the module docstring)."""
    from scenarios_nd import IMAGES, STEPS
    from tensor_parallel import tensor_parallel_mlps
    from vlm import LR, build_vlm, to_device, vlm_batches, vlm_loss

    from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer

    parallel_dims_module = _torchtitan()
    if parallel_dims_module is None:
        return {"skipped": "torchtitan is not installed"}
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig

    parallel_dims_module.device_type = ctx.device.type  # torchtitan assumes an accelerator
    parallel_dims = parallel_dims_module.ParallelDims(
        dp_replicate=1, dp_shard=-1, cp=1, tp=2, pp=1, ep=1, world_size=ctx.world_size
    )
    model = build_vlm(dtype=torch.float32, frozen_tower=True, device="meta")
    fn = parallelize_fn(
        DeepseekV41ModelParallelizer(frozen_multimodal_sharding="per_layer"),
        tensor_parallel=tensor_parallel_mlps,
    )
    model = fn(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(),
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=str(out),
    )
    on_meta = all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device=ctx.device)
    initial = build_vlm(dtype=torch.float32, frozen_tower=True)
    values = dict(initial.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            copy_full_into_(param, values[name])
        for name, buffer in initial.named_buffers():
            model.get_buffer(name).copy_(buffer)
    dp_rank = parallel_dims.get_mesh("dp_shard").get_local_rank()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step, per_dp in enumerate(vlm_batches(STEPS, 2, images=IMAGES)):
        loss = vlm_loss(model, to_device(per_dp[dp_rank], ctx.device))  # type: ignore[arg-type]
        loss.backward()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # both ranks of a TP group hold their DP coordinate's loss
        losses.append(total.item() / ctx.world_size)
    hooks = installed_hooks(model)
    return {
        "losses": losses,
        "grads0": grads0,
        "params": {n: full(p) for n, p in model.named_parameters()},
        "on_meta_after_parallelize": on_meta,
        "arrival_ranks": list(hooks["forward_agreement"].ranks),  # type: ignore[attr-defined]
        "unused_ranks": sorted(
            int(r)
            for r in hooks["unused_params"].mesh.mesh.flatten().tolist()  # type: ignore[attr-defined]
        ),
        "tp_mesh_dims": model.get_parameter("model.layers.0.mlp.gate_up.weight").device_mesh.ndim,
    }
