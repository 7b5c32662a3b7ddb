"""A tiny model and the single-process references the multi-process tests compare to."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


class MixedRMSNorm(nn.Module):
    """RMSNorm that computes in fp32 and returns the input dtype (any weight dtype)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * self.weight.float()).to(x.dtype)


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = MixedRMSNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ToyModel(nn.Module):
    """Embedding-free regression model with a layer container, as FSDP sees a transformer."""

    def __init__(self, dim: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(ToyBlock(dim) for _ in range(layers))
        self.norm = MixedRMSNorm(dim)
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(self.norm(h))


def build_toy(
    seed: int, *, dtype: torch.dtype = torch.float32, fp32_norms: bool = False
) -> ToyModel:
    torch.manual_seed(seed)
    model = ToyModel()
    for name, param in model.named_parameters():
        if param.dim() > 1:
            with torch.no_grad():
                param.normal_(0.0, 0.3)
        elif "bias" in name:
            with torch.no_grad():
                param.uniform_(-0.1, 0.1)
    model = model.to(dtype)
    if fp32_norms:
        for module in model.modules():
            if isinstance(module, MixedRMSNorm):
                module.float()
    return model


def toy_batches(
    steps: int, world: int, per_rank: int = 4, seed: int = 123
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``batches[step][rank] = (x, y)``: deterministic, different on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(per_rank, 16, generator=gen), torch.randn(per_rank, 4, generator=gen))
            for _ in range(world)
        ]
        for _ in range(steps)
    ]


def toy_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    out = model(x.to(next(model.parameters()).dtype))
    return F.mse_loss(out.float(), y)


def reference_run(
    build: Callable[[], nn.Module],
    batches: list[list[Any]],
    loss_fn: Callable[..., torch.Tensor],
    *,
    compute_dtype: torch.dtype | None,
    lr: float,
    keep_fp32: Callable[[str], bool] = lambda name: False,
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Emulate data-parallel FSDP training in one process.

    Each "rank" computes its loss and gradients with parameters cast to
    ``compute_dtype`` (except those ``keep_fp32`` selects), gradients are
    upcast to fp32 and averaged over ranks, and SGD updates the master copy
    in its storage dtype: the same arithmetic FSDP2 with a
    ``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=fp32)`` does,
    up to the order of the fp32 additions. Returns per-step mean losses, the
    final parameters and the first step's averaged gradients.
    """
    master = build()
    losses: list[float] = []
    first_grads: dict[str, torch.Tensor] = {}
    for step, per_rank in enumerate(batches):
        grads = {
            name: torch.zeros_like(p, dtype=torch.float32)
            for name, p in master.named_parameters()
            if p.requires_grad
        }
        step_losses = []
        for batch in per_rank:
            worker = build()
            masters = dict(master.named_parameters())
            with torch.no_grad():
                for name, p in worker.named_parameters():
                    src = masters[name]
                    target = (
                        src.dtype if compute_dtype is None or keep_fp32(name) else compute_dtype
                    )
                    p.data = src.detach().to(target)
                    p.requires_grad_(name in grads)
            # A list of micro-batches: one backward each, gradients accumulated in fp32
            # (as FSDP does with an fp32 reduce dtype when it does not sync).
            micro_batches = batch if isinstance(batch, list) else [batch]
            total = 0.0
            for micro in micro_batches:
                loss = loss_fn(worker, micro)
                loss.backward()
                total += loss.item()
                for name, p in worker.named_parameters():
                    if p.grad is not None:
                        grads[name] += p.grad.float()
                        p.grad = None
            step_losses.append(total)
        losses.append(sum(step_losses) / len(step_losses))
        with torch.no_grad():
            for name, p in master.named_parameters():
                if name not in grads:
                    continue
                g = grads[name] / len(per_rank)
                if step == 0:
                    first_grads[name] = g.to(p.dtype)
                p.add_(g.to(p.dtype), alpha=-lr)
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}, first_grads


def named_items(d: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(sorted(d.items()))
