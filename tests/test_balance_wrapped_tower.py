"""balance_media=True with the tower under torch's ``checkpoint_wrapper`` applied before
planning (as torchtitan, accelerate or a user may do): around the whole tower, or
around each of its blocks, non-reentrant and reentrant.

Wrapped whole, discovery finds the wrapped module (``vision._checkpoint_wrapped_module``),
and its forward was the one balanced: inside the checkpoint, so the backward's
recomputation ran the tower on the rank's own images instead of the exchanged ones
(non-reentrant: ``CheckpointError`` on the rank with images while the other waited in a
reduce-scatter; reentrant: the balanced call ran under the checkpoint's ``no_grad`` on
that rank only, "grad mode differs between ranks"). The balanced call now wraps the
outermost wrapper, so every rank's checkpoint recomputes what it ran.

One launch of 2 gloo ranks runs one step per case (rank 0 every image, rank 1 none) and compares
the losses and gradients with one process running both ranks' batches under the same
checkpointing (a reentrant checkpoint of the whole tower, whose pixels need no gradient,
gives the tower's parameters none, as in one process).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

from fsdp_core.testing import run_on_gloo_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _balance_wrapped_tower_rank_fn as rank_fn

TOL = 1e-5


@functools.cache
def _reference(case: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the same checkpointing, both ranks' batches (the loss their mean)."""
    model = rank_fn.build(case)
    losses = [model(**rank_fn.batch(rank)) for rank in range(2)]
    (sum(losses) / 2).backward()
    grads = {
        rank_fn.plain_name(name): p.grad
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return [loss.item() for loss in losses], grads  # type: ignore[misc]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch of 2 gloo ranks runs every case."""
    directory = tmp_path_factory.mktemp("wrapped_tower")
    run_on_gloo_ranks(rank_fn.run_cases, 2, str(directory), timeout_s=240)
    return directory


@pytest.mark.parametrize("case", sorted(rank_fn.CASES))
def test_a_checkpoint_wrapped_tower_trains_balanced_like_one_process(case: str, out: Path) -> None:
    results = [json.loads((out / f"{case}_rank{r}.json").read_text()) for r in range(2)]
    errors = [result.get("error", "") for result in results]
    assert errors == ["", ""], errors
    losses, want = _reference(case)
    assert [r["loss"] for r in results] == pytest.approx(losses, rel=TOL, abs=TOL)
    for result in results:
        got = result["grads"]
        assert sorted(got) == sorted(want)
        for name, expected in want.items():
            torch.testing.assert_close(
                torch.tensor(got[name]), expected, rtol=TOL, atol=TOL, msg=name
            )
