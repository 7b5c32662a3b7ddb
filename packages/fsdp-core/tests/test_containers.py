"""fsdp_core.containers: finding the layer-container items that become units."""

from __future__ import annotations

import pytest
from torch import nn

from fsdp_core.containers import (
    container_items,
    is_module_container,
    iter_layer_items,
    join_path,
)


class Block(nn.Module):
    """A layer with its own inner container (which belongs to the block's unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(4)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.towers = nn.ModuleDict(
            {"vision": nn.ModuleList([nn.Linear(4, 4)]), "audio": nn.Linear(4, 4)}
        )
        self.stack = nn.ModuleList([nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]), Block()])
        self.head = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)]))


def test_join_path() -> None:
    assert join_path("", "layers") == "layers"
    assert join_path("model", "layers") == "model.layers"
    assert join_path("model.layers", "0") == "model.layers.0"


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (nn.ModuleList(), True),
        (nn.ModuleDict(), True),
        (nn.Sequential(nn.Linear(2, 2)), False),
        (nn.Linear(2, 2), False),
        (Block(), False),
    ],
)
def test_is_module_container(module: nn.Module, expected: bool) -> None:
    assert is_module_container(module) is expected


def test_container_items_of_list_and_dict() -> None:
    a, b = nn.Linear(2, 2), nn.ReLU()
    assert container_items(nn.ModuleList([a, b])) == [("0", a), ("1", b)]
    assert container_items(nn.ModuleDict({"z": b, "a": a})) == [("z", b), ("a", a)]
    assert container_items(nn.ModuleList()) == []


@pytest.mark.parametrize("module", [nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2), Block()])
def test_container_items_refuses_other_modules(module: nn.Module) -> None:
    with pytest.raises(
        TypeError, match=rf"{type(module).__name__} is not an nn.ModuleList or nn.ModuleDict"
    ):
        container_items(module)


def test_iter_layer_items_paths() -> None:
    model = Model()
    items = list(iter_layer_items(model))
    assert [path for path, _ in items] == [
        # found at any depth outside items
        "encoder.layers.0",
        "encoder.layers.1",
        # dict items, with a list nested directly in the dict flattened
        "towers.vision.0",
        "towers.audio",
        # lists nested directly in lists are flattened; the Block item is not searched
        "stack.0.0",
        "stack.0.1",
        "stack.1",
        # an nn.Sequential is a layer, but a container inside it is still found
        "head.1.0",
    ]
    for path, module in items:
        assert model.get_submodule(path) is module
        assert not is_module_container(module)


def test_iter_layer_items_does_not_descend_into_items() -> None:
    paths = [path for path, _ in iter_layer_items(Model())]
    assert not any(".experts" in path for path in paths)


def test_iter_layer_items_prefix() -> None:
    paths = [path for path, _ in iter_layer_items(Encoder(), prefix="model.encoder")]
    assert paths == ["model.encoder.layers.0", "model.encoder.layers.1"]


def test_iter_layer_items_without_containers() -> None:
    assert list(iter_layer_items(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))) == []
    assert list(iter_layer_items(nn.Linear(2, 2))) == []


def test_iter_layer_items_of_a_bare_item_searches_its_inner_containers() -> None:
    block = Block()
    assert [path for path, _ in iter_layer_items(block)] == ["experts.0", "experts.1"]
