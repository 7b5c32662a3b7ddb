"""A frozen tower offloaded to host memory (``offload={"tower": CPUOffloadPolicy()}``)
while the language model stays on the device.

On 2 gloo ranks: trains exactly as one process does (same tolerances as the frozen-tower
policies), and the units FSDP2 made carry the offload where the plan put it. On one GPU
(``FSDP_TEST_BACKEND=nccl``, ``nox -s distributed_nccl``): the tower's shards are in host
memory, everything else on the GPU, and the device memory the sharded model takes drops
by at least the tower's shards, as the estimate predicts.
"""

from __future__ import annotations

import os

import pytest
import torch
from compare import TOL, check_against_reference
from launches import MpResults
from toy import reference_run
from vlm import LR, build_vlm, vlm_batches, vlm_loss

pytestmark = pytest.mark.distributed

ON_GPU = os.environ.get("FSDP_TEST_BACKEND") == "nccl" and torch.cuda.is_available()


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return reference_run(
        lambda: build_vlm(dtype=torch.float32, frozen_tower=True),
        vlm_batches(3, 2),  # type: ignore[arg-type]
        vlm_loss,
        compute_dtype=torch.bfloat16,
        lr=LR,
    )


def test_an_offloaded_tower_trains_as_one_process(
    mp2: MpResults,
    reference: tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    result = mp2("mm_offload_tower")
    check_against_reference(result, reference, TOL[torch.bfloat16])
    assert not any(name.startswith("vision.") for name in result["grads0"])
    offloaded = result["offloaded_units"]
    assert offloaded
    assert all(label.startswith("vision") for label in offloaded)
    assert "vision" in offloaded  # the unit for the rest of the tower
    assert result["offloaded_predicted_host_param_bytes"] > 0
    assert (
        result["plain_predicted_device_param_bytes"]
        - result["offloaded_predicted_device_param_bytes"]
        == result["offloaded_predicted_host_param_bytes"]
    )


@pytest.mark.skipif(
    not ON_GPU,
    reason="device memory of an offloaded tower: needs FSDP_TEST_BACKEND=nccl and CUDA",
)
def test_an_offloaded_tower_leaves_the_gpu(mp1: MpResults) -> None:
    result = mp1("mm_offload_tower")
    assert result["host_params"]
    assert all(name.startswith("vision.") for name in result["host_params"])
    assert not any(name.startswith("vision.") for name in result["device_params"])
    saved = result["plain_device_bytes"] - result["offloaded_device_bytes"]
    # The allocator rounds each tensor up (512 bytes), so at least the predicted shards go.
    assert saved >= result["offloaded_predicted_host_param_bytes"]
    assert result["offloaded_device_bytes"] >= result["offloaded_predicted_device_param_bytes"]
