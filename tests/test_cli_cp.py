"""``plan --cp N``: a job whose sequences are split over CP ranks (issue 35 item 3).

FSDP shards over the data-parallel ranks times CP, so at ``--cp 2`` 8 ranks shard the
parameters like an 8-rank job, while 4 of them hold different batches."""

from __future__ import annotations

import json

import pytest

from multimodal_fsdp.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert main(["plan", "--model", "deepseek-v41-tiny", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_cp_shards_over_the_data_parallel_ranks_times_cp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cp = _run(capsys, "--world-size", "8", "--cp", "2", "--balance-media", "--freeze", "vision")
    dp = _run(capsys, "--world-size", "8", "--balance-media", "--freeze", "vision")
    assert cp["parallel_dims"] == {
        "names": ["dp_shard", "cp"],
        "sizes": [4, 2],
        "dp_names": ["dp_shard"],
    }
    assert cp["dp_shard"] == dp["dp_shard"] == 8  # FSDP over dp x cp
    assert (
        cp["totals"]["sharded_param_bytes_per_rank"] == dp["totals"]["sharded_param_bytes_per_rank"]
    )
    (note,) = [n for n in cp["notes"] if n.startswith("context parallel")]
    assert "8 ranks as ('dp', 'cp') = (4, 2)" in note
    assert "3 + items int64" in note


def test_cp_traces_a_rank_s_share_of_each_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    """``--batch 2x64 --cp 2``: a CP rank's trace runs 2 sequences of 32 tokens, its
    balanced frozen tower encodes its share of the call, and the exchange's header and
    buffers are replayed beside it (``estimate._data_group_trace``): its saved
    activations are those of 2x32 without CP, its peaks at least theirs, and less than
    the whole sequences' (2x64 without CP)."""
    common = ("--world-size", "8", "--balance-media", "--freeze", "vision")
    cp = _run(capsys, *common, "--cp", "2", "--batch", "2x64")["memory"]
    shard = _run(capsys, *common, "--batch", "2x32")["memory"]
    whole = _run(capsys, *common, "--batch", "2x64")["memory"]
    assert cp["activation_bytes"] == shard["activation_bytes"]
    assert cp["step_peak_bytes"] >= shard["step_peak_bytes"]
    assert cp["backward_activation_bytes"] >= shard["backward_activation_bytes"]
    assert cp["activation_bytes"] < whole["activation_bytes"]
    assert cp["step_peak_bytes"] < whole["step_peak_bytes"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--world-size", "8", "--cp", "3"), "--cp 3 does not divide"),
        (("--world-size", "8", "--cp", "2", "--batch", "1x33"), "--cp 2 does not divide 33 tokens"),
    ],
)
def test_cp_refusals_name_the_fix(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "deepseek-v41-tiny", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
