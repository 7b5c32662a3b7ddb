"""``MultimodalParallelizer(balance_media=True)`` at plan time and when installed.

The plan holds the ``balance_media`` hook with its data (towers, layouts, whether each
tower owns units and trains, the join site); balanced towers are no media regions, so
no schedule check guards them; a tower no layout adapter understands fails at plan
time. The installed hook is checked under the single-process fake group (the
multi-process behaviour is in tests/test_balance_media_distributed.py).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from fsdp_core import build_mesh
from fsdp_core.fake_group import fake_process_group
from fsdp_core.runtime import installed_hooks, remove_runtime_hooks
from model_deepseek_v41 import DeepseekV41Config, DeepseekV41ModelParallelizer, build_deepseek_v41
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.record import plan_record
from multimodal_fsdp.runtime.balance_media import (
    BalancedTower,
    BalanceMedia,
    BalanceMediaRuntimeHook,
)

CONFIG = DeepseekV41Config.tiny()


def _model(*, frozen: bool = True) -> nn.Module:
    model = build_deepseek_v41(CONFIG, seed=0, dtype=torch.float32)
    if frozen:
        model.vision.requires_grad_(False)
    return model


def _parallelizer(policy: str = "per_layer", **options: object) -> MultimodalParallelizer:
    return MultimodalParallelizer(
        frozen_multimodal_sharding=policy,  # type: ignore[arg-type]
        extra_tower_names=("vision",),
        balance_media=True,
        **options,  # type: ignore[arg-type]
    )


def _hook(plan: object) -> BalanceMediaRuntimeHook:
    (planned,) = [h for h in plan.hooks if h.name == "balance_media"]  # type: ignore[attr-defined]
    assert isinstance(planned.hook, BalanceMediaRuntimeHook)
    return planned.hook


def test_balance_media_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="balance_media must be a bool, got 'yes'"):
        MultimodalParallelizer(balance_media="yes")  # type: ignore[arg-type]
    assert MultimodalParallelizer().balance_media is False
    assert DeepseekV41ModelParallelizer(balance_media=True).balance_media is True


@pytest.mark.parametrize(
    ("policy", "frozen", "owns_units"),
    [
        ("per_layer", True, True),
        ("root", True, False),
        ("replicate", True, False),
        ("root", False, True),
    ],
)
def test_the_plan_holds_the_hook_data(policy: str, frozen: bool, owns_units: bool) -> None:
    plan = _parallelizer(policy).plan(_model(frozen=frozen))
    hook = _hook(plan)
    (tower,) = hook.towers
    assert tower.probe.startswith("batch-first, probed on cpu weights: per item pixel_values")
    assert dataclasses.replace(tower, probe="") == BalancedTower(
        path="vision", layout="batch-first", run_when_empty=owns_units, trainable=not frozen
    )
    assert hook.join_site == "model.layers.0"
    assert "schedule_check" not in plan.hook_names()
    record = plan_record(plan)
    assert record is not None
    assert record.balanced_towers == ("vision",)
    assert record.media_regions == ()


def test_without_the_option_nothing_changes() -> None:
    plan = MultimodalParallelizer(
        frozen_multimodal_sharding="per_layer", extra_tower_names=("vision",)
    ).plan(_model())
    assert "balance_media" not in plan.hook_names()
    assert "schedule_check" in plan.hook_names()


def test_the_hook_line_names_towers_layouts_and_collectives_per_call() -> None:
    plan = _parallelizer("per_layer").plan(_model(frozen=False))
    (line,) = [h.format() for h in plan.hooks if h.name == "balance_media"]
    assert "'vision' (batch-first)" in line
    assert "'model.layers.0'" in line
    assert "2 all_gathers and 2 all_to_all in forward when items move" in line
    assert "1 all_to_all in backward" in line
    assert "2720 bytes" in line  # the barrier's last round: SLOT_INTS int64 per rank
    frozen = _parallelizer("root").plan(_model())
    (line,) = [h.format() for h in frozen.hooks if h.name == "balance_media"]
    assert "0 all_to_all in backward" in line


def test_disabling_the_hook_keeps_the_tower_a_media_region() -> None:
    plan = _parallelizer("per_layer", disabled_hooks=("balance_media",)).plan(_model())
    assert "balance_media" not in plan.hook_names()
    assert "schedule_check" in plan.hook_names()


def test_with_uneven_media_the_tower_keeps_its_per_layer_units() -> None:
    """uneven_media=True folds projectors and media-dependent decoder layers into the
    root; balanced towers keep their units (per_layer is allowed with both)."""
    plan = DeepseekV41ModelParallelizer(
        frozen_multimodal_sharding="per_layer", uneven_media=True, balance_media=True
    ).plan(_model())
    labels = [unit.label for unit in plan.units]
    assert "vision.blocks.0" in labels
    assert "vision.blocks.1" in labels
    assert "schedule_check" not in plan.hook_names()
    assert any("balanced towers keep their units" in note for note in plan.notes)
    with pytest.raises(ValueError, match="uneven_media=True use 'root' or"):
        MultimodalParallelizer(frozen_multimodal_sharding="per_layer", uneven_media=True)


class _PixelsTower(nn.Module):
    """A tower whose forward takes ``pixels``: no built-in layout knows it by name."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            pixels = layer(pixels)
        return pixels


