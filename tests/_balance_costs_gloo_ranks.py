"""Rank function for tests/test_plan_vs_measured_balance.py: spawned gloo ranks import it
by module name (a test module itself is not importable there)."""

from __future__ import annotations

import json
from pathlib import Path

import balanced_vlm

from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.estimate.exchange import StepMedia, record_step_media
from multimodal_fsdp.measure.comm import measure_plan

#: (policy, tower, step of balanced_vlm.DISTRIBUTIONS): a text-only rank, all media on
#: one rank, one call per image (4 calls on rank 0, 2 on rank 1).
CASES = (
    ("per_layer", "trainable", 1),
    ("root", "frozen", 2),
    ("replicate", "trainable", 3),
    ("per_layer", "trainable", 3),
)


def measure(rank: int, world_size: int, out: str) -> None:
    """Per case: cost the plan for every rank's media (each rank records every rank's
    batch, which is deterministic) and measure this rank's step on the real group."""
    results = {}
    for policy, tower, step in CASES:
        model = balanced_vlm.build(tower)
        plan = MultimodalParallelizer(
            frozen_multimodal_sharding=policy,  # type: ignore[arg-type]
            extra_tower_names=("vision",),
            balance_media=True,
        ).plan(model)
        calls = tuple(
            record_step_media(
                plan,
                model,
                lambda m, r=r, s=step: balanced_vlm.step_loss(m, s, r),
                world_size=1,
            ).ranks[0]
            for r in range(world_size)
        )
        result = measure_plan(
            plan,
            model,
            lambda m, s=step: balanced_vlm.step_loss(m, s, rank),
            world_size=world_size,
            media=StepMedia(ranks=calls, rank=rank),
        )
        assert result.costs.exchange is not None
        results[f"{policy}/{tower}/{step}"] = {
            "matches": result.matches,
            "comparison": result.comparison.format(),
            "exchange": result.costs.exchange.as_dict(),
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
