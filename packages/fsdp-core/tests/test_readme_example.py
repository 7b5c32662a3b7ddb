"""The README's example runs as written (one gloo rank, no torchrun)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch.distributed as dist

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "README has no python example"
    return blocks[0]


def test_readme_example_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    try:
        exec(compile(_example(), str(README), "exec"), {"__name__": "__readme__"})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = capsys.readouterr().out
    assert "5 FSDP units" in out
    assert "layers.3" in out
