"""Unit tests for multimodal_fsdp.layers: layer containers and which modules become units."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from torch import nn

from multimodal_fsdp.layers import (
    _container_items,
    _is_module_container,
    _shard_layer_containers_recursively,
    shard_multimodal_module,
)


class Recorder:
    """A ``shard_module`` stand-in that remembers what it was called with."""

    def __init__(self) -> None:
        self.calls: list[nn.Module] = []

    def __call__(self, module: nn.Module) -> None:
        self.calls.append(module)

    def names(self, model: nn.Module) -> list[str]:
        """Qualified names of the recorded modules in ``model``, in call order."""
        ids = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
        return [ids[id(module)] for module in self.calls]


class Block(nn.Module):
    """A layer that keeps its own inner list (which belongs to its unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(2)
        self.experts = nn.ModuleList([nn.Linear(2, 2) for _ in range(2)])


class Tower(nn.Module):
    """patch_embed + blocks + post_norm: a vision tower shape."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(2, 2)
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])
        self.post_norm = nn.LayerNorm(2)


def shard_all(module: nn.Module) -> tuple[bool, list[str]]:
    recorder = Recorder()
    result = _shard_layer_containers_recursively(module, recorder)
    return result, recorder.names(module)


# --- _is_module_container ----------------------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [
        nn.ModuleList(),
        nn.ModuleList([nn.Linear(2, 2)]),
        nn.ModuleDict(),
        nn.ModuleDict({"a": nn.Linear(2, 2)}),
    ],
)
def test_module_lists_and_dicts_are_containers(module: nn.Module) -> None:
    assert _is_module_container(module) is True


@pytest.mark.parametrize(
    "module",
    [
        nn.Sequential(nn.Linear(2, 2), nn.ReLU()),
        nn.Linear(2, 2),
        nn.Module(),
        Tower(),
        nn.ParameterList(),
    ],
)
def test_other_modules_are_not_containers(module: nn.Module) -> None:
    assert _is_module_container(module) is False


# --- _container_items ----------------------------------------------------------------------


def test_module_list_items_have_int_keys_in_order() -> None:
    layers = [nn.Linear(2, 2) for _ in range(3)]
    items = _container_items(nn.ModuleList(layers))
    assert [key for key, _ in items] == [0, 1, 2]
    assert all(type(key) is int for key, _ in items)
    assert [item for _, item in items] == layers


def test_module_dict_items_have_str_keys_in_registration_order() -> None:
    a, b = nn.Linear(2, 2), nn.ReLU()
    items = _container_items(nn.ModuleDict(OrderedDict([("zeta", a), ("alpha", b)])))
    assert items == [("zeta", a), ("alpha", b)]
    assert all(type(key) is str for key, _ in items)


def test_module_dict_with_numeric_looking_keys_keeps_str() -> None:
    items = _container_items(nn.ModuleDict({"0": nn.ReLU(), "1": nn.ReLU()}))
    assert [key for key, _ in items] == ["0", "1"]


def test_empty_containers_have_no_items() -> None:
    assert _container_items(nn.ModuleList()) == []
    assert _container_items(nn.ModuleDict()) == []


def test_sequential_items_are_enumerated_like_the_reference() -> None:
    """The reference enumerates any iterable module; a Sequential is not refused."""
    a, b = nn.Linear(2, 2), nn.ReLU()
    items = _container_items(nn.Sequential(a, b))
    assert items == [(0, a), (1, b)]
    assert all(type(key) is int for key, _ in items)


def test_named_sequential_is_enumerated_by_position_not_name() -> None:
    a, b = nn.Linear(2, 2), nn.ReLU()
    items = _container_items(nn.Sequential(OrderedDict([("proj", a), ("act", b)])))
    assert items == [(0, a), (1, b)]


def test_module_list_registering_one_layer_twice_lists_it_twice() -> None:
    layer = nn.Linear(2, 2)
    items = _container_items(nn.ModuleList([layer, layer]))
    assert items == [(0, layer), (1, layer)]


@pytest.mark.parametrize("module", [Tower(), nn.Linear(2, 2), nn.Module()])
def test_any_other_module_is_enumerated_over_its_children(module: nn.Module) -> None:
    items = _container_items(module)
    assert items == list(enumerate(module.children()))
    assert [key for key, _ in items] == list(range(len(list(module.children()))))


def test_plain_module_with_children_gives_each_child_once_in_order() -> None:
    tower = Tower()
    children = list(tower.children())
    assert children, "the fixture must have children for this test to mean anything"
    assert [item for _, item in _container_items(tower)] == children


# --- _shard_layer_containers_recursively ---------------------------------------------------


def test_no_container_returns_false_and_shards_nothing() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)))
    assert shard_all(model) == (False, [])


def test_empty_container_shards_nothing() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList()
    model.heads = nn.ModuleDict()
    assert shard_all(model) == (False, [])


def test_every_leaf_item_is_sharded_once_and_others_are_left() -> None:
    result, names = shard_all(Tower(depth=3))
    assert result is True
    assert names == ["blocks.0", "blocks.1", "blocks.2"]


def test_items_are_not_descended_into() -> None:
    _, names = shard_all(Tower(depth=2))
    assert not any("experts" in name for name in names)


def test_containers_at_any_depth_outside_items_are_found() -> None:
    model = nn.Module()
    model.encoder = nn.Module()
    model.encoder.stage = nn.Sequential(nn.Linear(2, 2))
    model.encoder.stage.add_module("deep", nn.Module())
    model.encoder.stage.deep.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    model.heads = nn.ModuleDict({"img": nn.Linear(2, 2), "txt": nn.Linear(2, 2)})
    model.proj = nn.Linear(2, 2)
    result, names = shard_all(model)
    assert result is True
    assert names == [
        "encoder.stage.deep.layers.0",
        "encoder.stage.deep.layers.1",
        "heads.img",
        "heads.txt",
    ]


def test_lists_nested_directly_in_lists_are_flattened() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(
        [
            nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]),
            nn.Linear(2, 2),
            nn.ModuleList([nn.ModuleList([nn.Linear(2, 2)])]),
            nn.ModuleDict({"x": nn.Linear(2, 2)}),
        ]
    )
    result, names = shard_all(model)
    assert result is True
    assert names == ["layers.0.0", "layers.0.1", "layers.1", "layers.2.0.0", "layers.3.x"]


def test_an_item_shared_by_two_containers_is_sharded_once() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Module()
    model.first = nn.ModuleList([shared, nn.Linear(2, 2)])
    model.second = nn.ModuleList([shared])
    recorder = Recorder()
    assert _shard_layer_containers_recursively(model, recorder) is True
    assert [id(m) for m in recorder.calls] == [id(shared), id(model.first[1])]


def test_called_on_a_container_shards_its_items() -> None:
    blocks = nn.ModuleList([Block(), Block()])
    recorder = Recorder()
    assert _shard_layer_containers_recursively(blocks, recorder) is True
    assert recorder.calls == [blocks[0], blocks[1]]


def test_called_on_a_nested_container_flattens_it() -> None:
    inner = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    outer = nn.ModuleList([inner, nn.ReLU()])
    recorder = Recorder()
    assert _shard_layer_containers_recursively(outer, recorder) is True
    assert recorder.calls == [inner[0], inner[1], outer[1]]


def test_called_on_an_empty_container_returns_false() -> None:
    recorder = Recorder()
    assert _shard_layer_containers_recursively(nn.ModuleList(), recorder) is False
    assert recorder.calls == []


def test_shard_module_return_value_is_ignored() -> None:
    model = Tower(depth=2)
    assert _shard_layer_containers_recursively(model, lambda m: None) is True
    assert _shard_layer_containers_recursively(model, lambda m: False) is True


def test_sequential_items_are_not_units() -> None:
    model = nn.Module()
    model.stack = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert shard_all(model) == (False, [])


# --- shard_multimodal_module ---------------------------------------------------------------


def test_shard_multimodal_module_shards_items_when_there_are_containers() -> None:
    tower = Tower(depth=2)
    recorder = Recorder()
    shard_multimodal_module(tower, recorder)
    assert recorder.calls == [tower.blocks[0], tower.blocks[1]]


def test_shard_multimodal_module_shards_the_whole_module_without_containers() -> None:
    projector = nn.Sequential(nn.Linear(2, 2), nn.GELU(), nn.Linear(2, 2))
    recorder = Recorder()
    shard_multimodal_module(projector, recorder)
    assert recorder.calls == [projector]


def test_shard_multimodal_module_shards_the_whole_module_when_containers_are_empty() -> None:
    module = nn.Module()
    module.layers = nn.ModuleList()
    module.proj = nn.Linear(2, 2)
    recorder = Recorder()
    shard_multimodal_module(module, recorder)
    assert recorder.calls == [module]


def test_shard_multimodal_module_on_a_container_shards_its_items() -> None:
    blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    recorder = Recorder()
    shard_multimodal_module(blocks, recorder)
    assert recorder.calls == [blocks[0], blocks[1]]


def test_shard_multimodal_module_on_a_leaf() -> None:
    leaf = nn.Linear(2, 2)
    recorder = Recorder()
    shard_multimodal_module(leaf, recorder)
    assert recorder.calls == [leaf]


@pytest.mark.parametrize(
    ("module", "type_name"), [(None, "NoneType"), ("tower", "str"), ([nn.Linear(2, 2)], "list")]
)
def test_shard_multimodal_module_rejects_non_modules(module: object, type_name: str) -> None:
    recorder = Recorder()
    with pytest.raises(TypeError, match=f"module must be an nn.Module, got {type_name}"):
        shard_multimodal_module(module, recorder)  # type: ignore[arg-type]
    assert recorder.calls == []


@pytest.mark.parametrize(
    ("shard_module", "type_name"), [(None, "NoneType"), ("fully_shard", "str"), (3, "int")]
)
def test_shard_multimodal_module_rejects_non_callables(
    shard_module: object, type_name: str
) -> None:
    with pytest.raises(TypeError, match=f"shard_module must be callable, got {type_name}"):
        shard_multimodal_module(Tower(), shard_module)  # type: ignore[arg-type]


# --- adapters (PEFT-style LoRA dicts beside the module they adapt) -------------------------


def lora_linear() -> nn.Module:
    """A Linear wrapped as PEFT's LoRA layers are: ``base_layer`` plus per-adapter dicts."""
    layer = nn.Module()
    layer.base_layer = nn.Linear(2, 2)
    layer.lora_dropout = nn.ModuleDict({"default": nn.Identity()})
    layer.lora_A = nn.ModuleDict({"default": nn.Linear(2, 1, bias=False)})
    layer.lora_B = nn.ModuleDict({"default": nn.Linear(1, 2, bias=False)})
    return layer


def test_adapter_dicts_make_no_units() -> None:
    projector = nn.Sequential(lora_linear(), nn.GELU(), lora_linear())
    assert shard_all(projector) == (False, [])
    recorder = Recorder()
    shard_multimodal_module(projector, recorder)
    assert recorder.names(projector) == [""]  # the whole projector, adapters included


def test_blocks_with_adapters_are_the_units() -> None:
    tower = nn.Module()
    tower.embed = lora_linear()
    tower.blocks = nn.ModuleList([nn.Sequential(lora_linear(), nn.Linear(2, 2)) for _ in "ab"])
    assert shard_all(tower) == (True, ["blocks.0", "blocks.1"])
