"""The contract's ``_shard_layer_containers_recursively`` and the planner walk the same
layer items (``fsdp_core.containers.iter_layer_items``): nested lists flattened, a branch
dict of adapters left in its layer, a layer registered in two containers sharded once."""

from __future__ import annotations

from torch import nn

from fsdp_core.containers import iter_layer_items
from multimodal_fsdp import _shard_layer_containers_recursively


class Adapted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(2, 2)
        self.lora = nn.ModuleDict({"default": nn.Linear(2, 2)})


def test_the_contract_walk_is_the_planner_walk() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), shared]), Adapted()])
    model.extra = nn.ModuleDict({"a": shared, "b": nn.Linear(2, 2)})
    model.head = Adapted()
    seen: list[nn.Module] = []
    assert _shard_layer_containers_recursively(model, seen.append) is True
    planned = [item for _, item in iter_layer_items(model)]
    assert seen == list({id(item): item for item in planned}.values())
    assert [id(m) for m in seen].count(id(shared)) == 1
    assert model.head.lora["default"] not in seen  # a branch dict is no container
    assert len(seen) == 4


def test_nothing_to_shard_returns_false() -> None:
    seen: list[nn.Module] = []
    assert _shard_layer_containers_recursively(nn.Linear(2, 2), seen.append) is False
    assert seen == []
