"""Phi-4-multimodal planned without a process group (issue 24, item 2): discovery reports the
encoders that its feature embedding holds, each addressable as a tower, and the schedule
check of a ``per_layer`` plan guards the first unit of each encoder, also when a caller
names the feature embedding itself a tower (a region that every rank enters).
"""

from __future__ import annotations

import pytest
from phi4 import FEATURE_EMBEDDING, build_phi4
from torch import nn

from fsdp_core import ShardingPlan
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.discovery.walk import resolve_multimodal_modules
from multimodal_fsdp.runtime.schedule_check import ScheduleCheckRuntimeHook, ScheduleLayout

pytestmark = pytest.mark.transformers

pytest.importorskip("transformers")

IMAGE = f"{FEATURE_EMBEDDING}.image_embed"
AUDIO = f"{FEATURE_EMBEDDING}.audio_embed"


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return build_phi4()


def _layout(plan: ShardingPlan) -> ScheduleLayout:
    planned = plan.hook(ScheduleCheckRuntimeHook.name)
    assert planned is not None
    assert isinstance(planned.hook, ScheduleCheckRuntimeHook)
    return planned.hook.layout


def test_the_encoders_inside_the_feature_embedding_are_the_towers(model: nn.Module) -> None:
    found = resolve_multimodal_modules(model)
    assert [(m.path, m.role, m.modality, m.rule) for m in found] == [
        (IMAGE, "tower", "vision", "name:image_embed"),
        (AUDIO, "tower", "audio", "name:audio_embed"),
    ]


def test_per_layer_makes_each_encoder_a_region_checked_at_its_first_unit(
    model: nn.Module,
) -> None:
    plan = MultimodalParallelizer(frozen_multimodal_sharding="per_layer").plan(model)
    layout = _layout(plan)
    assert [(r.path, r.kind, r.frozen) for r in layout.regions] == [
        (IMAGE, "tower", True),
        (AUDIO, "tower", True),
    ]
    # A checkpoint at the first unit of each encoder, whose stack is the region's part.
    assert dict(layout.parts) == {
        f"{IMAGE}.img_processor.encoder.layers.0": f"{IMAGE}.img_processor",
        f"{IMAGE}.img_processor.encoder.layers.1": f"{IMAGE}.img_processor",
        f"{AUDIO}.encoder.encoders.0": f"{AUDIO}.encoder",
        f"{AUDIO}.encoder.encoders.1": f"{AUDIO}.encoder",
    }


def test_each_encoder_takes_its_own_policy(model: nn.Module) -> None:
    """Addressable as towers: a policy per encoder (issue 26 balances them the same way)."""
    parallelizer = MultimodalParallelizer(
        frozen_multimodal_sharding={IMAGE: "per_layer", "*": "replicate"}
    )
    plan = parallelizer.plan(model)
    assert [r.path for r in _layout(plan).regions] == [IMAGE]
    assert not [u.label for u in plan.units if u.label.startswith(AUDIO)]
    assert any(name.startswith(f"{AUDIO}.") for name in plan.replicated_param_names)


def test_a_region_every_rank_enters_is_checked_at_each_encoder(model: nn.Module) -> None:
    """The feature embedding named a tower by the caller: every rank enters it, so its
    entry proves nothing; each encoder's first unit carries the checkpoint."""
    parallelizer = MultimodalParallelizer(
        frozen_multimodal_sharding="per_layer", extra_tower_names=("embed_tokens_extend",)
    )
    layout = _layout(parallelizer.plan(model))
    assert [r.path for r in layout.regions] == [FEATURE_EMBEDDING]
    assert set(dict(layout.parts).values()) == {IMAGE, AUDIO}
