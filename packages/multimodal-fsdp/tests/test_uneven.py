"""Unit tests for multimodal_fsdp.runtime.schedule_check: where the schedule checkpoints sit, what
they
cost, and that disagreeing ranks stop before any mismatched collective.

The model is sharded under the single-process ``fake`` backend (exact collectives,
meaningless numbers). Its all-reduce leaves local values in place, so every "rank"
agrees with itself; another rank is emulated by recording the positions a forward
with *its* batch reports and merging them into this rank's checkpoints.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from fsdp_core import CommCounter, build_mesh, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from fsdp_core.rank_agreement import RankAgreement, kind_of
from fsdp_core.runtime import installed_hooks
from multimodal_fsdp import MultimodalParallelizer, UnevenMediaError
from multimodal_fsdp.runtime import schedule_check as uneven_module
from multimodal_fsdp.runtime.schedule_check import ScheduleCheck

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
    """Needs the media features: the decoder skips it without them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor, media: Tensor) -> Tensor:
        return x + self.fc(media.mean(0))


class SelfLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor, media: Tensor | None = None) -> Tensor:
        return x + self.fc(x)


class Vlm(nn.Module):
    """A tower run once per media kind, a projector, a decoder (``cross`` adds a
    cross-attention layer at position ``cross``), a head."""

    def __init__(self, *, cross: int | None = None, layers: int = 3) -> None:
        super().__init__()
        self.vision_tower = Tower()
        self.multi_modal_projector = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(Cross() if i == cross else SelfLayer() for i in range(layers))
        self.head = nn.Linear(DIM, 2)

    def forward(
        self, x: Tensor, pixel_values: Tensor | None = None, videos: Tensor | None = None
    ) -> Tensor:
        feats = [self.vision_tower(p) for p in (pixel_values, videos) if p is not None]
        media = self.multi_modal_projector(torch.cat(feats)) if feats else None
        for layer in self.layers:
            if isinstance(layer, Cross):
                if media is None:
                    continue
                x = layer(x, media)
            else:
                x = layer(x)
        return self.head(x)


def images(n: int = 1) -> Tensor:
    return torch.randn(n, DIM)


@pytest.fixture
def fake2() -> Iterator[None]:
    with fake_process_group(2):
        yield


def shard(
    model: nn.Module, policy: str = "per_layer", **options: Any
) -> tuple[nn.Module, ScheduleCheck | None]:
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy, **options)
    plan = parallelizer.plan(model, mp_policy=FP32)
    parallelizer.apply_plan(model, plan, mesh=build_mesh())
    check = installed_hooks(model).get("schedule_check")
    assert check is None or isinstance(check, ScheduleCheck)
    return model, check


def frozen_tower(**kwargs: Any) -> Vlm:
    model = Vlm(**kwargs)
    model.vision_tower.requires_grad_(False)
    return model


class OtherRank:
    """Plays a second rank (rank 1) at the agreement: the positions it reported in a
    recorded forward are what it says at this rank's checkpoints (calls of the model it
    agrees with; past its last position, it is at the model's next call)."""

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


