"""The first ```python block of the package README runs as written."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

README = Path(__file__).resolve().parents[1] / "README.md"

#: Variables that would make ``init_distributed`` expect a torchrun launch.
TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def first_python_block(text: str) -> str:
    """The body of the first fenced ```python block of ``text``."""
    match = re.search(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.DOTALL | re.MULTILINE)
    if match is None:
        raise ValueError("no ```python block found")
    return match.group(1)


@pytest.fixture
def clean_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No process group before; none left after, whatever the example does."""
    assert not dist.is_initialized(), "a process group leaked into this test"
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_first_python_block() -> None:
    assert first_python_block("x\n```bash\nls\n```\n```python\na = 1\n```\n") == "a = 1\n"
    with pytest.raises(ValueError, match=r"no ```python block found"):
        first_python_block("```bash\nls\n```\n")


def test_readme_example_runs(clean_group: None) -> None:
    code = first_python_block(README.read_text(encoding="utf-8"))
    assert "init_distributed()" in code
    assert 'frozen_multimodal_sharding="root"' in code
    namespace: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(code, str(README), "exec"), namespace)
    # The example tears its group down itself.
    assert not dist.is_initialized()
    loss = namespace["loss"]
    assert isinstance(loss, torch.Tensor)
    assert torch.isfinite(loss)
    model = namespace["model"]
    assert isinstance(model, FSDPModule)
    vision = model.vision  # type: ignore[attr-defined]
    assert not isinstance(vision.blocks[0], FSDPModule)  # frozen blocks sit in the root unit
    assert isinstance(vision.blocks[0].attn.qkv.weight, DTensor)  # ... sharded there
    # The frozen fp32 norms are replicated: no unit, whole fp32 tensors, no gradient.
    norms = [vision.norm, *(n for b in vision.blocks for n in (b.norm1, b.norm2))]
    assert len(norms) == 2 * len(vision.blocks) + 1
    for norm in norms:
        assert not isinstance(norm, FSDPModule)
        assert type(norm.weight) is nn.Parameter
        assert norm.weight.dtype == torch.float32
        assert norm.weight.grad is None
    assert not any(isinstance(m, FSDPModule) for m in vision.modules())
