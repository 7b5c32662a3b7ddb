"""``ModelParallelizer._fully_shard_module`` called by a framework, outside any plan.

Frameworks that take a parallelizer object (NeMo Automodel's ``model_parallelizer=``)
decide the units themselves and call ``_fully_shard_module(module, mesh=..., mp_policy=...)``
on each, children first. Outside a plan the call makes ``module`` a dtype-safe unit and
returns it; inside ``apply_plan`` it makes exactly the planned unit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from fsdp_core import build_mesh
from fsdp_core.fake_group import fake_process_group
from fsdp_core.parallelizer import ModelParallelizer
from fsdp_core.precision import default_mp_policy, fp32_island_policy
from fsdp_core.sharding import SHARD_OPTION_NAMES, ShardOptions

BF16, FP32 = torch.bfloat16, torch.float32
DIM = 8
MP = default_mp_policy()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _mixed() -> Model:
    """bf16 weights, fp32 LayerNorms: a unit holding both fails at FSDP's first forward."""
    model = Model().to(BF16)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.float()
    return model


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_process_group(2):
        yield build_mesh()


def _units(model: nn.Module) -> dict[tuple[str, ...], MixedPrecisionPolicy]:
    states: dict[int, tuple[object, list[str]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            states.setdefault(id(state), (state, []))[1].append(name)
    return {tuple(sorted(names)): state._mp_policy for state, names in states.values()}  # type: ignore[attr-defined]


def _step(model: nn.Module) -> torch.Tensor:
    out = model(torch.randn(2, DIM, dtype=BF16))
    out.float().sum().backward()
    return out


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload_policy"])
def test_per_layer_then_root_with_mesh_and_policy_only(mesh: DeviceMesh, offload: bool) -> None:
    model = _mixed()
    extra = {"offload_policy": OffloadPolicy()} if offload else {}
    parallelizer = ModelParallelizer()
    for layer in model.layers:
        assert parallelizer._fully_shard_module(layer, mesh=mesh, mp_policy=MP, **extra) is layer
    assert parallelizer._fully_shard_module(model, mesh=mesh, mp_policy=MP, **extra) is model
    island = fp32_island_policy(MP, surrounding_dtype=BF16)
    assert _units(model) == {
        ("layers.0.norm",): island,
        ("layers.0",): MP,
        ("layers.1.norm",): island,
        ("layers.1",): MP,
        ("",): MP,
    }
    assert _step(model).dtype is BF16


def test_the_same_units_as_the_plan(mesh: DeviceMesh) -> None:
    """Called on the modules the plan makes units of, in plan order, it makes the plan's
    units."""
    planned, by_hand = _mixed(), _mixed()
    parallelizer = ModelParallelizer()
    parallelizer.parallelize(planned, mesh=mesh, mp_policy=MP)
    for path in ("layers.0", "layers.1", ""):
        parallelizer._fully_shard_module(by_hand.get_submodule(path), mesh=mesh, mp_policy=MP)
    assert _units(by_hand) == _units(planned)


def test_dtype_safe_false_makes_one_unit(mesh: DeviceMesh) -> None:
    model = _mixed()
    ModelParallelizer(dtype_safe=False)._fully_shard_module(model, mesh=mesh, mp_policy=MP)
    assert _units(model) == {("",): MP}


def test_a_group_is_one_unit_and_a_unit_is_left_alone(mesh: DeviceMesh) -> None:
    model = _mixed()
    parallelizer = ModelParallelizer()
    norms = [model.layers[0].norm, model.layers[1].norm]
    island = fp32_island_policy(MP, surrounding_dtype=BF16)
    assert parallelizer._fully_shard_module(norms, mesh=mesh, mp_policy=island) is norms
    parallelizer._fully_shard_module(model, mesh=mesh, mp_policy=MP)
    again = parallelizer._fully_shard_module(model, mesh=mesh, mp_policy=MP)
    assert again is model
    assert _units(model) == {("layers.0.norm", "layers.1.norm"): island, ("",): MP}
    _step(model)


def test_ignored_params_stay_out(mesh: DeviceMesh) -> None:
    model = _mixed()
    ignored = set(model.head.parameters())
    ModelParallelizer()._fully_shard_module(model, mesh=mesh, mp_policy=MP, ignored_params=ignored)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in ignored)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, TypeError, r"ModelParallelizer\._fully_shard_module needs mesh= and mp_policy="),
        ({"mesh": None, "mp_policy": MP}, TypeError, r"mesh must be a DeviceMesh, got NoneType"),
        ({"policy": MP}, TypeError, r"unexpected option 'policy'; valid options: mesh, mp_policy"),
    ],
)
def test_bad_options_are_named(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    model = _mixed()
    with pytest.raises(error, match=match):
        ModelParallelizer()._fully_shard_module(model, **kwargs)
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


def test_options_object(mesh: DeviceMesh) -> None:
    options = ShardOptions(mesh=mesh, mp_policy=MP, ignored_params=frozenset())
    assert options.ignored_params is None  # an empty set ignores nothing
    assert {field.name for field in dataclasses.fields(options)} == set(SHARD_OPTION_NAMES)
    with pytest.raises(TypeError, match=r"offload_policy must be an OffloadPolicy or None"):
        ShardOptions(mesh=mesh, mp_policy=MP, offload_policy="cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ignored_params must be a set of nn.Parameter"):
        ShardOptions(mesh=mesh, mp_policy=MP, ignored_params=nn.Linear(2, 2))  # type: ignore[arg-type]
