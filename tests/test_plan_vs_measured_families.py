"""Plan costs and memory of the issue-26 layouts against a measured balanced step, under
the fake process group (every rank has the batch's media; see
``tests/test_plan_vs_measured_balance.py`` for the method).

For each tower family of ``mp/balanced_families.py`` (``packed-by-size``: Mistral 3 and
LLaVA-Pixtral; ``batch-first`` on ``input_features``: Qwen2-Audio, and AudioFlamingo3
with its mask; ``packed-by-length`` beside ``packed-by-grid``: Qwen2.5-Omni; the
encoders inside Phi-4's feature embedding;
``tiled``: Mllama), the collectives ``plan_costs`` predicts from the media that
``record_step_media`` reads through the layout equal, per phase and kind, count and
bytes, those ``measure_plan`` counts on a real step, with a frozen tower under
``per_layer`` and a trainable one under ``root``; the memory model, with the exchange's
buffers, holds within the tolerances of ``tests/mp/memory_check.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import balanced_families
from memory_check import check_memory

from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.measure.comm import measure_plan
from multimodal_fsdp.measure.memory import measure_plan_memory

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")

#: Per model: the media of the measured batch (both kinds where the model has two).
MEDIA: dict[str, dict[str, int]] = {
    "mistral3": {"images": 3},
    "llava_pixtral": {"images": 3},
    "qwen2_audio": {"audio": 2},
    "audioflamingo3": {"audio": 2},
    "omni": {"audio": 2, "images": 1},
    "phi4": {"images": 1, "audio": 1},
    "mllama": {"images": 3},
}
CASES = [
    (model, policy, tower)
    for model in MEDIA
    for policy, tower in (("per_layer", "frozen"), ("root", "trainable"))
]


def _plan(model: str, policy: str, tower: str) -> tuple[Any, Any, Any]:
    build, batch, _ = balanced_families.MODELS[model]
    module = build(frozen=tower == "frozen")
    plan = MultimodalParallelizer(
        frozen_multimodal_sharding=policy,  # type: ignore[arg-type]
        balance_media=True,
    ).plan(module)
    made = batch(5, MEDIA[model])
    return module, plan, made


@pytest.mark.parametrize(("model", "policy", "tower"), CASES)
def test_family_plan_costs_match_measured(model: str, policy: str, tower: str) -> None:
    module, plan, batch = _plan(model, policy, tower)
    result = measure_plan(plan, module, lambda m: balanced_families.hf_loss(m, batch), world_size=2)
    assert result.matches, result.comparison.format()
    assert result.costs.exchange is not None
    assert set(result.costs.balanced_towers) == set(balanced_families.LAYOUTS[model])
    assert result.measured.comm.count("all_gather", "forward") > 0


@pytest.mark.parametrize("model", sorted(MEDIA))
def test_family_memory_matches_measured(model: str) -> None:
    module, plan, batch = _plan(model, "per_layer", "frozen")
    result = measure_plan_memory(
        plan, module, lambda m: balanced_families.hf_loss(m, batch), world_size=2
    )
    assert result.costs.exchange is not None
    check_memory(result)