class _PoolingTower(_PixelsTower):
    """Pools the call's items into one row: no row belongs to one item."""

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return super().forward(pixels).sum(0, keepdim=True)


class _ToyVLM(nn.Module):
    def __init__(self, tower: nn.Module | None = None) -> None:
        super().__init__()
        self.vision_tower = tower if tower is not None else _PixelsTower()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = self.vision_tower(pixels)
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


def test_a_plain_custom_tower_is_balanced_without_an_adapter() -> None:
    """Before issue 26 no layout applied (its argument is not ``pixel_values``); the
    plan-time probe finds one row per item in and out."""
    plan = MultimodalParallelizer(balance_media=True).plan(_ToyVLM())
    (tower,) = _hook(plan).towers
    assert (tower.path, tower.layout) == ("vision_tower", "batch-first")
    assert "per item pixels 1 row" in tower.probe


def test_a_tower_no_layout_fits_fails_at_plan_time() -> None:
    with pytest.raises(ValueError, match="cannot balance tower") as caught:
        MultimodalParallelizer(balance_media=True).plan(_ToyVLM(_PoolingTower()))
    message = str(caught.value)
    assert "cannot balance tower 'vision_tower'" in message
    assert "_PoolingTower" in message
    assert "pixels" in message
    assert "whole number of rows per item" in message
    assert "register_media_layout" in message
    MultimodalParallelizer().plan(_ToyVLM(_PoolingTower()))  # fine without the option


def test_installed_under_the_fake_group_and_removed() -> None:
    """Install patches the tower's instance forward (signature kept, class unchanged);
    a training step runs (every rank looks like this one); removal restores it."""
    model = _model(frozen=False)
    tower_class = type(model.vision)
    with fake_process_group(2):
        _parallelizer("per_layer").parallelize(model, mesh=build_mesh())
        hook = installed_hooks(model)["balance_media"]
        assert isinstance(hook, BalanceMedia)
        assert "forward" in vars(model.vision)
        assert type(model.vision) is tower_class
        assert list(inspect.signature(model.vision.forward).parameters) == ["pixel_values"]
        from model_deepseek_v41 import make_batch

        batch = make_batch(CONFIG, batch_size=2, seq_len=16, num_images_per_sample=1, seed=0)
        model(**batch).backward()
        assert hook.last_calls == 1
        model.eval()
        with torch.no_grad():
            model(**batch)
        assert hook.last_calls == 1  # a tower with units stays balanced in eval
        assert remove_runtime_hooks(model, ["balance_media"]) == ["balance_media"]
        assert "forward" not in vars(model.vision)
