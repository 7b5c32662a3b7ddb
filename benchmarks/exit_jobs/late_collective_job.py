"""torchrun job of ``exit_check.py``: the timing that makes a finished gloo job abort.

Usage: torchrun --nproc-per-node 2 late_collective_job.py [--ending destroy|return|exit_rank]

A small FSDP model trains a step; the job then all-reduces the loss for its log (a
temporary tensor) and ends right away, while FSDP still holds the group, so gloo's
worker thread releases that tensor (which needs the GIL) around the moment the
interpreter shuts down. Without the library's exit handling about one launch in three
ended with "terminate called without an active exception" on this 2-core machine.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_core import build_mesh, destroy_distributed, exit_rank, init_distributed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ending", choices=("destroy", "return", "exit_rank"), default="destroy")
    args = parser.parse_args()

    ctx = init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    fully_shard(model, mesh=build_mesh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    optimizer.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    if ctx.is_main:
        print(f"loss {logged.item() / ctx.world_size:.4f}")
    if args.ending == "destroy":
        destroy_distributed()
    elif args.ending == "exit_rank":
        exit_rank(0)


if __name__ == "__main__":
    main()
