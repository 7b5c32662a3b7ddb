"""ModelParallelizer under real gloo ranks matches a single-process reference.

fp32 runs must agree to 1e-5. bf16 runs compare with a reference that does the
same bf16 arithmetic per rank (parameters cast to bf16, gradients upcast to fp32
and averaged), so the only difference left is the order of fp32 additions in
the reduction: 1e-4 relative covers that with a wide margin, while any real
error (a wrong shard, a missed reduction, a bf16 reduction) moves results by
>= 1e-3, the bf16 rounding step.
"""

from __future__ import annotations

import pytest
import torch
from launches import MpResults
from toy import build_toy, reference_run, toy_batches, toy_loss

pytestmark = pytest.mark.distributed

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4}
#: With bf16 *storage* the optimizer step itself rounds to bf16, and torch's DTensor
#: kernels round ``lr * grad`` differently from plain tensors (one bf16 ulp, 2**-8
#: relative, on some elements each step): gradients still match to 1e-4, parameters
#: and losses after 3 steps to a few ulps.
BF16_STORAGE_TOL = 2**-6


def _reference(
    world: int, compute: torch.dtype | None, **kw: object
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return reference_run(
        lambda: build_toy(0, **kw),  # type: ignore[arg-type]
        toy_batches(3, world),
        toy_loss,
        compute_dtype=compute,
        lr=0.05,
        keep_fp32=lambda name: name.endswith("norm.weight") and bool(kw.get("fp32_norms")),
    )


def _check(
    result: dict[str, object],
    ref: tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]],
    tol: float,
    *,
    update_tol: float | None = None,
) -> None:
    losses, params, grads0 = ref
    grad_tol = tol
    tol = update_tol or tol
    assert result["losses"][0] == pytest.approx(losses[0], rel=grad_tol, abs=grad_tol)
    assert result["losses"] == pytest.approx(losses, rel=tol, abs=tol)
    got_params: dict[str, torch.Tensor] = result["params"]  # type: ignore[assignment]
    got_grads: dict[str, torch.Tensor] = result["grads0"]  # type: ignore[assignment]
    assert set(got_params) == set(params)
    assert set(got_grads) == set(grads0)
    for name, expected in grads0.items():
        assert got_grads[name].dtype == expected.dtype, name
        torch.testing.assert_close(
            got_grads[name].float(), expected.float(), rtol=grad_tol, atol=grad_tol, msg=name
        )
    for name, expected in params.items():
        assert got_params[name].dtype == expected.dtype, name
        torch.testing.assert_close(
            got_params[name].float(), expected.float(), rtol=tol, atol=tol, msg=name
        )


@pytest.mark.parametrize("world", [2, 4])
def test_fp32_1d_matches_reference(world: int, mp2: MpResults, mp4: MpResults) -> None:
    result = (mp2 if world == 2 else mp4)("core_fp32_1d")
    _check(result, _reference(world, None), TOL[torch.float32])


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_1d_matches_reference(world: int, mp2: MpResults, mp4: MpResults) -> None:
    result = (mp2 if world == 2 else mp4)("core_bf16_1d")
    _check(result, _reference(world, torch.bfloat16), TOL[torch.bfloat16])


def test_fp32_hsdp_matches_reference(mp4: MpResults) -> None:
    _check(mp4("core_fp32_hsdp"), _reference(4, None), TOL[torch.float32])


def test_bf16_hsdp_matches_reference(mp4: MpResults) -> None:
    _check(mp4("core_bf16_hsdp"), _reference(4, torch.bfloat16), TOL[torch.bfloat16])


def test_bf16_model_with_fp32_norms_trains_where_plain_fsdp_fails(mp2: MpResults) -> None:
    result = mp2("core_bf16_fp32_norms")
    assert "uniform original parameter dtype" in result["plain_error"]
    assert result["roles"] == {"dtype_island": 4, "layer": 3, "root": 1}
    _check(
        result,
        _reference(2, None, dtype=torch.bfloat16, fp32_norms=True),
        TOL[torch.bfloat16],
        update_tol=BF16_STORAGE_TOL,
    )
