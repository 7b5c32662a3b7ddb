"""balance_media=True on the tower families of issue 26, against one process running the
whole global batch (cases in ``mp/balanced_families.py``, run as ``balance_hf_<case>``
scenarios in the 2-rank launch).

Mistral 3 and LLaVA with a Pixtral tower (``packed-by-size``), Qwen2-Audio
(``batch-first`` on ``input_features``), the Qwen2.5-Omni thinker (``packed-by-length``
audio beside a ``packed-by-grid`` vision tower), Phi-4-multimodal (the encoders inside
its feature embedding) and Mllama (``tiled``), each under ``root`` and ``per_layer``
with a frozen tower and with a trainable one, through steps with a 3:1 skew, all media
on one rank and all on the other (Omni: audio on one rank and images on the other).
Before, Mistral 3 and LLaVA-Pixtral crashed at step 0 ("tower output tensor 0 has 1 rows
for items of [1, 1] input rows"), and the plan refused the others ("no media layout
applies").
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import balanced_families
from compare import TOL
from launches import MpResults
from reference import ReferenceRun, reference_training

from multimodal_fsdp import MultimodalParallelizer

FP32 = TOL[torch.float32]

LAYOUTS = balanced_families.LAYOUTS


@pytest.mark.parametrize("model", sorted(LAYOUTS))
def test_the_plan_picks_the_family_layout(model: str) -> None:
    """The probe picks each family's layout when the plan is made, and the plan says what
    it found (the probe's summary per balanced module)."""
    build = balanced_families.MODELS[model][0]
    plan = MultimodalParallelizer(balance_media=True).plan(build(frozen=True))
    hook = next(h for h in plan.hooks if h.name == "balance_media")
    runtime = hook.hook
    got = {t.path: t.layout for t in runtime.towers}  # type: ignore[attr-defined]
    assert got == LAYOUTS[model]
    for tower in runtime.towers:  # type: ignore[attr-defined]
        assert tower.probe.startswith(f"{tower.layout}, probed on "), tower.probe
    line = next(line for line in plan.format().splitlines() if "balance_media on" in line)
    assert "layouts:" in line
    assert "per item" in line


def test_omni_towers_split_the_calls_the_thinker_makes() -> None:
    """The Qwen2.5-Omni thinker forwards the batch's ``mm_token_type_ids`` (one value per
    text token, an argument it does not name) to both towers' ``**kwargs``; their layouts
    leave it out and the items, encoded apart, give the call's output. Before, both
    refused the call at the first step ("cannot split the precomputed tensor arguments
    ['mm_token_type_ids']")."""
    from multimodal_fsdp.balance import media_layout_for

    model = balanced_families.build_omni(frozen=True).eval()
    calls: dict[str, tuple[Any, ...]] = {}

    def record(path: str) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            calls[path] = (args, dict(kwargs))

        return hook

    handles = [
        model.get_submodule(path).register_forward_pre_hook(record(path), with_kwargs=True)
        for path in ("model.visual", "model.audio_tower")
    ]
    batch = balanced_families.omni_batch(0, {"audio": 2, "images": 2})
    with torch.no_grad():
        model(**batch)
    for handle in handles:
        handle.remove()
    assert set(calls) == {"model.visual", "model.audio_tower"}
    for path, (args, kwargs) in calls.items():
        assert "mm_token_type_ids" in kwargs, path
        tower = model.get_submodule(path)
        layout = media_layout_for(tower)
        call = layout.split_call(tower, args, kwargs)
        assert "mm_token_type_ids" not in call.spec.fields, path
        assert len(call.items) == 2, path
        with torch.no_grad():
            full = tower(*args, **kwargs)
            pieces = []
            for item in call.items:
                item_args, item_kwargs = layout.build_call(call.spec, [item])
                spec, parts = layout.split_output(
                    tower(*item_args, **item_kwargs), [item.fields[0].shape[0]]
                )
                pieces.extend(parts)
            joined = layout.join_output(spec, pieces)
        torch.testing.assert_close(
            joined.last_hidden_state, full.last_hidden_state, rtol=FP32, atol=FP32
        )


def _phi4_with_audio(audio: dict[str, Any]) -> torch.nn.Module:
    import transformers
    from phi4 import VOCAB

    small = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
    config = transformers.Phi4MultimodalConfig(
        vocab_size=VOCAB,
        num_hidden_layers=1,
        num_key_value_heads=2,
        pad_token_id=0,
        vision_config={**small, "num_hidden_layers": 1, "image_size": 32, "patch_size": 8},
        audio_config={**small, "num_blocks": 1, **audio},
        **small,
    )
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.Phi4MultimodalForCausalLM(config)
    return model


def test_phi4_audio_plans_when_its_widths_agree_and_is_refused_with_its_own_error() -> None:
    """What differs between Phi-4-multimodal's default config shrunk by its sizes and the
    tests' tiny Phi-4: the audio encoder's ``ext_pw_out_channel`` and
    ``depthwise_separable_out_channel`` must equal its ``hidden_size`` (the tiny config
    sets all three to 32; the defaults are 1024). Left at 1024, the encoder runs on no
    input, balanced or not, and the plan refuses it; the refusal now shows the error of
    the input from the config (the convolution's channels), where before it showed the
    last guess's ("The size of tensor a (224) must match the size of tensor b (80)").
    With the widths agreeing it plans, on its real weights. (The unshrunk default config
    plans on the meta device: tests/test_balance_media_every_type.py.)"""
    mismatched = _phi4_with_audio({})
    with pytest.raises(
        ValueError, match="no media layout fits tower Phi4MultimodalAudioEmb"
    ) as raised:
        MultimodalParallelizer(balance_media=True).plan(mismatched)
    assert "expected input[1, 1024, 8] to have 32 channels" in str(raised.value)
    agreeing = _phi4_with_audio({"ext_pw_out_channel": 32, "depthwise_separable_out_channel": 32})
    plan = MultimodalParallelizer(balance_media=True).plan(agreeing)
    hook = plan.hook("balance_media")
    assert hook is not None
    towers = {t.path: t.probe for t in hook.hook.towers}  # type: ignore[attr-defined]
    audio = towers["model.embed_tokens_extend.audio_embed.encoder"]
    assert audio.startswith("batch-first, probed on cpu weights"), audio


@functools.cache
def _reference(name: str) -> ReferenceRun:
    case = balanced_families.CASES[name]
    return reference_training(
        case.build_model,
        case.step_fn(),
        steps=case.steps,
        world=case.world,
        compute_dtype=None,
        optimizer=case.optimizer_fn(),
    )


def _check(name: str, result: dict[str, Any]) -> None:
    case = balanced_families.CASES[name]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert "error" not in result, result.get("error")
    errors = [message for message, _ in result["errors"]]
    assert errors == [""] * case.world, errors[0]
    assert "balance_media" in result["hooks"]
    if not name.startswith("mllama"):  # its cross-attention layers keep their own check
        assert "schedule_check" not in result["hooks"]
    ref = _reference(name)
    assert result["losses"] == pytest.approx(ref.losses, rel=FP32, abs=FP32)
    got: dict[str, torch.Tensor] = result["grads0"]
    assert sorted(set(ref.grads0) ^ set(got)) == []
    for param, expected in ref.grads0.items():
        torch.testing.assert_close(got[param], expected, rtol=FP32, atol=FP32, msg=param)
    assert set(result["params"]) == set(ref.params)
    for param, expected in ref.params.items():
        torch.testing.assert_close(
            result["params"][param], expected, rtol=FP32, atol=FP32, msg=param
        )
    for step, unused in enumerate(result["unused"]):
        assert set(unused) <= ref.unused[step], step


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name", sorted(set(balanced_families.CASES) - balanced_families.CROSS_TOWER)
)
def test_balanced_family_trains_like_one_process(name: str, mp2: MpResults) -> None:
    """Losses, first-step gradients and parameters after three SGD steps equal one
    process running each step's global batch, whatever the step's media distribution."""
    _check(name, mp2(f"balance_hf_{name}"))


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(balanced_families.CROSS_TOWER))
def test_audio_on_one_rank_and_images_on_the_other(name: str, mp2: MpResults) -> None:
    """Qwen2.5-Omni and Phi-4: audio on one rank and images on the other, then every
    medium on one rank."""
    _check(name, mp2(f"balance_hf_{name}"))
