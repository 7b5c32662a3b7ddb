"""The costs of a plan come from the plan: ``plan_costs(plan, model)`` counts the same
collectives with and without ``parallelizer=`` (the schedule check's all-reduces are
the plan's ``schedule_check`` hook data)."""

from __future__ import annotations

import pytest
import torch

from fsdp_core import mixed_precision_policy
from model_deepseek_v41 import PARALLELIZER, DeepseekV41Config, build_deepseek_v41
from multimodal_fsdp.costs import plan_costs


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
