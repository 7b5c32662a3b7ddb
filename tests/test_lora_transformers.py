"""LoRA (PEFT) and activation checkpointing on real transformers VLMs: plans in one process.

The units with LoRA must be those of the same model without it (every base weight
frozen, as ``get_peft_model`` leaves it) under every policy: adapters belong to the
unit of the layer they adapt, or to the root. Applying runs under the ``fake``
process group (layouts only); training against a single process is in the loop cases
of ``mp/loops.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from hf_lora import (
    PEFT_PREFIX,
    checkpoint_layers,
    frozen_like_peft,
    lora_names,
    strip_peft,
    with_lora,
)
from hf_vlms import HF_VLMS
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_core import ShardingPlan, build_mesh
from fsdp_core.fake_group import fake_process_group
from fsdp_core.plan import unit_parameters
from multimodal_fsdp import (
    VALID_FROZEN_MULTIMODAL_SHARDING,
    MultimodalParallelizer,
    resolve_multimodal_modules,
)

pytestmark = pytest.mark.transformers

POLICIES = VALID_FROZEN_MULTIMODAL_SHARDING
MODELS = ["llava", "qwen2_vl"]
WHERE = ["decoder", "tower"]
#: Units of the frozen model (2 decoder layers, 2 tower blocks): (root, per_layer,
#: replicate). LLaVA's frozen projector is one more unit under per_layer; Qwen2-VL's
#: merger is inside the tower, outside its blocks, so it joins the root unit.
UNIT_COUNTS = {"llava": (3, 6, 3), "qwen2_vl": (3, 5, 3)}


def plan_of(model: nn.Module, policy: str) -> ShardingPlan:
    return MultimodalParallelizer(frozen_multimodal_sharding=policy).plan(model)


def unit_paths(plan: ShardingPlan) -> list[tuple[str, ...]]:
    return [tuple(strip_peft(p) for p in unit.paths) for unit in plan.units]


def unit_param_names(plan: ShardingPlan, model: nn.Module) -> list[set[str]]:
    return [
        {strip_peft(name) for name, _ in params if ".lora_" not in name}
        for params in unit_parameters(plan, model)
    ]


def base(name: str) -> nn.Module:
    return frozen_like_peft(HF_VLMS[name].build())


def lora(name: str, where: str) -> nn.Module:
    return with_lora(HF_VLMS[name].build(), name, where)


# --- discovery through the PeftModel wrapper ---------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_discovery_finds_the_same_modules_under_peft_paths(name: str) -> None:
    without = [(m.path, m.role) for m in resolve_multimodal_modules(base(name))]
    found = resolve_multimodal_modules(lora(name, "tower"))
    assert [(m.path, m.role) for m in found] == [(PEFT_PREFIX + p, r) for p, r in without]
    assert found[0].path == PEFT_PREFIX + HF_VLMS[name].tower


# --- units with and without LoRA -----------------------------------------------------------


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("policy", POLICIES)
def test_lora_keeps_the_units_of_the_frozen_model(name: str, where: str, policy: str) -> None:
    model, reference = lora(name, where), base(name)
    adapters = lora_names(model)
    if where == "tower":
        assert any(HF_VLMS[name].tower + "." in n for n in adapters)
    else:
        assert not any(HF_VLMS[name].tower + "." in n for n in adapters)
    plan, expected = plan_of(model, policy), plan_of(reference, policy)
    assert len(plan.units) == UNIT_COUNTS[name][POLICIES.index(policy)]
    assert unit_paths(plan) == unit_paths(expected)
    # Each unit holds the same base weights, and each adapter is in the unit of its layer.
    assert unit_param_names(plan, model) == unit_param_names(expected, reference)
    owner = {
        n: unit.label
        for unit, params in zip(plan.units, unit_parameters(plan, model), strict=True)
        for n, _ in params
    }
    for adapter in adapters:
        layer = next((u.paths[0] for u in plan.units if adapter.startswith(u.paths[0] + ".")), "")
        assert owner[adapter] == (layer or "<root>"), adapter
    # Adapters are trained: never replicated, never ignored.
    assert not set(adapters) & set(plan.ignored_param_names)
    # The same media regions: no schedule check that the frozen model does not need.
    check = [("schedule_check" in p.hook_names()) for p in (plan, expected)]
    assert check[0] == check[1] == (policy == "per_layer")


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("policy", ["root", "replicate"])
def test_tower_adapters_keep_root_and_replicate_safe_for_uneven_media(
    name: str, policy: str
) -> None:
    plan = plan_of(lora(name, "tower"), policy)
    assert "schedule_check" not in plan.hook_names()


@pytest.mark.parametrize("name", MODELS)
def test_replicate_replicates_the_frozen_base_weights(name: str) -> None:
    model = lora(name, "tower")
    plan = plan_of(model, "replicate")
    reference = plan_of(base(name), "replicate").replicated_param_names
    assert sorted(strip_peft(n) for n in plan.replicated_param_names) == sorted(reference)


@pytest.mark.parametrize("policy", POLICIES)
def test_notes_for_a_tower_with_lora_stay_short(policy: str) -> None:
    plan = plan_of(lora("llava", "tower"), policy)
    tower = next(note for note in plan.notes if note.startswith("tower"))
    assert "partly trainable (layers: 2 adapted;" in tower
    assert "and 6 more" in tower  # 8 adapter dicts, two of them named
    assert all(len(note) < 400 for note in plan.notes), plan.notes


# --- apply under the fake process group ----------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_apply_with_tower_lora_trains_only_the_adapters(policy: str) -> None:
    vlm = HF_VLMS["llava"]
    model = lora("llava", "tower")
    with fake_process_group(2):
        MultimodalParallelizer(frozen_multimodal_sharding=policy).parallelize(
            model, mesh=build_mesh()
        )
        blocks = model.get_submodule(PEFT_PREFIX + vlm.tower + ".encoder.layers")
        assert all(isinstance(b, FSDPModule) for b in blocks) == (policy == "per_layer")
        tower = model.get_submodule(PEFT_PREFIX + vlm.tower)
        frozen = [p for n, p in tower.named_parameters() if ".lora_" not in n]
        assert all(isinstance(p, DTensor) for p in frozen) == (policy != "replicate")
        model(**vlm.batch(0)).loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad <= set(lora_names(model))
    # LLaVA reads the tower's second-to-last layer, so its last block gets no gradient.
    assert any(".encoder.layers.0.self_attn.q_proj.lora_A." in n for n in with_grad)
    assert any(".language_model.layers.1.self_attn.v_proj.lora_B." in n for n in with_grad)


# --- activation checkpointing --------------------------------------------------------------


def _checkpointed(name: str, how: str, *, lora_where: str | None = None) -> nn.Module:
    model = lora(name, lora_where) if lora_where else base(name)
    if how == "hf":
        model.gradient_checkpointing_enable()  # type: ignore[operator]
    else:
        checkpoint_layers(model)
    return model


@pytest.mark.parametrize("how", ["hf", "wrapper"])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("policy", POLICIES)
def test_checkpointing_keeps_the_units(name: str, how: str, policy: str) -> None:
    reference = base(name)
    expected = plan_of(reference, policy)
    for where in (None, "tower"):
        model = _checkpointed(name, how, lora_where=where)
        if how == "wrapper":
            assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_modules())
        plan = plan_of(model, policy)
        assert unit_paths(plan) == unit_paths(expected), where
        assert unit_param_names(plan, model) == unit_param_names(expected, reference), where
