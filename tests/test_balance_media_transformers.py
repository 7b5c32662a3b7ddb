"""balance_media=True on real models against one process running the whole global batch.

The cases (``mp/balanced_hf.py``, scenarios in ``mp/scenarios_balance_hf.py``): tiny
transformers LLaVA (CLIP tower, its hidden states), Qwen2-VL (packed patches; images and
videos; one tower call per image), Idefics3 (batch-first with a patch mask) and the
DeepSeek-V4.1 reference model (``DeepseekV41ModelParallelizer``), under ``root``,
``per_layer`` and ``replicate`` with the tower frozen, trainable or adapted by LoRA
(PEFT, every base weight frozen), through steps with even media, a text-only rank, all
media on one rank and image+video on one rank only; an eval pass and ``generate()``
before every step; HSDP 2 x 2 on 4 ranks; gradient accumulation with text-only
micro-batches.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import balanced_hf
from compare import TOL
from launches import MpResults
from reference import ReferenceRun, reference_training

from model_deepseek_v41 import DeepseekV41ModelParallelizer
from multimodal_fsdp import MultimodalParallelizer

FP32 = TOL[torch.float32]

#: Per model, the module between the tower and the decoder (a projector with layers of
#: its own under per_layer) that only ranks with media run.
PROJECTORS = {"llava": "multi_modal_projector", "idefics3": "connector", "deepseek": "aligner"}


@pytest.mark.parametrize("name", sorted(PROJECTORS))
def test_a_frozen_projector_keeps_its_units_and_is_joined_under_balance_media(name: str) -> None:
    """A projector runs between the balanced tower call and the join site (the first
    decoder layer), only on ranks with media. With a unit of its own (per_layer, PEFT's
    frozen base) its collectives, and the schedule check's before it, met the joining
    ranks' exchange: every step with a text-only rank hung, so it used to join the root
    unit. Now it keeps its units and its calls go through the exchange's rounds: a rank
    without the call runs it on a placeholder there (the training cases below run it)."""
    model = balanced_hf.CASES[f"{name}_per_layer_lora"].build_model()
    cls = DeepseekV41ModelParallelizer if name == "deepseek" else MultimodalParallelizer
    plan = cls(frozen_multimodal_sharding="per_layer", balance_media=True).plan(model)
    labels = [unit.label for unit in plan.units]
    assert [label for label in labels if PROJECTORS[name] in label], labels
    assert any(
        ".layers.0" in label or ".blocks.0" in label for label in labels if "vision" in label
    )
    assert "schedule_check" not in plan.hook_names()
    planned = plan.hook("balance_media")
    assert planned is not None
    joined = [module.path for module in planned.hook.joined]  # type: ignore[attr-defined]
    assert len(joined) == 1, joined
    assert joined[0].endswith(PROJECTORS[name]), joined


@functools.cache
def _reference(name: str) -> tuple[ReferenceRun, list[list[int]]]:
    """One process running every rank's batch of each step (``reference_training``) and
    the tokens its eval passes generated, in (step, rank) order."""
    case = balanced_hf.CASES[name]
    balanced_hf.GENERATED.clear()
    ref = reference_training(
        case.build_model,
        case.step_fn(),
        steps=case.steps,
        world=case.world,
        compute_dtype=None,
        optimizer=case.optimizer_fn(),
    )
    generated = list(balanced_hf.GENERATED)
    balanced_hf.GENERATED.clear()
    return ref, generated


def _check(name: str, result: dict[str, Any]) -> None:
    case = balanced_hf.CASES[name]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert "error" not in result, result.get("error")
    errors = [message for message, _ in result["errors"]]
    assert errors == [""] * case.world, errors[0]
    assert "balance_media" in result["hooks"]
    assert "schedule_check" not in result["hooks"]
    ref, generated = _reference(name)
    assert result["losses"] == pytest.approx(ref.losses, rel=FP32, abs=FP32)
    got: dict[str, torch.Tensor] = result["grads0"]
    assert set(ref.grads0) <= set(got), sorted(set(ref.grads0) - set(got))
    # None where one process has None: a tower parameter that only feeds outputs no loss
    # reads (LLaVA's last CLIP layer, above the hidden state it takes) gets no gradient.
    assert sorted(set(got) - set(ref.grads0)) == [], "gradients where one process has none"
    for param, expected in ref.grads0.items():
        torch.testing.assert_close(got[param], expected, rtol=FP32, atol=FP32, msg=param)
    assert set(result["params"]) == set(ref.params)
    for param, expected in ref.params.items():
        torch.testing.assert_close(
            result["params"][param], expected, rtol=FP32, atol=FP32, msg=param
        )
    for step, unused in enumerate(result["unused"]):
        assert set(unused) <= ref.unused[step], step
    if case.eval_extra is not None:
        mine = result["generated"]
        assert len(generated) == case.steps * case.world
        assert [mine[r][s] for s in range(case.steps) for r in range(case.world)] == generated


@pytest.mark.distributed
@pytest.mark.parametrize("name", balanced_hf.hf_cases_for(2))
def test_balanced_training_equals_one_process(name: str, mp2: MpResults) -> None:
    """Losses, first-step gradients, parameters after three SGD steps and the tokens
    ``generate()`` produced before each step equal one process running each step's
    global batch, whatever the media distribution of the step."""
    _check(name, mp2(f"balance_hf_{name}"))


@pytest.mark.distributed
@pytest.mark.parametrize("name", balanced_hf.hf_cases_for(4))
def test_balanced_training_on_hsdp_equals_one_process(name: str, mp4: MpResults) -> None:
    """2 x 2 HSDP: the tower's calls are balanced over all four ranks (both mesh
    dimensions); text-only ranks, video on one rank only, all media on one rank."""
    _check(name, mp4(f"balance_hf_{name}"))


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(balanced_hf.ACCUMULATION))
def test_accumulation_with_text_only_micro_batches(name: str, mp2: MpResults) -> None:
    """Two micro-batches per rank, a text-only one on each (first on rank 0, second on
    rank 1), no gradient sync for the first: the accumulated gradients equal one process's
    (``None`` where one process has ``None``)."""
    result = mp2("balance_hf_accumulation")
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert "error" not in result, result.get("error")
    got = result[name]["grads"]
    want = balanced_hf.accumulation_reference(name)
    assert "balance_media" in result[name]["hooks"]
    assert set(want) <= set(got), sorted(set(want) - set(got))
    assert sorted(set(got) - set(want)) == [], "gradients where one process has none"
    for param, expected in want.items():
        torch.testing.assert_close(got[param], expected, rtol=FP32, atol=FP32, msg=param)


@pytest.mark.parametrize(("policy", "balanced"), [("per_layer", True), ("root", False)])
def test_generate_is_one_balanced_scope_for_a_tower_with_units(policy: str, balanced: bool) -> None:
    """``generate()`` computes the image features before its first forward, outside any
    forward. A tower with units (per_layer) ran them locally: with an image on one rank
    only, that rank's tower all-gathers met the other rank's decoder collectives (gloo
    aborted: 'Received data size doesn't match expected size'). The hook wraps
    ``generate`` (over entry_unshard's wrapper) so that the call is balanced; a tower
    without units keeps running locally (as in an eval forward), and training forwards
    balance both; removing the hook restores the wrapper below."""
    from fsdp_core import build_mesh
    from fsdp_core.fake_group import fake_process_group
    from fsdp_core.runtime import installed_hooks, remove_runtime_hooks

    model = balanced_hf.CASES["llava_replicate_frozen"].build_model()
    with fake_process_group(2):
        parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy, balance_media=True)
        parallelizer.parallelize(model, mesh=build_mesh())
        below = installed_hooks(model)["entry_unshard"]
        hook = installed_hooks(model)["balance_media"]
        model.eval()
        with torch.no_grad():
            balanced_hf.generate_tokens("llava")(
                model, {"input_ids": torch.ones(1, 2).long(), "pixel_values": 0}
            )
        assert hook.last_calls == int(balanced)  # the one tower call, before the first forward
        with torch.no_grad():  # an eval forward: the same rule
            balanced_hf._hf_loss(model, balanced_hf._hf_batch("llava")(3, {"images": 2}))
        assert hook.last_calls == int(balanced)
        model.train()
        balanced_hf._hf_loss(model, balanced_hf._hf_batch("llava")(3, {"images": 2})).backward()
        assert hook.last_calls == 1  # training: every tower is balanced
        wrapper = vars(model)["generate"]
        assert remove_runtime_hooks(model, ["balance_media"]) == ["balance_media"]
        assert (vars(model)["generate"] is not wrapper) == balanced
        assert remove_runtime_hooks(model, ["entry_unshard"]) == ["entry_unshard"]
        assert "generate" not in vars(model)
        assert below is not None
