"""Section 8b: the balanced exchange per rank at 64, 256 and 1,024 ranks, and what each
balance group costs in balance.

Runs in one process under the fake process group (the same collectives and bytes as
real ranks; times are the host's work only, since the fake group moves nothing): a
training step of a small VLM with ``balance_media=True``, frozen tower under ``root``,
two images per rank, balanced within groups of 8 ranks (``balance_media_group=8``), the
default (``"auto"``: every rank up to 64, then blocks of up to 64) and over every rank
(``"all"``). Per world size and group: the exchange's collectives per step and the bytes
one rank receives, the assignment's input (ranks and items) and its time, and one
balanced call's host time (metadata, assignment, the tower's own call). The fake group
shows every rank with this rank's media, so every item stays home: the exchange is the
slot gather of the call and the join barrier's last round.

Balance quality needs different media per rank, which the fake group cannot show, so it
is computed from the assignment alone (``assign_items``, as each group runs it): skewed
media drawn per rank (0 to 8 images of 64 to 2,304 patches, seeded), each group
balanced on its own, and the step's pace as the slowest rank's patches over the mean
rank's (1.00 is perfect; without balancing it is the raw media's).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch
from torch import Tensor, nn

import multimodal_fsdp.balance.exchange as exchange_module
from fsdp_core import build_mesh
from fsdp_core.fake_group import fake_process_group
from fsdp_core.internals import TorchDispatchMode
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.balance import assign_items, balanced_call
from multimodal_fsdp.runtime.balance_media import balance_group_ranks

WORLDS = (64, 256, 1024)
GROUPS: tuple[int | str, ...] = (8, "auto", "all")
DIM = 16
IMAGES = 2
REPEATS = 20
#: Images per rank and patches per image of the quality model (drawn uniformly).
IMAGES_PER_RANK = (0, 0, 1, 2, 2, 3, 4, 6, 8)
PATCHES = (64, 256, 576, 1024, 2304)
SEEDS = 5


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(12, DIM), nn.GELU(), nn.Linear(DIM, DIM))

    def forward(self, pixel_values: Tensor) -> Tensor:
        out: Tensor = self.blocks(pixel_values)
        return out


class _Vlm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = _Tower()
        self.multi_modal_projector = nn.Linear(DIM, DIM)
        self.embed_tokens = nn.Embedding(32, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.lm_head = nn.Linear(DIM, 32)

    def forward(self, input_ids: Tensor, pixel_values: Tensor) -> Tensor:
        image = self.multi_modal_projector(self.vision_tower(pixel_values))
        hidden = torch.cat([image.reshape(1, -1, DIM), self.embed_tokens(input_ids)], dim=1)
        for layer in self.layers:
            hidden = hidden + torch.tanh(layer(hidden))
        loss: Tensor = self.lm_head(hidden).float().pow(2).mean()
        return loss


class _Exchange(TorchDispatchMode):
    """The exchange's c10d ops (FSDP2 uses the ``_base_`` forms) and bytes received."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0
        self.received = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            op = func._schema.name.split("::")[-1]
            if op == "allgather_":
                self.count += 1
                self.received += sum(t.nbytes for slots in args[0] for t in slots)
            elif op == "alltoall_base_":
                self.count += 1
                self.received += args[0].nbytes
        return func(*args, **(kwargs or {}))


def _median_us(fn: Any) -> tuple[float, float]:
    """Median wall and CPU (this process's) microseconds of ``fn``: on a shared machine the
    CPU time is the host's own work, the wall time adds the waits for a core."""
    walls, cpus = [], []
    for _ in range(REPEATS):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        cpus.append(time.process_time() - start_cpu)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls) * 1e6, statistics.median(cpus) * 1e6


