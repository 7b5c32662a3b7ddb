"""The data groups ``balance_media`` shares tower calls within (TP x CP ranks), and the
rounds' group that spans them, under the fake process group (one process, any world
size, any rank); and how a data group splits a call's items."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

from fsdp_core.fake_group import fake_process_group
from fsdp_core.parallel_dims import ParallelDims
from multimodal_fsdp.balance._data_group import HEADER_INTS, DataGroup, gathered_bytes
from multimodal_fsdp.runtime.balance_media import _data_groups, _spanning

#: (mesh shape, names, data-parallel names, every data group)
MESHES = [
    ((2, 2), ("dp", "tp"), ("dp",), [[0, 1], [2, 3]]),
    ((2, 4), ("dp", "tp"), ("dp",), [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (
        (2, 2, 2),
        ("dp_replicate", "dp_shard", "tp"),
        ("dp_replicate", "dp_shard"),
        [[0, 1], [2, 3], [4, 5], [6, 7]],
    ),
    ((2, 2, 2), ("dp", "cp", "tp"), ("dp",), [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ((2, 2, 2), ("pp", "dp", "tp"), ("dp",), [[0, 1], [2, 3], [4, 5], [6, 7]]),
]


@pytest.mark.parametrize(("shape", "names", "dp", "groups"), MESHES)
def test_data_groups_are_the_ranks_along_tp_and_cp(
    shape: tuple[int, ...], names: tuple[str, ...], dp: tuple[str, ...], groups: list[list[int]]
) -> None:
    world = 1
    for size in shape:
        world *= size
    with fake_process_group(world, rank=0):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dims = ParallelDims.from_mesh(mesh, dp_dims=dp if len(dp) > 1 else dp[0])
        assert _data_groups(dims) == groups
        assert sorted(r for g in groups for r in g) == list(range(world))
        # Rank 0's data group is its own; every rank holds one.
        assert tuple(groups[0]) == dims.data_group_ranks()


def test_the_rounds_span_the_balance_groups_data_groups() -> None:
    """``"all"`` on a ``('pp', 'dp', 'tp')`` mesh: rank 0's data-parallel peers are
    ranks 0 and 2 (its pipeline stage), their data groups ranks 0 to 3."""
    with fake_process_group(8, rank=0):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        dims = ParallelDims.from_mesh(mesh, dp_dims="dp")
        _, size = _spanning(dims, dims.dp_mesh, "all")
        assert size == 4


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("items", [0, 1, 2, 3, 5, 8])
def test_shares_cover_every_item_once_and_differ_by_at_most_one(size: int, items: int) -> None:
    """A call of at least as many items as ranks is split (each item in one share, the
    shares' sizes within one); a smaller one goes whole to every rank, unsplit."""
    ranks = tuple(range(size))
    shares = [DataGroup(None, ranks, p).share(items) for p in range(size)]
    if items < size:
        assert shares == [(0, items)] * size
        assert gathered_bytes([7] * items, size) == []
        return
    covered = [i for start, stop in shares for i in range(start, stop)]
    assert covered == list(range(items))
    lengths = [stop - start for start, stop in shares]
    assert min(lengths) >= 1
    assert max(lengths) - min(lengths) <= 1
    if size > 1:  # the header, then every share padded to the longest (7 bytes per item)
        assert gathered_bytes([7] * items, size) == [
            size * HEADER_INTS * 8,
            size * 7 * max(lengths),
        ]
