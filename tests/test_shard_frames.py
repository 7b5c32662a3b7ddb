"""Plan -> apply reaches torch's ``fully_shard`` in a few library frames (issue 36).

``fully_shard`` is patched where the library calls it (``fsdp_core.sharding``) with a
function that records the call stack and then shards. Counted are the frames of the
three packages' source trees, from the entry point (``parallelize``, ``apply_plan``,
``_fully_shard_module``, the free functions) down to ``fully_shard``: every entry point,
for the core, multimodal and DeepSeek-V4.1 parallelizers, stays within
``MAX_LIBRARY_FRAMES``, on every unit it makes.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import fsdp_core.sharding
from fsdp_core import ModelParallelizer, build_mesh, mixed_precision_policy
from fsdp_core.dtype_units import fully_shard_dtype_safe
from fsdp_core.fake_group import fake_process_group
from fsdp_core.parallelizer import apply_plan
from model_deepseek_v41 import (
    PARALLELIZER,
    DeepseekV41Config,
    build_deepseek_v41,
    fully_shard_deepseek_v41,
)
from multimodal_fsdp import MultimodalParallelizer

#: Library frames from the entry point (included) to torch's ``fully_shard`` (excluded).
MAX_LIBRARY_FRAMES = 3
MP = mixed_precision_policy("bf16", "fp32")
ROOT = Path(__file__).resolve().parents[1]
SOURCES = tuple(str(p) for p in sorted((ROOT / "packages").glob("*/src")))

Entry = Callable[[nn.Module, DeviceMesh], object]


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_process_group(2):
        yield build_mesh()


@pytest.fixture
def stacks(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The library frames (``file:function``) of every ``fully_shard`` call, outermost
    first."""
    seen: list[list[str]] = []
    real = fsdp_core.sharding.fully_shard

    def recording(*args: Any, **kwargs: Any) -> Any:
        frames = traceback.extract_stack()[:-1]
        seen.append(
            [f"{Path(f.filename).name}:{f.name}" for f in frames if f.filename.startswith(SOURCES)]
        )
        return real(*args, **kwargs)

    monkeypatch.setattr(fsdp_core.sharding, "fully_shard", recording)
    return seen


def _model() -> nn.Module:
    return build_deepseek_v41(DeepseekV41Config.tiny(), dtype=torch.bfloat16)


def _apply_plan_function(model: nn.Module, mesh: DeviceMesh) -> object:
    return apply_plan(model, PARALLELIZER.plan(model, mp_policy=MP), mesh=mesh)


def _apply_plan_method(model: nn.Module, mesh: DeviceMesh) -> object:
    return PARALLELIZER.apply_plan(model, PARALLELIZER.plan(model, mp_policy=MP), mesh=mesh)


def _framework_calls(model: nn.Module, mesh: DeviceMesh) -> object:
    """NeMo Automodel's order: each vision block, the tower, then the root."""
    vision = model.get_submodule("vision")
    blocks = vision.get_submodule("blocks")
    assert isinstance(blocks, nn.ModuleList)
    for block in blocks:
        PARALLELIZER._fully_shard_module(block, mesh=mesh, mp_policy=MP)
    PARALLELIZER._fully_shard_module(vision, mesh=mesh, mp_policy=MP)
    return PARALLELIZER._fully_shard_module(model, mesh=mesh, mp_policy=MP)


ENTRIES: dict[str, Entry] = {
    "core.parallelize": lambda m, mesh: ModelParallelizer().parallelize(m, mesh=mesh, mp_policy=MP),
    "multimodal.parallelize": lambda m, mesh: MultimodalParallelizer().parallelize(
        m, mesh=mesh, mp_policy=MP
    ),
    "deepseek.parallelize": lambda m, mesh: PARALLELIZER.parallelize(m, mesh=mesh, mp_policy=MP),
    "apply_plan": _apply_plan_function,
    "ModelParallelizer.apply_plan": _apply_plan_method,
    "_fully_shard_module": _framework_calls,
    "fully_shard_deepseek_v41": lambda m, mesh: fully_shard_deepseek_v41(m, mesh, MP),
    "fully_shard_dtype_safe": lambda m, mesh: fully_shard_dtype_safe(m, mesh=mesh, mp_policy=MP),
}


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_entry_points_reach_fully_shard_in_a_few_frames(
    mesh: DeviceMesh, stacks: list[list[str]], entry: str
) -> None:
    ENTRIES[entry](_model(), mesh)
    assert len(stacks) > 1  # several units, each counted
    deepest = max(stacks, key=len)
    assert all(len(stack) <= MAX_LIBRARY_FRAMES for stack in stacks), " -> ".join(deepest)
