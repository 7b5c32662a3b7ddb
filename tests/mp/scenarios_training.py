"""What real training throws at it: meta init, uneven media, accumulation, checkpoints."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from scenarios_vlm import train_vlm
from torch import nn
from torch.distributed.tensor import DTensor
from vlm import CONFIG, LR, build_vlm, global_batches, split_batch, to_device, vlm_batches, vlm_loss

from fsdp_core import (
    DistributedContext,
    build_mesh,
    export_full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    materialize_from_full,
    mixed_precision_policy,
    save_checkpoint,
)
from model_deepseek_v41 import PARALLELIZER, build_deepseek_v41
from model_deepseek_v41.modeling import iter_initial_parameters
from multimodal_fsdp.runtime.schedule_check import UnevenMediaError

BF16 = mixed_precision_policy("bf16", "fp32")


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


# ---------------------------------------------------------------- initialisation
@scenario("init_meta")
def init_meta(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Meta build -> shard -> materialise from full tensors; and the broadcast path."""
    results: dict[str, Any] = {}
    for policy in ("root", "per_layer", "replicate"):
        model = build_vlm(dtype=torch.bfloat16, frozen_tower=True, device="meta")
        PARALLELIZER.with_options(frozen_multimodal_sharding=policy).parallelize(
            model, mesh=build_mesh(), mp_policy=BF16
        )
        materialize_from_full(model, iter_initial_parameters(model, 0), device=ctx.device)
        results[f"materialized_{policy}"] = _full_params(model)
    model = build_vlm(dtype=torch.bfloat16, frozen_tower=False, device="meta")
    PARALLELIZER.parallelize(model, mesh=build_mesh(), mp_policy=BF16)
    model.to_empty(device=ctx.device)
    source = (
        build_deepseek_v41(CONFIG, seed=0, dtype=torch.bfloat16).state_dict()
        if ctx.rank == 0
        else None
    )
    load_full_state_dict(model, source)
    results["broadcast"] = _full_params(model)
    # What not to do: per-shard random init on a CPU mesh gives every rank the same draw.
    model = build_vlm(dtype=torch.float32, frozen_tower=False, device="meta")
    PARALLELIZER.parallelize(model, mesh=build_mesh(), mp_policy=BF16)
    model.to_empty(device=ctx.device)
    torch.manual_seed(0)
    with torch.no_grad():
        weight = model.model.layers[0].mlp.down.weight
        assert isinstance(weight, DTensor)
        weight.to_local().normal_()
    results["naive_local"] = weight.to_local().clone()
    gathered = [torch.zeros_like(results["naive_local"]) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, results["naive_local"])
    results["naive_all_ranks_equal"] = all(torch.equal(g, gathered[0]) for g in gathered)
    return results


# ------------------------------------------------------------------ uneven media
def _uneven(
    ctx: DistributedContext, policy: str, on_step: Callable[[int], object] | None = None
) -> dict[str, Any]:
    model = build_vlm(dtype=torch.bfloat16, frozen_tower=True).to(ctx.device)
    PARALLELIZER.with_options(frozen_multimodal_sharding=policy).parallelize(
        model, mesh=build_mesh(), mp_policy=BF16
    )
    images = [1 if rank % 2 == 0 else 0 for rank in range(ctx.world_size)]
    return train_vlm(model, ctx, vlm_batches(3, ctx.world_size, images=images), on_step=on_step)


