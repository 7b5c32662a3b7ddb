"""A single-process reference for any training loop, to compare multi-process runs with.

:func:`reference_training` emulates data-parallel FSDP in one process: for every
step and every "rank" it copies the master weights into a fresh worker model (cast
to the compute dtype, as FSDP's mixed precision does, except parameters that
``keep_fp32`` selects), runs the loop's step function there (which may run no-grad
passes, eval, two forwards, ...) and backpropagates the loss it returns. A
parameter's gradient is the mean over ranks, counting zero for ranks that did not
use it; a parameter that no rank used has no gradient at all (``None``), so the
optimizer leaves it alone, which is what one process and plain FSDP do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

#: Runs one step of the loop on ``model`` as rank ``rank``; returns the loss to backward.
StepFn = Callable[[nn.Module, int, int], torch.Tensor]
OptimizerFn = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class ReferenceRun:
    losses: list[float]
    params: dict[str, torch.Tensor]
    grads0: dict[str, torch.Tensor]
    #: Per step: trainable parameters that no rank used (their gradient stays None).
    unused: list[frozenset[str]]

    def as_tuple(self) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return self.losses, self.params, self.grads0


def _never(name: str) -> bool:
    return False


def reference_training(
    build: Callable[[], nn.Module],
    step_fn: StepFn,
    *,
    steps: int,
    world: int,
    compute_dtype: torch.dtype | None,
    optimizer: OptimizerFn,
    keep_fp32: Callable[[str], bool] = _never,
    max_norm: float | None = None,
) -> ReferenceRun:
    """``max_norm``: clip the averaged gradients by their total norm before each step
    (``torch.nn.utils.clip_grad_norm_``), as a framework's gradient clipping does."""
    master = build()
    trainable = {name for name, p in master.named_parameters() if p.requires_grad}
    opt = optimizer([p for p in master.parameters() if p.requires_grad])
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    unused: list[frozenset[str]] = []
    for step in range(steps):
        sums: dict[str, torch.Tensor] = {}
        step_losses = []
        for rank in range(world):
            worker = build()
            masters = dict(master.named_parameters())
            with torch.no_grad():
                for name, p in worker.named_parameters():
                    src = masters[name]
                    keep = compute_dtype is None or keep_fp32(name)
                    p.data = src.detach().to(src.dtype if keep else compute_dtype)
                    p.requires_grad_(name in trainable)
            worker.train()
            loss = step_fn(worker, step, rank)
            loss.backward()  # type: ignore[no-untyped-call]
            step_losses.append(float(loss.detach().float()))
            for name, p in worker.named_parameters():
                if p.grad is not None:
                    grad = p.grad.float()
                    sums[name] = sums[name] + grad if name in sums else grad.clone()
        losses.append(sum(step_losses) / world)
        unused.append(frozenset(trainable - set(sums)))
        with torch.no_grad():
            for name, p in master.named_parameters():
                if name in sums:
                    p.grad = (sums[name] / world).to(p.dtype)
                    if step == 0:
                        grads0[name] = p.grad.clone()
                else:
                    p.grad = None
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(
                    [p for p in master.parameters() if p.grad is not None], max_norm
                )
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in master.named_parameters()}
    return ReferenceRun(losses, params, grads0, unused)


def sgd(lr: float) -> OptimizerFn:
    return lambda params: torch.optim.SGD(params, lr=lr)


def adamw(lr: float, weight_decay: float) -> OptimizerFn:
    return lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
