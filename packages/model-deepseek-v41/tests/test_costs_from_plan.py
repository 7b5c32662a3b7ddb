"""The costs of a plan come from the plan: ``plan_costs(plan, model)`` counts the same
collectives with and without ``parallelizer=`` (the schedule check's all-reduces are
the plan's ``schedule_check`` hook data)."""

from __future__ import annotations

import pytest
import torch

from fsdp_core import mixed_precision_policy
from model_deepseek_v41 import PARALLELIZER, DeepseekV41Config, build_deepseek_v41
from multimodal_fsdp.estimate.costs import plan_costs


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
@pytest.mark.parametrize("frozen", [False, True])
def test_costs_count_the_same_without_the_parallelizer(policy: str, frozen: bool) -> None:
    model = build_deepseek_v41(DeepseekV41Config.tiny(), dtype=torch.bfloat16)
    if frozen:
        model.vision.requires_grad_(False)
    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("bf16", "fp32"))
    given = plan_costs(plan, model, world_size=2, parallelizer=parallelizer)
    alone = plan_costs(plan, model, world_size=2)
    assert alone.comm.counts == given.comm.counts
    assert alone.extra.counts == given.extra.counts
    assert alone.replicated_param_bytes == given.replicated_param_bytes


def test_plan_discovers_once_and_apply_never(monkeypatch: pytest.MonkeyPatch) -> None:
    import multimodal_fsdp.parallelizer as parallelizer_module
    from fsdp_core import build_mesh
    from fsdp_core.fake_group import fake_process_group
    from multimodal_fsdp.discovery.walk import resolve_multimodal_modules

    calls: list[object] = []

    def counting(model: torch.nn.Module, **kwargs: object) -> object:
        calls.append(model)
        return resolve_multimodal_modules(model, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(parallelizer_module, "resolve_multimodal_modules", counting)
    model = build_deepseek_v41(DeepseekV41Config.tiny(), dtype=torch.bfloat16)
    model.vision.requires_grad_(False)
    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding="replicate")
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("bf16", "fp32"))
    assert len(calls) == 1
    assert plan.replicated_param_names
    calls.clear()
    with fake_process_group(2):
        parallelizer.apply_plan(model, plan, mesh=build_mesh())
    assert calls == []
