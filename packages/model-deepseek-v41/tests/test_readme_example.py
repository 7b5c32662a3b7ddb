"""The first ```python block of the package README runs as written."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_core.testing import python_blocks, run_markdown_example

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs() -> None:
    code = python_blocks(README.read_text(encoding="utf-8"))[0]
    assert "init_distributed()" in code
    assert 'frozen_multimodal_sharding="root"' in code
    run = run_markdown_example(README, module_name="__readme__")
    assert not run.left_process_group  # the example tears its group down itself
    namespace = run.namespace
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
