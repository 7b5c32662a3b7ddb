"""Staged training across runs on 2 gloo ranks, against one process (issue 25).

Three runs of the toy VLM under ``per_layer``: the projector alone, then with the
language model, then everything. Each run shards its model anew (another freeze set,
another plan), builds a new AdamW and starts from the last run's DCP checkpoint with
``load_stage_checkpoint``. One process does the same with plain tensors and hands
the optimizer state over by parameter name: the parameters trainable in both runs keep
theirs, the newly trainable ones start with none. Losses and final parameters must
agree; the reports name what was restored, what starts fresh and what was dropped,
alike on every rank. A model whose shape changed is refused on every rank.
"""

from __future__ import annotations

import functools

import pytest
import torch
from compare import TOL
from framework_cases import (
    STAGES,
    STEPS_PER_STAGE,
    WORLD,
    stage_batch,
    stage_model,
    stage_optimizer,
)
from launches import MpResults
from loops import toy_loss
from reference import reference_training
from torch import nn

pytestmark = pytest.mark.distributed


def _names(stage: int) -> list[str]:
    """Trainable parameter names of ``stage``, in the model's order."""
    return [n for n, p in stage_model(stage).named_parameters() if p.requires_grad]


@functools.cache
def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    losses: list[float] = []
    values: dict[str, torch.Tensor] | None = None
    saved: dict[str, dict[str, torch.Tensor]] = {}  # the last stage's optimizer state by name
    for stage in range(len(STAGES)):
        masters: list[nn.Module] = []
        optimizers: list[torch.optim.Optimizer] = []

        def build(
            stage: int = stage,
            start: dict[str, torch.Tensor] | None = values,
            masters: list[nn.Module] = masters,
        ) -> nn.Module:
            model = stage_model(stage)
            if start is not None:
                model.load_state_dict(start)
            if not masters:
                masters.append(model)
            return model

        def optimizer(
            params: list[nn.Parameter],
            previous: dict[str, dict[str, torch.Tensor]] = saved,
            masters: list[nn.Module] = masters,
            optimizers: list[torch.optim.Optimizer] = optimizers,
        ) -> torch.optim.Optimizer:
            opt = stage_optimizer(params)
            names = {id(p): n for n, p in masters[0].named_parameters()}
            for param in params:
                if names[id(param)] in previous:
                    opt.state[param] = {k: v.clone() for k, v in previous[names[id(param)]].items()}
            optimizers.append(opt)
            return opt

        offset = stage * STEPS_PER_STAGE

        def step_fn(model: nn.Module, step: int, rank: int, offset: int = offset) -> torch.Tensor:
            return toy_loss(model, stage_batch(offset + step, rank))

        run = reference_training(
            build,
            step_fn,
            steps=STEPS_PER_STAGE,
            world=WORLD,
            compute_dtype=None,
            optimizer=optimizer,
        )
        losses += run.losses
        values = run.params
        names = {id(p): n for n, p in masters[0].named_parameters()}
        saved = {names[id(p)]: dict(state) for p, state in optimizers[0].state.items()}
    assert values is not None
    return losses, values


def test_three_stages_train_like_one_process(mp2: MpResults) -> None:
    result = mp2("staged_three_stages")
    losses, params = _reference()
    tol = TOL[torch.float32]
    assert result["losses"] == pytest.approx(losses, rel=tol, abs=tol)
    assert set(result["params"]) == set(params)
    for name, expected in params.items():
        torch.testing.assert_close(result["params"][name], expected, rtol=tol, atol=tol, msg=name)


def test_each_stage_reports_what_it_restored_and_what_starts_fresh(mp2: MpResults) -> None:
    result = mp2("staged_three_stages")
    reports = result["reports"]
    assert result["reports_per_rank"] == [reports] * WORLD
    for stage, report in enumerate(reports, start=1):
        before, now = _names(stage - 1), _names(stage)
        assert report["step"] == stage * STEPS_PER_STAGE
        assert list(report["restored"]) == [n for n in now if n in before]
        assert list(report["fresh"]) == [n for n in now if n not in before]
        assert list(report["dropped"]) == [n for n in before if n not in now]
    assert reports[0]["restored"]  # the projector's state
    assert reports[0]["fresh"]  # the language model's
    assert any(n.startswith("vision_tower.") for n in reports[1]["fresh"])


def test_a_parameter_that_changed_shape_fails_on_every_rank(mp2: MpResults) -> None:
    errors = mp2("staged_shape_changed")["errors"]
    assert errors[0] == errors[1]
    kind, message = errors[0]
    assert kind == "ValueError"
    assert "lm_head.weight: (37, 16) saved, (40, 16) here" in message
