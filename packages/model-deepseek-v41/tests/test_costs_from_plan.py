"""The costs of a plan come from the plan: the schedule check's all-reduces are the
plan's ``schedule_check`` hook data, or (a hook entry without data) laid out from the
media regions the plan recorded; no parallelizer is asked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fsdp_core import mixed_precision_policy
from model_deepseek_v41 import PARALLELIZER, DeepseekV41Config, build_deepseek_v41
from multimodal_fsdp.estimate.costs import plan_costs


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
@pytest.mark.parametrize("frozen", [False, True])
def test_costs_count_the_same_from_the_hook_data_and_from_the_record(
    policy: str, frozen: bool
) -> None:
    model = build_deepseek_v41(DeepseekV41Config.tiny(), dtype=torch.bfloat16)
    if frozen:
        model.vision.requires_grad_(False)
    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("bf16", "fp32"))
    bare = dataclasses.replace(
        plan,
        hooks=tuple(
            dataclasses.replace(h, hook=None) if h.name == "schedule_check" else h
            for h in plan.hooks
        ),
    )
    recorded = plan_costs(bare, model, world_size=2)
    alone = plan_costs(plan, model, world_size=2)
    assert alone.comm.counts == recorded.comm.counts
    assert alone.extra.counts == recorded.extra.counts
    assert alone.replicated_param_bytes == recorded.replicated_param_bytes


def test_plan_discovers_once_and_apply_never(monkeypatch: pytest.MonkeyPatch) -> None:
    import multimodal_fsdp.model_discovery as discovery_module
    from fsdp_core import build_mesh
    from fsdp_core.fake_group import fake_process_group
    from multimodal_fsdp.discovery.walk import resolve_multimodal_modules

    calls: list[object] = []

    def counting(model: torch.nn.Module, **kwargs: object) -> object:
        calls.append(model)
        return resolve_multimodal_modules(model, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(discovery_module, "resolve_multimodal_modules", counting)
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


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
def test_the_plan_alone_applies_as_the_parallelizer_does(policy: str) -> None:
    """``fsdp_core.parallelizer.apply_plan`` (no parallelizer) makes the units the
    DeepSeek-V4.1 parallelizer makes, fp32 norm groups included, and places the frozen
    fp32 norms and the replicated tower as the plan recorded."""
    from fsdp_core import build_mesh, internals
    from fsdp_core.fake_group import fake_process_group
    from fsdp_core.parallelizer import apply_plan

    applied = []
    for alone in (False, True):
        model = build_deepseek_v41(DeepseekV41Config.tiny(), dtype=torch.bfloat16)
        model.vision.requires_grad_(False)
        parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
        plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("bf16", "fp32"))
        with fake_process_group(2):
            if alone:
                apply_plan(model, plan, mesh=build_mesh())
            else:
                parallelizer.apply_plan(model, plan, mesh=build_mesh())
        replicated = {
            name: p.dtype
            for name, p in model.named_parameters()
            if name in plan.replicated_param_names
        }
        applied.append((sorted(internals.applied_unit_paths(model)), replicated))
    assert applied[1] == applied[0]
    assert any(dtype == torch.float32 for dtype in applied[0][1].values())
