"""The README's example runs as written (one gloo rank, no torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_core.testing import python_blocks, run_markdown_example

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_blocks() -> None:
    assert python_blocks("x\n```bash\nls\n```\n```python\na = 1\n```\n") == ["a = 1\n"]
    assert python_blocks("```bash\nls\n```\n") == []


def test_run_markdown_example_without_a_block(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("no code here\n")
    with pytest.raises(LookupError, match=r"has 0 python blocks"):
        run_markdown_example(page)


def test_readme_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    run = run_markdown_example(README, module_name="__readme__")
    assert not run.left_process_group  # the example tears its group down itself
    out = capsys.readouterr().out
    assert "5 FSDP units" in out
    assert "layers.3" in out
