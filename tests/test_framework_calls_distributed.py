"""The reference entry points, called as frameworks call them, train like one process
on 2 gloo ranks (issue 24): ``PARALLELIZER._fully_shard_module`` and
``fully_shard_deepseek_v41`` per block, tower, layer and root with ``mesh=`` and
``mp_policy=`` only, and a framework's loop over the ``multimodal_fsdp`` free functions
under each frozen-tower policy. Same references and tolerances as
tests/test_vlm_distributed.py (the ``parallelize`` path of the same model)."""

from __future__ import annotations

import pytest
import torch
from compare import BF16_STORAGE_TOL, TOL, check_against_reference
from launches import MpResults
from toy import reference_run
from vlm import LR, build_vlm, is_vision_norm, vlm_batches, vlm_loss

from model_deepseek_v41 import DeepseekV41Config

pytestmark = pytest.mark.distributed

TINY = DeepseekV41Config.tiny()
BLOCKS = [f"vision.blocks.{i}" for i in range(TINY.vision_layers)]


def _reference(*, deepseek: bool, frozen: bool) -> tuple:  # type: ignore[type-arg]
    """One process on the global batch, with the per-rank arithmetic of the runs (as in
    tests/test_vlm_distributed.py)."""
    return reference_run(
        lambda: build_vlm(dtype=torch.bfloat16 if deepseek else torch.float32, frozen_tower=frozen),
        vlm_batches(3, 2),  # type: ignore[arg-type]
        vlm_loss,
        compute_dtype=None if deepseek else torch.bfloat16,
        lr=LR,
        keep_fp32=is_vision_norm,
    )


@pytest.fixture(scope="module")
def trainable_reference() -> tuple:  # type: ignore[type-arg]
    return _reference(deepseek=True, frozen=False)


@pytest.fixture(scope="module")
def frozen_reference() -> tuple:  # type: ignore[type-arg]
    return _reference(deepseek=False, frozen=True)


@pytest.mark.parametrize("entry", ["fully_shard_module", "function"])
def test_deepseek_framework_calls_train_like_one_process(
    entry: str,
    mp2: MpResults,
    trainable_reference: tuple,  # type: ignore[type-arg]
) -> None:
    result = mp2(f"entry_ds_{entry}")
    check_against_reference(
        result, trainable_reference, TOL[torch.bfloat16], update_tol=BF16_STORAGE_TOL
    )
    # Every vision norm computes in fp32 in a unit of its own, the rest in bf16.
    fp32_members = result["units"]["fp32"]
    expected = [f"{b}.norm{i}" for b in BLOCKS for i in (1, 2)] + ["vision.norm"]
    assert fp32_members == sorted(expected)
    assert set(BLOCKS) | {"vision", ""} <= set(result["units"]["bf16"])
    for name, dtype in result["param_dtypes"].items():
        assert dtype == (torch.float32 if is_vision_norm(name) else torch.bfloat16), name


def test_both_deepseek_entries_make_the_same_units(mp2: MpResults) -> None:
    assert mp2("entry_ds_fully_shard_module")["units"] == mp2("entry_ds_function")["units"]


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
def test_multimodal_free_functions_train_like_one_process(
    policy: str,
    mp2: MpResults,
    frozen_reference: tuple,  # type: ignore[type-arg]
) -> None:
    result = mp2(f"entry_mm_flow_{policy}")
    recast = frozenset(result["replicated_dtypes"])
    check_against_reference(result, frozen_reference, TOL[torch.bfloat16], recast=recast)
    assert not any(name.startswith("vision.") for name in result["grads0"])
    sharded = set(result["tower_sharded"])
    assert sharded == ({False} if policy == "replicate" else {True})
    units = result["vision_units"]
    assert [u for u in units if u in BLOCKS] == (BLOCKS if policy == "per_layer" else [])
