"""The gathers of a data group after a split tower call, on two gloo ranks.

Each rank encodes its share of a call of 3 items of weights 2, 1 and 3 (shares of 1 and
2 items: the padded gather of bytes carries shares of different sizes) with two output
tensors of different dtypes and rows per weight; after ``gather_outputs`` every rank has
the output the whole call gives in one process, its own share's rows keeping their
graph. Ranks whose outputs differ in structure (a dtype here) raise on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_core.testing import run_on_gloo_ranks
from multimodal_fsdp.balance._data_group import DataGroup, gather_outputs
from multimodal_fsdp.balance.generic_layouts import BatchFirstLayout

WEIGHTS = [2, 1, 3]


def _tower(weights: list[int], start: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Items ``start, start + 1, ...`` of the call: 1 row per weight of ``a`` (3 floats),
    2 rows per weight of ``b`` (2 values of ``dtype``), values telling the item apart."""
    a = torch.cat(
        [torch.full((w, 3), float(start + i + 1)) for i, w in enumerate(weights)]
    ).requires_grad_()
    b = torch.cat(
        [
            torch.arange(2 * w * 2, dtype=dtype).reshape(2 * w, 2) + 100 * (start + i)
            for i, w in enumerate(weights)
        ]
    )
    return {"a": a * 1, "b": b}


def _gather(rank: int, world: int, mismatch: bool) -> None:
    data = DataGroup(group=dist.group.WORLD, ranks=tuple(range(world)), position=rank)
    start, stop = data.share(len(WEIGHTS))
    dtype = torch.float64 if mismatch and rank == 1 else torch.float32
    mine = _tower(WEIGHTS[start:stop], start, dtype)
    if mismatch:
        with pytest.raises(RuntimeError, match="different structures"):
            gather_outputs(BatchFirstLayout(), data, mine, WEIGHTS, torch.device("cpu"))
        return
    whole: Any = gather_outputs(BatchFirstLayout(), data, mine, WEIGHTS, torch.device("cpu"))
    expected = _tower(WEIGHTS, 0, torch.float32)
    assert set(whole) == {"a", "b"}
    torch.testing.assert_close(whole["a"], expected["a"], rtol=0, atol=0)
    torch.testing.assert_close(whole["b"], expected["b"], rtol=0, atol=0)
    # This rank's rows keep their graph: a gradient reaches its share's encoding alone.
    assert whole["a"].requires_grad


def test_split_call_outputs_are_gathered_on_every_rank() -> None:
    run_on_gloo_ranks(_gather, 2, False, timeout_s=60)


def test_ranks_with_different_output_structures_raise_on_every_rank() -> None:
    run_on_gloo_ranks(_gather, 2, True, timeout_s=60)
