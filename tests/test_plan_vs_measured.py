"""The plan's communication figures against a measured training step, exactly.

For each frozen-tower policy, on the DeepSeek-V4.1 reference model and on two
transformers VLMs (LLaVA, Qwen2-VL) built small on CPU, the collectives that
:func:`multimodal_fsdp.estimate.costs.plan_costs` predicts from the plan alone equal,
per phase and per kind, count and bytes, those that
:func:`multimodal_fsdp.measure.comm.measure_plan` counts on one forward+backward
under the fake process group. Odd widths and world sizes make FSDP pad.

Also here: the frozen-tower minimum (gathered once per step, in forward only,
never reduce-scattered; nothing at all under ``replicate``), what the prefetch
guard saves, and the extra collectives of DeepSeek-V4.1's fp32 vision norms
against one unit per norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from padded_deepseek import PADDED_TINY
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core import ShardingPlan, mixed_precision_policy
from fsdp_core.collective_count import CommTally
from model_deepseek_v41 import PARALLELIZER, build_deepseek_v41, make_batch
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.estimate.rewrite import ungroup_units
from multimodal_fsdp.measure.comm import Measurement, measure_plan

POLICIES = ("root", "per_layer", "replicate")
MP = mixed_precision_policy("bf16", "fp32")
#: Tiny, with widths no world size below divides evenly (36, 131, ...): FSDP pads.
DS_CONFIG = PADDED_TINY
DS_BATCH = make_batch(DS_CONFIG, batch_size=2, seq_len=16)
DS_WORLD = 8

pytestmark = [
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor"),
    pytest.mark.filterwarnings("ignore:.*mm_token_type_ids.*"),
]


# --- DeepSeek-V4.1 ---------------------------------------------------------------------------


def _deepseek(*, frozen_tower: bool = True, frozen: tuple[str, ...] = ()) -> nn.Module:
    model = build_deepseek_v41(DS_CONFIG, dtype=torch.bfloat16)
    if frozen_tower:
        model.vision.requires_grad_(False)
    for path in frozen:
        model.get_submodule(path).requires_grad_(False)
    return model


def _ds_loss(model: nn.Module) -> torch.Tensor:
    loss: torch.Tensor = model(**DS_BATCH)
    return loss


def _plan_and_measure(
    build: Callable[[], nn.Module],
    parallelizer: MultimodalParallelizer,
    loss: Callable[[nn.Module], torch.Tensor],
    *,
    mp_policy: MixedPrecisionPolicy = MP,
    reshard_after_forward: bool | int | None = None,
    transform_plan: Callable[[ShardingPlan], ShardingPlan] | None = None,
    **options: Any,
) -> Measurement:
    """Plan the model ``build()`` returns, optionally rewrite the plan, then measure it:
    the measurement takes the plan and the model only."""
    model = build()
    plan = parallelizer.plan(
        model, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
    )
    if transform_plan is not None:
        plan = transform_plan(plan)
    return measure_plan(plan, model, loss, **options)


def _measure_ds(policy: str, **kwargs: Any) -> Measurement:
    options = {"world_size": DS_WORLD, **kwargs}
    build = options.pop("build", _deepseek)
    return _plan_and_measure(
        build, PARALLELIZER.with_options(frozen_multimodal_sharding=policy), _ds_loss, **options
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_deepseek_plan_matches_measured(policy: str) -> None:
    result = _measure_ds(policy)
    assert result.matches, result.comparison.format()
    assert result.measured.comm.count("all_gather", "forward") > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_deepseek_hsdp_and_trainable_tower_match(policy: str) -> None:
    hsdp = _measure_ds(policy, world_size=4, dp_replicate=2)
    assert hsdp.matches, hsdp.comparison.format()
    assert hsdp.measured.comm.count("all_reduce", "backward") > 0
    trainable = _measure_ds(policy, build=lambda: _deepseek(frozen_tower=False))
    assert trainable.matches, trainable.comparison.format()


@pytest.mark.parametrize("reshard", [False, True, 2])
def test_deepseek_reshard_settings_match(reshard: bool | int) -> None:
    result = _measure_ds("per_layer", reshard_after_forward=reshard)
    assert result.matches, result.comparison.format()


def test_steady_state_step_is_the_same() -> None:
    first = _measure_ds("per_layer")
    second = _measure_ds("per_layer", steps=2)
    assert second.matches
    assert first.measured.comm == second.measured.comm


# --- the frozen-tower minimum ------------------------------------------------------------------


def _tower_units(result: Measurement) -> list[str]:
    return [u.label for u in result.costs.units if any(p.startswith("vision") for p in u.paths)]


def test_frozen_tower_is_gathered_once_in_forward_and_never_reduced() -> None:
    runs = {policy: _measure_ds(policy) for policy in POLICIES}
    for result in runs.values():
        assert result.matches, result.comparison.format()
    # Backward is identical under every policy: the frozen tower costs nothing there
    # (no all-gather, no reduce-scatter), wherever its parameters live.
    backward = {
        policy: {k: v for k, v in r.measured.comm.as_dict().items() if k == "backward"}
        for policy, r in runs.items()
    }
    assert backward["root"] == backward["per_layer"] == backward["replicate"]
    # replicate: no tower unit, so no tower collective at all.
    assert _tower_units(runs["replicate"]) == []
    # per_layer: exactly one forward all-gather per tower unit, nothing else.
    per_layer = runs["per_layer"]
    tower = [u for u in per_layer.costs.units if u.label in _tower_units(per_layer)]
    assert [u.label for u in tower] == [f"vision.blocks.{i}" for i in range(3)]
    for unit in tower:
        assert unit.comm.as_dict() == {
            "forward": {"all_gather": {"count": 1, "bytes": unit.gathered_bytes}}
        }
    extra = per_layer.measured.comm.count("all_gather", "forward") - runs[
        "replicate"
    ].measured.comm.count("all_gather", "forward")
    assert extra == len(tower)
    # root: the tower rides in the root's single all-gather (no extra collective).
    assert runs["root"].measured.comm.count("all_gather", "forward") == runs[
        "replicate"
    ].measured.comm.count("all_gather", "forward")
    root = {p: next(u for u in r.costs.units if u.is_root) for p, r in runs.items()}
    assert root["root"].gathered_bytes > root["replicate"].gathered_bytes
    # ... which is what it costs in memory: the whole tower stays gathered all step.
    assert runs["root"].costs.peak_gathered_backward_bytes > (
        runs["per_layer"].costs.peak_gathered_backward_bytes
    )


def test_prefetch_guard_removes_the_backward_regather() -> None:
    guarded = _measure_ds("per_layer")
    default = _measure_ds("per_layer", prefetch_guard=False)
    assert default.matches, default.comparison.format()  # the plan predicts the waste too
    last_block = next(u for u in guarded.costs.units if u.label == "vision.blocks.2")
    diff = CommTally()
    diff.add("backward", "all_gather", last_block.gathered_bytes)
    expected = CommTally()
    expected.merge(guarded.measured.comm)
    expected.merge(diff)
    assert default.measured.comm == expected
    assert guarded.measured.blocked_units == tuple(f"vision.blocks.{i}" for i in range(3))


def test_guard_keeps_gathers_of_frozen_units_that_gradients_reach() -> None:
    # A frozen text layer sits between trainable ones: its backward must run.
    result = _measure_ds(
        "per_layer", build=lambda: _deepseek(frozen_tower=False, frozen=("model.layers.0",))
    )
    assert result.matches, result.comparison.format()
    layer = next(u for u in result.costs.units if u.label == "model.layers.0")
    assert layer.frozen
    assert layer.runs_backward
    assert layer.comm.count("all_gather", "backward") == 1
    assert "model.layers.0" not in result.measured.blocked_units


# --- DeepSeek-V4.1 fp32 vision norms -----------------------------------------------------------


@pytest.mark.parametrize("reshard", [None, False])
def test_fp32_norm_overhead_against_one_unit_per_norm(reshard: bool | None) -> None:
    def trainable() -> nn.Module:
        return _deepseek(frozen_tower=False)

    grouped = _measure_ds("root", build=trainable, reshard_after_forward=reshard)
    per_norm = _measure_ds(
        "root",
        build=trainable,
        reshard_after_forward=reshard,
        transform_plan=lambda plan: ungroup_units(plan, role="fp32_norms"),
    )
    assert grouped.matches, grouped.comparison.format()
    assert per_norm.matches, per_norm.comparison.format()
    norms = 2 * DS_CONFIG.vision_layers + 1
    group = [u for u in grouped.costs.units if u.role == "fp32_norms"]
    assert len(group) == 1
    assert len([u for u in per_norm.costs.units if u.role == "fp32_norms"]) == norms
    # The grouped unit: one all-gather in forward, one in backward if it reshards,
    # one reduce-scatter; one unit per norm pays that 2L+1 times.
    # The DeepSeek parallelizer plans the norm unit with reshard_after_forward=None
    # (resharded: it is not the root) whatever the caller asks for the other units.
    regather = 0 if group[0].reshard_after_forward is False else 1
    assert group[0].comm.count("all_gather", "forward") == 1
    assert group[0].comm.count("all_gather", "backward") == regather
    assert group[0].comm.count("reduce_scatter", "backward") == 1
    fewer = {
        ("forward", "all_gather"): norms - 1,
        ("backward", "all_gather"): regather * (norms - 1),
        ("backward", "reduce_scatter"): norms - 1,
    }
    for (phase, kind), count in fewer.items():
        assert (
            per_norm.measured.comm.count(kind, phase) - grouped.measured.comm.count(kind, phase)
            == count
        )


def test_frozen_fp32_norms_cost_no_collective() -> None:
    result = _measure_ds("per_layer")
    assert not [u for u in result.costs.units if u.role == "fp32_norms"]
    assert result.costs.replicated_numel == (2 * DS_CONFIG.vision_layers + 1) * 36


# --- transformers VLMs ------------------------------------------------------------------------


def _llava(transformers: Any) -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    vision = transformers.CLIPVisionConfig(
        hidden_size=36,
        intermediate_size=70,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        projection_dim=36,
    )
    text = transformers.LlamaConfig(
        hidden_size=36,
        intermediate_size=70,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=131,
    )
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=3, projector_hidden_act="gelu"
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config)
    ids = torch.randint(4, 131, (2, 24))
    ids[:, 2:18] = 3  # (32 / 8) ** 2 patches per image
    batch = {"input_ids": ids, "pixel_values": torch.randn(2, 3, 32, 32), "labels": ids.clone()}
    return model, batch, "model.vision_tower"


def _qwen2_vl(transformers: Any) -> tuple[nn.Module, dict[str, torch.Tensor], str]:
    config = transformers.Qwen2VLConfig(
        text_config={
            "hidden_size": 32,
            "intermediate_size": 70,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "vocab_size": 163,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 2, 4]},
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=151,
        video_token_id=152,
        vision_start_token_id=150,
        vision_end_token_id=153,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config)
    grid = 4  # 4 x 4 patches, merged 2 x 2 -> 4 image tokens
    ids = torch.randint(4, 140, (1, 20))
    ids[0, 3], ids[0, 4:8], ids[0, 8] = 150, 151, 153
    batch = {
        "input_ids": ids,
        "pixel_values": torch.randn(grid * grid, 3 * 2 * 4 * 4),
        "image_grid_thw": torch.tensor([[1, grid, grid]]),
        "mm_token_type_ids": (ids == 151).int(),
        "labels": ids.clone(),
    }
    return model, batch, "model.visual"


HF_MODELS: dict[str, Callable[[Any], tuple[nn.Module, dict[str, torch.Tensor], str]]] = {
    "llava": _llava,
    "qwen2_vl": _qwen2_vl,
}


@pytest.fixture(scope="module")
def transformers() -> Any:
    return pytest.importorskip("transformers")


def _measure_hf(
    transformers: Any, name: str, policy: str, **kwargs: Any
) -> tuple[Measurement, str]:
    model, batch, tower = HF_MODELS[name](transformers)
    model.get_submodule(tower).requires_grad_(False)

    def loss(sharded: nn.Module) -> torch.Tensor:
        out: torch.Tensor = sharded(**batch).loss
        return out

    result = _plan_and_measure(
        lambda: model,
        MultimodalParallelizer(frozen_multimodal_sharding=policy),
        loss,
        world_size=3,
        **kwargs,
    )
    return result, tower


@pytest.mark.transformers
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_transformers_vlm_plan_matches_measured(transformers: Any, name: str, policy: str) -> None:
    result, tower = _measure_hf(transformers, name, policy)
    assert result.matches, result.comparison.format()
    tower_units = [u for u in result.costs.units if u.paths[0].startswith(tower)]
    if policy == "per_layer":
        assert tower_units
        assert all(
            u.comm.count() == u.comm.count("all_gather", "forward") == 1 for u in tower_units
        )
    else:
        assert tower_units == []


@pytest.mark.transformers
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_transformers_vlm_prefetch_waste_is_predicted(transformers: Any, name: str) -> None:
    default, _ = _measure_hf(transformers, name, "per_layer", prefetch_guard=False)
    assert default.matches, default.comparison.format()
    assert default.costs.wasted.count() == 1
