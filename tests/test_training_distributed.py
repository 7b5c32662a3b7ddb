"""Real training situations on gloo ranks: meta init, uneven media, accumulation, checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from compare import BF16_STORAGE_TOL, TOL, check_against_reference
from launches import MpResults
from toy import reference_run
from vlm import CONFIG, LR, build_vlm, is_vision_norm, vlm_batches, vlm_loss

from fsdp_core import load_checkpoint_unsharded
from model_deepseek_v41 import build_deepseek_v41

pytestmark = pytest.mark.distributed


def _pick(world: int, mp2: MpResults, mp4: MpResults) -> MpResults:
    return mp2 if world == 2 else mp4


# -------------------------------------------------------------- initialisation
@pytest.mark.parametrize("world", [2, 4])
def test_meta_init_is_bit_exact(world: int, mp2: MpResults, mp4: MpResults) -> None:
    result = _pick(world, mp2, mp4)("init_meta")
    expected = dict(build_deepseek_v41(CONFIG, seed=0, dtype=torch.bfloat16).named_parameters())
    for key in (
        "materialized_root",
        "materialized_per_layer",
        "materialized_replicate",
        "broadcast",
    ):
        got = result[key]
        assert set(got) == set(expected), key
        for name, param in expected.items():
            assert got[name].dtype == param.dtype, (key, name)
            assert torch.equal(got[name], param.detach()), (key, name)


@pytest.mark.parametrize("world", [2, 4])
def test_naive_per_shard_init_repeats_one_shard(world: int, mp2: MpResults, mp4: MpResults) -> None:
    # Why the helpers exist: reset/normal_ on local shards gives every rank the same values.
    assert _pick(world, mp2, mp4)("init_meta")["naive_all_ranks_equal"] is True


# ------------------------------------------------------------------ uneven media
def _uneven_reference(world: int) -> Any:
    images = [1 if rank % 2 == 0 else 0 for rank in range(world)]
    return reference_run(
        lambda: build_vlm(dtype=torch.bfloat16, frozen_tower=True),
        vlm_batches(3, world, images=images),  # type: ignore[arg-type]
        vlm_loss,
        compute_dtype=None,
        lr=LR,
        keep_fp32=is_vision_norm,
    )


@pytest.mark.parametrize(("policy", "world"), [("root", 2), ("root", 4), ("replicate", 2)])
def test_uneven_media_trains_under_root_and_replicate(
    policy: str, world: int, mp2: MpResults, mp4: MpResults
) -> None:
    result = _pick(world, mp2, mp4)(f"uneven_{policy}")
    check_against_reference(
        result, _uneven_reference(world), TOL[torch.bfloat16], update_tol=BF16_STORAGE_TOL
    )


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_media_under_per_layer_fails_fast_with_advice(
    world: int, mp2: MpResults, mp4: MpResults
) -> None:
    result = _pick(world, mp2, mp4)("uneven_per_layer")
    message = result["error_message"]
    assert "'vision'" in message
    assert "'root'" in message
    assert "'replicate'" in message
    # Raised by the guard before the first step's collectives, on every rank (the launch
    # itself has a hard timeout, so a hang would fail the whole launch instead).
    assert result["steps_done"] == 0


# ------------------------------------------------------- gradient accumulation
def _accumulation_reference(world: int) -> Any:
    from scenarios_training import accumulation_batches

    return reference_run(
        lambda: build_vlm(dtype=torch.float32, frozen_tower=False),
        accumulation_batches(world),
        vlm_loss,
        compute_dtype=torch.bfloat16,
        lr=LR,
        keep_fp32=lambda name: False,
    )


@pytest.mark.parametrize("world", [2, 4])
def test_text_only_micro_batches_with_accumulation(
    world: int, mp2: MpResults, mp4: MpResults
) -> None:
    result = _pick(world, mp2, mp4)("accum_text_only")
    check_against_reference(result, _accumulation_reference(world), TOL[torch.bfloat16])
    # The tower really trained: its gradients came from the image micro-batches only.
    assert result["grads0"]["vision.blocks.0.attn.qkv.weight"].abs().sum() > 0


# ------------------------------------------------------------------- checkpoints
def test_resume_gives_the_same_losses_as_an_uninterrupted_run(mp4: MpResults) -> None:
    result = mp4("ckpt_save_resume")
    assert result["loaded_step"] == 2
    assert result["interrupted"] == result["uninterrupted"]  # bit-identical


def test_checkpoint_round_trip_is_bit_exact_in_original_dtypes(mp4: MpResults) -> None:
    result = mp4("ckpt_save_resume")
    saved, loaded, dtypes = result["saved_full"], result["loaded_full"], result["saved_dtypes"]
    assert set(saved) == set(dtypes)  # original parameter names, nothing missing
    assert result["replicated"], "the scenario must include replicated (ignored) parameters"
    for name, dtype in dtypes.items():
        assert saved[name].dtype == dtype, name
        assert dtype == (torch.float32 if is_vision_norm(name) else torch.bfloat16), name
        assert torch.equal(saved[name], loaded[name]), name


def test_checkpoint_saved_on_4_ranks_loads_on_2(mp2: MpResults, mp4: MpResults) -> None:
    saved = mp4("ckpt_save_resume")
    loaded = mp2("ckpt_load_other_world")
    assert loaded["loaded_step"] == 2
    for name, tensor in saved["saved_full"].items():
        assert loaded["dtypes"][name] == tensor.dtype, name
        assert torch.equal(loaded["loaded_full"][name], tensor), name
    # Training continues from the same state (2 ranks reduce in another order: bf16 ulps).
    assert loaded["next_losses"] == pytest.approx(saved["uninterrupted"][2:], rel=1e-3)


def test_checkpoint_loads_into_an_unsharded_model(mp4: MpResults) -> None:
    saved = mp4("ckpt_save_resume")
    model = build_deepseek_v41(CONFIG, seed=999, dtype=torch.bfloat16)
    load_checkpoint_unsharded(saved["checkpoint"], model)
    for name, param in model.named_parameters():
        assert param.dtype == saved["saved_dtypes"][name], name
        assert torch.equal(param.detach(), saved["saved_full"][name]), name