def media_meetings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The positions this rank says at the agreement from now on (one per checkpoint)."""
    met: list[str] = []
    real = RankAgreement.meet

    def meet(agreement: RankAgreement, kind: str, payload: str, *, what: str) -> None:
        if kind == uneven_module.POSITION:
            met.append(payload)
        real(agreement, kind, payload, what=what)

    monkeypatch.setattr(RankAgreement, "meet", meet)
    return met


def forward_all_reduces(counter: CommCounter) -> int:
    return sum(1 for r in counter.records if r.kind == "all_reduce" and r.phase == "forward")


# --- where the checkpoints are ---------------------------------------------------------------


def test_a_frozen_per_layer_tower_is_one_region_with_two_checkpoints(fake2: None) -> None:
    _, check = shard(frozen_tower())
    assert check is not None
    (region,) = check.layout.regions
    assert (region.path, region.kind, region.frozen) == ("vision_tower", "tower", True)
    assert region.units == ("vision_tower.blocks.0", "vision_tower.blocks.1")
    assert check.layout.successors == {"layers.0"}
    assert check.layout.end_check is False
    # The tower's entry, then the first unit after it.
    assert check.layout.checkpoints_per_forward() == 2


@pytest.mark.parametrize(("cross", "end"), [(1, False), (2, True)])
def test_a_cross_attention_layer_is_a_region_even_under_root(
    fake2: None, cross: int, end: bool
) -> None:
    _, check = shard(frozen_tower(cross=cross), policy="root")
    assert check is not None
    (region,) = check.layout.regions
    assert (region.path, region.kind) == (f"layers.{cross}", "decoder layer")
    assert check.layout.end_check is end
    assert check.layout.successors == (set() if end else {f"layers.{cross + 1}"})
    # First unit after the root starts, the layer's entry, then its successor (or the end).
    assert check.layout.checkpoints_per_forward() == 3


def test_no_region_no_check(fake2: None, monkeypatch: pytest.MonkeyPatch) -> None:
    met = media_meetings(monkeypatch)
    for policy in ("root", "replicate"):
        model, check = shard(frozen_tower(), policy=policy)
        assert check is None
        model(torch.randn(2, DIM), images()).sum().backward()
        assert met == [], policy


@pytest.mark.parametrize(("kinds", "expected"), [((1, 0), 2), ((1, 1), 3), ((0, 0), 1)])
def test_each_tower_call_is_one_checkpoint(
    fake2: None, monkeypatch: pytest.MonkeyPatch, kinds: tuple[int, int], expected: int
) -> None:
    met = media_meetings(monkeypatch)
    model, check = shard(frozen_tower())
    assert check is not None
    pixels = images() if kinds[0] else None
    videos = images(3) if kinds[1] else None
    with CommCounter() as counter:
        with counter.phase("forward"):
            loss = model(torch.randn(2, DIM), pixels, videos).sum()
        loss.backward()
    assert check.last_checkpoints == len(met) == expected
    assert forward_all_reduces(counter) == 0  # the checkpoints meet at the store


def test_a_forward_recomputed_in_backward_is_not_checked(
    fake2: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    met = media_meetings(monkeypatch)
    model = Vlm()
    model.vision_tower.blocks[0].forward = lambda x, f=model.vision_tower.blocks[0].forward: (
        checkpoint(f, x, use_reentrant=False)
    )
    model, check = shard(model)
    assert check is not None
    loss = model(torch.randn(2, DIM), images()).sum()
    assert len(met) == 2
    loss.backward()  # recomputes the checkpointed block
    assert len(met) == 2


# --- disagreement --------------------------------------------------------------------------------


def _tower_gathers(counter: CommCounter) -> int:
    # Tower blocks: fc weight 8x8 + bias 8, fp32, world 2 -> 288 bytes gathered.
    return sum(1 for r in counter.records if r.kind == "all_gather" and r.nbytes == 288)


@pytest.mark.parametrize(
    ("mine", "theirs", "at"),
    [
        (
            (1, 0),
            (0, 0),
            "rank 0 is about to run 'vision_tower.blocks.0' in tower 'vision_tower' (call 1",
        ),
        ((0, 0), (1, 0), "rank 0 is about to run 'layers.0' (call 1"),
        (
            (1, 1),
            (1, 0),
            "rank 0 is about to run 'vision_tower.blocks.0' in tower 'vision_tower' (call 2",
        ),
    ],
    ids=["media-vs-text", "text-vs-media", "two-calls-vs-one"],
)
def test_disagreeing_ranks_stop_before_a_mismatched_collective(
    fake2: None,
    monkeypatch: pytest.MonkeyPatch,
    mine: tuple[int, int],
    theirs: tuple[int, int],
    at: str,
) -> None:
    model, _ = shard(frozen_tower())
    other = OtherRank(monkeypatch)
    x = torch.randn(2, DIM)

    def batch(kinds: tuple[int, int]) -> tuple[Tensor | None, Tensor | None]:
        return (images() if kinds[0] else None, images() if kinds[1] else None)

    with torch.no_grad():
        model(x, *batch(theirs))  # what the other rank reports
    other.recording = False
    counter = CommCounter()
    with counter, pytest.raises(UnevenMediaError) as info:
        model(x, *batch(mine))
    message = str(info.value)
    assert at in message
    assert "tower 'vision_tower'" in message
    # Every rank's position, so that every rank raises the same message.
    assert "rank 0 is about to run" in message
    assert "rank 1 is about to run" in message
    # uneven_media=True is refused with per_layer: the advice changes the policy instead.
    assert "uneven_media=True" not in message
    assert "frozen_multimodal_sharding='root' or 'replicate'" in message
    # Raised at a checkpoint, before the extra tower call's all-gathers.
    tower_calls_both_agree_on = min(mine[0] + mine[1], theirs[0] + theirs[1])
    assert _tower_gathers(counter) == 2 * tower_calls_both_agree_on


def test_agreeing_ranks_train(fake2: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = shard(frozen_tower())
    other = OtherRank(monkeypatch)
    x = torch.randn(2, DIM)
    with torch.no_grad():
        model(x, images(), images(2))
    other.recording = False
    model(x, images(3), images(1)).sum().backward()  # other counts, same calls
    assert other.merged == 3


# --- a region whose entry runs on every rank ------------------------------------------------


class Holder(nn.Module):
    """Every rank calls it (it takes the text stream); it calls each encoder only with its
    media, as Phi-4-multimodal's feature embedding does."""

    def __init__(self) -> None:
        super().__init__()
        self.image = Tower()
        self.audio = Tower()

    def forward(self, x: Tensor, images: Tensor | None, audio: Tensor | None) -> Tensor:
        if images is not None:
            x = x + self.image(images).mean(0)
        if audio is not None:
            x = x + self.audio(audio).mean(0)
        return x


