"""Deep crashes and a silent no-op turned into the same clear error on every rank (issue 24,
item 4): uneven micro-batch counts, an empty batch on one rank, a meta-built model that was
never loaded, and an optimizer step after backwards with gradient sync off.

Each scenario catches the expected error (a raising scenario would abort the whole
launch, and before the fixes several aborted the process or hung), gathers what every
rank saw and returns it; the assertions are in tests/test_crashes_distributed.py. After
the error, each scenario checks that the process group still works (no rank was left
inside a collective) and, where it makes sense, that the remedy trains.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_misuse import DIM, _model
from torch import nn

from fsdp_core import (
    DistributedContext,
    ModelParallelizer,
    build_mesh,
    export_full_state_dict,
    load_checkpoint,
    load_full_state_dict,
)

LR = 0.1


def _gather(mine: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _caught(action: Any) -> tuple[str, str]:
    """(exception type, message) of what ``action`` raised; ('', '') if nothing. Any
    exception: the tests say which type every rank must report."""
    try:
        action()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", ""


def _alive() -> float:
    """1.0 per rank when the process group still works."""
    alive = torch.ones(1)
    dist.all_reduce(alive)
    return float(alive)


def _toy() -> nn.Module:
    model = _model()
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    return model


def _has(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


# ----------------------------------------------------------- uneven micro-batches
@scenario("crash_uneven_micro_batches")
def uneven_micro_batches(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 0 accumulates 2 micro-batches, rank 1 runs 1 (gradient sync set before each
    forward, as accelerate and Lightning do). Before: gloo EnforceNotMet, SIGABRT."""
    model = _toy()
    count = 2 if ctx.rank == 0 else 1

    def step() -> None:
        for index in range(count):
            model.set_requires_gradient_sync(index == count - 1)
            model(torch.randn(2, DIM)).sum().backward()

    error = _caught(step)
    return {"errors": _gather(error), "alive": _alive()}


