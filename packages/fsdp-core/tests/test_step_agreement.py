"""Unit tests for fsdp_core.step_agreement and the forward agreement that carries it
(one process, the fake group).

Under the fake group a rank meets only itself at the agreement, so only what one rank
can see is tested here: an empty batch, gradient sync changed between a forward and its
backward, an optimizer step after unreduced backwards, and the error texts built from a
table of ranks. What several ranks disagree about is tested on real ranks
(tests/test_crashes_distributed.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import CommCounter, ModelParallelizer
from fsdp_core.runtime import installed_hooks
from fsdp_core.step_agreement import (
    EmptyBatchError,
    RankStep,
    StepMismatchError,
    UnreducedGradientsError,
    is_empty_batch,
    mismatch_error,
)

DIM = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _sharded(mesh: DeviceMesh) -> Net:
    torch.manual_seed(0)
    model = Net()
    ModelParallelizer().parallelize(model, mesh=mesh)
    return model


def _step(**changes: int) -> RankStep:
    values = {"grad": 1, "sync": 3, "units": 3, "empty": 0, "forwards": 1, "micro": 1}
    values.update(changes)
    return RankStep(changed=values.pop("changed", 0), **values)


def test_an_empty_batch_is_one_without_rows() -> None:
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert not is_empty_batch((), {"input_ids": ids})
    assert is_empty_batch((), {"input_ids": ids[:0], "labels": ids[:0]})
    # Empty images beside token ids with rows: a text-only batch, not an empty one.
    assert not is_empty_batch((), {"input_ids": ids, "pixel_values": torch.zeros(0, 3, 4, 4)})
    assert is_empty_batch((torch.zeros(0, DIM),), {})
    # One-dimensional inputs count only when nothing has two dimensions.
    assert is_empty_batch((torch.zeros(0),), {})
    assert not is_empty_batch((ids, torch.zeros(0)), {})
    assert not is_empty_batch((), {"flag": True})


def test_the_errors_name_the_ranks_and_the_remedy() -> None:
    uneven = mismatch_error({0: _step(sync=0), 1: _step(), 2: _step(sync=0), 3: _step()})
    assert isinstance(uneven, StepMismatchError)
    assert "ranks [0, 2] at micro-batch 1 of its step, gradient sync off" in str(uneven)
    assert "ranks [1, 3] at micro-batch 1 of its step, gradient sync on" in str(uneven)
    assert "same number of micro-batches per optimizer step" in str(uneven)

    empty = mismatch_error({0: _step(empty=1), 1: _step(sync=0)})
    assert isinstance(empty, EmptyBatchError)  # an empty batch is named first
    assert str(empty).startswith("rank 0 called the model with an empty batch")

    forwards = mismatch_error({0: _step(forwards=3), 1: _step(forwards=2)})
    assert "rank 0: the 3rd forward of the model; rank 1: the 2nd forward" in str(forwards)

    grads = mismatch_error({0: _step(grad=0, sync=0, micro=0), 1: _step()})
    assert "rank 0: without gradients" in str(grads)

    changed = mismatch_error({0: _step(changed=1), 1: _step()})
    assert str(changed).startswith("rank 0 changed set_requires_gradient_sync between")


def test_a_forward_costs_no_collective(mesh2: DeviceMesh) -> None:
    model = _sharded(mesh2)
    hook = installed_hooks(model)["forward_agreement"]
    with CommCounter() as counter, counter.phase("forward"):
        out = model(torch.randn(2, DIM))
    assert [r for r in counter.records if r.kind == "all_reduce"] == []
    assert counter.records[0].kind == "all_gather"  # the forward's own, first
    assert (hook.step.forwards, hook.agreement.points) == (1, 1)  # type: ignore[attr-defined]
    out.sum().backward()


def test_an_empty_batch_stops_before_any_collective(mesh2: DeviceMesh) -> None:
    model = _sharded(mesh2)
    with CommCounter() as counter, pytest.raises(EmptyBatchError, match="empty batch"):
        model(torch.randn(0, DIM))
    assert counter.records == []
    model(torch.randn(2, DIM)).sum().backward()  # the model works on


def test_sync_changed_after_the_forward_is_put_back_and_reported(
    mesh2: DeviceMesh, caplog: pytest.LogCaptureFixture
) -> None:
    model = _sharded(mesh2)
    model.set_requires_gradient_sync(True)
    loss = model(torch.randn(2, DIM)).sum()
    model.set_requires_gradient_sync(False)
    with caplog.at_level(logging.WARNING, logger="fsdp_core.step_agreement"):
        loss.backward()
    assert "changed between a forward and its backward" in caplog.text
    # The backward ran with the flag agreed at the forward: the gradients were reduced.
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(StepMismatchError, match="changed set_requires_gradient_sync"):
        model(torch.randn(2, DIM))
    model(torch.randn(2, DIM)).sum().backward()  # reported once


def test_a_step_after_unreduced_backwards_stops(mesh2: DeviceMesh) -> None:
    model = _sharded(mesh2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    model.set_requires_gradient_sync(False)
    model(torch.randn(2, DIM)).sum().backward()
    with pytest.raises(UnreducedGradientsError, match="gradient sync is still off"):
        optimizer.step()
    other.step()  # an optimizer of another model is none of its business
    model.set_requires_gradient_sync(True)
    with pytest.raises(UnreducedGradientsError, match="on again, but it was off"):
        optimizer.step()
    model(torch.randn(2, DIM)).sum().backward()
    optimizer.step()  # a backward with sync on reduced them


def test_removing_the_hook_removes_the_agreement(mesh2: DeviceMesh) -> None:
    model = _sharded(mesh2)
    hook = installed_hooks(model)["forward_agreement"]
    hook.remove()
    model(torch.randn(2, DIM)).sum().backward()
    assert hook.agreement.points == 0  # type: ignore[attr-defined]
    model(torch.randn(0, DIM))  # the hook removed: nothing refuses an empty batch
    model.set_requires_gradient_sync(False)
    model(torch.randn(2, DIM)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # no check left


class Generating(Net):
    """Takes the key-value cache keyword transformers' ``generate()`` passes."""

    def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)


def test_generation_steps_say_no_step(mesh2: DeviceMesh) -> None:
    torch.manual_seed(0)
    model = Generating()
    ModelParallelizer().parallelize(model, mesh=mesh2)
    hook = installed_hooks(model)["forward_agreement"]
    with torch.no_grad():
        model(torch.randn(2, DIM), cache=object())
    assert hook.step.forwards == 0  # type: ignore[attr-defined]
    with torch.no_grad():
        model(torch.randn(2, DIM))  # an eval forward says its step
    assert hook.step.forwards == 1  # type: ignore[attr-defined]
    assert hook.agreement.points == 2  # type: ignore[attr-defined]
