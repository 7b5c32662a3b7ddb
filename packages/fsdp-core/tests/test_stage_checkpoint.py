"""Checkpoints across training stages (issue 25), in one process without a process group.

The usual vision-language recipe trains in stages with different freeze sets (the
projector first, then the language model, then the tower), each stage a new run that
starts from the last one's DCP checkpoint. ``load_stage_checkpoint`` loads the model,
the optimizer state of the parameters trainable in both runs, starts the newly
trainable ones fresh (no state, like a new optimizer) and reports which;
``load_checkpoint`` (a resume of the same run) refuses another freeze set with a
pointer to it. A parameter whose shape changed is a clear error for both. The sharded
form runs on 2 gloo ranks in tests/test_staged_distributed.py.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_core import load_checkpoint, load_stage_checkpoint, save_checkpoint
from fsdp_core.checkpoint import StageLoadReport

PROJECTOR = ("projector.weight", "projector.bias")
LANGUAGE = ("language.weight", "language.bias")


class Staged(nn.Module):
    """tower -> projector -> language, and a head that only some batches use."""

    def __init__(self, vocab: int = 6) -> None:
        super().__init__()
        self.tower = nn.Linear(4, 4)
        self.projector = nn.Linear(4, 4)
        self.language = nn.Linear(4, vocab)
        self.spare = nn.Linear(4, vocab)

    def forward(self, x: torch.Tensor, spare: bool = False) -> torch.Tensor:
        h = self.projector(self.tower(x))
        out = self.language(h) + (self.spare(h) if spare else 0)
        return out.pow(2).mean()


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    # DCP warns that it assumes one process without a process group: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _model(trainable: tuple[str, ...], vocab: int = 6) -> Staged:
    torch.manual_seed(0)
    model = Staged(vocab)
    for name, param in model.named_parameters():
        param.requires_grad_(name.split(".")[0] in trainable)
    return model


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(step))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, spare: bool = False) -> None:
    for step in steps:
        model(_batch(step), spare=spare).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.fixture
def stage1(tmp_path: Path) -> tuple[Path, Staged, torch.optim.Optimizer]:
    """The projector trained alone for 2 steps, saved at step 2."""
    model = _model(("projector",))
    opt = _optimizer(model)
    _train(model, opt, range(2))
    path = tmp_path / "stage1"
    save_checkpoint(path, model, opt, step=2)
    return path, model, opt


def _stage2_reference(
    model: Staged, opt: torch.optim.Optimizer
) -> tuple[Staged, torch.optim.Optimizer]:
    """Stage 2 by hand: stage 1's weights, a new optimizer, the projector's state copied."""
    ref = _model(("projector", "language"))
    ref.load_state_dict(model.state_dict())
    ref_opt = _optimizer(ref)
    old = dict(model.named_parameters())
    for name, param in ref.named_parameters():
        if name in PROJECTOR:
            ref_opt.state[param] = {k: v.clone() for k, v in opt.state[old[name]].items()}
    return ref, ref_opt


def test_a_stage_two_run_loads_the_model_and_the_shared_optimizer_state(
    stage1: tuple[Path, Staged, torch.optim.Optimizer], caplog: pytest.LogCaptureFixture
) -> None:
    path, model1, opt1 = stage1
    model = _model(("projector", "language"))
    opt = _optimizer(model)
    with caplog.at_level(logging.INFO, logger="fsdp_core.checkpoint"):
        report = load_stage_checkpoint(path, model, opt)
    assert isinstance(report, StageLoadReport)
    assert report.step == 2
    assert report.restored == PROJECTOR
    assert report.fresh == LANGUAGE
    assert report.dropped == ()
    assert "fresh for 2 (language.weight, language.bias)" in caplog.text
    for name, value in model1.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
    params = dict(model.named_parameters())
    assert all(params[name] not in opt.state for name in LANGUAGE)  # fresh: no state at all
    # The hyperparameters are this run's, and the next steps equal stage 2 done by hand.
    ref, ref_opt = _stage2_reference(model1, opt1)
    _train(model, opt, range(2, 4))
    _train(ref, ref_opt, range(2, 4))
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)


def test_parameters_frozen_in_the_new_stage_are_reported_as_dropped(
    stage1: tuple[Path, Staged, torch.optim.Optimizer],
) -> None:
    path, _, _ = stage1
    model = _model(("tower",))
    report = load_stage_checkpoint(path, model, _optimizer(model))
    assert report.restored == ()
    assert report.fresh == ("tower.weight", "tower.bias")
    assert report.dropped == PROJECTOR


def test_a_stage_load_without_optimizer_loads_the_model(
    stage1: tuple[Path, Staged, torch.optim.Optimizer],
) -> None:
    path, model1, _ = stage1
    model = _model(("language",))
    report = load_stage_checkpoint(path, model)
    assert (report.restored, report.fresh, report.step) == ((), (), 2)
    torch.testing.assert_close(model.projector.weight, model1.projector.weight, rtol=0, atol=0)


@pytest.mark.parametrize("entry", ["load_checkpoint", "load_stage_checkpoint"])
def test_a_parameter_whose_shape_changed_is_a_clear_error(
    stage1: tuple[Path, Staged, torch.optim.Optimizer], entry: str
) -> None:
    path, _, _ = stage1
    model = _model(("projector",), vocab=9)
    load = load_checkpoint if entry == "load_checkpoint" else load_stage_checkpoint
    with pytest.raises(ValueError, match="changed shape") as raised:
        load(path, model, _optimizer(model))
    message = str(raised.value)
    assert "language.weight: (6, 4) saved, (9, 4) here" in message
    assert "language.bias: (6,) saved, (9,) here" in message


def test_a_resume_with_another_freeze_set_points_to_the_stage_load(
    stage1: tuple[Path, Staged, torch.optim.Optimizer],
) -> None:
    path, _, _ = stage1
    model = _model(("projector", "language"))
    with pytest.raises(ValueError, match="load_stage_checkpoint") as raised:
        load_checkpoint(path, model, _optimizer(model))
    assert "language.weight" in str(raised.value)


def test_a_model_parameter_missing_from_the_checkpoint_is_named(
    stage1: tuple[Path, Staged, torch.optim.Optimizer],
) -> None:
    path, _, _ = stage1
    model = _model(("projector",))
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"extra\.weight"):
        load_stage_checkpoint(path, model)


def test_a_resume_keeps_parameters_that_had_no_gradient_stateless(tmp_path: Path) -> None:
    """A trainable parameter that got no gradient before the save has no optimizer state
    in the checkpoint (AdamW skips it); the resumed run must go on exactly, not fail on
    the missing state."""
    model = _model(("projector", "language", "spare"))
    opt = _optimizer(model)
    _train(model, opt, range(2))  # never uses the spare head
    save_checkpoint(tmp_path / "ckpt", model, opt, step=2)
    resumed = _model(("projector", "language", "spare"))
    resumed_opt = _optimizer(resumed)
    assert load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt) == 2
    _train(model, opt, range(2, 3), spare=True)
    _train(resumed, resumed_opt, range(2, 3), spare=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0)


def test_a_resume_with_an_optimizer_from_a_model_only_checkpoint_says_so(tmp_path: Path) -> None:
    model = _model(("projector",))
    save_checkpoint(tmp_path / "model-only", model)
    with pytest.raises(ValueError, match="saved without an optimizer"):
        load_checkpoint(tmp_path / "model-only", model, _optimizer(model))
    report = load_stage_checkpoint(tmp_path / "model-only", model, _optimizer(model))
    assert report.fresh == PROJECTOR
