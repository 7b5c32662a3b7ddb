"""Discovery runs once per ``plan()`` and never during ``apply_plan()``: later stages
read what the plan recorded instead of walking the model again."""

from __future__ import annotations

import pytest
from _mm_toy_vlm import ToyVLM
from torch import nn

import multimodal_fsdp.model_discovery as discovery_module
from fsdp_core import build_mesh, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.discovery.walk import resolve_multimodal_modules


@pytest.fixture
def discovery_calls(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    """Counts the parallelizer's discovery runs (one entry per run)."""
    calls: list[nn.Module] = []

    def counting(model: nn.Module, **kwargs: object) -> object:
        calls.append(model)
        return resolve_multimodal_modules(model, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(discovery_module, "resolve_multimodal_modules", counting)
    return calls


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
def test_plan_discovers_once_and_apply_never(policy: str, discovery_calls: list[nn.Module]) -> None:
    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy)  # type: ignore[arg-type]
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("bf16", "fp32"))
    assert len(discovery_calls) == 1
    discovery_calls.clear()
    with fake_process_group(2):
        parallelizer.apply_plan(model, plan, mesh=build_mesh())
    assert discovery_calls == []


def test_a_given_discovery_is_reused_and_never_repeated(discovery_calls: list[nn.Module]) -> None:
    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer()
    found = parallelizer.discover(model)
    reference = MultimodalParallelizer().plan(model)
    discovery_calls.clear()
    for policy in ("root", "per_layer", "replicate"):
        planner = parallelizer.with_options(frozen_multimodal_sharding=policy)
        plan = planner.plan(model, discovery=found)
        assert plan == planner.plan(model)
    assert len(discovery_calls) == 3  # the three plans without discovery=, one each
    assert parallelizer.plan(model, discovery=found) == reference


def test_a_stale_or_foreign_discovery_is_refused() -> None:
    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer()
    found = parallelizer.discover(model)
    with pytest.raises(ValueError, match="not this model's as it is now"):
        parallelizer.plan(ToyVLM(frozen_tower=True), discovery=found)
    with pytest.raises(ValueError, match="not this model's as it is now"):
        MultimodalParallelizer(exclude=("vision_tower",)).plan(model, discovery=found)
    model.vision_tower.requires_grad_(True)
    with pytest.raises(ValueError, match="parameters frozen or unfrozen since"):
        parallelizer.plan(model, discovery=found)
    with pytest.raises(TypeError, match="discovery must be a multimodal_fsdp Discovery"):
        parallelizer.plan(model, discovery="found")  # type: ignore[arg-type]


def test_the_chooser_discovers_once_for_all_its_plans(
    discovery_calls: list[nn.Module],
) -> None:
    from multimodal_fsdp import choose_frozen_policy

    choice = choose_frozen_policy(ToyVLM(frozen_tower=True), "1GiB", world_size=2)
    assert len(choice.candidates) >= 3  # root, per_layer, replicate: one plan each at least
    assert len(discovery_calls) == 1


def test_costs_use_the_plans_backward_judgement() -> None:
    """The costs read the plan's backward-free paths, not a discovery with default
    options (which would find the excluded tower)."""
    from multimodal_fsdp.estimate.costs import plan_costs

    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer(exclude=("vision_tower",))
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("bf16", "fp32"))
    assert plan.backward_free_paths == ()
    given = plan_costs(plan, model, world_size=2, no_backward=())
    alone = plan_costs(plan, model, world_size=2)
    assert alone.comm.counts == given.comm.counts
    assert alone.notes == given.notes
