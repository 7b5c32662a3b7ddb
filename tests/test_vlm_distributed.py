"""Frozen-tower policies and DeepSeek-V4.1 fp32 norms on 2 gloo ranks vs one process.

Both runs use the same per-rank bf16 arithmetic (see ``toy.reference_run``):
the multimodal runs keep fp32 master weights (tolerance 1e-4, as for the core
bf16 runs); the DeepSeek runs store weights in bf16 with fp32 vision norms, so
their parameters are compared to a few bf16 ulps after the optimizer steps
(gradients of the first step still to 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from compare import BF16_STORAGE_TOL, TOL, check_against_reference
from launches import MpResults
from toy import reference_run
from vlm import LR, build_vlm, is_vision_norm, vlm_batches, vlm_loss

from model_deepseek_v41 import DeepseekV41Config

pytestmark = pytest.mark.distributed

POLICIES = ["root", "per_layer", "replicate"]
BLOCKS = DeepseekV41Config.tiny().vision_layers


def _reference(
    *, deepseek: bool, frozen: bool
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return reference_run(
        lambda: build_vlm(dtype=torch.bfloat16 if deepseek else torch.float32, frozen_tower=frozen),
        vlm_batches(3, 2),  # type: ignore[arg-type]
        vlm_loss,
        compute_dtype=None if deepseek else torch.bfloat16,
        lr=LR,
        keep_fp32=is_vision_norm,
    )


@pytest.fixture(scope="module")
def mm_reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return _reference(deepseek=False, frozen=True)


@pytest.fixture(scope="module")
def ds_reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return _reference(deepseek=True, frozen=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_multimodal_policy_matches_reference(
    policy: str, mp2: MpResults, mm_reference: tuple
) -> None:  # type: ignore[type-arg]
    result = mp2(f"mm_frozen_{policy}")
    recast = frozenset(result["replicated_dtypes"])
    check_against_reference(result, mm_reference, TOL[torch.bfloat16], recast=recast)
    assert not any(name.startswith("vision.") for name in result["grads0"])


@pytest.mark.parametrize("policy", POLICIES)
def test_deepseek_policy_matches_reference(
    policy: str, mp2: MpResults, ds_reference: tuple
) -> None:  # type: ignore[type-arg]
    result = mp2(f"ds_frozen_{policy}")
    check_against_reference(result, ds_reference, TOL[torch.bfloat16], update_tol=BF16_STORAGE_TOL)
    for name, param in result["params"].items():
        expected = torch.float32 if is_vision_norm(name) else torch.bfloat16
        if policy != "replicate" or not name.startswith("vision."):
            assert param.dtype == expected, name


@pytest.mark.parametrize("prefix", ["mm", "ds"])
def test_replicated_tower_is_plain_and_equal_on_ranks(prefix: str, mp2: MpResults) -> None:
    result = mp2(f"{prefix}_frozen_replicate")
    assert result["replicated_plain"] is True
    assert result["replicated_equal"] is True
    assert result["vision_units"] == []
    dtypes = result["replicated_dtypes"]
    assert dtypes, "no replicated parameters"
    for name, dtype in dtypes.items():
        if prefix == "ds" and is_vision_norm(name):
            assert dtype == torch.float32, name  # fp32 islands stay fp32
        else:
            assert dtype == torch.bfloat16, name  # cast to the compute dtype


@pytest.mark.parametrize("prefix", ["mm", "ds"])
def test_per_layer_tower_has_one_unit_per_block(prefix: str, mp2: MpResults) -> None:
    units = mp2(f"{prefix}_frozen_per_layer")["vision_units"]
    blocks = [u for u in units if u.startswith("vision.blocks.") and u.count(".") == 2]
    assert blocks == [f"vision.blocks.{i}" for i in range(BLOCKS)]


def test_root_policy_gives_the_tower_no_units(mp2: MpResults) -> None:
    assert mp2("mm_frozen_root")["vision_units"] == []
    # DeepSeek: the frozen tower's fp32 norms are replicated (no unit, no collective).
    ds = mp2("ds_frozen_root")
    assert ds["vision_units"] == []
    assert "fp32_norms" not in ds["roles"]
    assert ds["replicated_dtypes"]
    assert all(is_vision_norm(n) for n in ds["replicated_dtypes"])
    assert set(ds["replicated_dtypes"].values()) == {torch.float32}


def test_deepseek_trainable_tower_matches_reference(mp2: MpResults) -> None:
    result = mp2("ds_trainable")
    check_against_reference(
        result,
        _reference(deepseek=True, frozen=False),
        TOL[torch.bfloat16],
        update_tol=BF16_STORAGE_TOL,
    )
    assert result["roles"]["fp32_norms"] == 1
    assert any(name.startswith("vision.blocks.0.norm1") for name in result["grads0"])
