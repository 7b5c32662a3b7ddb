"""The training loops users write, on 2 gloo ranks (HSDP on 4), against one process.

Each case of ``mp/loops.py`` either trains exactly like the single-process
reference of ``mp/reference.py`` (losses, first-step gradients, final parameters,
and which parameters got no gradient in each step), or stops on every rank with
the same ``UnevenMediaError`` before the first step completes: a case that cannot
train must never hang, crash deep in the collective library, or change the numbers.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from compare import TOL, check_against_reference
from launches import MpResults
from loops import CASES, LoopCase, cases_for
from reference import ReferenceRun, reference_training

pytestmark = pytest.mark.distributed


@functools.cache
def reference(name: str) -> ReferenceRun:
    case = CASES[name]
    return reference_training(
        case.build_model,
        case.step_fn(),
        steps=case.steps,
        world=case.world,
        compute_dtype=case.compute_dtype,
        optimizer=case.optimizer_fn(),
        keep_fp32=case.keep_fp32,
    )


def _results(case: LoopCase, mp2: MpResults, mp4: MpResults) -> dict[str, Any]:
    return (mp2 if case.world == 2 else mp4)(f"loop_{case.name}")


def _matching(world: int) -> list[str]:
    return [n for n in cases_for(world) if CASES[n].expect == "match"]


def _stopping(world: int) -> list[str]:
    return [n for n in cases_for(world) if CASES[n].expect == "uneven_error"]


def check_match(case: LoopCase, result: dict[str, Any]) -> None:
    errors = [message for message, _ in result["errors"]]
    assert errors == [""] * case.world, errors[0]
    ref = reference(case.name)
    tol = case.grad_tol or TOL[case.compute_dtype or torch.float32]
    # A replicated tower is stored in the compute dtype by design: compare after that cast.
    recast = frozenset(result.get("replicated", ()))
    check_against_reference(result, ref.as_tuple(), tol, update_tol=case.update_tol, recast=recast)
    # Parameters that no rank used keep no gradient; every other one has one.
    assert [frozenset(step) for step in result["unused"]] == ref.unused


@pytest.mark.parametrize("name", _matching(2))
def test_loop_trains_like_one_process(name: str, mp2: MpResults, mp4: MpResults) -> None:
    case = CASES[name]
    check_match(case, _results(case, mp2, mp4))


@pytest.mark.parametrize("name", _matching(4))
def test_loop_trains_like_one_process_on_hsdp(name: str, mp2: MpResults, mp4: MpResults) -> None:
    case = CASES[name]
    check_match(case, _results(case, mp2, mp4))


@pytest.mark.parametrize("name", _stopping(2) + _stopping(4))
def test_loop_stops_on_every_rank_with_a_clear_error(
    name: str, mp2: MpResults, mp4: MpResults
) -> None:
    case = CASES[name]
    result = _results(case, mp2, mp4)
    messages = [message for message, _ in result["errors"]]
    steps = [done for _, done in result["errors"]]
    assert all(messages), messages  # every rank raised
    assert len(set(messages)) == 1, messages  # the same error, naming every rank's position
    assert steps == [0] * case.world  # in the first step, before any step completed
    policies = case.policy.values() if isinstance(case.policy, dict) else [case.policy]
    for message in messages:
        assert "about to run" in message
        if "per_layer" in policies:  # uneven_media=True is refused with per_layer
            assert "frozen_multimodal_sharding='root' or 'replicate'" in message
        else:
            assert "pass uneven_media=True" in message
    assert "schedule_check" in result["hooks"]


def test_adamw_leaves_parameters_that_no_rank_used_untouched() -> None:
    """The reference itself: in the step without media the projector gets no gradient,
    so AdamW neither decays nor moves it (a forced zero gradient would do both)."""
    ref = reference("adamw_no_media_root")
    assert ref.unused[0] == frozenset()
    assert {n.split(".")[0] for n in ref.unused[1]} == {"multi_modal_projector"}


@pytest.mark.parametrize(
    "name", ["adamw_no_media_root", "adamw_no_media_per_layer", "adamw_no_media_replicate"]
)
def test_no_rank_used_the_projector_so_its_gradient_stays_none(
    name: str, mp2: MpResults, mp4: MpResults
) -> None:
    result = _results(CASES[name], mp2, mp4)
    assert {n.split(".")[0] for n in result["unused"][1]} == {"multi_modal_projector"}
    assert result["unused"][0] == result["unused"][2] == []


#: Each ``per_layer`` case with a text-only rank, and the cases that apply the remedy its
#: ``UnevenMediaError`` proposes (``root`` or ``replicate``, with ``uneven_media=True``).
TEXT_ONLY_REMEDIES = {
    "lora_llava_tower_text_only_rank_per_layer": "lora_llava_tower_text_only_rank_uneven_media",
    "lora_qwen2_vl_tower_text_only_rank_per_layer": (
        "lora_qwen2_vl_tower_text_only_rank_replicate_uneven_media"
    ),
}


@pytest.mark.parametrize("stopping", sorted(TEXT_ONLY_REMEDIES))
def test_tower_lora_with_a_text_only_rank_remedy_trains(
    stopping: str, mp2: MpResults, mp4: MpResults
) -> None:
    """LoRA in the tower with a text-only rank (issue 17, item 7): ``per_layer`` stops on
    every rank, and the remedy its message proposes, applied to the same model and media,
    trains like one process (the remedy case is also checked against the reference)."""
    remedy = CASES[TEXT_ONLY_REMEDIES[stopping]]
    case = CASES[stopping]
    assert (case.expect, remedy.expect) == ("uneven_error", "match")
    assert remedy.uneven_media
    assert remedy.policy in ("root", "replicate")
    assert remedy.build is case.build  # the same model,
    assert remedy.media is case.media  # the same media
    for message, _ in _results(case, mp2, mp4)["errors"]:
        assert "'root' or 'replicate' instead of 'per_layer'" in message, message
        assert "uneven_media=True" in message, message
    check_match(remedy, _results(remedy, mp2, mp4))