def measure(world: int, group: int | str) -> dict[str, Any]:
    assigned: list[tuple[int, int]] = []
    real = exchange_module.assign_items

    def spy(costs: Any) -> list[list[int]]:
        assigned.append((len(costs), sum(len(c) for c in costs)))
        return real(costs)

    exchange_module.assign_items = spy  # type: ignore[assignment]
    try:
        with fake_process_group(world, rank=5):
            torch.manual_seed(0)
            model = _Vlm()
            model.vision_tower.requires_grad_(False)
            MultimodalParallelizer(balance_media=True, balance_media_group=group).parallelize(
                model, mesh=build_mesh()
            )
            batch = {
                "input_ids": torch.randint(0, 32, (1, 6)),
                "pixel_values": torch.randn(IMAGES, 4, 12),
            }
            counter = _Exchange()
            with counter:
                model(**batch).backward()
            ranks, items = assigned[-1]
            costs = [[48] * IMAGES for _ in range(ranks)]
            tower = _Tower().requires_grad_(False)
            pixels = torch.randn(IMAGES, 4, 12)
            size = len(balance_group_ranks([list(range(world))], group)[0])
            dist_group = None
            if size < world:
                import torch.distributed as dist

                dist_group = dist.new_group(ranks=list(range(size)), use_local_synchronization=True)
            with torch.no_grad():
                call_us, call_cpu_us = _median_us(
                    lambda: balanced_call(tower, (pixels,), group=dist_group)
                )
            assign_us, assign_cpu_us = _median_us(lambda: real(costs))
    finally:
        exchange_module.assign_items = real  # type: ignore[assignment]
    unbalanced, balanced = quality(world, group)
    return {
        "world_size": world,
        "group": group,
        "group_size": size,
        "collectives": counter.count,
        "received_bytes": counter.received,
        "assigned_ranks": ranks,
        "assigned_items": items,
        "assign_us": assign_us,
        "assign_cpu_us": assign_cpu_us,
        "call_us": call_us,
        "call_cpu_us": call_cpu_us,
        "max_over_mean_unbalanced": unbalanced,
        "max_over_mean_balanced": balanced,
    }


def quality(world: int, group: int | str) -> tuple[float, float]:
    """The slowest rank's patches over the mean rank's, without balancing and with each
    group of ``group`` balanced by ``assign_items``, averaged over ``SEEDS`` draws."""
    before, after = [], []
    groups = balance_group_ranks([list(range(world))], group)
    for seed in range(SEEDS):
        draw = random.Random(seed)
        costs = [
            [draw.choice(PATCHES) for _ in range(draw.choice(IMAGES_PER_RANK))]
            for _ in range(world)
        ]
        loads = [0] * world
        for ranks in groups:
            mine = [costs[r] for r in ranks]
            owners = assign_items(mine) if any(mine) else [[] for _ in mine]
            for items, encoders in zip(mine, owners, strict=True):
                for cost, encoder in zip(items, encoders, strict=True):
                    loads[ranks[encoder]] += cost
        mean = statistics.mean(loads)
        before.append(max(sum(c) for c in costs) / mean)
        after.append(max(loads) / mean)
    return statistics.mean(before), statistics.mean(after)


def measure_all() -> list[dict[str, Any]]:
    return [measure(world, group) for world in WORLDS for group in GROUPS]


def _group_label(row: dict[str, Any]) -> str:
    if row["group"] == "all":
        return "all (every rank)"
    if row["group"] == "auto":
        return f"auto ({row['group_size']} ranks)"
    return f"{row['group']} ranks"


def report(rows: list[dict[str, Any]], table: Any) -> list[str]:
    """Section 8b's table and its reading; ``table(header, rows)`` renders markdown."""
    header = [
        "ranks",
        "balance group",
        "exchange coll. / step",
        "KiB received / rank / step",
        "assignment: ranks, items",
        "assignment us (CPU)",
        "balanced call host us (CPU)",
        "slowest / mean rank, unbalanced -> balanced",
    ]
    body = [
        [
            str(r["world_size"]),
            _group_label(r),
            str(r["collectives"]),
            f"{r['received_bytes'] / 1024:.1f}",
            f"{r['assigned_ranks']}, {r['assigned_items']}",
            f"{r['assign_us']:.0f} ({r['assign_cpu_us']:.0f})",
            f"{r['call_us']:.0f} ({r['call_cpu_us']:.0f})",
            f"{r['max_over_mean_unbalanced']:.2f} -> {r['max_over_mean_balanced']:.2f}",
        ]
        for r in rows
    ]
    return [
        "### 8b. The exchange at scale (fake process group, one process: bytes and counts as "
        "on real ranks, times the host's work only; 2 images per rank, frozen tower, root)",
        "",
        table(header, body),
        "",
        "Each rank's exchange (its collectives, the bytes it receives) and the assignment (the "
        "ranks and items it balances) grow with its balance group, not with the world: the "
        "same at every world size for groups of 8, and for the default (`auto`) from 64 ranks "
        "on. Every fake rank has this rank's media, so every item stays home (the call's slot "
        "gather and the join barrier's last round). The last column is the step's pace under "
        "skewed media (0 to 8 images of 64 to 2,304 patches per rank, 5 seeded draws): the "
        "slowest rank's patches over the mean rank's, from the assignment alone.",
    ]


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from bench import _table

    print("\n".join(report(measure_all(), _table)))
