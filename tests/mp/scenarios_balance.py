"""balance_media=True on 2 ranks: every tower call spread over the ranks, any media.

Each case trains the fp32 DeepSeek-V4.1 VLM of ``balance.py`` (one policy, one kind of
tower) through the steps of ``balance.DISTRIBUTIONS`` (even, a text-only rank, all media
on one rank, one tower call per image with different numbers of calls per rank), with
an eval pass (uneven media) after step 1, and records losses, every step's gradients,
the final parameters and how many images each rank's tower encoded per step; the
pytest side compares them with one process running each step's global batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import balanced_vlm as balance
import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from torch import nn
from vlm import LR

from fsdp_core import DistributedContext, build_mesh
from multimodal_fsdp import MultimodalParallelizer


def _parallelize(model: nn.Module, policy: str, *, dp_replicate: int = 1, **options: Any) -> Any:
    parallelizer = MultimodalParallelizer(
        frozen_multimodal_sharding=policy,
        extra_tower_names=("vision",),
        balance_media=True,
        **options,
    )
    plan = parallelizer.plan(model)
    parallelizer.apply_plan(model, plan, mesh=build_mesh(dp_replicate=dp_replicate))
    return plan


def _encoded_counter(model: nn.Module) -> list[int]:
    """Images the tower's patch embedding saw on this rank (placeholders included)."""
    seen = [0]

    def count(_module: nn.Module, args: tuple[Any, ...]) -> None:
        seen[0] += int(args[0].shape[0])

    model.vision.patch_embed.register_forward_pre_hook(count)  # type: ignore[union-attr,operator]
    return seen


def _gathered(value: int, ctx: DistributedContext) -> list[int]:
    tensor = torch.tensor([value])
    parts = [torch.zeros(1, dtype=torch.int64) for _ in range(ctx.world_size)]
    dist.all_gather(parts, tensor)
    return [int(p.item()) for p in parts]


def _mean(value: torch.Tensor, ctx: DistributedContext) -> float:
    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / ctx.world_size


def _case(
    ctx: DistributedContext,
    policy: str,
    tower: str,
    *,
    table: tuple[tuple[int | bool, ...], ...] = balance.DISTRIBUTIONS,
    dp_replicate: int = 1,
) -> dict[str, Any]:
    model = balance.build(tower)
    plan = _parallelize(model, policy, dp_replicate=dp_replicate)
    seen = _encoded_counter(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads, encoded = [], [], []
    eval_loss = 0.0
    for step in range(len(table)):
        seen[0] = 0
        loss = balance.step_loss(model, step, ctx.rank, table)
        loss.backward()
        encoded.append(_gathered(seen[0], ctx))
        grads.append({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(_mean(loss, ctx))
        if step == 1:
            model.eval()
            with torch.no_grad():
                eval_loss = _mean(balance.eval_loss(model, ctx.rank), ctx)
            model.train()
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: full(p) for n, p in model.named_parameters()},
        "encoded": encoded,
        "eval_loss": eval_loss,
        "hooks": plan.hook_names(),
        "hook_lines": [h.format() for h in plan.hooks],
    }


@scenario("balance_media")
def balance_media(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Every policy with every kind of tower (see the module docstring)."""
    return {
        f"{policy}/{tower}": _case(ctx, policy, tower)
        for policy in balance.POLICIES
        for tower in balance.TOWERS
    }


@scenario("balance_media_hsdp")
def balance_media_hsdp(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """4 ranks on an HSDP 2x2 mesh: the calls are balanced over both dimensions."""
    return {
        f"per_layer/{tower}": _case(
            ctx, "per_layer", tower, table=balance.HSDP_DISTRIBUTIONS, dp_replicate=2
        )
        for tower in ("trainable", "adapter")
    }


@scenario("balance_media_accumulation")
def balance_media_accumulation(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Two micro-batches per step, text-only on one rank while the other has images
    (and the reverse), no gradient sync for the first: per_layer, adapter in the tower;
    also with uneven_media=True (projector folded into the root, the tower balanced)."""
    results: dict[str, Any] = {}
    for name, options in (("per_layer", {}), ("uneven", {"uneven_media": True})):
        model = balance.build("adapter")
        plan = _parallelize(model, "per_layer", **options)
        micro = balance.micro_batches(ctx.rank)
        for index, batch in enumerate(micro):
            model.set_requires_gradient_sync(index == len(micro) - 1)  # type: ignore[operator]
            model(**batch).backward()
        results[name] = {
            "grads": {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None},
            "units": [u.label for u in plan.units],
            "hooks": plan.hook_names(),
        }
    return results


@scenario("balance_media_hf")
def balance_media_hf(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Tiny transformers LLaVA (CLIP tower, hidden states) and Qwen2-VL (packed patches;
    images and videos: two tower calls on one rank, one or none on the other) under
    per_layer, frozen and trainable tower, media on some ranks only."""
    from multimodal_fsdp import MultimodalParallelizer as Parallelizer

    results: dict[str, Any] = {}
    for case in balance.HF_CASES:
        name, tower = case.split("/")
        model = balance.hf_build(name, tower)
        parallelizer = Parallelizer(frozen_multimodal_sharding="per_layer", balance_media=True)
        plan = parallelizer.plan(model)
        parallelizer.apply_plan(model, plan, mesh=build_mesh())
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        losses, grads = [], []
        for step in range(len(balance.HF_MEDIA[name])):
            loss = balance.hf_step_loss(model, name, step, ctx.rank)
            loss.backward()
            grads.append(
                {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            )
            opt.step()
            opt.zero_grad()
            losses.append(_mean(loss, ctx))
        results[case] = {"losses": losses, "grads": grads, "hooks": plan.hook_names()}
    return results
