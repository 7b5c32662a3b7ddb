"""The demo's options fail fast; one short end-to-end run passes its reference check."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from model_deepseek_v41.demo import parse_args


def test_defaults() -> None:
    args = parse_args([])
    assert args.policy == "root"
    assert args.precision == "bf16"
    assert args.size == "tiny"
    assert args.steps == 8
    assert args.nproc >= 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "sideways"], "unknown frozen multimodal sharding 'sideways'"),
        (["--precision", "int8"], "invalid choice: 'int8'"),
        (["--size", "huge"], "invalid choice: 'huge'"),
        (["--steps", "0"], "expected a positive integer, got 0"),
        (["--nproc", "two"], "expected a positive integer, got 'two'"),
        (["--seq-len", "3"], "must be greater than the 4 image tokens"),
    ],
)
def test_bad_options_fail_fast(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("spelling", ["PER_LAYER", "per-layer", " Per-Layer "])
def test_policy_takes_every_spelling_the_api_takes(spelling: str) -> None:
    assert parse_args(["--policy", spelling]).policy == "per_layer"


@pytest.mark.distributed
def test_demo_runs_and_matches_its_reference() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "model_deepseek_v41.demo", "--steps", "2", "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FSDP units" in result.stdout
    assert "step 2/2" in result.stdout
    assert "-> PASS" in result.stdout
