"""``multimodal_fsdp.measure.comm.compare``: a plan's tally against a measured one, as the
plan-vs-measured tests read it (``matches``, ``differences``, the printed table)."""

from __future__ import annotations

from fsdp_core.collective_count import CommTally
from multimodal_fsdp.measure.comm import compare


def _tally(*entries: tuple[str, str, int, int, int | None]) -> CommTally:
    tally = CommTally()
    for phase, kind, nbytes, count, received in entries:
        tally.add(phase, kind, nbytes, count, received=received)
    return tally


def test_equal_tallies_match() -> None:
    plan = _tally(("forward", "all_gather", 64, 2, None), ("backward", "all_to_all", 8, 1, 5))
    measured = _tally(("backward", "all_to_all", 8, 1, 5), ("forward", "all_gather", 64, 2, None))
    comparison = compare(plan, measured)
    assert comparison.matches
    assert comparison.differences() == []
    assert "<-- differs" not in comparison.format()


def test_a_difference_is_named_and_marked() -> None:
    plan = _tally(("forward", "all_gather", 64, 2, None), ("backward", "all_to_all", 8, 1, 5))
    measured = _tally(("forward", "all_gather", 64, 2, None), ("backward", "all_to_all", 8, 1, 6))
    measured.add("backward", "reduce_scatter", 32)
    comparison = compare(plan, measured)
    assert not comparison.matches
    assert comparison.differences() == [
        "backward all_to_all: expected 5 B received, got 6 B",
        "backward reduce_scatter: expected 0 (0 B), got 1 (32 B)",
    ]
    lines = comparison.format().splitlines()
    assert lines[0].split() == ["phase", "kind", "plan", "measured", "plan", "B", "measured", "B"]
    rows = {" ".join(line.split()[:3]): line for line in lines[1:]}
    # phases then kinds in their natural order; the received bytes on a row of their own
    assert [" ".join(line.split()[:2]) for line in lines[1:]] == [
        "forward all_gather",
        "backward reduce_scatter",
        "backward all_to_all",
        "backward all_to_all",
    ]
    assert rows["forward all_gather 2"].split()[2:6] == ["2", "2", "64", "64"]
    assert rows["backward reduce_scatter 0"].endswith("<-- differs")
    assert rows["backward all_to_all recv"].split()[3:5] == ["5", "6"]
    assert rows["backward all_to_all recv"].endswith("<-- differs")
    assert not rows["backward all_to_all 1"].endswith("<-- differs")
