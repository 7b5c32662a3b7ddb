"""A sharded step of the library's own model prints no FSDP2 "returned a view tensor"
warning: no unit's forward returns a view (docs/getting-started.md explains the ones
transformers models cause)."""

from __future__ import annotations

import warnings

import pytest
import torch

from fsdp_core import build_mesh, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from model_deepseek_v41 import PARALLELIZER, DeepseekV41Config, build_deepseek_v41, make_batch


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
@pytest.mark.parametrize("frozen", ["none", "vision", "vision+aligner"])
def test_a_sharded_step_warns_about_no_view(policy: str, frozen: str) -> None:
    config = DeepseekV41Config.tiny()
    model = build_deepseek_v41(config, dtype=torch.bfloat16)
    if frozen != "none":
        model.vision.requires_grad_(False)
    if frozen == "vision+aligner":
        model.aligner.requires_grad_(False)
    batch = make_batch(config, batch_size=2, seq_len=16)
    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
    with fake_process_group(2):
        parallelizer.parallelize(
            model, mesh=build_mesh(), mp_policy=mixed_precision_policy("bf16", "fp32")
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(**batch).backward()
    views = [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]
    assert views == []
