"""The reference entry points called as frameworks call them, on real ranks (issue 24).

Each scenario shards the tiny DeepSeek-V4.1 model without ``parallelize``: the way NeMo
Automodel's MoE parallelizer drives ``PARALLELIZER._fully_shard_module`` (each vision
block, the tower, each text layer, the root; ``mesh=`` and ``mp_policy=`` only), the
same with ``fully_shard_deepseek_v41``, and a framework's own loop over the
``multimodal_fsdp`` free functions for each frozen-tower policy. Then it trains 3 steps;
tests/test_framework_calls_distributed.py compares with one process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from registry import scenario
from scenarios_vlm import STEPS, train_vlm
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from vlm import build_vlm, vlm_batches

from fsdp_core import DistributedContext, build_mesh, mixed_precision_policy
from model_deepseek_v41 import PARALLELIZER, fully_shard_deepseek_v41
from multimodal_fsdp import (
    MultimodalParallelizer,
    _shard_layer_containers_recursively,
    ignored_params_for_root,
    iter_multimodal_modules,
    module_is_fully_frozen,
    module_parameters,
    normalize_frozen_multimodal_sharding,
    shard_multimodal_module,
)

BF16 = mixed_precision_policy("bf16", "fp32")


def _nemo_flow(model: nn.Module, shard: Callable[..., object], mesh: DeviceMesh) -> None:
    """Each vision block, the tower, each text layer, then the root."""
    for block in model.vision.blocks:  # type: ignore[union-attr]
        shard(block, mesh=mesh, mp_policy=BF16)
    shard(model.vision, mesh=mesh, mp_policy=BF16)
    for layer in model.model.layers:  # type: ignore[union-attr]
        shard(layer, mesh=mesh, mp_policy=BF16)
    shard(model, mesh=mesh, mp_policy=BF16)


def _units(model: nn.Module) -> dict[str, list[str]]:
    """Unit members by their policy's param dtype ('fp32' / 'bf16')."""
    found: dict[int, tuple[Any, list[str]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            found.setdefault(id(state), (state, []))[1].append(name)
    by_dtype: dict[str, list[str]] = {}
    for state, names in found.values():
        dtype = state._mp_policy.param_dtype
        key = "fp32" if dtype == torch.float32 else "bf16"
        by_dtype.setdefault(key, []).extend(names)
    return {key: sorted(names) for key, names in by_dtype.items()}


def _deepseek(ctx: DistributedContext, shard: Callable[..., object]) -> dict[str, Any]:
    mesh = build_mesh()
    model = build_vlm(dtype=torch.bfloat16, frozen_tower=False).to(ctx.device)
    _nemo_flow(model, shard, mesh)
    result = train_vlm(model, ctx, vlm_batches(STEPS, ctx.world_size))
    result["units"] = _units(model)
    result["param_dtypes"] = {n: p.dtype for n, p in model.named_parameters()}
    return result


@scenario("entry_ds_fully_shard_module")
def ds_fully_shard_module(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _deepseek(ctx, PARALLELIZER._fully_shard_module)


@scenario("entry_ds_function")
def ds_function(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _deepseek(ctx, fully_shard_deepseek_v41)


def _multimodal_flow(model: nn.Module, policy: str, mesh: DeviceMesh) -> None:
    """A framework's loop over the reference functions, with its own frozen policy."""
    parallelizer = MultimodalParallelizer(extra_tower_names=("vision",))
    frozen_policy = normalize_frozen_multimodal_sharding(policy)

    def shard(module: nn.Module) -> object:
        return parallelizer._fully_shard_module(module, mesh=mesh, mp_policy=BF16)

    replicated: set[nn.Parameter] = set()
    for _name, module in iter_multimodal_modules(model):
        if not module_is_fully_frozen(module) or frozen_policy == "per_layer":
            shard_multimodal_module(module, shard)
        elif frozen_policy == "replicate":
            # Replicated parameters are not cast by FSDP: the framework casts them to the
            # compute dtype itself (fp32 islands would keep theirs).
            module.to(torch.bfloat16)
            replicated.update(module_parameters(module))
    _shard_layer_containers_recursively(model.model, shard)  # type: ignore[arg-type]
    parallelizer._fully_shard_module(
        model, mesh=mesh, mp_policy=BF16, ignored_params=ignored_params_for_root(model, replicated)
    )


for _policy in ("root", "per_layer", "replicate"):

    def _mm(ctx: DistributedContext, out: Path, _p: str = _policy) -> dict[str, Any]:
        model = build_vlm(dtype=torch.float32, frozen_tower=True).to(ctx.device)
        _multimodal_flow(model, _p, build_mesh())
        result = train_vlm(model, ctx, vlm_batches(STEPS, ctx.world_size))
        result["tower_sharded"] = [isinstance(p, DTensor) for p in model.vision.parameters()]
        result["vision_units"] = [
            n
            for n, m in model.named_modules()
            if n.startswith("vision") and isinstance(m, FSDPModule)
        ]
        result["replicated_dtypes"] = {
            n: p.dtype for n, p in model.named_parameters() if not isinstance(p, DTensor)
        }
        return result

    scenario(f"entry_mm_flow_{_policy}")(_mm)
