"""Misuse caught on every rank (issue 17, items 8 and 9): an optimizer built before
``parallelize``, adapters added after sharding, a plan applied after adapters.

Each scenario catches the expected error (a raising scenario would abort the whole
launch), gathers what every rank saw and returns it; the assertions are in
tests/test_misuse_distributed.py. All three are deterministic: every rank must raise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from torch import nn

from fsdp_core import (
    DistributedContext,
    ModelParallelizer,
    ModuleTreeChangedError,
    StaleOptimizerError,
    build_mesh,
)

DIM = 8


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.q_proj(x)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.lm_head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def _model() -> _Model:
    torch.manual_seed(0)
    return _Model()


def _lora(model: nn.Module) -> nn.Module:
    import peft

    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
    wrapped: nn.Module = peft.get_peft_model(model, config)
    return wrapped


def _gather(mine: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _caught(error: type[Exception], action: Any) -> tuple[str, str]:
    """(exception type, message) of what ``action`` raised; ('', '') if nothing."""
    try:
        action()
    except error as exc:
        return type(exc).__name__, str(exc)
    return "", ""


@scenario("misuse_optimizer_before_parallelize")
def optimizer_before_parallelize(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    model = _model()
    early = torch.optim.AdamW(model.parameters(), lr=0.1)
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    model(torch.randn(2, DIM)).sum().backward()
    error = _caught(StaleOptimizerError, early.step)
    # The remedy: the optimizer built after parallelize moves the head.
    late = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = model.lm_head.weight.full_tensor().clone()  # type: ignore[operator]
    late.step()
    moved = not torch.equal(before, model.lm_head.weight.full_tensor())  # type: ignore[operator]
    return {"errors": _gather(error), "moved": _gather(moved)}


@scenario("misuse_lora_after_parallelize")
def lora_after_parallelize(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    model = _model()
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    wrapped = _lora(model)
    error = _caught(ModuleTreeChangedError, lambda: wrapped(torch.randn(2, DIM)))
    # The group still works after the error (no rank was left inside a collective).
    alive = torch.ones(1)
    dist.all_reduce(alive)
    return {"errors": _gather(error), "alive": float(alive)}


@scenario("misuse_plan_before_lora")
def plan_before_lora(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    model = _model()
    parallelizer = ModelParallelizer()
    plan = parallelizer.plan(model)
    wrapped = _lora(model)
    error = _caught(
        ModuleTreeChangedError,
        lambda: parallelizer.apply_plan(wrapped, plan, mesh=build_mesh()),
    )
    # The remedy: plan the model as it is now.
    parallelizer.parallelize(wrapped, mesh=build_mesh())
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=0.1)
    wrapped(torch.randn(2, DIM)).sum().backward()
    optimizer.step()
    return {"errors": _gather(error), "trained": True}
