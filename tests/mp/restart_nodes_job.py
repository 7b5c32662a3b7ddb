"""A job on two torchrun "nodes" (``tests/test_restarts_distributed.py``): rank 1 kills
itself once; its node restarts it, the other node restarts for the membership change
without counting it, so the two see different ``TORCHELASTIC_RESTART_COUNT``s and
must still meet."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_core import destroy_distributed, init_distributed
from fsdp_core.checkpoint import latest_checkpoint


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    init_distributed(backend="gloo")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    marker = out / "killed"
    if rank == 1 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    assert latest_checkpoint(out / "checkpoints") is None  # a library collective call
    dist.all_reduce(total)
    with open(out / f"rank{rank}.json", "w", encoding="utf-8") as file:
        json.dump({"restart_count": count, "total": total.item()}, file)
    destroy_distributed()


if __name__ == "__main__":
    main()
