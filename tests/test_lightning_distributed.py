"""Lightning's ModelParallelStrategy with the library, on 2 gloo ranks, against one
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
