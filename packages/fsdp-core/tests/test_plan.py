"""fsdp_core.plan: sharding plans as data."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core.plan import ShardCall, ShardingPlan, UnitPlan, format_policy, unit_parameters
from fsdp_core.precision import default_mp_policy, fp32_island_policy, mixed_precision_policy

MP = default_mp_policy()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.lin = nn.Linear(4, 4)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)


def _unit(*paths: str, role: str = "layer", **kwargs: object) -> UnitPlan:
    return UnitPlan(paths=paths, mp_policy=MP, role=role, **kwargs)  # type: ignore[arg-type]


def _call(*units: UnitPlan, ignored: tuple[str, ...] = ()) -> ShardCall:
    return ShardCall(
        paths=units[0].paths,
        mp_policy=units[0].mp_policy,
        reshard_after_forward=units[0].reshard_after_forward,
        ignored_param_names=ignored,
        units=units,
    )


def _model_plan(ignored: tuple[str, ...] = ()) -> ShardingPlan:
    """Islands first, then layers, then the root, as the parallelizer plans them."""
    island = UnitPlan(
        paths=("layers.0.norm", "layers.1.norm"),
        mp_policy=fp32_island_policy(),
        role="dtype_island",
    )
    return ShardingPlan(
        calls=(
            _call(island),
            _call(_unit("layers.0", reshard_after_forward=2)),
            _call(_unit("layers.1")),
            _call(_unit("", role="root"), ignored=ignored),
        ),
        ignored_param_names=ignored,
    )


# UnitPlan / ShardCall ----------------------------------------------------------------------------


def test_unit_needs_paths() -> None:
    with pytest.raises(ValueError, match=r"a unit needs at least one module path"):
        UnitPlan(paths=(), mp_policy=MP)


def test_unit_defaults() -> None:
    unit = _unit("layers.0")
    assert unit.reshard_after_forward is None
    assert unit.ignored_param_names == ()
    assert unit.role == "layer"
    assert not unit.is_root


@pytest.mark.parametrize(
    ("paths", "label"),
    [
        (("",), "<root>"),
        (("layers.0",), "layers.0"),
        (("encoder.layers.3.norm",), "encoder.layers.3.norm"),
        (("layers.0.norm", "layers.1.norm"), "layers[2 modules]"),
        (("norm", "head", "proj"), "norm[3 modules]"),
        (("", "head"), "<root>[2 modules]"),
    ],
)
def test_unit_label(paths: tuple[str, ...], label: str) -> None:
    assert _unit(*paths).label == label


def test_unit_is_root() -> None:
    assert _unit("", role="root").is_root
    assert not _unit("", "head").is_root
    assert not _unit("head").is_root


def test_unit_is_frozen_and_hashable() -> None:
    unit = _unit("layers.0")
    with pytest.raises(AttributeError):
        unit.role = "root"  # type: ignore[misc]
    assert unit == _unit("layers.0")


def test_shard_call_is_group() -> None:
    assert not _call(_unit("layers.0")).is_group
    assert _call(_unit("a.norm", "b.norm")).is_group


# ShardingPlan ------------------------------------------------------------------------------------


def test_plan_units_flatten_calls_in_order() -> None:
    a, b, c = _unit("a"), _unit("b"), _unit("c")
    plan = ShardingPlan(calls=(_call(a, b), _call(c)))
    assert plan.units == (a, b, c)
    assert plan.unit_labels() == ["a", "b", "c"]
    assert ShardingPlan(calls=()).units == ()


def test_plan_role_counts() -> None:
    assert _model_plan().role_counts() == {"dtype_island": 1, "layer": 2, "root": 1}
    assert ShardingPlan(calls=()).role_counts() == {}


def test_plan_defaults() -> None:
    plan = ShardingPlan(calls=())
    assert plan.ignored_param_names == ()
    assert plan.replicated_param_names == ()
    assert plan.notes == ()


def test_format_without_model() -> None:
    plan = ShardingPlan(
        calls=_model_plan().calls,
        ignored_param_names=("embed.weight",),
        notes=("vision tower replicated",),
    )
    text = plan.format()
    lines = text.splitlines()
    assert lines[0] == "4 FSDP units"
    assert "[  0] layers[2 modules]" in lines[1]
    assert "dtype_island" in lines[1]
    assert "param=float32 reduce=float32 out=bfloat16" in lines[1]
    assert "layers.0" in lines[2]
    assert "reshard=2" in lines[2]
    assert "reshard=" not in lines[3]
    assert "<root>" in lines[4]
    assert "root" in lines[4]
    assert "params=" not in text
    assert "  ignored parameters: 1 (0 replicated by the parallelizer)" in lines
    assert text.endswith("  note: vision tower replicated")


def test_format_counts_replicated_params() -> None:
    plan = ShardingPlan(
        calls=_model_plan().calls,
        ignored_param_names=("embed.weight", "head.bias"),
        replicated_param_names=("embed.weight",),
    )
    assert "  ignored parameters: 2 (1 replicated by the parallelizer)" in plan.format()
    assert "ignored parameters" not in _model_plan().format()


def test_format_with_model_shows_params_and_dtypes() -> None:
    model = Model().to(torch.bfloat16)
    for layer in model.layers:
        layer.norm.float()
    model.layers[1].lin.requires_grad_(False)
    text = _model_plan().format(model)
    lines = text.splitlines()
    assert lines[0] == "4 FSDP units"
    # Two norms of 4 + 4 parameters each, in fp32.
    assert "params=16 dtype=float32" in lines[1]
    # Linear(4, 4): 20 parameters.
    assert "params=20 dtype=bfloat16" in lines[2]
    assert "frozen" not in lines[2]
    assert "params=20 dtype=bfloat16 frozen" in lines[3]
    # Root: embedding 40 + head 10.
    assert "params=50 dtype=bfloat16" in lines[4]
    for path in ("layers.0", "layers.1", "<root>"):
        assert path in text


def test_format_with_model_unit_without_params() -> None:
    model = nn.Sequential(nn.ReLU())
    plan = ShardingPlan(calls=(_call(_unit("", role="root")),))
    assert "params=0 dtype=-" in plan.format(model)


def test_format_thousands_separator() -> None:
    model = nn.Linear(100, 100)
    plan = ShardingPlan(calls=(_call(_unit("", role="root")),))
    assert "params=10,100 dtype=float32" in plan.format(model)


@pytest.mark.parametrize(
    ("policy", "text"),
    [
        (MixedPrecisionPolicy(), "param=- reduce=-"),
        (default_mp_policy(), "param=bfloat16 reduce=float32"),
        (fp32_island_policy(), "param=float32 reduce=float32 out=bfloat16"),
        (
            mixed_precision_policy(None, "fp32", output_dtype="fp16"),
            "param=- reduce=float32 out=float16",
        ),
    ],
)
def test_format_policy(policy: MixedPrecisionPolicy, text: str) -> None:
    assert format_policy(policy) == text


# unit_parameters ---------------------------------------------------------------------------------


def _names(owned: list[list[tuple[str, nn.Parameter]]]) -> list[list[str]]:
    return [[name for name, _ in params] for params in owned]


def test_unit_parameters_children_before_parents() -> None:
    model = Model()
    owned = unit_parameters(_model_plan(), model)
    assert _names(owned) == [
        [
            "layers.0.norm.weight",
            "layers.0.norm.bias",
            "layers.1.norm.weight",
            "layers.1.norm.bias",
        ],
        ["layers.0.lin.weight", "layers.0.lin.bias"],
        ["layers.1.lin.weight", "layers.1.lin.bias"],
        ["embed.weight", "head.weight", "head.bias"],
    ]
    for params in owned:
        for name, param in params:
            assert model.get_parameter(name) is param


def test_unit_parameters_assigns_each_param_exactly_once() -> None:
    model = Model()
    plan = _model_plan(ignored=("embed.weight", "layers.1.lin.bias"))
    owned = unit_parameters(plan, model)
    flat = [id(p) for params in owned for _, p in params]
    assert len(flat) == len(set(flat))
    expected = {
        id(p) for name, p in model.named_parameters() if name not in plan.ignored_param_names
    }
    assert set(flat) == expected
    assert _names(owned)[2] == ["layers.1.lin.weight"]
    assert _names(owned)[3] == ["head.weight", "head.bias"]


def test_unit_parameters_respects_unit_ignored_names() -> None:
    model = Model()
    plan = ShardingPlan(
        calls=(
            _call(_unit("layers.0", ignored_param_names=("layers.0.lin.weight",))),
            _call(_unit("", role="root")),
        )
    )
    owned = _names(unit_parameters(plan, model))
    assert "layers.0.lin.weight" not in owned[0]
    # Not ignored by the plan, so the root unit takes it.
    assert "layers.0.lin.weight" in owned[1]


def test_unit_parameters_shared_parameter_goes_to_first_unit() -> None:
    model = Model()
    model.head.weight = model.layers[0].lin.weight  # type: ignore[assignment]
    owned = unit_parameters(_model_plan(), model)
    assert "layers.0.lin.weight" in _names(owned)[1]
    assert all(p is not model.head.weight for _, p in owned[3])


def test_unit_parameters_unknown_path() -> None:
    plan = ShardingPlan(calls=(_call(_unit("nope")),))
    with pytest.raises(AttributeError):
        unit_parameters(plan, Model())
