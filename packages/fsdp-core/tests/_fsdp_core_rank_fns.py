"""Functions run on spawned gloo ranks by ``test_testing_helpers``.

They live in a plain module (not a test module) so the spawned children can
import them: pytest's ``--import-mode=importlib`` gives test modules names
that a fresh interpreter cannot import.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def all_reduce_rank_sum(rank: int, world_size: int, out_dir: str) -> None:
    """All-reduce ``rank + 1`` and record the result (and the env) for the parent to check."""
    assert dist.is_initialized()
    assert dist.get_rank() == rank
    assert dist.get_world_size() == world_size
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world_size * (world_size + 1) / 2
    assert value.item() == expected, (value.item(), expected)
    Path(out_dir, f"rank{rank}.txt").write_text(f"{value.item()} {dist.get_backend()}")