class HolderVlm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.media = Holder()
        self.layers = nn.ModuleList(SelfLayer() for _ in range(2))
        self.head = nn.Linear(DIM, 2)

    def forward(
        self, x: Tensor, images: Tensor | None = None, audio: Tensor | None = None
    ) -> Tensor:
        x = self.media(x, images, audio)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def holder_vlm() -> HolderVlm:
    """The holder named a tower (``extra_tower_names``): a region that every rank enters."""
    model = HolderVlm()
    model.media.requires_grad_(False)
    return model


def shard_holder() -> tuple[nn.Module, ScheduleCheck]:
    model, check = shard(holder_vlm(), extra_tower_names=("media",))
    assert check is not None
    return model, check


def test_each_encoder_in_a_region_is_a_part_with_its_checkpoint(fake2: None) -> None:
    _, check = shard_holder()
    (region,) = check.layout.regions
    assert region.path == "media"
    assert dict(check.layout.parts) == {
        "media.image.blocks.0": "media.image",
        "media.image.blocks.1": "media.image",
        "media.audio.blocks.0": "media.audio",
        "media.audio.blocks.1": "media.audio",
    }
    # Entering an encoder, in each encoder; then the first unit after the region.
    assert check.layout.checkpoints_per_forward() == 3


@pytest.mark.parametrize(
    ("kinds", "expected"), [((1, 1), 3), ((1, 0), 2), ((0, 1), 2), ((0, 0), 1)]
)
def test_a_region_call_checks_only_the_parts_it_runs(
    fake2: None, monkeypatch: pytest.MonkeyPatch, kinds: tuple[int, int], expected: int
) -> None:
    met = media_meetings(monkeypatch)
    model, check = shard_holder()
    media = (images() if kinds[0] else None, images(2) if kinds[1] else None)
    with CommCounter() as counter:
        with counter.phase("forward"):
            loss = model(torch.randn(2, DIM), *media).sum()
        loss.backward()
    assert check.last_checkpoints == len(met) == expected
    assert forward_all_reduces(counter) == 0


@pytest.mark.parametrize(
    ("mine", "theirs", "mine_at", "theirs_at", "agreed"),
    [
        ((1, 0), (0, 0), "'media.image.blocks.0' in tower 'media'", "'layers.0'", 0),
        ((0, 0), (1, 0), "'layers.0'", "'media.image.blocks.0' in tower 'media'", 0),
        ((1, 1), (1, 0), "'media.audio.blocks.0' in tower 'media'", "'layers.0'", 1),
        ((0, 1), (1, 0), "'media.audio.blocks.0' in tower 'media'", "'media.image.blocks.0'", 0),
    ],
    ids=["image-vs-text", "text-vs-image", "image-audio-vs-image", "audio-vs-image"],
)
def test_ranks_that_part_inside_a_region_stop_before_a_mismatched_collective(
    fake2: None,
    monkeypatch: pytest.MonkeyPatch,
    mine: tuple[int, int],
    theirs: tuple[int, int],
    mine_at: str,
    theirs_at: str,
    agreed: int,
) -> None:
    """Every rank enters the region; the ranks part at the encoders inside it."""
    model, _ = shard_holder()
    other = OtherRank(monkeypatch)
    x = torch.randn(2, DIM)

    def batch(kinds: tuple[int, int]) -> tuple[Tensor | None, Tensor | None]:
        return (images() if kinds[0] else None, images() if kinds[1] else None)

    with torch.no_grad():
        model(x, *batch(theirs))  # what the other rank reports
    other.recording = False
    counter = CommCounter()
    with counter, pytest.raises(UnevenMediaError) as info:
        model(x, *batch(mine))
    message = str(info.value)
    assert f"rank 0 is about to run {mine_at} (call 1" in message, message
    assert f"rank 1 is about to run {theirs_at}" in message, message
    # Raised at a checkpoint: only the encoders both ranks ran have gathered.
    assert _tower_gathers(counter) == 2 * agreed


