"""One-GPU NCCL smoke run of the multi-process scenarios (world size 1).

Runs only with ``FSDP_TEST_BACKEND=nccl`` (``nox -s distributed_nccl``) on a
machine with CUDA; the 2- and 4-rank suites run under NCCL too when enough GPUs
exist, and skip with a message otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch
from compare import check_against_reference
from launches import MpResults
from toy import build_toy, reference_run, toy_batches, toy_loss

from model_deepseek_v41 import DeepseekV41Config, build_deepseek_v41

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(
        os.environ.get("FSDP_TEST_BACKEND") != "nccl",
        reason="world-size-1 NCCL smoke test: set FSDP_TEST_BACKEND=nccl on a CUDA machine",
    ),
]


def test_core_training_matches_reference_on_one_gpu(mp1: MpResults) -> None:
    for name, compute in (("core_fp32_1d", None), ("core_bf16_1d", torch.bfloat16)):
        reference = reference_run(
            lambda: build_toy(0), toy_batches(3, 1), toy_loss, compute_dtype=compute, lr=0.05
        )
        # GPU kernels round differently from the CPU reference: compare loosely.
        tol = 1e-3 if compute is None else 2e-2
        check_against_reference(mp1(name), reference, tol)


def test_meta_init_on_gpu_is_bit_exact(mp1: MpResults) -> None:
    expected = dict(
        build_deepseek_v41(DeepseekV41Config.tiny(), dtype=torch.bfloat16).named_parameters()
    )
    got = mp1("init_meta")["materialized_root"]
    for name, param in expected.items():
        assert torch.equal(got[name], param.detach()), name


def test_vlm_scenarios_run(mp1: MpResults) -> None:
    for name in ("mm_frozen_root", "ds_trainable"):
        losses = mp1(name)["losses"]
        assert len(losses) == 3
        assert all(torch.isfinite(torch.tensor(losses)))
