"""Context parallelism on a ``('dp', 'cp')`` 2x2 mesh (4 gloo ranks), against one process.

The scenario ``cp_dp_llava`` (``tests/mp/scenarios_cp.py``) splits each DP coordinate's
sample over its two CP ranks (torch's load-balanced halves), shards with the library over
``dp`` x ``cp`` and balances the tower's calls over each CP group: images, a sample with
one image (fewer items than CP ranks) beside a text-only one, and a long video's frames.
It must train like one process on both samples, encode every image or frame once in the
world (frozen towers), and give each rank only the items its shard's media tokens need.
"""

from __future__ import annotations

import pytest
import torch
from compare import TOL, check_against_reference
from launches import MpResults
from scenarios_cp import LR, MEDIA, STEPS, build, cp_cases, reference_loss

pytestmark = pytest.mark.distributed

#: Per case, per rank (``2 * d + c``), the items its shard's media tokens come from.
NEEDS = {
    "images": [[0], [1], [0], [0]],
    "one_image": [[0], [0], [], []],
    "video_frames": [[0, 1], [1, 2, 3], [], [0, 1]],
}


def _reference(case: str, trainable: bool) -> tuple:  # type: ignore[type-arg]
    model = build(trainable)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads0 = [], {}
    for step in range(STEPS):
        loss = reference_loss(model, case, step)
        loss.backward()
        if step == 0:
            grads0 = {
                n: p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        losses.append(reference_loss(model, case, 0).item())  # the trained model in eval
    return losses, params, grads0


@pytest.mark.parametrize("name", cp_cases())
def test_trains_like_one_process(name: str, mp4: MpResults) -> None:
    case, variant = name.split("/")
    result = mp4("cp_dp_llava")[name]
    (*losses, eval_loss), params, grads0 = _reference(case, variant == "trainable")
    check_against_reference(result, (losses, params, grads0), TOL[torch.float32])
    # Eval: a tower without units runs locally, and still gives each rank its items.
    assert result["eval_loss"] == pytest.approx(eval_loss, rel=1e-5)
    assert result["fsdp_ranks"] == [0, 1, 2, 3]  # FSDP shards over dp x cp


@pytest.mark.parametrize("name", cp_cases())
def test_each_rank_gets_the_items_of_its_shard(name: str, mp4: MpResults) -> None:
    case, _ = name.split("/")
    assert mp4("cp_dp_llava")[name]["needs"] == NEEDS[case]


@pytest.mark.parametrize("case", sorted(MEDIA))
def test_a_frozen_tower_encodes_each_item_once_in_the_world(case: str, mp4: MpResults) -> None:
    """A call of fewer items than the CP group has ranks (one image) is encoded by each
    rank of the group; every other item once. (Under ``per_layer`` a rank with nothing to
    encode also runs the tower on a one-row placeholder, which this count would see.)"""
    encoded = [int(n) for n in mp4("cp_dp_llava")[f"{case}/root"]["encoded"]]
    counts = MEDIA[case][0]
    expected = sum(n if n >= 2 else 2 * n for n in counts)
    assert sum(encoded) == expected, encoded


def test_the_cost_model_counts_the_cp_header_and_the_exchange() -> None:
    """Per balanced call on a CP data group: a header of 3 + items int64 per rank, then
    an all_to_all that moves nothing when each rank needs its own share; a call of fewer
    items than ranks has the header only. Without CP (TP) the gathers are unchanged."""
    from multimodal_fsdp.balance._data_group import HEADER_INTS, gathered_bytes

    assert gathered_bytes([100] * 4, 2, indexed=True) == [2 * (HEADER_INTS + 1 + 4) * 8, 0]
    assert gathered_bytes([100], 2, indexed=True) == [2 * (HEADER_INTS + 1 + 1) * 8]
    assert gathered_bytes([100] * 4, 2) == [2 * HEADER_INTS * 8, 2 * 200]
