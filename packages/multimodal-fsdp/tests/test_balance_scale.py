"""Balancing within groups of ranks (``balance_media_group``) keeps each rank's exchange
bounded as the world grows: under the fake process group at 64, 256 and 1,024 ranks,
a balanced training step's exchange collectives, their bytes per rank and the
assignment's input (the ranks and items it balances) are the same with groups of 8,
while with one group of every rank the slot gather and the assignment grow with the
world. (The fake group shows every rank with this rank's media.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import multimodal_fsdp.balance.exchange as exchange_module
from fsdp_core import build_mesh
from fsdp_core.fake_group import fake_process_group
from fsdp_core.internals import TorchDispatchMode
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.balance._planned import auto_group_size, group_size
from multimodal_fsdp.balance.assign import CallRoute
from multimodal_fsdp.balance.traffic import SLOT_INTS
from multimodal_fsdp.runtime.balance_media import (
    AUTO_GROUP_RANKS,
    BalanceMediaRuntimeHook,
    balance_group_ranks,
)

pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")

DIM = 16
WORLDS = (64, 256, 1024)
#: Exchange ops: the slot (and status) gathers and the all_to_alls; FSDP2 uses the
#: ``_allgather_base_`` / ``_reduce_scatter_base_`` forms.
EXCHANGE_OPS = ("allgather_", "alltoall_base_")


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(12, DIM), nn.GELU(), nn.Linear(DIM, DIM))

    def forward(self, pixel_values: Tensor) -> Tensor:
        out: Tensor = self.blocks(pixel_values)
        return out


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])

    def forward(self, hidden: Tensor) -> Tensor:
        for layer in self.layers:
            hidden = hidden + torch.tanh(layer(hidden))
        return hidden


class _Vlm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = _Tower()
        self.multi_modal_projector = nn.Linear(DIM, DIM)
        self.language_model = _Decoder()
        self.lm_head = nn.Linear(DIM, 32)

    def forward(self, input_ids: Tensor, pixel_values: Tensor | None = None) -> Tensor:
        hidden = self.language_model.embed_tokens(input_ids)
        if pixel_values is not None:
            image = self.multi_modal_projector(self.vision_tower(pixel_values))
            hidden = torch.cat([image.reshape(1, -1, DIM), hidden], dim=1)
        loss: Tensor = self.lm_head(self.language_model(hidden)).float().pow(2).mean()
        return loss


class _Exchange(TorchDispatchMode):
    """The exchange's c10d ops in the block, with the bytes this rank receives."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "c10d":
            op = func._schema.name.split("::")[-1]
            if op == "allgather_":
                self.ops.append((op, sum(t.nbytes for slots in args[0] for t in slots)))
            elif op == "alltoall_base_":
                self.ops.append((op, args[0].nbytes))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def assigned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(ranks, items) of every assignment the exchange computes."""
    calls: list[tuple[int, int]] = []
    real = exchange_module.route_call

    def spy(costs: Any, *, run_when_empty: bool) -> CallRoute | None:
        calls.append((len(costs), sum(len(c) for c in costs)))
        return real(costs, run_when_empty=run_when_empty)

    monkeypatch.setattr(exchange_module, "route_call", spy)
    return calls


def _step(world: int, group: str | int) -> list[tuple[str, int]]:
    with fake_process_group(world, rank=5):
        torch.manual_seed(0)
        model = _Vlm()
        model.vision_tower.requires_grad_(False)
        MultimodalParallelizer(balance_media=True, balance_media_group=group).parallelize(
            model, mesh=build_mesh()
        )
        batch = {"input_ids": torch.randint(0, 32, (1, 6)), "pixel_values": torch.randn(2, 4, 12)}
        counter = _Exchange()
        with counter:
            model(**batch).backward()
    return counter.ops


def test_groups_of_eight_cost_the_same_at_every_world_size(
    assigned: list[tuple[int, int]],
) -> None:
    steps = {world: _step(world, 8) for world in WORLDS}
    # The call's slot gather and the join barrier's last round, over 8 ranks; the items
    # stay home (every rank has the same two images), nothing else.
    expected = [("allgather_", 8 * SLOT_INTS * 8)] * 2
    assert all(ops == expected for ops in steps.values()), steps
    # One assignment per step, of the group's 8 ranks and their 16 images.
    assert assigned == [(8, 16)] * len(WORLDS)


def test_one_group_of_every_rank_grows_with_the_world(assigned: list[tuple[int, int]]) -> None:
    for world in WORLDS[:2]:
        assert _step(world, "all") == [("allgather_", world * SLOT_INTS * 8)] * 2
    assert assigned == [(world, 2 * world) for world in WORLDS[:2]]


def test_the_groups_of_a_mesh() -> None:
    rows = [[0, 1, 2, 3], [4, 5, 6, 7]]  # 2 replicas of 4 shards (HSDP)
    assert balance_group_ranks(rows, "all") == [list(range(8))]
    assert balance_group_ranks(rows, "shard") == rows
    assert balance_group_ranks(rows, "replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert balance_group_ranks(rows, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="must divide the 8 data-parallel ranks"):
        balance_group_ranks(rows, 3)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("node", "unknown balance_media_group 'node'"),
        (0, "positive block size"),
        (True, "str or an int"),
    ],
)
def test_a_bad_group_is_refused_when_the_parallelizer_is_made(value: Any, error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        MultimodalParallelizer(balance_media=True, balance_media_group=value)


def test_a_group_smaller_than_the_world_needs_towers_without_cross_group_units() -> None:
    """A tower with units (per_layer) shards over every rank: a group without media would
    skip its all-gathers. The install refuses it, naming the tower and the remedies."""
    with fake_process_group(16, rank=0):
        model = _Vlm()
        model.vision_tower.requires_grad_(False)
        parallelizer = MultimodalParallelizer(
            frozen_multimodal_sharding="per_layer", balance_media=True, balance_media_group=8
        )
        with pytest.raises(ValueError, match=r"\['vision_tower'\] own FSDP units"):
            parallelizer.parallelize(model, mesh=build_mesh())


def test_the_default_group_is_auto() -> None:
    assert MultimodalParallelizer().balance_media_group == "auto"
    assert MultimodalParallelizer(balance_media_group="all").balance_media_group == "all"


def test_auto_is_the_whole_world_up_to_64_ranks_then_a_divisor_near_64() -> None:
    """``"auto"``: every rank up to 64; above, the largest divisor of the data-parallel
    size up to 64 when it is at least 32, else the smallest divisor above 64 (every rank
    on a prime size), so each group is a valid block and balances at least 32 ranks."""
    assert AUTO_GROUP_RANKS == 64
    assert [auto_group_size(n) for n in (1, 2, 3, 4, 8, 13, 64)] == [1, 2, 3, 4, 8, 13, 64]
    assert [auto_group_size(n) for n in (128, 1024, 96, 72, 100, 1000)] == [64, 64, 48, 36, 50, 50]
    assert [auto_group_size(n) for n in (67, 134, 536, 1016)] == [67, 67, 67, 127]
    assert [group_size("auto", n) for n in (2, 4, 1024)] == [2, 4, 64]
    assert group_size("auto", 1024, dp_replicate=8) == 64  # the data-parallel ranks, all dims


def test_the_auto_groups_of_a_mesh() -> None:
    assert balance_group_ranks([list(range(8))], "auto") == [list(range(8))]
    assert balance_group_ranks([list(range(128))], "auto") == [
        list(range(64)),
        list(range(64, 128)),
    ]
    rows = [list(range(r * 48, r * 48 + 48)) for r in range(2)]  # HSDP: 2 replicas of 48
    assert balance_group_ranks(rows, "auto") == rows  # blocks of 48 in row order


def test_the_default_balances_within_64_ranks_at_1024(assigned: list[tuple[int, int]]) -> None:
    """The default group at scale: the slot gathers of 64 ranks and an assignment of their
    128 images, as ``balance_media_group=64``; at 64 ranks it is every rank."""
    assert _step(1024, "auto") == [("allgather_", 64 * SLOT_INTS * 8)] * 2
    assert _step(64, "auto") == _step(64, "all")
    assert assigned == [(64, 128)] * 3


def _plan_group(policy: str, group: str | int = "auto") -> tuple[str | int, str]:
    model = _Vlm()
    model.vision_tower.requires_grad_(False)
    plan = MultimodalParallelizer(
        frozen_multimodal_sharding=policy, balance_media=True, balance_media_group=group
    ).plan(model)
    planned = plan.hook("balance_media")
    assert planned is not None
    assert isinstance(planned.hook, BalanceMediaRuntimeHook)
    return planned.hook.group, planned.format()


def test_the_plan_shows_the_default_group() -> None:
    group, line = _plan_group("root")
    assert group == "auto"
    assert "tower calls balanced over groups of at most 64 consecutive data-parallel ranks" in line
    assert _plan_group("root", "all")[0] == "all"


def test_auto_balances_a_tower_with_units_over_every_rank() -> None:
    """A tower with units (``per_layer``) gathers over every rank, so a group without media
    would skip its all-gathers: ``"auto"`` balances it over every rank (an explicit
    smaller group is refused at install), and the 128-rank install succeeds."""
    group, line = _plan_group("per_layer")
    assert group == "all"
    assert "tower calls balanced over all data-parallel ranks" in line
    with fake_process_group(128, rank=0):
        model = _Vlm()
        model.vision_tower.requires_grad_(False)
        MultimodalParallelizer(
            frozen_multimodal_sharding="per_layer", balance_media=True
        ).parallelize(model, mesh=build_mesh())
