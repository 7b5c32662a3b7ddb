"""One dtype rule for the estimates (``multimodal_fsdp.estimate.units``): a floating parameter
is gathered in the policy's ``param_dtype`` (``fsdp_core.precision.compute_dtype``), others
in their own dtype; gradients are reduced in ``reduce_dtype``, else the compute dtype. The
collectives, the costs and the activation replay all use it."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core import runtime
from multimodal_fsdp.estimate import activations, costs, units
from multimodal_fsdp.estimate.units import (
    param_compute_dtype,
    param_reduce_dtype,
    unit_reduce_dtype,
)

BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
NONE = MixedPrecisionPolicy()


def test_compute_and_reduce_dtypes() -> None:
    weight = nn.Parameter(torch.zeros(2))
    index = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    assert param_compute_dtype(weight, BF16_FP32) == torch.bfloat16
    assert param_compute_dtype(index, BF16_FP32) == torch.int64
    assert param_compute_dtype(weight, NONE) == torch.float32
    assert param_reduce_dtype(weight, BF16_FP32) == torch.float32
    assert param_reduce_dtype(weight, BF16) == torch.bfloat16
    assert param_reduce_dtype(weight, NONE) == torch.float32
    assert unit_reduce_dtype([("index", index), ("weight", weight)], BF16) == torch.bfloat16
    assert unit_reduce_dtype([], BF16) == torch.bfloat16


def test_every_estimate_uses_the_one_rule() -> None:
    assert activations.param_compute_dtype is units.param_compute_dtype
    assert activations.param_reduce_dtype is units.param_reduce_dtype
    assert costs.param_compute_dtype is units.param_compute_dtype
    assert costs.unit_reduce_dtype is units.unit_reduce_dtype
    # The replay watches unit outputs with the runtime hooks' tensor walker.
    assert activations.output_tensors is runtime.output_tensors
