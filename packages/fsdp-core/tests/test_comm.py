"""fsdp_core.collective_count: counting c10d collectives (exact under the fake process group)
and tallying them per phase and kind."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core.collective_count import CollectiveRecord, CommCounter, CommTally, collective_kind
from fsdp_core.precision import default_mp_policy
from fsdp_core.sharding import apply_fully_shard


@pytest.mark.parametrize(
    ("op", "kind"),
    [
        ("_allgather_base_", "all_gather"),
        ("allgather_", "all_gather"),
        ("allgather_into_tensor_coalesced_", "all_gather"),
        ("_reduce_scatter_base_", "reduce_scatter"),
        ("reduce_scatter_", "reduce_scatter"),
        ("reduce_scatter_tensor_coalesced_", "reduce_scatter"),
        ("allreduce_", "all_reduce"),
        ("allreduce_coalesced_", "all_reduce"),
        ("broadcast_", "broadcast"),
        ("barrier", "barrier"),
        ("send", "send"),
    ],
)
def test_collective_kind(op: str, kind: str) -> None:
    assert collective_kind(op) == kind


def test_collective_record_is_frozen() -> None:
    record = CollectiveRecord(kind="all_gather", phase="forward", nbytes=8, dtype=torch.float32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.nbytes = 0  # type: ignore[misc]


def test_counter_starts_empty() -> None:
    counter = CommCounter()
    assert counter.records == []
    assert counter.counts() == {}
    assert counter.bytes() == {}


def test_counter_ignores_non_collective_ops(fake_pg2: None) -> None:
    with CommCounter() as counter:
        (torch.ones(3) * 2).sum()
        dist.barrier()  # a c10d op, but not a counted collective
    assert counter.records == []


def test_counter_records_plain_collectives(fake_pg2: None) -> None:
    counter = CommCounter()
    with counter:
        dist.all_reduce(torch.ones(5))
        dist.broadcast(torch.ones(3, dtype=torch.bfloat16), 0)
    assert counter.records == [
        CollectiveRecord("all_reduce", "unspecified", 20, torch.float32),
        CollectiveRecord("broadcast", "unspecified", 6, torch.bfloat16),
    ]


def test_counter_fsdp_forward_backward(mesh4: DeviceMesh) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    apply_fully_shard(model[0], mesh=mesh4, mp_policy=default_mp_policy())
    apply_fully_shard(model, mesh=mesh4, mp_policy=default_mp_policy())
    counter = CommCounter()
    with counter:
        with counter.phase("forward"):
            out = model(torch.randn(2, 8))
        with counter.phase("backward"):
            out.float().sum().backward()
    # Each unit holds one Linear(8, 8): 72 parameters, gathered in bf16 and reduced in fp32.
    assert counter.counts("forward") == {"all_gather": 2}
    assert counter.bytes("forward") == {"all_gather": 2 * 72 * 2}
    # The root keeps its parameters after forward; the inner unit gathers again.
    assert counter.counts("backward") == {"all_gather": 1, "reduce_scatter": 2}
    assert counter.bytes("backward") == {"all_gather": 72 * 2, "reduce_scatter": 2 * 72 * 4}
    assert counter.counts() == {"all_gather": 3, "reduce_scatter": 2}
    assert counter.counts("optimizer") == {}
    assert {r.dtype for r in counter.records if r.kind == "all_gather"} == {torch.bfloat16}
    assert {r.dtype for r in counter.records if r.kind == "reduce_scatter"} == {torch.float32}


def test_counter_phases_nest_and_restore(fake_pg2: None) -> None:
    counter = CommCounter()
    with counter:
        with counter.phase("outer"):
            with counter.phase("inner"):
                dist.all_reduce(torch.ones(1))
            dist.all_reduce(torch.ones(1))
        with pytest.raises(RuntimeError), counter.phase("failing"):
            raise RuntimeError("boom")
        dist.all_reduce(torch.ones(1))
    assert [r.phase for r in counter.records] == ["inner", "outer", "unspecified"]


def test_counter_clear(fake_pg2: None) -> None:
    counter = CommCounter()
    with counter:
        dist.all_reduce(torch.ones(2))
    assert counter.counts() == {"all_reduce": 1}
    counter.clear()
    assert counter.records == []
    with counter:
        dist.all_reduce(torch.ones(2))
    assert counter.counts() == {"all_reduce": 1}


@pytest.mark.parametrize(
    ("op", "kind"), [("alltoall_base_", "all_to_all"), ("alltoall_", "all_to_all")]
)
def test_all_to_all_kind(op: str, kind: str) -> None:
    assert collective_kind(op) == kind


def test_counter_records_all_to_all_sent_and_received(fake_pg2: None) -> None:
    """An all_to_all's bytes are what this rank sends (its whole input buffer, its own
    part included); what it receives is recorded beside them."""
    counter = CommCounter()
    with counter:
        dist.all_to_all_single(
            torch.empty(7, dtype=torch.uint8),
            torch.empty(5, dtype=torch.uint8),
            output_split_sizes=[3, 4],
            input_split_sizes=[2, 3],
        )
        dist.all_to_all(
            [torch.empty(2), torch.empty(4)], [torch.empty(1), torch.empty(1, dtype=torch.float32)]
        )
    assert counter.records == [
        CollectiveRecord("all_to_all", "unspecified", 5, torch.uint8, received=7),
        CollectiveRecord("all_to_all", "unspecified", 8, torch.float32, received=24),
    ]
    assert counter.counts() == {"all_to_all": 2}
    assert counter.bytes() == {"all_to_all": 13}
    assert counter.received_bytes() == {"all_to_all": 31}


def test_counter_list_all_gather_counts_the_whole_output(fake_pg2: None) -> None:
    """``dist.all_gather`` into a list of slots: the bytes are the gathered output (every
    slot), as for the flat all-gather FSDP issues, not one slot."""
    counter = CommCounter()
    with counter:
        dist.all_gather([torch.empty(3), torch.empty(3)], torch.empty(3))
    assert counter.records == [CollectiveRecord("all_gather", "unspecified", 24, torch.float32)]
    assert counter.received_bytes() == {}


def test_counter_tally_is_its_records_per_phase_and_kind(fake_pg2: None) -> None:
    """``CommCounter.tally`` is the type the estimates predict: counts, bytes and, for an
    all_to_all, the bytes received, per (phase, kind)."""
    counter = CommCounter()
    with counter:
        with counter.phase("forward"):
            dist.all_reduce(torch.ones(5))
            dist.all_reduce(torch.ones(3))
        with counter.phase("backward"):
            dist.all_to_all_single(
                torch.empty(7, dtype=torch.uint8),
                torch.empty(5, dtype=torch.uint8),
                output_split_sizes=[3, 4],
                input_split_sizes=[2, 3],
            )
    expected = CommTally()
    expected.add("forward", "all_reduce", 32, 2)
    expected.add("backward", "all_to_all", 5, received=7)
    tally = counter.tally()
    assert tally == expected, tally.differences(expected)
    assert (tally.count(phase="forward"), tally.bytes("all_reduce")) == (2, 32)
    assert tally.received_bytes("all_to_all", "backward") == 7
    other = CommTally()
    other.add("backward", "all_to_all", 5, received=6)
    assert tally != other
    assert tally.differences(other) == [
        "backward all_to_all: expected 7 B received, got 6 B",
        "forward all_reduce: expected 2 (32 B), got 0 (0 B)",
    ]


def test_tally_merge_repeats_a_tally() -> None:
    """A unit that runs ``times`` times in a step issues its collectives that often."""
    unit = CommTally()
    unit.add("forward", "all_gather", 10)
    unit.add("backward", "all_to_all", 4, received=3)
    total = CommTally()
    total.merge(unit, 3)
    total.merge(unit, 0)
    assert total.as_dict() == {
        "forward": {"all_gather": {"count": 3, "bytes": 30}},
        "backward": {"all_to_all": {"count": 3, "bytes": 12, "received_bytes": 9}},
    }