@scenario("crash_sync_set_after_forward")
def sync_set_after_forward(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Uneven counts with the flag set between forward and backward: rank 0 (2
    micro-batches) and rank 1 (1, then its next step) meet at their second forward."""
    model = _toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    count = 2 if ctx.rank == 0 else 1

    def steps() -> None:
        for _ in range(2):
            for index in range(count):
                loss = model(torch.randn(2, DIM)).sum()
                model.set_requires_gradient_sync(index == count - 1)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    error = _caught(steps)
    return {"errors": _gather(error), "alive": _alive()}


# ------------------------------------------------------------------- empty batch
def _llava(**options: Any) -> nn.Module:
    from hf_vlms import build_llava

    from multimodal_fsdp import MultimodalParallelizer

    model = build_llava()
    MultimodalParallelizer(**options).parallelize(model, mesh=build_mesh())
    return model


def _text_batch(rank: int, *, empty: bool) -> dict[str, torch.Tensor]:
    from hf_vlms import llava_batch

    batch = llava_batch(seed=rank, images=0)
    return {k: v[:0] for k, v in batch.items()} if empty else batch


def _train_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model(**batch).loss.backward()


def _eval_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model.eval()
    with torch.no_grad():
        model(**batch)


@scenario("crash_empty_batch")
def empty_batch(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 0's batch has zero rows (training, eval, and under balance_media). Before:
    a reshape error inside transformers on rank 0, 'Connection closed by peer' on rank 1."""
    if not _has("transformers"):
        return {"skipped": "needs transformers"}
    results: dict[str, Any] = {}
    batch = _text_batch(ctx.rank, empty=ctx.rank == 0)
    for name, options in (("plain", {}), ("balance_media", {"balance_media": True})):
        model = _llava(**options)
        results[f"{name}_train"] = _gather(_caught(lambda m=model: _train_step(m, batch)))
        results[f"{name}_eval"] = _gather(_caught(lambda m=model: _eval_step(m, batch)))
        model.train()
    # The remedy: every rank with rows; the same model trains on.
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model(**_text_batch(ctx.rank, empty=False)).loss.backward()
    optimizer.step()
    results["alive"] = _alive()
    return results


# ------------------------------------------------------------- never loaded
def _meta_llava() -> nn.Module:
    from hf_vlms import build_llava

    from multimodal_fsdp import MultimodalParallelizer

    config = build_llava().config
    with torch.device("meta"):
        model = type(build_llava())(config)
    MultimodalParallelizer().parallelize(model, mesh=build_mesh())
    return model


@scenario("crash_never_loaded")
def never_loaded(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Meta build -> parallelize -> to_empty() -> forward without loading. Before:
    IndexError: index out of range in self (CLIP's position_ids buffer is garbage)."""
    if not _has("transformers"):
        return {"skipped": "needs transformers"}
    model = _meta_llava()
    model.to_empty(device=ctx.device)
    batch = _text_batch(ctx.rank, empty=False)
    return {"errors": _gather(_caught(lambda: model(**batch))), "alive": _alive()}


@scenario("crash_checkpoint_after_to_empty")
def checkpoint_after_to_empty(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Resume: meta build -> parallelize -> to_empty() -> load_checkpoint -> forward (and
    load_full_state_dict in place of load_checkpoint).
    Non-persistent buffers are in no checkpoint. Before: a checkpoint saved without
    step= did not load ('Missing key in checkpoint state_dict: step.'), and with a step
    the forward failed (IndexError: CLIP's position_ids buffer was garbage)."""
    if not _has("transformers"):
        return {"skipped": "needs transformers"}
    from fsdp_core import save_checkpoint

    trained = _llava()
    save_checkpoint(out / "crash_ckpt", trained)
    batch = _text_batch(ctx.rank, empty=False)
    with torch.no_grad():
        expected = _gather(trained(**batch).loss.item())
    model = _meta_llava()
    model.to_empty(device=ctx.device)
    step = load_checkpoint(out / "crash_ckpt", model)  # saved without step=: None
    loss: list[float] = []

    def forward() -> None:
        with torch.no_grad():
            loss.append(model(**batch).loss.item())

    error = _caught(forward)
    # The sibling: a full state dict broadcast from rank 0 after to_empty().
    full = export_full_state_dict(trained)
    broadcast = _meta_llava()
    broadcast.to_empty(device=ctx.device)
    load_full_state_dict(broadcast, full if ctx.rank == 0 else None)
    with torch.no_grad():
        broadcast_loss = _caught(lambda: loss.append(broadcast(**batch).loss.item()))
    return {
        "errors": _gather(error),
        "broadcast_errors": _gather(broadcast_loss),
        "step": step,
        "loss": _gather(loss[0] if loss else None),
        "broadcast_loss": _gather(loss[-1] if len(loss) == 2 else None),
        "expected": expected,
        "alive": _alive(),
    }


# ------------------------------------------------------- gradient sync left off
@scenario("crash_sync_never_on")
def sync_never_on(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """set_requires_gradient_sync(False) and never on again before optimizer.step()
    (and: turned on only after the backward). Before: the step silently changed nothing."""
    model = _toy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    before = model.lm_head.weight.full_tensor().clone()  # type: ignore[operator]
    model.set_requires_gradient_sync(False)
    model(torch.randn(2, DIM)).sum().backward()
    off = _caught(optimizer.step)
    model.set_requires_gradient_sync(True)
    turned_on_late = _caught(optimizer.step)
    unchanged = torch.equal(before, model.lm_head.weight.full_tensor())  # type: ignore[operator]
    # The remedy: a backward with gradient sync on before the step moves the weights.
    optimizer.zero_grad()
    model(torch.randn(2, DIM)).sum().backward()
    optimizer.step()
    moved = not torch.equal(before, model.lm_head.weight.full_tensor())  # type: ignore[operator]
    return {
        "off": _gather(off),
        "turned_on_late": _gather(turned_on_late),
        "unchanged": unchanged,
        "moved": moved,
    }
