"""Pipeline parallelism on 4 gloo ranks: two stages, each sharded by the library over its
data-parallel ranks (``tests/mp/scenarios_pp.py``).

Each case (GPipe and 1F1B; frozen tower under ``root``, ``replicate`` and ``per_layer``
with ``balance_media``; a trainable tower with ``balance_media``) trains like one process
on the same microbatches, text-only ones included: the loss of a step is the mean of the
microbatch losses over microbatches and DP ranks (torch's schedules divide each stage's
gradients by the microbatch count, FSDP averages over the DP ranks). fp32, so to 1e-5.
The runtime hooks of each stage agree over that stage's ranks only.
"""

from __future__ import annotations

import pytest
import torch
from compare import TOL, check_against_reference
from launches import MpResults
from pipeline_vlm import LR, MICROBATCHES, STEPS, microbatches
from scenarios_pp import VARIANTS, pp_cases
from vlm import CONFIG

from model_deepseek_v41 import build_deepseek_v41

pytestmark = pytest.mark.distributed

Reference = tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]


def _reference(frozen: bool, media: str) -> Reference:
    """One process, the whole model, every DP rank's microbatches of each step."""
    model = build_deepseek_v41(CONFIG, seed=0)
    if frozen:
        model.vision.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses: list[float] = []
    grads0: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        batches = [b for dp in range(2) for b in microbatches(step, dp, media)]
        loss = torch.stack([model(**batch) for batch in batches]).mean()
        loss.backward()
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, grads0


@pytest.fixture(scope="module")
def references() -> dict[tuple[bool, str], Reference]:
    return {
        (frozen, media): _reference(frozen, media)
        for frozen in (True, False)
        for media in ("mixed", "text_rank")
    }


@pytest.mark.parametrize("case", pp_cases())
def test_pipeline_stages_train_like_one_process(
    case: str, mp4: MpResults, references: dict[tuple[bool, str], Reference]
) -> None:
    result = mp4("pp_dp_stages")[case]
    _, variant, media = case.split("/")
    check_against_reference(result, references[VARIANTS[variant][1], media], TOL[torch.float32])


@pytest.mark.parametrize("case", pp_cases())
def test_each_stage_agrees_over_its_own_ranks(case: str, mp4: MpResults) -> None:
    result = mp4("pp_dp_stages")[case]
    # ('pp', 'dp') 2x2: ranks 0, 1 run stage 0, ranks 2, 3 stage 1.
    assert result["arrival_ranks"] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    balanced = "balanced" in case
    assert ["balance_media" in hooks for hooks in result["hooks"]] == [balanced] * 2 + [False] * 2


def test_text_only_microbatches_are_in_the_data() -> None:
    """The data holds what the cases claim: a text-only microbatch on each DP rank."""
    for dp in range(2):
        kinds = [b["pixel_values"] is None for b in microbatches(0, dp, "mixed")]
        assert len(kinds) == MICROBATCHES
        assert any(kinds)
        assert not all(kinds)
    assert all(b["pixel_values"] is None for b in microbatches(0, 1, "text_rank"))
