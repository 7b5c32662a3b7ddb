"""The TP helper, then the library: a tiny transformers LLaVA on 4 gloo ranks.

A ``('dp', 'tp')`` 2x2 mesh. ``multimodal_fsdp.tensor_parallel.llama_style_plan`` plans
the Llama language model's attention and MLP projections (the frozen CLIP tower is left
out), ``apply_tensor_parallel`` applies it over ``tp``, then the library shards over
``dp`` (the whole mesh with ``dp_dims='dp'``). The two ranks of a TP group hold their DP
coordinate's batch, so the job must train like one process on the mean of the two DP
batches' losses: ``tests/test_tensor_parallel_distributed.py`` compares losses,
first-step gradients and final parameters (full tensors). Two cases: the plain plan,
and ``sequence_parallel=True`` (norms and residual adds on half the sequence each).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hf_vlms import build_llava, hf_loss, llava_batch
from registry import scenario
from scenarios_core import full
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp_core import DistributedContext
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.tensor_parallel import apply_tensor_parallel, llama_style_plan

STEPS = 2
LR = 0.05
DP = 2


def tp_llava_batches() -> list[list[dict[str, torch.Tensor]]]:
    """``batches[step][dp_rank]``: one image in DP 0's batch, two in DP 1's."""
    return [
        [llava_batch(100 * step + dp, images=1 + dp) for dp in range(DP)] for step in range(STEPS)
    ]


def build_tp_llava() -> torch.nn.Module:
    """The tiny LLaVA with its CLIP tower frozen."""
    model = build_llava()
    model.model.vision_tower.requires_grad_(False)
    return model


#: The cases of ``tp_helper_llava``: whether the plan is sequence-parallel.
CASES = {"plain": False, "sequence_parallel": True}


@scenario("tp_helper_llava")
def tp_helper_llava(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """See the module docstring."""
    return {name: _case(ctx, sequence_parallel=sp) for name, sp in CASES.items()}


def _case(ctx: DistributedContext, *, sequence_parallel: bool) -> dict[str, Any]:
    world = init_device_mesh(ctx.device.type, (DP, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = world["dp"].get_local_rank()
    model = build_tp_llava().to(ctx.device)
    plan = llama_style_plan(model, tp_size=world["tp"].size(), sequence_parallel=sequence_parallel)
    planned = apply_tensor_parallel(model, world["tp"], plan)
    MultimodalParallelizer(frozen_multimodal_sharding="root").parallelize(
        model, mesh=world, dp_dims="dp"
    )
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step, per_dp in enumerate(tp_llava_batches()):
        batch = {k: v.to(ctx.device) for k, v in per_dp[dp_rank].items()}
        loss = hf_loss(model, batch)
        loss.backward()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # both ranks of a TP group hold their DP coordinate's loss
        losses.append(total.item() / ctx.world_size)
    down = model.get_parameter("model.language_model.layers.0.mlp.down_proj.weight")
    assert isinstance(down, DTensor)
    norm = model.get_parameter("model.language_model.layers.0.input_layernorm.weight")
    return {
        "norm_is_dtensor": isinstance(norm, DTensor)
        and "tp" in (norm.device_mesh.mesh_dim_names or ()),
        "planned": planned,
        "losses": losses,
        "grads0": grads0,
        "params": {n: full(p) for n, p in model.named_parameters() if p.requires_grad},
        "down_proj_mesh": list(down.device_mesh.mesh_dim_names or ()),
        "down_proj_placements": [str(p) for p in down.placements],
    }
