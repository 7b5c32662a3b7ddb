"""The README's example runs as written: the first ```python block is executed here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsdp_core.testing import python_blocks, run_markdown_example

README = Path(__file__).resolve().parents[1] / "README.md"


def first_python_block(text: str) -> str:
    blocks = python_blocks(text)
    if not blocks:
        raise AssertionError(f"no ```python block in {README}")
    return blocks[0]


def test_readme_has_one_example_block_that_compiles() -> None:
    code = first_python_block(README.read_text(encoding="utf-8"))
    compile(code, str(README), "exec")
    assert 'if __name__ == "__main__":' in code
    assert "init_distributed()" in code
    assert "destroy_distributed()" in code


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning")
def test_readme_example_runs_on_one_gloo_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert not run_markdown_example(README).left_process_group
    out = capsys.readouterr().out

    sections = re.split(r"^=== frozen_multimodal_sharding=", out, flags=re.MULTILINE)[1:]
    by_policy = {section.split("\n", 1)[0].strip("'"): section for section in sections}
    assert list(by_policy) == ["root", "per_layer", "replicate"]

    root, per_layer, replicate = by_policy["root"], by_policy["per_layer"], by_policy["replicate"]
    assert "vision_tower.blocks" not in root
    assert "tower sharded: True, tower units: 0, tower dtype: torch.float32" in root
    for index in range(3):
        assert f"vision_tower.blocks.{index}" in per_layer
    assert "tower sharded: True, tower units: 3" in per_layer
    assert "vision_tower.blocks" not in replicate
    assert "ignored parameters: 16 (16 replicated by the parallelizer)" in replicate
    assert "tower sharded: False, tower units: 0, tower dtype: torch.bfloat16" in replicate
    for section in (root, per_layer, replicate):
        assert "note: tower 'vision_tower' (vision): frozen" in section
        assert re.search(r"loss: \d+\.\d{4}", section)


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning")
def test_readme_example_runs_twice_in_one_process() -> None:
    """The example cleans up after itself, so a second run starts a fresh group."""
    for _ in range(2):
        assert not run_markdown_example(README).left_process_group
