"""Rank function for tests/test_plan_vs_measured_memory.py: spawned gloo ranks import it
by module name (a test module itself is not importable there)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from padded_deepseek import PADDED_TINY

from fsdp_core import mixed_precision_policy
from model_deepseek_v41 import PARALLELIZER, build_deepseek_v41, make_batch
from multimodal_fsdp.measure.memory import measure_plan_memory

CONFIG = PADDED_TINY


def build() -> torch.nn.Module:
    model = build_deepseek_v41(CONFIG, dtype=torch.bfloat16)
    model.vision.requires_grad_(False)
    return model


def measure(rank: int, world_size: int, policy: str, out: str) -> None:
    """Predict and measure one AdamW step on this rank; write both as JSON."""
    batch = make_batch(CONFIG, batch_size=2, seq_len=16)
    model = build()
    plan = PARALLELIZER.with_options(frozen_multimodal_sharding=policy).plan(
        model, mp_policy=mixed_precision_policy("bf16", "fp32")
    )
    result = measure_plan_memory(
        plan, model, lambda sharded: sharded(**batch), world_size=world_size
    )
    assert result.costs.memory is not None
    figures = {"predicted": result.costs.memory.as_dict(), "measured": result.measured.as_dict()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(figures))
