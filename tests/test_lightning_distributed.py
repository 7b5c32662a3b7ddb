"""Lightning's ModelParallelStrategy with the library, on 2 gloo ranks (4 with TP), against one
process (issue 25): the Trainer (``configure_model()`` calls
``fsdp_core.integrations.lightning.parallelize_fn``) and Fabric
(``ModelParallelStrategy(parallelize_fn=...)``), under ``root`` and ``per_layer``
with gradient clipping, ``balance_media`` with every image on rank 0, LoRA on LLaVA's
language model, and a save -> ``fit(ckpt_path=...)`` resume whose third step equals the
uninterrupted run. Losses, first-step gradients (before clipping) and final parameters
must equal the single-process reference with the same clipping."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from compare import TOL, check_against_reference
from framework_cases import FABRIC, LIGHTNING, MAX_NORM, reference
from launches import MpResults

pytestmark = pytest.mark.distributed


def _result(mp2: MpResults, name: str) -> dict[str, Any]:
    result = mp2(name)
    if "skipped" in result:
        pytest.skip(result["skipped"])
    return result


@pytest.mark.parametrize("name", [*LIGHTNING, *FABRIC])
def test_lightning_trains_like_one_process(name: str, mp2: MpResults) -> None:
    result = _result(mp2, name)
    check_against_reference(result, reference(name).as_tuple(), TOL[torch.float32])


def test_the_clipping_cases_clip() -> None:
    """The reference's gradient norm exceeds the clipping norm, so clipping is exercised."""
    grads = reference("lightning_root").grads0
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert norm > 2 * MAX_NORM


def test_the_resumed_run_continues_the_steps(mp2: MpResults) -> None:
    result = _result(mp2, "lightning_resume")
    assert len(result["losses"]) == 3  # 2 before the save, 1 after the resume


@pytest.fixture(scope="module")
def nd_reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process on the two data-parallel batches of each step (scenarios_nd's)."""
    from scenarios_nd import IMAGES, STEPS
    from toy import reference_run
    from vlm import LR, build_vlm, vlm_batches, vlm_loss

    return reference_run(
        lambda: build_vlm(dtype=torch.float32, frozen_tower=True),
        vlm_batches(STEPS, 2, images=IMAGES),
        vlm_loss,
        compute_dtype=None,
        lr=LR,
    )


def test_lightning_tensor_parallel_beside_the_library_trains_like_one_process(
    mp4: MpResults,
    nd_reference: tuple,  # type: ignore[type-arg]
) -> None:
    """ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2): the user's TP
    in configure_model(), then the library over the data_parallel ranks, seeing the
    tensor_parallel dimension of Lightning's mesh (issue 34)."""
    result = mp4("lightning_dp_tp")
    if "skipped" in result:
        pytest.skip(result["skipped"])
    check_against_reference(result, nd_reference, TOL[torch.float32])
    assert result["dims"] == "data_parallel=2 (data-parallel), tensor_parallel=2"
    assert result["arrival_ranks"] == [0, 1, 2, 3]  # the forward's checks span TP peers
    assert result["dp_coordinate"] == result["dp_rank"]
