"""Section 8's scale table: the balanced exchange per rank at 64, 256 and 1,024 ranks.

Runs in one process under the fake process group (the same collectives and bytes as
real ranks; times are the host's work only, since the fake group moves nothing): a
training step of a small VLM with ``balance_media=True``, frozen tower under ``root``,
two images per rank, balanced within groups of 8 ranks (``balance_media_group=8``) and
over every rank (``"all"``). Per world size and group: the exchange's collectives per
step and the bytes one rank receives, the assignment's input (ranks and items) and its
time, and one balanced call's host time (metadata, assignment, the tower's own call).
The fake group shows every rank with this rank's media, so every item stays home: the
exchange is the slot gather of the call and the join barrier's last round.
"""

from __future__ import annotations

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
from multimodal_fsdp.balance import balanced_call

WORLDS = (64, 256, 1024)
GROUPS: tuple[int | str, ...] = (8, "all")
DIM = 16
IMAGES = 2
REPEATS = 20


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


def _median_us(fn: Any) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


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
            dist_group = None
            if group != "all":
                import torch.distributed as dist

                dist_group = dist.new_group(
                    ranks=list(range(int(group))), use_local_synchronization=True
                )
            with torch.no_grad():
                call_us = _median_us(lambda: balanced_call(tower, (pixels,), group=dist_group))
            assign_us = _median_us(lambda: real(costs))
    finally:
        exchange_module.assign_items = real  # type: ignore[assignment]
    return {
        "world_size": world,
        "group": group,
        "collectives": counter.count,
        "received_bytes": counter.received,
        "assigned_ranks": ranks,
        "assigned_items": items,
        "assign_us": assign_us,
        "call_us": call_us,
    }


def measure_all() -> list[dict[str, Any]]:
    return [measure(world, group) for world in WORLDS for group in GROUPS]
