"""N-D meshes on 4 gloo ranks: the library's FSDP beside tensor parallelism.

The scenario ``nd_dp_tp`` (``tests/mp/scenarios_nd.py``) shards the tiny DeepSeek-V4.1
reference model's language MLPs over ``tp`` of a ``('dp', 'tp')`` 2x2 mesh, then the
library over ``dp`` (the sub-mesh, or the whole mesh with ``dp_dims``), under every
frozen-tower policy with and without ``balance_media``. Each case trains like one
process on the two DP batches of each step (fp32, so to 1e-5), and its runtime hooks
agree over the right ranks: the checks that keep a forward in step over the whole
mesh (TP collectives run inside the forward), the unused-parameter flags over the
data-parallel ranks that share FSDP's reduce-scatter.
"""

from __future__ import annotations

import pytest
import torch
from compare import TOL, check_against_reference
from launches import MpResults
from scenarios_nd import IMAGES, STEPS, nd_cases
from toy import reference_run
from vlm import LR, build_vlm, vlm_batches, vlm_loss

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return reference_run(
        lambda: build_vlm(dtype=torch.float32, frozen_tower=True),
        vlm_batches(STEPS, 2, images=IMAGES),
        vlm_loss,
        compute_dtype=None,
        lr=LR,
    )


@pytest.mark.parametrize("case", nd_cases())
def test_dp_beside_tp_trains_like_one_process(
    case: str,
    mp4: MpResults,
    reference: tuple,  # type: ignore[type-arg]
) -> None:
    result = mp4("nd_dp_tp")[case]
    check_against_reference(result, reference, TOL[torch.float32])
    assert result["tp_mesh_dims"] == 2  # TP's placement kept, FSDP's dp dimension added
    assert ("balance_media" in result["hooks"]) == case.endswith("/balanced")


@pytest.mark.parametrize("case", nd_cases())
def test_hooks_agree_over_the_ranks_they_must(case: str, mp4: MpResults) -> None:
    result = mp4("nd_dp_tp")[case]
    assert result["arrival_ranks"] == [0, 1, 2, 3]
    assert result["agreement_ranks"] == [0, 1, 2, 3]
    assert result["unused_ranks"] in ([0, 2], [1, 3])


def test_an_empty_batch_on_a_tp_peer_stops_every_rank(mp4: MpResults) -> None:
    """The step agreement covers the TP peers: all four ranks raise the same
    EmptyBatchError before the forward's collectives, and the job trains on."""
    result = mp4("nd_tp_peer_empty_batch")
    kinds = {kind for kind, _ in result["errors"]}
    messages = {message for _, message in result["errors"]}
    assert kinds == {"EmptyBatchError"}, result["errors"]
    assert len(messages) == 1, messages
    assert "rank 1" in messages.pop()
    assert result["alive"] == 4.0