@scenario("uneven_root")
def uneven_root(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _uneven(ctx, "root")


@scenario("uneven_replicate")
def uneven_replicate(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _uneven(ctx, "replicate")


@scenario("uneven_per_layer")
def uneven_per_layer(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Must fail fast on every rank with a message, not hang."""
    steps: list[int] = []
    try:
        _uneven(ctx, "per_layer", on_step=steps.append)
    except UnevenMediaError as exc:
        return {
            "error_message": str(exc),
            "steps_done": len(steps),
        }
    return {"error_message": "", "steps_done": len(steps)}


# ------------------------------------------------------- gradient accumulation
def accumulation_batches(world: int) -> list[list[list[Any]]]:
    """``[step][rank] = micro-batches``: text-only first, then images (and the reverse)."""
    text = vlm_batches(2, world, images=[0] * world, base_seed=7000)
    image = vlm_batches(2, world, base_seed=8000)
    return [
        [[text[0][r], image[0][r]] for r in range(world)],
        [[image[1][r], text[1][r]] for r in range(world)],
    ]


@scenario("accum_text_only")
def accum_text_only(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """A separately sharded (trainable) tower, text-only micro-batches, accumulation."""
    model = build_vlm(dtype=torch.float32, frozen_tower=False).to(ctx.device)
    PARALLELIZER.parallelize(model, mesh=build_mesh(), mp_policy=BF16)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step, per_rank in enumerate(accumulation_batches(ctx.world_size)):
        micro = per_rank[ctx.rank]
        total = torch.zeros(())
        for index, batch in enumerate(micro):
            model.set_requires_gradient_sync(index == len(micro) - 1)
            loss = vlm_loss(model, to_device(batch, ctx.device))  # type: ignore[arg-type]
            loss.backward()
            total += loss.detach().float().cpu()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    return {"losses": losses, "grads0": grads0, "params": _full_params(model)}


# ------------------------------------------------------------------- checkpoints
def _ckpt_model(ctx: DistributedContext, *, seed: int = 0) -> nn.Module:
    """bf16 DeepSeek with fp32 norms; frozen tower replicated except a trainable block 0."""
    model = build_deepseek_v41(CONFIG, seed=seed, dtype=torch.bfloat16).to(ctx.device)
    model.vision.requires_grad_(False)
    model.vision.blocks[0].requires_grad_(True)
    PARALLELIZER.with_options(frozen_multimodal_sharding="replicate").parallelize(
        model, mesh=build_mesh(), mp_policy=BF16
    )
    return model


def _ckpt_steps(
    model: nn.Module, opt: torch.optim.Optimizer, ctx: DistributedContext, steps: range
) -> list[float]:
    data = global_batches(max(steps) + 1)
    losses = []
    for step in steps:
        loss = vlm_loss(
            model, to_device(split_batch(data[step], ctx.world_size, ctx.rank), ctx.device)
        )  # type: ignore[arg-type]
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    return losses


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


@scenario("ckpt_save_resume")
def ckpt_save_resume(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Uninterrupted 4 steps vs 2 steps + save + fresh model/optimizer + load + 2 steps."""
    ckpt = out / "ckpt"
    model = _ckpt_model(ctx)
    opt = _optimizer(model)
    uninterrupted = _ckpt_steps(model, opt, ctx, range(4))
    del model, opt

    model = _ckpt_model(ctx)
    opt = _optimizer(model)
    first = _ckpt_steps(model, opt, ctx, range(2))
    save_checkpoint(ckpt, model, opt, step=2)
    saved_full = export_full_state_dict(model)
    saved_dtypes = {n: p.dtype for n, p in model.named_parameters()}
    replicated = sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor))
    del model, opt

    model = _ckpt_model(ctx, seed=123)  # different values: the load must overwrite them all
    opt = _optimizer(model)
    step = load_checkpoint(ckpt, model, opt)
    loaded_full = export_full_state_dict(model)
    resumed = _ckpt_steps(model, opt, ctx, range(2, 4))
    if ctx.rank == 0:
        torch.save(saved_full, out / "ckpt_full.pt")
    return {
        "uninterrupted": uninterrupted,
        "interrupted": first + resumed,
        "loaded_step": step,
        "saved_full": saved_full,
        "loaded_full": loaded_full,
        "saved_dtypes": saved_dtypes,
        "replicated": replicated,
        "checkpoint": str(ckpt),
    }


@scenario("ckpt_load_other_world")
def ckpt_load_other_world(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Load the checkpoint written by a launch of another world size."""
    previous = os.environ.get("FSDP_TEST_PREVIOUS_OUT")
    if not previous:
        raise RuntimeError("FSDP_TEST_PREVIOUS_OUT is not set (the save launch must run first)")
    model = _ckpt_model(ctx, seed=321)
    opt = _optimizer(model)
    step = load_checkpoint(Path(previous) / "ckpt", model, opt)
    return {
        "loaded_step": step,
        "loaded_full": export_full_state_dict(model),
        "dtypes": {n: p.dtype for n, p in model.named_parameters()},
        "next_losses": _ckpt_steps(model, opt, ctx, range(2, 4)),
    }
