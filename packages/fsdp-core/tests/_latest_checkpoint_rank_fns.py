"""Run on spawned gloo ranks by ``test_latest_checkpoint``."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from fsdp_core.checkpoint import latest_checkpoint


def each_rank_sees_its_own_disk(rank: int, world_size: int, out: str) -> None:
    """Each rank's root holds a different newest checkpoint (node-local disks)."""
    root = Path(out) / f"disk-{rank}"
    for step in range(1, 3 + rank):  # rank 0 up to step 2, rank 1 up to step 3
        (root / f"step-{step}").mkdir(parents=True)
        (root / f"step-{step}" / ".metadata").write_bytes(b"")
    try:
        found = latest_checkpoint(root, timeout=60)
        outcome = {"type": None, "message": str(found)}
    except Exception as exc:
        outcome = {"type": type(exc).__name__, "message": str(exc)}
    dist.barrier()  # the group is still usable
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(outcome))


def shared_root(rank: int, world_size: int, out: str) -> None:
    """Every rank finds the same newest checkpoint in a shared root."""
    root = Path(out) / "shared"
    if rank == 0:
        for name in ("step-7", "step-12"):
            (root / name).mkdir(parents=True)
            (root / name / ".metadata").write_bytes(b"")
        (root / ".step-13.saving-checkpoint").mkdir()
        (root / ".step-13.saving-checkpoint" / ".metadata").write_bytes(b"")
    dist.barrier()
    found = latest_checkpoint(root, timeout=60)
    (Path(out) / f"shared{rank}.json").write_text(json.dumps(str(found)))
