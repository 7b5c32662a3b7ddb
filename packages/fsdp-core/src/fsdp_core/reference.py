"""A single-process reference for data-parallel training, to compare FSDP runs with.

Comparing a sharded run with "the same model trained on one GPU" only works
to within the rounding of the compute dtype; emulating each rank's arithmetic
(parameters cast to the compute dtype, gradients upcast and averaged in fp32)
removes that slack, so a real bug (a wrong shard, a lost reduction) stands out
by orders of magnitude.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["ReferenceResult", "emulate_data_parallel"]


class ReferenceResult(NamedTuple):
    """Per-step losses (mean over ranks), final parameters, first-step averaged gradients."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    first_grads: dict[str, torch.Tensor]


def _never(name: str) -> bool:
    return False


def emulate_data_parallel(
    build: Callable[[], nn.Module],
    batches: list[list[Any]],
    loss_fn: Callable[..., torch.Tensor],
    *,
    compute_dtype: torch.dtype | None,
    lr: float,
    keep_fp32: Callable[[str], bool] = _never,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> ReferenceResult:
    """Emulate data-parallel FSDP training in one process.

    Each "rank" computes its loss and gradients with parameters cast to
    ``compute_dtype`` (except those ``keep_fp32`` selects), gradients are
    upcast to fp32 and averaged over ranks, and SGD updates the master copy
    in its storage dtype: the same arithmetic FSDP2 with a
    ``MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=fp32)`` does,
    up to the order of the fp32 additions. ``batches[step][rank]`` is one batch
    (or a list of micro-batches, accumulated as FSDP does without syncing).
    The reference a multi-process run should be compared with. ``optimizer``
    builds the optimizer over the trainable master parameters (plain SGD with
    ``lr`` when omitted).
    """
    master = build()
    trainable = [p for p in master.parameters() if p.requires_grad]
    opt = optimizer(trainable) if optimizer is not None else None
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
                loss.backward()  # type: ignore[no-untyped-call]
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
                if opt is None:
                    p.add_(g.to(p.dtype), alpha=-lr)
                else:
                    p.grad = g.to(p.dtype)
        if opt is not None:
            opt.step()
            opt.zero_grad()
    params = {n: p.detach().clone() for n, p in master.named_parameters()}
    return ReferenceResult(losses, params, first_grads)
