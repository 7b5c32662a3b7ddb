"""Building blocks of the reference model that the vision tower and the text decoder share.

Vision-tower norms ([`RMSNorm`][model_deepseek_v41.layers.RMSNorm]) keep fp32 weights through any
floating dtype cast; text norms ([`TextRMSNorm`][model_deepseek_v41.layers.TextRMSNorm]) follow
the model dtype. Rotary tables are computed per call in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional

__all__ = ["RMSNorm", "SwiGLU", "TextRMSNorm"]


# Norms -----------------------------------------------------------------------


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMS-normalise in (at least) fp32 and hand back the input dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.to(compute)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm whose weight is pinned to fp32 (vision tower).

    ``_apply`` (behind ``.to()``, ``.half()``, ``.bfloat16()``, ``.cuda()``,
    ``to_empty()``) is overridden so that a *floating dtype change* of an fp32
    tensor of this module is dropped while a device move or a meta ->
    empty materialisation still happens. Checkpoints therefore keep fp32 norms.

    Args:
        dim: the normalised dimension.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def reset_parameters(self) -> None:
        """Weight to ones (what ``init_parameters_`` also writes)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return _rms_norm(x, self.weight, self.eps)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> RMSNorm:
        def keep_fp32(t: Tensor) -> Tensor:
            out = fn(t)
            if t.dtype != torch.float32 or out.dtype == t.dtype or not out.is_floating_point():
                return out
            if t.is_meta or out.is_meta:
                # Nothing to lose: just fix the dtype of the (meta/uninitialised) result.
                return out.to(torch.float32)
            # Discard the cast copy and move the original fp32 values (no rounding).
            return t.detach().to(device=out.device)

        # super() (not nn.Module) so an FSDP2 wrapper class earlier in the MRO still chains.
        # torch leaves Module._apply unannotated; bind it to a typed name for mypy --strict.
        parent_apply: Callable[[Callable[[Tensor], Tensor], bool], object] = super()._apply
        parent_apply(keep_fp32, recurse)
        return self

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight_dtype=float32 (pinned)"


class TextRMSNorm(nn.Module):
    """RMSNorm for the text decoder: weight follows the model dtype, math still in fp32.

    Args:
        dim: the normalised dimension.
        eps: added to the mean square.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Weight to ones (what ``init_parameters_`` also writes)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        return _rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


# Rotary embeddings -------------------------------------------------------------


def _rope_tables(positions: Tensor, dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin of shape [N, dim] for the rotate-half convention.

    Computed per call (no buffers) so meta construction + ``to_empty`` needs no
    extra buffer re-initialisation step.
    """
    exponent = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim
    inv_freq = 1.0 / (theta**exponent)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _apply_rope_1d(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate [B, H, N, D] by position; fp32 math, input dtype out."""
    return _rotate(x.float(), cos, sin).to(x.dtype)


def _apply_rope_2d(x: Tensor, tables: tuple[Tensor, Tensor, Tensor, Tensor]) -> Tensor:
    """First half of the head dim rotates with the patch row, second half with the column."""
    row_cos, row_sin, col_cos, col_sin = tables
    xf = x.float()
    rows, cols = xf.chunk(2, dim=-1)
    out = torch.cat([_rotate(rows, row_cos, row_sin), _rotate(cols, col_cos, col_sin)], dim=-1)
    return out.to(x.dtype)


def _grid_rope_tables(
    grid_h: int, grid_w: int, head_dim: int, theta: float, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    idx = torch.arange(grid_h * grid_w, device=device)
    row_cos, row_sin = _rope_tables(idx // grid_w, head_dim // 2, theta)
    col_cos, col_sin = _rope_tables(idx % grid_w, head_dim // 2, theta)
    return row_cos, row_sin, col_cos, col_sin


# Shared blocks -----------------------------------------------------------------


class SwiGLU(nn.Module):
    """``down(silu(gate) * up)`` with a fused gate/up Linear (one matmul, one shardable weight).

    Args:
        dim: input and output width.
        intermediate: hidden width.
        bias: whether the Linears have biases.
    """

    def __init__(self, dim: int, intermediate: int, *, bias: bool) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * intermediate, bias=bias)
        self.down = nn.Linear(intermediate, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        out: Tensor = self.down(functional.silu(gate) * up)
        return out
