"""Every remedy an error message of multimodal_fsdp proposes works, in the configuration
that raised it: the message is triggered, the proposed option is applied, and the step
it stopped then runs (or the plan no longer has what made it stop).

Another rank is emulated as in test_uneven.py: the positions a forward with *its*
batch reports are merged into this rank's checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from fsdp_core import build_mesh, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from fsdp_core.rank_agreement import RankAgreement, kind_of
from fsdp_core.runtime import installed_hooks
from multimodal_fsdp import MultimodalParallelizer, UnevenMediaError
from multimodal_fsdp.runtime import schedule_check as uneven_module

DIM = 8
FP32 = mixed_precision_policy("fp32", "fp32")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc(x)


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Cross(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor, media: Tensor) -> Tensor:
        return x + self.fc(media.mean(0))


class Vlm(nn.Module):
    def __init__(self, *, cross: bool = False) -> None:
        super().__init__()
        self.vision_tower = Tower()
        self.multi_modal_projector = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([Block(), Cross() if cross else Block(), Block()])
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: Tensor, pixel_values: Tensor | None = None) -> Tensor:
        media = None
        if pixel_values is not None:
            media = self.multi_modal_projector(self.vision_tower(pixel_values))
        for layer in self.layers:
            if isinstance(layer, Cross):
                if media is not None:
                    x = layer(x, media)
            else:
                x = layer(x)
        return self.head(x)


@pytest.fixture
def fake2() -> Iterator[None]:
    with fake_process_group(2):
        yield


class OtherRank:
    """Plays a second rank that saw images while this one is text-only (its positions
    at the agreement, recorded in a forward with an image)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.values: list[str] = []
        self.recording = True
        self.merged = 0

        def local(agreement: RankAgreement, value: str) -> dict[int, str]:
            if kind_of(value) != uneven_module.POSITION:
                return {0: value}
            if self.recording:
                self.values.append(value)
                return {0: value}
            other = self.values[self.merged] if self.merged < len(self.values) else "call|"
            self.merged += 1
            return {0: value, 1: other}

        monkeypatch.setattr(RankAgreement, "_local", local)


def build(*, frozen: bool, cross: bool = False) -> Vlm:
    torch.manual_seed(0)
    model = Vlm(cross=cross)
    if frozen:
        model.vision_tower.requires_grad_(False)
    return model


def uneven_step(model: nn.Module, parallelizer: MultimodalParallelizer) -> None:
    """Shard, let the other rank see an image, then run a text-only step here."""
    parallelizer.parallelize(model, mesh=build_mesh(), mp_policy=FP32)
    x = torch.randn(2, DIM)
    if "schedule_check" in installed_hooks(model):
        with torch.no_grad():
            model(x, torch.randn(1, DIM))  # what the other rank reports
        OtherRank.current.recording = False  # type: ignore[attr-defined]
    model(x).sum().backward()


def uneven_error(
    monkeypatch: pytest.MonkeyPatch, model: nn.Module, parallelizer: MultimodalParallelizer
) -> str:
    OtherRank.current = OtherRank(monkeypatch)  # type: ignore[attr-defined]
    with pytest.raises(UnevenMediaError) as info:
        uneven_step(model, parallelizer)
    return str(info.value)


def remedied(monkeypatch: pytest.MonkeyPatch, model: nn.Module, **options: Any) -> None:
    monkeypatch.undo()
    OtherRank.current = OtherRank(monkeypatch)  # type: ignore[attr-defined]
    uneven_step(model, MultimodalParallelizer(**options))


# --- UnevenMediaError, in each configuration that raises it ---------------------------------


def test_per_layer_frozen_tower_remedies(fake2: None, monkeypatch: pytest.MonkeyPatch) -> None:
    message = uneven_error(
        monkeypatch,
        build(frozen=True),
        MultimodalParallelizer(frozen_multimodal_sharding="per_layer"),
    )
    assert "frozen_multimodal_sharding='root' or 'replicate'" in message
    # The first remedy must be one the constructor accepts with this policy.
    first = message.split("To fix it, ")[1]
    assert not first.startswith("pass uneven_media=True"), first
    for policy in ("root", "replicate"):
        remedied(monkeypatch, build(frozen=True), frozen_multimodal_sharding=policy)
    if "uneven_media=True" in message:
        remedied(monkeypatch, build(frozen=True), uneven_media=True)
    # balance_media keeps the units and trains under any media distribution.
    assert first.startswith("pass balance_media=True"), first
    remedied(
        monkeypatch,
        build(frozen=True),
        frozen_multimodal_sharding="per_layer",
        balance_media=True,
    )


