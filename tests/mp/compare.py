"""Comparing a multi-process result with the single-process reference.

fp32 runs must agree to 1e-5. bf16 runs compare with a reference that does the
same bf16 arithmetic per rank (parameters cast to bf16, gradients upcast to fp32
and averaged), so the only difference left is the order of fp32 additions in
the reduction: 1e-4 relative covers that with a wide margin, while a real error
(a wrong shard, a missed or doubled reduction, a bf16 reduction) moves results
by at least a bf16 rounding step (~4e-3).
"""

from __future__ import annotations

import pytest
import torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4}
#: With bf16 *storage* the optimizer step itself rounds to bf16, and torch's DTensor
#: kernels round ``lr * grad`` differently from plain tensors (one bf16 ulp, 2**-8
#: relative, on some elements each step): gradients still match to 1e-4, parameters
#: and losses after 3 steps to a few ulps.
BF16_STORAGE_TOL = 2**-6


def check_against_reference(
    result: dict[str, object],
    ref: tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]],
    tol: float,
    *,
    update_tol: float | None = None,
    recast: frozenset[str] = frozenset(),
) -> None:
    """``recast``: parameters the parallelizer deliberately stored in another dtype
    (a replicated tower cast to the compute dtype); compared after the same cast."""
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
        if name in recast:
            expected = expected.to(got_params[name].dtype)
        assert got_params[name].dtype == expected.dtype, name
        torch.testing.assert_close(
            got_params[name].float(), expected.float(), rtol=tol, atol=tol, msg=name
        )
