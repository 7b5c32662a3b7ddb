"""A call of the model made on some ranks only (issue 24, item 2).

The model is sharded over a mesh whose process group times out after ``TIMEOUT_S``, so
a rank left inside a collective fails within the test; the default group stays healthy
for the scenarios after these. Each scenario catches what every rank raises and gathers
it; tests/test_arrival_distributed.py holds the assertions.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from torch.distributed.device_mesh import DeviceMesh
from vlm import build_vlm, to_device, vlm_batches, vlm_loss

from fsdp_core import DistributedContext, mixed_precision_policy
from fsdp_core.runtime import installed_hooks
from model_deepseek_v41 import PARALLELIZER
from multimodal_fsdp import MultimodalParallelizer

#: The collective timeout of the scenarios' mesh.
TIMEOUT_S = 8.0
BF16 = mixed_precision_policy("bf16", "fp32")


def _sharded(ctx: DistributedContext) -> tuple[torch.nn.Module, list[Any]]:
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu")
    model = build_vlm(dtype=torch.bfloat16, frozen_tower=True).to(ctx.device)
    PARALLELIZER.parallelize(model, mesh=mesh, mp_policy=BF16)
    batches = [to_device(b[ctx.rank], ctx.device) for b in vlm_batches(3, ctx.world_size)]
    return model, batches


def _outcome(action: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        action()
    except Exception as exc:  # what this rank raised, for the test to read
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "notes": list(getattr(exc, "__notes__", [])),
            "seconds": round(time.monotonic() - start, 1),
        }
    return {"type": "", "message": "", "notes": [], "seconds": round(time.monotonic() - start, 1)}


def _gather(mine: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _train_step(model: torch.nn.Module, batch: Any) -> None:
    model.train()
    vlm_loss(model, batch).backward()


def _eval_forward(model: torch.nn.Module, batch: Any) -> None:
    model.eval()
    with torch.no_grad():
        vlm_loss(model, batch)


@scenario("arrival_eval_then_train")
def eval_then_train(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 0 evaluates alone while rank 1 goes on to the next training step."""
    model, batches = _sharded(ctx)
    _train_step(model, batches[0])
    if ctx.rank == 0:
        outcome = _outcome(lambda: _eval_forward(model, batches[1]))
    else:
        outcome = _outcome(lambda: _train_step(model, batches[1]))
    return {"outcomes": _gather(outcome)}


@scenario("arrival_eval_alone")
def eval_alone(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 0 evaluates alone; rank 1 makes no call of the model at all."""
    model, batches = _sharded(ctx)
    _train_step(model, batches[0])
    if ctx.rank == 0:
        outcome = _outcome(lambda: _eval_forward(model, batches[1]))
    else:
        outcome = _outcome(lambda: None)
    return {"outcomes": _gather(outcome)}


@scenario("arrival_tower_by_hand")
def tower_by_hand(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 0 calls the tower outside the forward (a gather of the root unit) while
    rank 1 trains: the sibling of the forward case."""
    model, batches = _sharded(ctx)
    _train_step(model, batches[0])
    pixels = batches[1]["pixel_values"]

    def tower() -> None:
        with torch.no_grad():
            model.vision(pixels)  # type: ignore[operator]

    action = tower if ctx.rank == 0 else (lambda: _train_step(model, batches[1]))
    return {"outcomes": _gather(_outcome(action))}


@scenario("arrival_eval_everywhere")
def eval_everywhere(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """The right way: every rank evaluates (its own batch); nothing is raised, and only
    the calls without gradients waited."""
    model, batches = _sharded(ctx)
    outcomes = []
    for batch in batches:
        outcomes.append(_outcome(lambda b=batch: _train_step(model, b)))
        outcomes.append(_outcome(lambda b=batch: _eval_forward(model, b)))
    hook = installed_hooks(model)["forward_arrival"]
    return {
        "outcomes": _gather(outcomes),
        "calls": _gather(hook.calls),  # type: ignore[attr-defined]
        "waits": _gather(hook.waits),  # type: ignore[attr-defined]
    }


@scenario("arrival_generate_empty_batch")
def generate_empty_batch(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 1's generate() prompt has no rows (the last, incomplete batch of an eval
    set): every rank raises at once instead of rank 1 crashing inside transformers while
    rank 0 waits in a collective."""
    from hf_vlms import HF_VLMS

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))
    mesh = DeviceMesh.from_group(group, "cpu")
    vlm = HF_VLMS["llava"]
    model = vlm.build()
    model.get_submodule(vlm.tower).requires_grad_(False)
    MultimodalParallelizer().parallelize(model, mesh=mesh)
    batch = vlm.batch(100 + ctx.rank, images=1)
    rows = 1 if ctx.rank == 0 else 0
    prompt = {
        "input_ids": batch["input_ids"][:rows, :20],
        "pixel_values": batch["pixel_values"][:rows],
    }

    def generate() -> None:
        model.generate(**prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)  # type: ignore[operator]

    return {"outcomes": _gather(_outcome(generate))}
