"""``init_distributed`` after ``destroy_distributed`` in the same torchrun job.

A script (a notebook, a documentation page run as one script) may tear the group
down and start it again. Under torchrun each new default group used the store keys
of the one before it, so a rank could read the other rank's stale gloo address and
the new group hung in its rendezvous (about every other run on 2 CPU ranks).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fsdp_core.testing import run_torchrun

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    from fsdp_core import ModelParallelizer, build_mesh, destroy_distributed, init_distributed

    for cycle in range(4):
        ctx = init_distributed()
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        ModelParallelizer().parallelize(model, mesh=build_mesh())
        model(torch.randn(2, 8)).sum().backward()
        total = torch.tensor([float(ctx.rank + cycle)])
        dist.all_reduce(total)
        assert total.item() == 1 + 2 * cycle, total
        destroy_distributed()
    print("cycles done")
    """
)


@pytest.mark.distributed
def test_init_after_destroy_in_one_torchrun_job(tmp_path: Path) -> None:
    script = tmp_path / "reinit.py"
    script.write_text(SCRIPT, encoding="utf-8")
    result = run_torchrun(str(script), nproc=2, timeout_s=90)
    assert result.stdout.count("cycles done") == 2