def test_agreeing_ranks_run_a_region_every_rank_enters(
    fake2: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, check = shard_holder()
    other = OtherRank(monkeypatch)
    x = torch.randn(2, DIM)
    with torch.no_grad():
        model(x, images(), images(2))
    other.recording = False
    model(x, images(3), images(1)).sum().backward()
    assert other.merged == check.layout.checkpoints_per_forward() == 3


def test_a_text_only_rank_beside_a_media_rank_stops_at_a_cross_layer(
    fake2: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = shard(frozen_tower(cross=1), policy="root")
    other = OtherRank(monkeypatch)
    x = torch.randn(2, DIM)
    with torch.no_grad():
        model(x, images())
    other.recording = False
    with pytest.raises(UnevenMediaError) as info:
        model(x)
    message = str(info.value)
    assert "decoder layer 'layers.1'" in message
    assert "'layers.2' (call 1" in message  # this rank skipped layers.1
    assert "frozen_multimodal_sharding" not in message  # not a frozen-tower matter


# --- uneven_media=True ---------------------------------------------------------------------------


def test_uneven_media_folds_regions_into_the_root(
    fake2: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    met = media_meetings(monkeypatch)
    trainable = Vlm(cross=1)
    parallelizer = MultimodalParallelizer(uneven_media=True)
    plan = parallelizer.plan(trainable, mp_policy=FP32)
    assert [u.label for u in plan.units] == ["layers.0", "layers.2", "<root>"]
    assert "schedule_check" not in plan.hook_names()
    assert any("join the root unit" in note for note in plan.notes)
    parallelizer.apply_plan(trainable, plan, mesh=build_mesh())
    trainable(torch.randn(2, DIM)).sum().backward()  # text only: fine on any rank
    assert met == []


def test_uneven_media_refuses_per_layer() -> None:
    with pytest.raises(ValueError, match="with uneven_media=True use 'root' or 'replicate'"):
        MultimodalParallelizer(frozen_multimodal_sharding="per_layer", uneven_media=True)
    base = MultimodalParallelizer(uneven_media=True)
    with pytest.raises(ValueError, match="uneven_media=True"):
        base.with_options(frozen_multimodal_sharding="per_layer")
    with pytest.raises(TypeError, match="uneven_media must be a bool"):
        MultimodalParallelizer(uneven_media="yes")  # type: ignore[arg-type]


def test_uneven_media_refuses_odd_dtype_units_inside_a_tower() -> None:
    model = Vlm()
    model.vision_tower.blocks[0].to(torch.bfloat16)  # its own dtype island: a unit
    with pytest.raises(ValueError, match="still need units of their own: 'vision_tower'"):
        MultimodalParallelizer(uneven_media=True).plan(model, mp_policy=FP32)


def test_schedule_check_can_be_disabled(fake2: None, monkeypatch: pytest.MonkeyPatch) -> None:
    met = media_meetings(monkeypatch)
    model, check = shard(frozen_tower(), disabled_hooks=("schedule_check",))
    assert check is None
    model(torch.randn(2, DIM), images()).sum().backward()
    assert met == []


def test_unknown_hook_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown runtime hook 'schedule'; valid names: "):
        MultimodalParallelizer(disabled_hooks=("schedule",))
    with pytest.raises(TypeError, match="disabled_hooks must be a collection"):
        MultimodalParallelizer(disabled_hooks="schedule_check")  # type: ignore[arg-type]


def test_uneven_media_error_is_a_runtime_error() -> None:
    assert issubclass(UnevenMediaError, RuntimeError)
