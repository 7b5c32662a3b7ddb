"""A tiny model for the multi-process tests (the reference lives in fsdp_core.testing)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from fsdp_core.testing import emulate_data_parallel


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


reference_run = emulate_data_parallel
