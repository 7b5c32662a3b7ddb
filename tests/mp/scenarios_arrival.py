"""A call of the model made on some ranks only (issue 24, item 2).

The model is sharded over a mesh whose process group times out after ``TIMEOUT_S``, so
a rank left inside a collective fails within the test; the default group stays healthy
for the scenarios after these. Each scenario catches what every rank raises and gathers
it; tests/test_arrival_distributed.py holds the assertions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from torch.distributed.device_mesh import DeviceMesh
from vlm import build_vlm, to_device, vlm_batches, vlm_loss

from fsdp_core import DistributedContext, mixed_precision_policy
from fsdp_core.rank_wait import TIMEOUT_ENV, WARN_ENV
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
    """The right way: every rank evaluates (its own batch); nothing is raised, and every
    call met the other ranks at the agreement."""
    model, batches = _sharded(ctx)
    outcomes = []
    for batch in batches:
        outcomes.append(_outcome(lambda b=batch: _train_step(model, b)))
        outcomes.append(_outcome(lambda b=batch: _eval_forward(model, b)))
    hook = installed_hooks(model)["forward_agreement"]
    return {
        "outcomes": _gather(outcomes),
        "calls": _gather(hook.calls),  # type: ignore[attr-defined]
        "points": _gather(hook.agreement.points),  # type: ignore[attr-defined]
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


#: The short waits of the warning scenarios: warn after WARN_S, give up after GIVE_UP_S
#: (shorter than the mesh's collective timeout, so the setting is what ends the wait).
WARN_S = 1.0
GIVE_UP_S = 4.0


class _Records(logging.Handler):
    """The warnings of the shared wait on this rank (fsdp_core.rank_wait)."""

    def __init__(self, on_warning: Any = None) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.on_warning = on_warning

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if self.on_warning is not None:
            self.on_warning()


@contextlib.contextmanager
def _short_waits(timeout_s: float, records: _Records) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in (TIMEOUT_ENV, WARN_ENV)}
    os.environ[TIMEOUT_ENV] = f"{timeout_s:g}"
    os.environ[WARN_ENV] = f"{WARN_S:g}"
    logger = logging.getLogger("fsdp_core.rank_wait")
    logger.addHandler(records)
    try:
        yield
    finally:
        logger.removeHandler(records)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@scenario("arrival_warns_then_gives_up")
def warns_then_gives_up(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 0 evaluates alone while rank 1 waits in a barrier (issue 33, item 3): rank 0
    warns within WARN_S, naming rank 1 and its last call, and gives up after GIVE_UP_S;
    rank 1, let out of the barrier, then makes the given-up call and raises too instead
    of running the forward alone."""
    model, batches = _sharded(ctx)
    _train_step(model, batches[0])
    records = _Records()
    with _short_waits(GIVE_UP_S, records):
        if ctx.rank == 0:
            outcome = _outcome(lambda: _eval_forward(model, batches[1]))
            dist.barrier()  # lets rank 1 out once this rank gave up
        else:
            dist.barrier()
            outcome = _outcome(lambda: _eval_forward(model, batches[1]))
    return {"outcomes": _gather(outcome), "warnings": _gather(records.messages)}


@scenario("arrival_slow_rank_goes_on")
def slow_rank_goes_on(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """A false alarm: rank 1 comes to an eval forward only after rank 0 warned about it
    (well before the give-up). The forward runs on both ranks, with the same losses as
    when the ranks came together, and training goes on."""
    model, batches = _sharded(ctx)
    _train_step(model, batches[0])
    store: Any = dist.group.WORLD.get_group_store()  # type: ignore[union-attr]
    warned = "scenario/arrival_slow_rank_goes_on/warned"

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            return float(vlm_loss(model, batches[1]))

    together = eval_loss()
    records = _Records(on_warning=lambda: store.set(warned, "1"))
    with _short_waits(60.0, records):
        if ctx.rank == 1:
            # Slow: it comes only once rank 0 has warned (or, where nothing warns, later
            # than rank 0's wait would last without the setting).
            with contextlib.suppress(RuntimeError):  # DistStoreError: nobody warned
                store.wait([warned], timedelta(seconds=2 * TIMEOUT_S))
        late: dict[str, Any] = {}
        outcome = _outcome(lambda: late.update(loss=eval_loss()))
    after = _outcome(lambda: _train_step(model, batches[2]))
    return {
        "outcomes": _gather([outcome, after]),
        "losses": _gather((together, late.get("loss"))),
        "warnings": _gather(records.messages),
    }


@scenario("arrival_slow_training_rank")
def slow_training_rank(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """The sibling in a training forward: rank 0 waits at the agreement (the c10d store,
    as for an eval forward) for rank 1, which comes only once rank 0 warned about it. The
    step runs on both ranks and training goes on."""
    model, batches = _sharded(ctx)
    _train_step(model, batches[0])
    store: Any = dist.group.WORLD.get_group_store()  # type: ignore[union-attr]
    warned = "scenario/arrival_slow_training_rank/warned"
    records = _Records(on_warning=lambda: store.set(warned, "1"))
    with _short_waits(60.0, records):
        if ctx.rank == 1:
            with contextlib.suppress(RuntimeError):  # DistStoreError: nobody warned
                store.wait([warned], timedelta(seconds=2 * TIMEOUT_S))
        late = _outcome(lambda: _train_step(model, batches[1]))
    after = _outcome(lambda: _train_step(model, batches[2]))
    return {"outcomes": _gather([late, after]), "warnings": _gather(records.messages)}
