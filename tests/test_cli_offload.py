"""``python -m multimodal_fsdp plan --offload PART``: the plan offloads that part's units
and the memory estimate moves their bytes from the device to the host."""

from __future__ import annotations

import json
from typing import Any

import pytest

from multimodal_fsdp.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FROZEN_PER_LAYER = (
    "--model",
    "deepseek-v41-tiny",
    "--world-size",
    "8",
    "--policy",
    "per_layer",
    "--freeze",
    "vision",
)


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *FROZEN_PER_LAYER, "--json", *argv]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def test_offload_tower_moves_its_shards_to_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    # The tower's own unit for its rest exists only with --offload; compare memory, not units.
    plain = plan_json(capsys)["memory"]
    offloaded = plan_json(capsys, "--offload", "tower")["memory"]
    assert plain["host_param_bytes"] == 0
    assert offloaded["host_param_bytes"] > 0
    assert (
        plain["sharded_param_bytes"] - offloaded["sharded_param_bytes"]
        == offloaded["host_param_bytes"]
    )
    assert offloaded["host_gradient_bytes"] == offloaded["host_optimizer_bytes"] == 0  # frozen
    assert offloaded["peak_bytes"] < plain["peak_bytes"]


def test_offload_is_shown_in_the_notes_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *FROZEN_PER_LAYER, "--offload", "tower"]) == 0
    out = capsys.readouterr().out
    assert "note: offload per part: tower=cpu, projector=-, language_model=-" in out
    assert "host (offloaded)" in out


def test_offload_under_root_is_refused_naming_per_layer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--model", "deepseek-v41-tiny", "--freeze", "vision", "--offload", "tower"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'vision'" in err
    assert "per_layer" in err


def test_an_unknown_part_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", *FROZEN_PER_LAYER, "--offload", "vision"])
    assert "invalid choice: 'vision'" in capsys.readouterr().err
