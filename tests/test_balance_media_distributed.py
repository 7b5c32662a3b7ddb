"""balance_media=True on 2 gloo ranks against one process running each global batch.

The scenarios (``mp/scenarios_balance.py``) train the fp32 DeepSeek-V4.1 VLM under each
policy with a frozen tower, a trainable tower and a frozen tower with a trainable
adapter in a block, through steps with even media, a text-only rank, all media on one
rank and one tower call per image (4 calls on one rank, 2 or none on the other), with an
eval pass between steps; and gradient accumulation with a text-only micro-batch.
"""

from __future__ import annotations

import functools
from typing import Any

import balanced_vlm as balance
import pytest
import torch
from launches import MpResults

pytestmark = pytest.mark.distributed

TOL = 1e-5
CASES = [f"{policy}/{tower}" for policy in balance.POLICIES for tower in balance.TOWERS]


@functools.cache
def _reference(tower: str) -> dict[str, Any]:
    return balance.reference(tower)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for name, expected in want.items():
        torch.testing.assert_close(got[name], expected, rtol=TOL, atol=TOL, msg=f"{what} {name}")


@pytest.mark.parametrize("case", CASES)
def test_balanced_training_equals_one_process(case: str, mp2: MpResults) -> None:
    """Every step's gradients, the losses, the eval loss between steps and the final
    parameters equal one process's, whatever the media distribution of the step."""
    result = mp2("balance_media")[case]
    ref = _reference(case.split("/")[1])
    assert result["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL)
    assert result["eval_loss"] == pytest.approx(ref["eval_loss"], rel=TOL, abs=TOL)
    for step, grads in enumerate(ref["grads"]):
        _close(result["grads"][step], grads, f"step {step} ({balance.DISTRIBUTIONS[step]})")
    _close(result["params"], ref["params"], "parameters")


@pytest.mark.parametrize("case", CASES)
def test_every_rank_encodes_an_equal_share(case: str, mp2: MpResults) -> None:
    """Images per rank's tower in the steps with one call per rank: 2 images on rank 0
    and none on rank 1 become one each; 4 on rank 1 two each (even steps stay even)."""
    encoded = mp2("balance_media")[case]["encoded"]
    assert encoded[:3] == [[2, 2], [1, 1], [2, 2]]


@pytest.mark.parametrize("case", CASES)
def test_the_plan_lists_the_balanced_tower_and_no_schedule_check(case: str, mp2: MpResults) -> None:
    result = mp2("balance_media")[case]
    assert "balance_media" in result["hooks"]
    assert "schedule_check" not in result["hooks"]
    line = next(h for h in result["hook_lines"] if h.startswith("balance_media"))
    assert "'vision' (batch-first)" in line
    assert "'model.layers.0'" in line


@pytest.mark.parametrize("variant", ["per_layer", "uneven"])
def test_accumulation_with_a_text_only_micro_batch(variant: str, mp2: MpResults) -> None:
    """Text-only then images on rank 0, the reverse on rank 1, no sync for the first
    micro-batch; with uneven_media=True too (the tower keeps its per_layer units)."""
    result = mp2("balance_media_accumulation")[variant]
    _close(result["grads"], balance.accumulation_reference("adapter"), "accumulated gradients")
    assert "vision.blocks.0" in result["units"]
    assert "schedule_check" not in result["hooks"]


@functools.cache
def _hf_reference(case: str) -> dict[str, Any]:
    name, tower = case.split("/")
    return balance.hf_reference(name, tower)


@pytest.mark.parametrize("case", balance.HF_CASES)
def test_transformers_llava_and_qwen2_vl_under_per_layer(case: str, mp2: MpResults) -> None:
    """Tiny transformers LLaVA (CLIP tower, its hidden states) and Qwen2-VL (packed
    patches; images and videos, so two tower calls on one rank and one or none on the
    other) with per_layer units in the tower and media on some ranks only: every step's
    gradients equal one process's, including which are ``None``: tower parameters that
    only feed outputs the loss never reads (LLaVA's last CLIP layer, below the hidden
    state it takes) keep no gradient, as in one process."""
    result = mp2("balance_media_hf")[case]
    ref = _hf_reference(case)
    assert "balance_media" in result["hooks"]
    assert result["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL)
    for step, want in enumerate(ref["grads"]):
        got = result["grads"][step]
        assert sorted(set(got) - set(want)) == [], f"step {step}: gradients where none"
        _close(got, want, f"step {step}")


@pytest.mark.parametrize("tower", ["trainable", "adapter"])
def test_hsdp_2x2_balances_over_both_dimensions(tower: str, mp4: MpResults) -> None:
    """4 ranks, an HSDP 2x2 mesh, per_layer: all media on one rank, a skew, one call per
    image (4 calls, none, none, 2): gradients equal one process's, and the images are
    spread over all four ranks (not only within a shard group)."""
    result = mp4("balance_media_hsdp")[f"per_layer/{tower}"]
    ref = _hsdp_reference(tower)
    assert result["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL)
    assert result["eval_loss"] == pytest.approx(ref["eval_loss"], rel=TOL, abs=TOL)
    for step, grads in enumerate(ref["grads"]):
        _close(result["grads"][step], grads, f"step {step}")
    assert result["encoded"][1] == [2, 2, 1, 1]  # 6 images on ranks 1 and 2


@functools.cache
def _hsdp_reference(tower: str) -> dict[str, Any]:
    return balance.reference(tower, table=balance.HSDP_DISTRIBUTIONS)
