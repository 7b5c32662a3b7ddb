"""N-D meshes: the library's data parallelism beside tensor parallelism applied first.

4 gloo ranks on a ``('dp', 'tp')`` 2x2 mesh. torch's ``parallelize_module`` shards the
language model's MLPs of the tiny DeepSeek-V4.1 reference model over ``tp``
(``tensor_parallel.tensor_parallel_mlps``); then the library shards over ``dp``, given
either the sub-mesh ``world['dp']`` or the whole mesh with ``dp_dims='dp'``, under each
frozen-tower policy, with and without ``balance_media``. The two ranks of a TP group
hold the same batch (their DP coordinate's), so the run must train like one process on
the two DP batches of each step: ``tests/test_nd_distributed.py`` compares losses,
first-step gradients and final parameters (full tensors) with that reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from tensor_parallel import tensor_parallel_mlps
from torch.distributed.device_mesh import init_device_mesh
from vlm import LR, build_vlm, to_device, vlm_batches, vlm_loss

from fsdp_core import DistributedContext
from fsdp_core.runtime import installed_hooks
from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer

STEPS = 3
#: Images per sample on each DP coordinate: uneven, so balancing moves some.
IMAGES = [2, 1]
POLICIES = ("root", "per_layer", "replicate")
#: How the library is given the mesh.
GIVEN = ("submesh", "whole")


def nd_cases() -> list[str]:
    return [
        f"{given}/{policy}/{'balanced' if balanced else 'plain'}"
        for given in GIVEN
        for policy in POLICIES
        for balanced in (False, True)
    ]


def _case(ctx: DistributedContext, given: str, policy: str, balanced: bool) -> dict[str, Any]:
    world = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = world["dp"].get_local_rank()
    model = build_vlm(dtype=torch.float32, frozen_tower=True).to(ctx.device)
    tensor_parallel_mlps(model, world["tp"])
    parallelizer = DeepseekV41ModelParallelizer(
        frozen_multimodal_sharding=policy, balance_media=balanced
    )
    if given == "submesh":
        parallelizer.parallelize(model, mesh=world["dp"])
    else:
        parallelizer.parallelize(model, mesh=world, dp_dims="dp")
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
    arrival = hooks["forward_arrival"]
    warmup = hooks["accumulation_warmup"]
    return {
        "losses": losses,
        "grads0": grads0,
        "params": {n: full(p) for n, p in model.named_parameters()},
        "hooks": sorted(hooks),
        "arrival_ranks": list(arrival.ranks),  # type: ignore[attr-defined]
        "agreement_ranks": sorted(
            int(r)
            for r in warmup.agreement.mesh.mesh.flatten().tolist()  # type: ignore[attr-defined]
        ),
        "unused_ranks": sorted(
            int(r)
            for r in hooks["unused_params"].mesh.mesh.flatten().tolist()  # type: ignore[attr-defined]
        ),
        "tp_mesh_dims": model.get_parameter("model.layers.0.mlp.gate_up.weight").device_mesh.ndim,
    }


@scenario("nd_dp_tp")
def nd_dp_tp(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Every case of ``nd_cases`` (see the module docstring)."""
    results: dict[str, Any] = {}
    for name in nd_cases():
        given, policy, balanced = name.split("/")
        results[name] = _case(ctx, given, policy, balanced == "balanced")
    return results


def _gather(mine: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


@scenario("nd_tp_peer_empty_batch")
def nd_tp_peer_empty_batch(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 1, the TP peer of rank 0, calls the model with an empty batch. The step
    agreement runs over the ranks that run the forward together (all four), so every
    rank raises ``EmptyBatchError`` before any collective of the forward; agreeing over
    the data-parallel ranks only ({1, 3}) would stop ranks 1 and 3 while ranks 0 and 2
    waited in the TP collectives of the forward. Then every rank with rows trains on."""
    from fsdp_core.step_agreement import is_empty_batch

    world = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = world["dp"].get_local_rank()
    model = build_vlm(dtype=torch.float32, frozen_tower=True).to(ctx.device)
    tensor_parallel_mlps(model, world["tp"])
    DeepseekV41ModelParallelizer(frozen_multimodal_sharding="root").parallelize(
        model, mesh=world["dp"]
    )
    batch = to_device(vlm_batches(1, 2, images=IMAGES)[0][dp_rank], ctx.device)
    empty = {k: (v[:0] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    mine = empty if ctx.rank == 1 else batch
    assert is_empty_batch((), mine) == (ctx.rank == 1)
    error: tuple[str, str] = ("", "")
    try:
        vlm_loss(model, mine).backward()  # type: ignore[arg-type]
    except Exception as exc:
        error = (type(exc).__name__, str(exc))
    errors = _gather(error)
    vlm_loss(model, batch).backward()  # type: ignore[arg-type]
    alive = torch.ones(1)
    dist.all_reduce(alive)
    return {"errors": errors, "alive": float(alive)}


#: Images per sample on each DP coordinate, per media distribution of
#: ``nd_encoder_work``: even, uneven, and all media on one data group (the other
#: text-only).
ENCODER_MEDIA = {"even": [1, 1], "uneven": [2, 1], "one": [2, 0]}


def _encoder_rows(ctx: DistributedContext, media: list[int], balanced: bool) -> list[int]:
    """Images each rank's tower encodes in one training step (forward and backward) on
    the ``('dp', 'tp')`` 2x2 mesh, gathered from every rank: a forward pre-hook on the
    tower's first layer counts the rows (images) it runs on."""
    world = init_device_mesh(ctx.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = world["dp"].get_local_rank()
    model = build_vlm(dtype=torch.float32, frozen_tower=True).to(ctx.device)
    tensor_parallel_mlps(model, world["tp"])
    DeepseekV41ModelParallelizer(
        frozen_multimodal_sharding="root", balance_media=balanced
    ).parallelize(model, mesh=world["dp"])
    rows = [0]

    def count(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        rows[0] += int(args[0].shape[0])

    model.get_submodule("vision.patch_embed").register_forward_pre_hook(count)
    batch = vlm_batches(1, 2, images=media)[0][dp_rank]
    vlm_loss(model, to_device(batch, ctx.device)).backward()  # type: ignore[arg-type]
    return [int(n) for n in _gather(rows[0])]


@scenario("nd_encoder_work")
def nd_encoder_work(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Images encoded per rank, with and without ``balance_media``, for each media
    distribution of ``ENCODER_MEDIA`` (``tests/test_nd_encoder_work.py``)."""
    return {
        f"{name}/{'balanced' if balanced else 'plain'}": _encoder_rows(ctx, media, balanced)
        for name, media in ENCODER_MEDIA.items()
        for balanced in (False, True)
    }
