"""Inference through entries that bypass the root forward, on 2 gloo ranks.

The scenarios (``mp/scenarios_inference.py``) shard tiny LLaVA and Qwen2-VL models
under each frozen-tower policy (``root``, ``per_layer``, ``replicate``, a per-module
mapping, ``uneven_media=True``) and call ``generate()``, ``get_image_features`` /
``get_video_features`` and the tower and projector by hand, right after
``parallelize`` and after a training step, in ``eval()`` and ``train()`` mode. Every
call must work on every rank and give what one process gives with the same weights:
the same greedy tokens and the same features.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

from launches import MpResults
from scenarios_inference import (
    CONFIGS,
    LORA_CONFIGS,
    MODELS,
    MODES,
    MOMENTS,
    MORE_POLICIES,
    MORE_VLMS,
    TOL,
    UNEVEN_CONFIGS,
)

pytestmark = [pytest.mark.distributed, pytest.mark.transformers]


def _result(mp2: MpResults, name: str) -> dict[str, Any]:
    result = mp2(f"inference_{name}")
    if "skipped" in result:
        pytest.fail(f"the ranks lacked a dependency the test process has: {result['skipped']}")
    return result


@pytest.mark.parametrize("name", list(MODELS))
def test_every_entry_matches_one_process(name: str, mp2: MpResults) -> None:
    result = _result(mp2, name)
    entries = list(MODELS[name][1]())
    expected = len(CONFIGS[name]) * len(MOMENTS) * len(MODES) * len(entries)
    for rank, ranked in enumerate(result["ranks"]):
        rows = ranked["rows"]
        assert len(rows) == expected, f"rank {rank} ran {len(rows)} of {expected} calls"
        for row in rows:
            where = f"rank {rank}, {row['config']}, {row['moment']}, {row['mode']}, {row['entry']}"
            assert row["error"] is None, f"{where}: {row['error']}"
            if row["entry"] == "generate":
                assert row["tokens"] == row["ref_tokens"], where
            else:
                assert row["diff"] <= TOL, f"{where}: features differ by {row['diff']}"


@pytest.mark.parametrize("name", list(MODELS))
def test_training_continues_from_the_right_weights(name: str, mp2: MpResults) -> None:
    for rank, ranked in enumerate(_result(mp2, name)["ranks"]):
        for config, (sharded, single) in ranked["after"].items():
            assert sharded == pytest.approx(single, rel=1e-5), f"rank {rank}, {config}"


@pytest.mark.parametrize("name", list(MODELS))
def test_the_plan_lists_the_hook(name: str, mp2: MpResults) -> None:
    hooks = _result(mp2, name)["hooks"]
    for config, names in hooks.items():
        # Even with the whole tower replicated (Qwen2-VL's merger is inside it), the base
        # model computing image features is an entry: its embeddings are in the root unit.
        assert "entry_unshard" in names, config


def test_backward_outside_the_forward_names_the_remedy(mp2: MpResults) -> None:
    """LLaVA's projector trains: features computed with gradients enabled outside the
    forward cannot be backpropagated, and every rank says why and what to do."""
    for ranked in _result(mp2, "llava")["ranks"]:
        for config, outcome in ranked["grad_calls"].items():
            assert outcome.startswith("RuntimeError: backward through"), (config, outcome)
            assert "torch.no_grad()" in outcome, outcome
            assert "model's forward" in outcome, outcome
    for ranked in _result(mp2, "qwen2_vl")["ranks"]:
        assert set(ranked["grad_calls"].values()) == {"no gradient needed"}


def test_generate_matches_one_process_for_more_families(mp2: MpResults) -> None:
    """PaliGemma and Idefics3 crashed like LLaVA; Mllama and Qwen2-Audio must keep working."""
    for rank, rows in enumerate(_result(mp2, "more_vlms")["ranks"]):
        assert len(rows) == len(MORE_VLMS) * len(MORE_POLICIES)
        for row in rows:
            where = f"rank {rank}, {row['model']}, {row['config']}"
            assert row["error"] is None, f"{where}: {row['error']}"
            assert row["tokens"] == row["ref_tokens"], where


def test_peft_generate_matches_one_process(mp2: MpResults) -> None:
    """``PeftModel.generate`` runs the wrapped model outside the root forward: LoRA on the
    towers of LLaVA and Qwen2-VL (MultimodalParallelizer) and on a text-only Llama
    (ModelParallelizer), right after parallelize and after a step, eval and train."""
    result = _result(mp2, "lora")
    for rank, rows in enumerate(result["ranks"]):
        assert len(rows) == len(LORA_CONFIGS) * len(MOMENTS) * len(MODES)
        for row in rows:
            where = f"rank {rank}, {row['config']}, {row['moment']}, {row['mode']}"
            assert row["error"] is None, f"{where}: {row['error']}"
            assert row["tokens"] == row["ref_tokens"], where
    assert all("entry_unshard" in names for names in result["hooks"].values())


def test_generate_with_uneven_media_and_lengths(mp2: MpResults) -> None:
    """Rank 0 has an image and stops early (its end-of-sequence token), rank 1 has none and
    runs on: where the tower owns no unit, every rank gets one process's tokens and runs as
    many forwards as the longest rank (transformers' synced generation); under per_layer
    every rank stops with UnevenMediaError."""
    ranks = _result(mp2, "uneven")["ranks"]
    rows = {(row["model"], row["config"]): row for row in ranks[0]}
    assert len(rows) == len(MODELS) * len(UNEVEN_CONFIGS)
    for rank, ranked in enumerate(ranks):
        for row in ranked:
            where = f"rank {rank}, {row['model']}, {row['config']}"
            if row["config"] == "per_layer":
                assert (row["error"] or "").startswith("UnevenMediaError"), where
                continue
            assert row["error"] is None, f"{where}: {row['error']}"
            assert row["tokens"] == row["ref_tokens"], where
            assert row["forwards"] == rows[row["model"], row["config"]]["forwards"], where
    assert len(ranks[0][0]["tokens"][0]) < len(ranks[1][0]["tokens"][0]), "lengths must differ"
