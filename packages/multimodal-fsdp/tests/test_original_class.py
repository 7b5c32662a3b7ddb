"""The class a module had before ``fully_shard`` swapped in its ``FSDP<name>`` subclass is
found by the swap itself (the ``FSDPModule`` base), not by a name prefix: a user's own class
may be called ``FSDP...`` too. One helper, ``fsdp_core.sharding.original_class``, serves
the costs' model name, the forward-argument check and the Hugging Face checkpoint code."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from fsdp_core import build_mesh
from fsdp_core.fake_group import fake_process_group
from fsdp_core.sharding import original_class
from multimodal_fsdp import plan_costs
from multimodal_fsdp.discovery.conditional import required_forward_arguments
from multimodal_fsdp.parallelizer import MultimodalParallelizer


class FSDPBlock(nn.Module):
    """A user's class whose name happens to start with FSDP."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * mask


class FSDPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FSDPBlock() for _ in range(2))


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_process_group(2):
        yield build_mesh()


def test_an_unsharded_class_named_fsdp_is_its_own_class() -> None:
    block = FSDPBlock()
    assert original_class(block) is FSDPBlock
    assert required_forward_arguments(block) == frozenset({"x", "mask"})


def test_the_swapped_class_is_seen_through(mesh: DeviceMesh) -> None:
    block = FSDPBlock()
    fully_shard(block, mesh=mesh)
    assert type(block) is not FSDPBlock
    assert original_class(block) is FSDPBlock
    assert required_forward_arguments(block) == frozenset({"x", "mask"})


def test_the_costs_name_the_users_class() -> None:
    model = FSDPNet()
    plan = MultimodalParallelizer().plan(model)
    assert plan_costs(plan, model, world_size=2).model == "FSDPNet"
