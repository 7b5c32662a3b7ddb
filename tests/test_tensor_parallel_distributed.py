"""The TP helper on 4 gloo ranks: ``tp_helper_llava`` (``tests/mp/scenarios_tensor_parallel.py``).

A tiny transformers LLaVA whose Llama layers ``llama_style_plan`` shards over ``tp`` of a
``('dp', 'tp')`` 2x2 mesh, then the library over ``dp``: it trains like one process on
the mean of the two DP batches' losses (fp32, to 1e-5), and FSDP's ``dp`` placement sits
in front of TP's.
"""

from __future__ import annotations

import pytest
import torch
from compare import TOL, check_against_reference
from launches import MpResults
from scenarios_tensor_parallel import CASES, LR, build_tp_llava, tp_llava_batches

pytestmark = pytest.mark.distributed


def _reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from hf_vlms import hf_loss

    model = build_tp_llava()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step, per_dp in enumerate(tp_llava_batches()):
        loss = sum(hf_loss(model, batch) for batch in per_dp) / len(per_dp)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, params, grads0


@pytest.mark.parametrize("case", list(CASES))
def test_llama_tp_plan_then_the_library_trains_like_one_process(case: str, mp4: MpResults) -> None:
    pytest.importorskip("transformers")
    result = mp4("tp_helper_llava")[case]
    check_against_reference(result, _reference(), TOL[torch.float32])
    # 2 layers x (q, k, v, o, gate, up, down), and with sequence parallelism each layer,
    # its two norms, its attention and its MLP.
    assert len(result["planned"]) == 2 * 7 + (2 * 5 if CASES[case] else 0)
    assert result["norm_is_dtensor"] == CASES[case]  # SequenceParallel replicates norms on tp
    assert result["down_proj_mesh"] == ["dp", "tp"]
    assert result["down_proj_placements"] == ["S(0)", "S(1)"]  # str(Shard(0))
