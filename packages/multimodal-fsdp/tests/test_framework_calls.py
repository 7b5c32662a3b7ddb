"""The reference API used the way a framework uses it, outside ``parallelize``.

A framework that pins ``multimodal-fsdp`` decides its units with the free functions
(``iter_multimodal_modules``, ``module_is_fully_frozen``, ``normalize_frozen_multimodal_sharding``,
``shard_multimodal_module``, ``_shard_layer_containers_recursively``,
``module_parameters``, ``ignored_params_for_root``) and shards each unit with a
parallelizer's ``_fully_shard_module(module, mesh=..., mp_policy=...)``. Checked here for
units and dtypes under the fake process group; tests/test_framework_calls_distributed.py
trains the same flow on 2 gloo ranks against one process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _mm_toy_vlm import PATCH, TOWER_DEPTH, VOCAB, ToyVLM
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from fsdp_core import build_mesh
from fsdp_core.fake_group import fake_process_group
from multimodal_fsdp import (
    MultimodalParallelizer,
    _shard_layer_containers_recursively,
    ignored_params_for_root,
    iter_multimodal_modules,
    module_is_fully_frozen,
    module_parameters,
    normalize_frozen_multimodal_sharding,
    shard_multimodal_module,
)

MP = MixedPrecisionPolicy()


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_process_group(2):
        yield build_mesh()


def framework_flow(
    model: nn.Module, parallelizer: MultimodalParallelizer, policy: str, mesh: DeviceMesh
) -> None:
    """A framework's own sharding loop over the reference functions."""
    frozen_policy = normalize_frozen_multimodal_sharding(policy)

    def shard(module: nn.Module) -> object:
        return parallelizer._fully_shard_module(module, mesh=mesh, mp_policy=MP)

    replicated: set[nn.Parameter] = set()
    for _name, module in iter_multimodal_modules(model):
        if not module_is_fully_frozen(module) or frozen_policy == "per_layer":
            shard_multimodal_module(module, shard)
        elif frozen_policy == "replicate":
            replicated.update(module_parameters(module))
    language = model.get_submodule("language_model")
    assert _shard_layer_containers_recursively(language, shard)
    root_ignored = ignored_params_for_root(model, replicated)
    parallelizer._fully_shard_module(model, mesh=mesh, mp_policy=MP, ignored_params=root_ignored)


def _unit_names(model: nn.Module) -> list[str]:
    return sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule))


def _step(model: nn.Module) -> None:
    pixels = torch.randn(2, 3, PATCH)
    ids = torch.randint(0, VOCAB, (2, 5))
    model(pixels, ids).sum().backward()


#: The trainable projector has no layer container: one unit of its own.
TEXT_UNITS = ["language_model.layers.0", "language_model.layers.1", "multi_modal_projector"]
TOWER_UNITS = [f"vision_tower.blocks.{i}" for i in range(TOWER_DEPTH)]


@pytest.mark.parametrize(
    ("policy", "units", "tower_sharded"),
    [
        ("root", ["", *TEXT_UNITS], True),
        ("Per-Layer", ["", *TEXT_UNITS, *TOWER_UNITS], True),
        ("replicate", ["", *TEXT_UNITS], False),
    ],
)
def test_frozen_tower_flow(
    mesh: DeviceMesh, policy: str, units: list[str], tower_sharded: bool
) -> None:
    model = ToyVLM(frozen_tower=True)
    framework_flow(model, MultimodalParallelizer(), policy, mesh)
    assert _unit_names(model) == sorted(units)
    tower = model.vision_tower
    assert all(isinstance(p, DTensor) == tower_sharded for p in tower.parameters())
    assert all(isinstance(p, DTensor) for p in model.language_model.parameters())
    _step(model)


def test_trainable_tower_flow(mesh: DeviceMesh) -> None:
    model = ToyVLM(frozen_tower=False)
    framework_flow(model, MultimodalParallelizer(), "root", mesh)
    assert _unit_names(model) == sorted(["", *TEXT_UNITS, *TOWER_UNITS])
    _step(model)
    assert all(p.grad is not None for p in model.vision_tower.parameters())


def test_the_flow_keeps_fp32_islands_in_their_own_units(mesh: DeviceMesh) -> None:
    """bf16 weights with fp32 LayerNorms: each call is dtype-safe, as the plan's units."""
    model = ToyVLM(frozen_tower=False).to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.float()
    framework_flow(model, MultimodalParallelizer(), "root", mesh)
    block = model.vision_tower.blocks[0]
    assert isinstance(block.norm, FSDPModule)
    assert block.norm._get_fsdp_state() is not block._get_fsdp_state()
    out = model(torch.randn(2, 3, PATCH, dtype=torch.bfloat16), torch.randint(0, VOCAB, (2, 5)))
    assert out.shape == (2, 8, VOCAB)
