"""``plan --pp N``: a job whose model is cut into pipeline stages (issue 35 item 3).

Each stage is planned and costed on its own, per rank of its ``world-size / pp`` ranks;
what a job would refuse (a stage that could stop alone) is refused here, naming the fix.
"""

from __future__ import annotations

import json

import pytest

from multimodal_fsdp.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert main(["plan", "--model", "deepseek-v41-tiny", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def _fail(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "deepseek-v41-tiny", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_each_stage_is_costed_on_its_own_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    staged = _run(capsys, "--world-size", "8", "--pp", "2", "--freeze", "vision")
    whole = _run(capsys, "--world-size", "4", "--freeze", "vision")
    assert staged["parallel_dims"] == {
        "names": ["pp", "dp_shard"],
        "sizes": [2, 4],
        "dp_names": ["dp_shard"],
    }
    first, last = staged["stages"]
    assert first["dp_shard"] == last["dp_shard"] == 4
    # The stages split the model's parameters between them.
    assert first["totals"]["params"] + last["totals"]["params"] == whole["totals"]["params"]
    assert first["totals"]["replicated_params"] == whole["totals"]["replicated_params"]
    assert last["totals"]["replicated_params"] == 0  # the frozen fp32 norms are stage 0's
    for stage in (first, last):
        assert (
            stage["totals"]["sharded_param_bytes_per_rank"]
            < (whole["totals"]["sharded_param_bytes_per_rank"])
        )
    (note,) = [n for n in first["notes"] if n.startswith("pipeline stage 0 of 2")]
    assert "model.layers 0..0; with the towers" in note
    (note,) = [n for n in last["notes"] if n.startswith("pipeline stage 1 of 2")]
    assert "model.layers 1..1; with the head" in note


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (("--world-size", "8", "--pp", "3"), "--pp 3 does not divide --world-size 8"),
        (("--world-size", "8", "--pp", "4"), "2 decoder layers cannot fill 4 pipeline stages"),
        (("--world-size", "8", "--pp", "2", "--batch", "2x16"), "give --activations"),
        (
            ("--world-size", "8", "--pp", "2", "--freeze", "vision", "--policy", "per_layer"),
            "media regions",
        ),
    ],
)
def test_what_a_pipeline_job_could_not_run_is_refused(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], words: str
) -> None:
    assert words in _fail(capsys, *argv)


def test_per_layer_towers_plan_with_balanced_media(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--world-size", "8", "--pp", "2", "--freeze", "vision", "--policy", "per_layer")
    staged = _run(capsys, *argv, "--balance-media")
    assert len(staged["stages"]) == 2
