"""After ``apply_plan``, the FSDP units in the model are exactly the plan's units.

Checked for every parallelizer the project ships, on the DeepSeek-V4.1 reference
(trainable and frozen tower, bf16 storage and fp32 master weights: its fp32 vision-norm
units are planned, not decided while applying), on the tiny transformers VLMs of the
multi-process tests and on LoRA-wrapped ones, under every frozen-tower policy, in one
process under the fake process group.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_core import ModelParallelizer, ShardingPlan, build_mesh, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from fsdp_core.internals import applied_unit_paths
from multimodal_fsdp import MultimodalParallelizer

sys.path.insert(0, str(Path(__file__).parent / "mp"))

POLICIES = ("root", "per_layer", "replicate")
MP = mixed_precision_policy("bf16", "fp32")


def _units_of(plan_units: object) -> list[tuple[str, ...]]:
    return sorted(tuple(sorted(unit.paths)) for unit in plan_units)  # type: ignore[attr-defined]


def _apply_and_compare(parallelizer: ModelParallelizer, model: nn.Module) -> ShardingPlan:
    plan = parallelizer.plan(model, mp_policy=MP)
    with fake_process_group(2):
        parallelizer.apply_plan(model, plan, mesh=build_mesh())
    applied = sorted(tuple(sorted(paths)) for paths in applied_unit_paths(model))
    assert applied == _units_of(plan.units)
    return plan


def _deepseek(*, dtype: torch.dtype, frozen: bool) -> nn.Module:
    from model_deepseek_v41 import DeepseekV41Config, build_deepseek_v41

    model = build_deepseek_v41(DeepseekV41Config.tiny(), seed=0, dtype=dtype)
    if frozen:
        model.vision.requires_grad_(False)
    return model


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_deepseek_units_are_the_planned_ones(policy: str, dtype: torch.dtype, frozen: bool) -> None:
    from model_deepseek_v41 import PARALLELIZER

    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
    plan = _apply_and_compare(parallelizer, _deepseek(dtype=dtype, frozen=frozen))
    # Trainable fp32 vision norms are units of their own that compute in fp32, whatever
    # the storage dtype; frozen ones are replicated in fp32.
    fp32_units = [u for u in plan.units if u.mp_policy.param_dtype == torch.float32]
    assert bool(fp32_units) != frozen


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["llava", "qwen2_vl", "mllama", "paligemma", "idefics3"])
def test_transformers_units_are_the_planned_ones(name: str, policy: str) -> None:
    pytest.importorskip("transformers")
    from hf_vlms import HF_VLMS

    vlm = HF_VLMS[name]
    model = vlm.build()
    model.get_submodule(vlm.tower).requires_grad_(False)
    _apply_and_compare(MultimodalParallelizer(frozen_multimodal_sharding=policy), model)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_lora_units_are_the_planned_ones(name: str, policy: str) -> None:
    pytest.importorskip("peft")
    from hf_lora import with_lora
    from hf_vlms import HF_VLMS

    model = with_lora(HF_VLMS[name].build(), name, "tower")
    _apply_and_compare(MultimodalParallelizer(frozen_multimodal_sharding=policy), model)


def test_uneven_media_units_are_the_planned_ones() -> None:
    pytest.importorskip("transformers")
    from hf_vlms import HF_VLMS

    model = HF_VLMS["mllama"].build()
    _apply_and_compare(MultimodalParallelizer(uneven_media=True), model)