@pytest.mark.parametrize("policy", ["root", "replicate", "per_layer"])
def test_trainable_tower_remedies(
    fake2: None, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    message = uneven_error(
        monkeypatch,
        build(frozen=False),
        MultimodalParallelizer(frozen_multimodal_sharding=policy),
    )
    assert "pass uneven_media=True" in message
    if policy == "per_layer":
        # uneven_media=True needs another policy for every module: say so.
        assert "frozen_multimodal_sharding='root' or 'replicate'" in message
        remedied(monkeypatch, build(frozen=False), uneven_media=True)
    else:
        assert "frozen_multimodal_sharding" not in message
        remedied(
            monkeypatch, build(frozen=False), uneven_media=True, frozen_multimodal_sharding=policy
        )


@pytest.mark.parametrize("policy", ["root", "replicate", "per_layer"])
def test_cross_attention_layer_remedies(
    fake2: None, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    message = uneven_error(
        monkeypatch,
        build(frozen=True, cross=True),
        MultimodalParallelizer(frozen_multimodal_sharding=policy),
    )
    assert "uneven_media=True" in message
    if policy == "per_layer":
        assert "frozen_multimodal_sharding='root' or 'replicate'" in message
        for other in ("root", "replicate"):
            remedied(
                monkeypatch,
                build(frozen=True, cross=True),
                uneven_media=True,
                frozen_multimodal_sharding=other,
            )
    else:
        remedied(
            monkeypatch,
            build(frozen=True, cross=True),
            uneven_media=True,
            frozen_multimodal_sharding=policy,
        )


# --- the constructor's and the planner's own advice ------------------------------------------


def test_uneven_media_with_per_layer_advice_works() -> None:
    with pytest.raises(ValueError, match="with uneven_media=True use 'root' or 'replicate'"):
        MultimodalParallelizer(frozen_multimodal_sharding="per_layer", uneven_media=True)
    for policy in ("root", "replicate"):
        MultimodalParallelizer(frozen_multimodal_sharding=policy, uneven_media=True)
    MultimodalParallelizer(frozen_multimodal_sharding="per_layer")  # keep per_layer


def test_unknown_module_path_advice_works() -> None:
    model = build(frozen=True)
    with pytest.raises(ValueError, match=r"use '\*' for the rest"):
        MultimodalParallelizer(frozen_multimodal_sharding={"tower": "per_layer"}).plan(model)
    plan = MultimodalParallelizer(
        frozen_multimodal_sharding={"vision_tower": "per_layer", "*": "replicate"}
    ).plan(model)
    assert "vision_tower.blocks.0" in plan.unit_labels()


def test_odd_dtype_units_under_uneven_media_advice_works() -> None:
    def odd() -> Vlm:
        model = build(frozen=False)
        model.vision_tower.blocks[0].to(torch.bfloat16)
        return model

    with pytest.raises(ValueError, match="still need units of their own") as info:
        MultimodalParallelizer(uneven_media=True).plan(odd(), mp_policy=FP32)
    message = str(info.value)
    assert "Freeze them" in message
    assert "give them the model's dtype" in message
    frozen = odd()
    frozen.vision_tower.blocks[0].requires_grad_(False)
    MultimodalParallelizer(uneven_media=True).plan(frozen, mp_policy=FP32)
    same = odd()
    same.vision_tower.blocks[0].to(torch.float32)
    MultimodalParallelizer(uneven_media=True).plan(same, mp_policy=FP32)
    assert "uneven_media=False" in message
    MultimodalParallelizer().plan(odd(), mp_policy=FP32)


def test_choose_per_layer_only_with_uneven_media_advice_works() -> None:
    from multimodal_fsdp import choose_frozen_policy

    parallelizer = MultimodalParallelizer(uneven_media=True)
    with pytest.raises(ValueError, match="allow 'root' or 'replicate'"):
        choose_frozen_policy(
            build(frozen=True),
            "1GiB",
            policies=("per_layer",),
            world_size=2,
            parallelizer=parallelizer,
        )
    choice = choose_frozen_policy(
        build(frozen=True),
        "1GiB",
        policies=("root", "replicate"),
        world_size=2,
        parallelizer=parallelizer,
    )
    assert set(choice.policies.values()) <= {"root", "replicate"}


def test_the_chooser_keeps_per_layer_where_balanced_media_allows_it() -> None:
    """uneven_media=True refuses per_layer only without balance_media (balanced towers
    keep their units): the chooser must not leave out what the parallelizer accepts."""
    from multimodal_fsdp import choose_frozen_policy

    parallelizer = MultimodalParallelizer(uneven_media=True, balance_media=True)
    parallelizer.with_options(frozen_multimodal_sharding="per_layer")  # accepted
    choice = choose_frozen_policy(
        build(frozen=True),
        "1GiB",
        policies=("per_layer",),
        world_size=2,
        parallelizer=parallelizer,
    )
    assert set(choice.policies.values()) == {"per_layer"}
    assert not any("left out" in note for note in choice.notes)
