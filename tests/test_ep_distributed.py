"""Expert parallelism on 4 gloo ranks (``tests/mp/scenarios_ep.py``).

The DeepSeek-V4.1 reference model with 4 routed experts per layer on a ``('dp', 'ep')``
2x2 mesh trains like one process on the mean of the four ranks' losses (fp32): through
the library (the vision tower frozen under each policy, and trainable), through the calls
NeMo Automodel's MoE parallelizer makes, and through the torchtitan adapter (experts
placed on the meta model, then ``to_empty`` and ``init_weights``). The experts stay
``Shard(0)`` on ``ep`` and out of every FSDP unit of the library's plan.
"""

from __future__ import annotations

import pytest
import torch
from compare import TOL, check_against_reference
from launches import MpResults
from scenarios_ep import (
    BALANCE_CASES,
    CASES,
    LR,
    build_ep_model,
    ep_balance_batches,
    ep_batches,
    micro_batches,
)

pytestmark = pytest.mark.distributed


def _reference(
    case: str, micro: int = 1, *, balanced: bool = False
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = build_ep_model(case)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    batches = ep_balance_batches() if balanced else ep_batches()
    for step, per_rank in enumerate(batches):
        parts = [part for batch in per_rank for part in micro_batches(batch, micro)]
        loss = sum(model(**part) for part in parts) / len(parts)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, params, grads0


@pytest.mark.parametrize("case", CASES)
def test_moe_with_ep_through_the_library_trains_like_one_process(case: str, mp4: MpResults) -> None:
    result = mp4("ep_deepseek_moe")[case]
    check_against_reference(result, _reference(case), TOL[torch.float32])
    # 2 layers x (gate_up, down): placed Shard(0) on ep, 2 of the 4 experts per rank,
    # ignored by the plan and in no FSDP unit; their gradients reduced by the planned hook.
    assert len(result["sharded"]) == 4
    assert result["ignored"] == sorted(result["sharded"])
    assert result["experts_in_units"] == []
    assert (result["expert_mesh"], result["expert_placements"]) == (["ep"], ["S(0)"])
    assert result["expert_local_experts"] == 2
    assert "replica_grad_reduce" in result["planned_hooks"]
    assert "replica_grad_reduce" in result["hooks"]


def test_moe_with_ep_accumulates_micro_batches_like_one_process(mp4: MpResults) -> None:
    """Two micro-batches per step, the first without gradient sync: FSDP reduces the
    dense gradients once, the expert hook after each backward; both sum the same."""
    result = mp4("ep_deepseek_moe")["accumulate"]
    check_against_reference(result, _reference("root", micro=2), TOL[torch.float32])


def test_nemo_automodel_moe_calls_keep_working(mp4: MpResults) -> None:
    result = mp4("ep_nemo_calls")
    check_against_reference(result, _reference("trainable"), TOL[torch.float32])
    # FSDP's ep_shard dimension in front of the EP placement NeMo's ExpertParallel made.
    assert result["expert_mesh"] == ["ep_shard", "ep"]
    assert result["expert_placements"] == ["S(1)", "S(0)"]


def test_torchtitan_adapter_with_ep_trains_like_one_process(mp4: MpResults) -> None:
    pytest.importorskip("torchtitan")
    result = mp4("torchtitan_dp_ep")
    check_against_reference(result, _reference("trainable"), TOL[torch.float32])
    assert (result["expert_mesh"], result["expert_placements"]) == (["ep"], ["S(0)"])
    assert "replica_grad_reduce" in result["hooks"]


@pytest.mark.parametrize("case", BALANCE_CASES)
def test_balance_media_with_ep_balances_over_every_rank_with_its_own_batch(
    case: str, mp4: MpResults
) -> None:
    """EP ranks hold different batches: with uneven media (4, 2, 4, 2 images on ranks
    0..3) the four ranks balance together, 3 images each, and train like one process.
    Balanced over ``dp`` alone (each ``ep`` coordinate apart), ranks 0 and 2 would
    encode 4 and ranks 1 and 3 would encode 2."""
    result = mp4("ep_balance_media")[case]
    assert result["rows"] == [3, 3, 3, 3], result["rows"]
    assert "balance_media" in result["hooks"]
    check_against_reference(result, _reference(case, balanced=True), TOL[torch.float32])
