"""fsdp_core.containers: finding the layer-container items that become units."""

from __future__ import annotations

import pytest
from torch import nn

from fsdp_core.containers import (
    container_items,
    is_branch_dict,
    is_layer_container,
    is_module_container,
    iter_layer_items,
    join_path,
    unwrap_module,
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


# --- adapter dicts (branch dicts) ----------------------------------------------------------


class AdaptedLinear(nn.Module):
    """A Linear with per-adapter low-rank branches, laid out as PEFT's LoRA layers are."""

    def __init__(self, adapters: tuple[str, ...] = ("default",)) -> None:
        super().__init__()
        self.base_layer = nn.Linear(4, 4)
        self.lora_dropout = nn.ModuleDict({name: nn.Dropout(0.1) for name in adapters})
        self.lora_A = nn.ModuleDict({name: nn.Linear(4, 2, bias=False) for name in adapters})
        self.lora_B = nn.ModuleDict({name: nn.Linear(2, 4, bias=False) for name in adapters})
        self.lora_embedding_A = nn.ParameterDict()


class SavedCopy(nn.Module):
    """A frozen module beside trainable copies of it, as PEFT's ``modules_to_save``."""

    def __init__(self, original: nn.Module, copy: nn.Module) -> None:
        super().__init__()
        self.original_module = original
        self.modules_to_save = nn.ModuleDict({"default": copy})


class AdaptedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = AdaptedLinear()
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))


class AdaptedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([AdaptedBlock(), AdaptedBlock()])
        self.proj = AdaptedLinear(("one", "two"))
        self.head = SavedCopy(nn.Linear(4, 4), nn.Linear(4, 4))


def test_adapter_dicts_of_a_wrapped_linear_are_branch_dicts() -> None:
    layer = AdaptedLinear()
    for name in ("lora_A", "lora_B", "lora_dropout"):
        container = layer.get_submodule(name)
        assert is_branch_dict(container, layer), name
        assert not is_layer_container(container, layer), name
        # Without its parent the same dict still reads as a container.
        assert is_layer_container(container)
    assert list(iter_layer_items(layer)) == []


def test_adapters_stay_in_the_unit_of_the_layer_they_adapt() -> None:
    paths = [path for path, _ in iter_layer_items(AdaptedModel())]
    # No lora_A/lora_B item of the wrapped projection or the top-level proj, and no
    # trainable copy in modules_to_save: only the real layers.
    assert paths == ["layers.0", "layers.1"]


def test_a_copy_of_a_non_leaf_module_is_a_branch_and_still_searched() -> None:
    def tower() -> nn.Module:
        module = nn.Module()
        module.embed = nn.Linear(4, 4)
        module.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        return module

    model = nn.Module()
    model.tower = SavedCopy(tower(), tower())
    model.other = nn.Linear(4, 4)
    assert is_branch_dict(model.tower.modules_to_save, model.tower)
    # The copy's dict makes no unit, but layer lists inside both towers are found.
    assert [path for path, _ in iter_layer_items(model)] == [
        "tower.original_module.blocks.0",
        "tower.original_module.blocks.1",
        "tower.modules_to_save.default.blocks.0",
        "tower.modules_to_save.default.blocks.1",
    ]


@pytest.mark.parametrize(
    "build",
    [
        # Two modules with parameters beside the dict: the parent wraps nothing.
        lambda: (nn.Linear(4, 4), nn.Linear(4, 4), {"a": nn.Linear(4, 4)}),
        # Items that are neither leaves nor copies of the one module beside them: layers.
        lambda: (nn.Linear(4, 4), None, {"a": Block(), "b": Block()}),
        # No module with parameters beside the dict.
        lambda: (None, None, {"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}),
        # Empty dicts are never branches.
        lambda: (nn.Linear(4, 4), None, {}),
    ],
)
def test_dicts_that_are_layer_containers(build: object) -> None:
    first, second, items = build()  # type: ignore[operator]
    parent = nn.Module()
    if first is not None:
        parent.first = first
    if second is not None:
        parent.second = second
    parent.items = nn.ModuleDict(items)
    assert not is_branch_dict(parent.items, parent)
    assert is_layer_container(parent.items, parent)


def test_module_lists_are_always_layer_lists() -> None:
    parent = nn.Module()
    parent.base_layer = nn.Linear(4, 4)
    parent.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    assert not is_branch_dict(parent.experts, parent)
    assert [path for path, _ in iter_layer_items(parent)] == ["experts.0", "experts.1"]


def test_branch_items_are_looked_at_through_checkpoint_wrappers() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layer = AdaptedLinear()
    layer.lora_A["default"] = checkpoint_wrapper(nn.Linear(4, 2))
    assert is_branch_dict(layer.lora_A, layer)
    assert list(iter_layer_items(layer)) == []


def test_checkpoint_wrapped_layers_are_the_same_items() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    model = AdaptedModel()
    before = [path for path, _ in iter_layer_items(model)]
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, AdaptedBlock))
    items = list(iter_layer_items(model))
    assert [path for path, _ in items] == before
    assert all(isinstance(unwrap_module(item), AdaptedBlock) for _, item in items)


def test_is_under_is_a_path_rule_not_a_string_prefix() -> None:
    from fsdp_core.containers import is_under

    assert is_under("vision.blocks.1", "vision")
    assert is_under("vision", "vision")
    assert is_under("anything.at.all", "")
    assert not is_under("vision_proj.weight", "vision")
    assert not is_under("vision", "vision.blocks")
