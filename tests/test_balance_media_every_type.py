"""balance_media=True planned on every vision- and audio-language model type of transformers
5.24 that has a tower, each built from its default config on the meta device (the types
and their towers are those of ``mp/hf_model_types.py``).

Every tower is either balanced (with a layout the plan-time probe fitted on the meta
device, or a family's own layout that cannot run there, trusted and checked at the first
step) or refused when the plan is made, for the reason pinned in :data:`REFUSED`. Before
the probe gave audio encoders their masks and raw waveforms, 26 of the 111 were refused;
now 16 are: encoders whose batch norms mix the items of a call (refused on any weights),
encoders that read data on the meta device (``.item()`` on a mask: their real weights are
probed instead, see ``AudioFlamingo3`` in ``mp/balanced_families.py``), and towers whose
input is not one row of media per item. About 70 s on two CPU cores (the builds and the
probes on the meta device).
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")

from hf_model_types import EXPECTED, build_or_skip, pinned

from multimodal_fsdp import MultimodalParallelizer

pytestmark = pytest.mark.transformers

#: The types whose towers balance_media refuses when planned on the meta device, with a
#: part of the probe's reason.
REFUSED: dict[str, str] = {
    # Batch norms normalise over the items of a call: refused on any weights.
    "canary": "misfit (batch norms",
    "cohere_asr": "misfit (batch norms",
    "granite_speech": "misfit (batch norms",
    "granite_speech_plus": "misfit (batch norms",
    "seamless_m4t": "misfit (batch norms",
    # The encoder reads its mask or lengths as data (``.item()``, masks built on the
    # input's device), which the meta device cannot give: probed on real weights only.
    "apertus1p5": "batch-first: unprobed",
    "audioflamingo3": "batch-first: unprobed",
    "fun_asr_nano": "batch-first: unprobed",
    "kyutai_speech_to_text": "batch-first: unprobed",
    "musicflamingo": "batch-first: unprobed",
    "nemo_speechlm": "batch-first: unprobed",
    # On real weights a misfit: it packs the valid frames of all clips into one sequence.
    "qwen3_asr": "batch-first: unprobed",
    # Inputs that are not rows of media: audio token ids (Inkling), clip lengths without
    # a mask (dots3), a neck fed the tower's hidden states (DeepSeek-VL hybrid).
    "deepseek_vl_hybrid": "batch-first: unprobed",
    "dots3_note": "batch-first: unprobed",
    "inkling_mm_model": "batch-first: unprobed",
    # Packed clips whose output rows are not a whole number per clip on the probe's input.
    "qwen3_omni_moe_thinker": "packed-by-length: misfit",
}

WITH_TOWERS = sorted(
    name
    for name, (_, found) in EXPECTED.items()
    if any(r.startswith("tower/") for r in found.values())
)


def test_the_refused_types_are_a_minority() -> None:
    assert set(REFUSED) <= set(WITH_TOWERS)
    if pinned():
        assert (len(WITH_TOWERS), len(REFUSED)) == (111, 16)


@pytest.mark.parametrize("model_type", WITH_TOWERS)
def test_every_tower_is_balanced_or_refused_for_its_pinned_reason(model_type: str) -> None:
    model = build_or_skip(model_type)
    logging.disable(logging.WARNING)  # the probe's debug lines and transformers' warnings
    try:
        planner = MultimodalParallelizer(balance_media=True)
        if model_type in REFUSED:
            with pytest.raises(ValueError, match="balance_media=True cannot balance") as raised:
                planner.plan(model)
            assert REFUSED[model_type] in str(raised.value)
            assert "register_media_layout" in str(raised.value)  # says what to change
            return
        plan = planner.plan(model)
    finally:
        logging.disable(logging.NOTSET)
    planned = plan.hook("balance_media")
    assert planned is not None, plan.hook_names()
    towers = planned.hook.towers  # type: ignore[attr-defined]
    assert towers, model_type
    for tower in towers:  # probed, or a family's own layout the first step checks
        assert tower.probe.startswith(
            (f"{tower.layout}, probed on the meta device", f"{tower.layout}, not probed (")
        ), tower.probe
        if "not probed" in tower.probe:
            assert tower.probe.endswith("its calls are checked at the first step"), tower.probe
