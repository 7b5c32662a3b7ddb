"""fsdp_core.parallelizer: planning without a process group, applying under the fake one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_core.sharding
from fsdp_core.parallelizer import ModelParallelizer, parameter_names
from fsdp_core.plan import ShardCall, ShardingPlan, UnitPlan, unit_parameters
from fsdp_core.plan_context import PlanContext
from fsdp_core.precision import default_mp_policy, fp32_island_policy

BF16, FP32 = torch.bfloat16, torch.float32
DIM = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    """Layers in a list, towers in a dict (one a nested list), a parameter-free list."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.towers = nn.ModuleDict({"a": nn.ModuleList([Block()]), "b": Block()})
        self.acts = nn.ModuleList([nn.ReLU()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        h = self.towers["a"][0](h) + self.towers["b"](h)
        return self.head(self.norm(self.acts[0](h)))


LAYER_PATHS = ["layers.0", "layers.1", "towers.a.0", "towers.b"]


def _mixed(model: nn.Module) -> nn.Module:
    """bf16 model with fp32 LayerNorms."""
    model.to(BF16)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.float()
    return model


def _run(model: nn.Module) -> torch.Tensor:
    out = model(torch.randn(2, DIM))
    out.float().sum().backward()
    return out


def _call_paths(plan: ShardingPlan) -> list[tuple[str, ...]]:
    return [call.paths for call in plan.calls]


# parameter_names ---------------------------------------------------------------------------------


def test_parameter_names() -> None:
    model = Model()
    assert parameter_names(model, None) == ()
    assert parameter_names(model, set()) == ()
    # Model order, whatever the input order.
    params = [model.head.bias, model.embed.weight]
    assert parameter_names(model, params) == ("embed.weight", "head.bias")


def test_parameter_names_refuses_foreign_params() -> None:
    model = Model()
    foreign = {nn.Linear(1, 1).weight, nn.Linear(1, 1).bias, model.head.bias}
    with pytest.raises(
        ValueError, match=r"2 of the ignored_params are not parameters of the model"
    ):
        parameter_names(model, foreign)


# PlanContext -------------------------------------------------------------------------------------


def _ctx(model: nn.Module, ignored: frozenset[str] = frozenset()) -> PlanContext:
    return PlanContext(
        model=model, mp_policy=MixedPrecisionPolicy(), reshard_after_forward=None,
        ignored_param_names=ignored, found=None,
    )  # fmt: skip


def test_plan_context_marks_and_modules() -> None:
    model = Model()
    ctx = _ctx(model)
    assert ctx.module("") is model
    assert ctx.module("layers.1.attn") is model.layers[1].attn
    assert not ctx.is_planned(model.layers[0])
    ctx.mark(["layers.0", ""])
    assert ctx.is_planned(model.layers[0])
    assert ctx.is_planned(model)
    assert not ctx.is_planned(model.layers[1])


def test_plan_context_ignored_under() -> None:
    names = frozenset({"layers.1.attn.weight", "layers.10.attn.weight", "head.bias"})
    ctx = _ctx(Model(), names)
    assert ctx.ignored_under([""]) == tuple(sorted(names))
    assert ctx.ignored_under(["layers.1"]) == ("layers.1.attn.weight",)
    assert ctx.ignored_under(["layers.1", "head"]) == ("head.bias", "layers.1.attn.weight")
    assert ctx.ignored_under(["layers.0"]) == ()


def test_plan_context_has_unplanned_params() -> None:
    model = Model()
    ignored = frozenset(name for name, _ in model.layers[1].named_parameters(prefix="layers.1"))
    ctx = _ctx(model, ignored)
    assert ctx.has_unplanned_params("layers.0")
    assert not ctx.has_unplanned_params("layers.1")  # everything ignored
    assert not ctx.has_unplanned_params("acts.0")  # no parameters
    ctx.mark(["layers.0.norm1", "layers.0.attn", "layers.0.norm2"])
    assert ctx.has_unplanned_params("layers.0")
    ctx.mark(["layers.0.mlp"])
    assert not ctx.has_unplanned_params("layers.0")
    assert ctx.has_unplanned_params("")


# plan(): mesh-free, side-effect free -------------------------------------------------------------


def test_plan_units_per_container_item_then_root() -> None:
    model = Model()
    before = {name: p for name, p in model.named_parameters()}
    plan = ModelParallelizer().plan(model)
    assert not dist.is_initialized()
    assert _call_paths(plan) == [(p,) for p in LAYER_PATHS] + [("",)]
    assert plan.unit_labels() == [*LAYER_PATHS, "<root>"]
    assert plan.role_counts() == {"layer": 4, "root": 1}
    assert plan.units[-1].is_root
    assert all(unit.mp_policy == MixedPrecisionPolicy() for unit in plan.units)
    assert plan.ignored_param_names == ()
    assert plan.replicated_param_names == ()
    assert plan.notes == ()
    # Planning touched nothing.
    assert dict(model.named_parameters()) == before
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


def test_plan_is_deterministic() -> None:
    model = _mixed(Model())
    parallelizer = ModelParallelizer()
    assert parallelizer.plan(model) == parallelizer.plan(model)


def test_plan_skips_items_without_parameters() -> None:
    plan = ModelParallelizer().plan(Model())
    assert not any(path.startswith("acts") for call in plan.calls for path in call.paths)


def test_plan_passes_policy_and_reshard() -> None:
    policy = default_mp_policy()
    plan = ModelParallelizer(dtype_safe=False).plan(
        Model(), mp_policy=policy, reshard_after_forward=3
    )
    for unit in plan.units:
        assert unit.mp_policy is policy
        assert unit.reshard_after_forward == 3
    for call in plan.calls:
        assert call.reshard_after_forward == 3
        assert call.mp_policy is policy
        assert len(call.units) == 1
        assert not call.is_group


def test_plan_units_own_every_parameter_once() -> None:
    model = _mixed(Model())
    ignored = {model.layers[1].attn.weight, model.head.bias}
    plan = ModelParallelizer().plan(model, ignored_params=ignored)
    owned = unit_parameters(plan, model)
    flat = [id(p) for params in owned for _, p in params]
    assert len(flat) == len(set(flat))
    assert set(flat) == {id(p) for p in model.parameters() if p not in ignored}
    assert all(params for params in owned[:-1])  # only the root may be empty


def test_plan_ignored_params_appear_in_every_owning_call() -> None:
    model = Model()
    ignored = {model.layers[1].attn.weight, model.head.bias}
    plan = ModelParallelizer(dtype_safe=False).plan(model, ignored_params=ignored)
    assert plan.ignored_param_names == ("head.bias", "layers.1.attn.weight")
    by_path = {call.paths: call for call in plan.calls}
    assert by_path[("layers.1",)].ignored_param_names == ("layers.1.attn.weight",)
    assert by_path[("layers.0",)].ignored_param_names == ()
    assert by_path[("towers.b",)].ignored_param_names == ()
    assert by_path[("",)].ignored_param_names == ("head.bias", "layers.1.attn.weight")
    for call in plan.calls:
        for unit in call.units:
            assert unit.ignored_param_names == call.ignored_param_names


def test_plan_ignored_params_inside_an_island() -> None:
    model = _mixed(Model())
    plan = ModelParallelizer().plan(model, ignored_params={model.layers[0].norm2.bias})
    island = plan.calls[0]
    assert island.paths == ("layers.0.norm1", "layers.0.norm2")
    assert island.ignored_param_names == ("layers.0.norm2.bias",)
    assert plan.calls[1].ignored_param_names == ("layers.0.norm2.bias",)


def test_plan_item_with_only_ignored_params_is_skipped() -> None:
    model = Model()
    ignored = set(model.towers["b"].parameters())
    plan = ModelParallelizer().plan(model, ignored_params=ignored)
    assert ("towers.b",) not in _call_paths(plan)
    assert len(plan.calls[-1].ignored_param_names) == 8
    assert len(plan.ignored_param_names) == 8


def test_plan_refuses_foreign_ignored_params() -> None:
    with pytest.raises(
        ValueError, match=r"1 of the ignored_params are not parameters of the model"
    ):
        ModelParallelizer().plan(Model(), ignored_params={nn.Linear(2, 2).weight})


def test_plan_bad_inputs() -> None:
    parallelizer = ModelParallelizer()
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got dict"):
        parallelizer.plan({})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"mp_policy must be a MixedPrecisionPolicy, got str"):
        parallelizer.plan(Model(), mp_policy="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"reshard_after_forward=0 must be a positive divisor"):
        parallelizer.plan(Model(), reshard_after_forward=0)
    with pytest.raises(TypeError, match=r"reshard_after_forward must be a bool, an int or None"):
        parallelizer.plan(Model(), reshard_after_forward=2.0)  # type: ignore[arg-type]


def test_dtype_safe_must_be_bool() -> None:
    with pytest.raises(TypeError, match=r"dtype_safe must be a bool, got 1"):
        ModelParallelizer(dtype_safe=1)  # type: ignore[arg-type]
    assert ModelParallelizer().dtype_safe is True


def test_plan_dtype_islands_come_first() -> None:
    model = _mixed(Model())
    plan = ModelParallelizer().plan(model, mp_policy=default_mp_policy(), reshard_after_forward=2)
    assert _call_paths(plan) == [
        ("layers.0.norm1", "layers.0.norm2"),
        ("layers.0",),
        ("layers.1.norm1", "layers.1.norm2"),
        ("layers.1",),
        ("towers.a.0.norm1", "towers.a.0.norm2"),
        ("towers.a.0",),
        ("towers.b.norm1", "towers.b.norm2"),
        ("towers.b",),
        ("norm",),
        ("",),
    ]
    assert plan.role_counts() == {"dtype_island": 5, "layer": 4, "root": 1}
    island = plan.calls[0]
    assert island.is_group
    assert island.units[0].role == "dtype_island"
    assert island.units[0].label == "layers[2 modules]"
    assert island.mp_policy == fp32_island_policy(default_mp_policy())
    assert island.reshard_after_forward == 2  # islands follow the caller's setting
    assert plan.calls[1].reshard_after_forward == 2


def test_plan_islands_not_grouped_without_torch_support(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_core import compat

    monkeypatch.setattr(compat, "GROUPED_PER_MODULE_CASTING", False)
    plan = ModelParallelizer().plan(_mixed(Model()))
    assert _call_paths(plan)[:3] == [("layers.0.norm1",), ("layers.0.norm2",), ("layers.0",)]


def test_plan_dtype_safe_false_skips_islands() -> None:
    plan = ModelParallelizer(dtype_safe=False).plan(_mixed(Model()))
    assert _call_paths(plan) == [(p,) for p in LAYER_PATHS] + [("",)]
    assert "dtype_island" not in plan.role_counts()


# hooks for subclasses ----------------------------------------------------------------------------


class SharedFirst(ModelParallelizer):
    """Plans ``towers.b`` before every layer and ignores ``embed`` entirely."""

    def __init__(self) -> None:
        super().__init__()
        self.before_apply: list[ShardingPlan] = []

    def _units(self, ctx: PlanContext) -> list[str | ShardCall]:
        shared = self._make_call(
            ("towers.b",), ctx, mp_policy=ctx.mp_policy, reshard_after_forward=False,
            role="shared",
        )  # fmt: skip
        return [shared, *super()._units(ctx)]

    def _ignored_param_names(self, model: nn.Module, names: tuple[str, ...]) -> list[str]:
        return [*names, "embed.weight", "embed.bias"]

    def _plan_notes(self, ctx: PlanContext) -> list[str]:
        return [f"{len(ctx.ignored_param_names)} ignored"]

    def _before_apply(self, model: nn.Module, plan: ShardingPlan, *, mesh: DeviceMesh) -> None:
        self.before_apply.append(plan)


def test_planning_hooks() -> None:
    plan = SharedFirst().plan(Model(), ignored_params=None)
    assert _call_paths(plan) == [
        ("towers.b",),
        ("layers.0",),
        ("layers.1",),
        ("towers.a.0",),
        ("",),
    ]
    assert plan.calls[0].units[0].role == "shared"
    assert plan.calls[0].reshard_after_forward is False
    assert plan.ignored_param_names == ("embed.bias", "embed.weight")
    assert plan.notes == ("2 ignored",)
    assert "note: 2 ignored" in plan.format()


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class EncoderModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class EncoderFirst(ModelParallelizer):
    """A leading call that makes an ancestor of layer items one unit."""

    def _units(self, ctx: PlanContext) -> list[str | ShardCall]:
        shared = self._make_call(
            ("encoder",), ctx, mp_policy=ctx.mp_policy, reshard_after_forward=None,
            role="shared",
        )  # fmt: skip
        return [shared, *super()._units(ctx)]


def test_plan_skips_items_under_a_planned_ancestor() -> None:
    model = EncoderModel()
    plan = EncoderFirst().plan(model)
    owned = unit_parameters(plan, model)
    assert all(params for params in owned[:-1]), plan.format(model)
    assert _call_paths(plan) == [("encoder",), ("",)]


def test_make_call_with_explicit_units() -> None:
    model = Model()
    ctx = _ctx(model)
    units = (
        UnitPlan(paths=("layers.0",), mp_policy=ctx.mp_policy),
        UnitPlan(paths=("layers.1",), mp_policy=ctx.mp_policy),
    )
    call = ModelParallelizer()._make_call(
        ("layers",), ctx, mp_policy=ctx.mp_policy, reshard_after_forward=None, role="x",
        units=units,
    )  # fmt: skip
    assert call.units == units
    assert ctx.is_planned(model.layers)
    assert ctx.is_planned(model.layers[0])
    assert ctx.is_planned(model.layers[1])


def test_units_override() -> None:
    class OnlyLayers(ModelParallelizer):
        def _units(self, ctx: PlanContext) -> list[str | ShardCall]:
            return ["layers"]

    plan = OnlyLayers(dtype_safe=False).plan(Model())
    assert _call_paths(plan) == [("layers",), ("",)]


# apply_plan / parallelize under the fake process group -------------------------------------------


Recorded = list[tuple[object, dict[str, object]]]


@pytest.fixture
def fully_shard_calls(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    """Every call of torch's ``fully_shard`` (where the library calls it): target, options."""
    calls: Recorded = []
    real = fsdp_core.sharding.fully_shard

    def recording(target: object, **kwargs: object) -> object:
        calls.append((target, kwargs))
        return real(target, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(fsdp_core.sharding, "fully_shard", recording)
    return calls


def test_parallelize_hsdp_shards_every_unit(
    hsdp_mesh: DeviceMesh, fully_shard_calls: Recorded
) -> None:
    model = _mixed(Model())
    parallelizer = ModelParallelizer()
    plan = parallelizer.plan(model, mp_policy=default_mp_policy())
    result = parallelizer.parallelize(model, mesh=hsdp_mesh, mp_policy=default_mp_policy())
    assert result is model
    # Every call of the plan reached fully_shard, in order, with its own options.
    assert len(fully_shard_calls) == len(plan.calls)
    for (target, kwargs), call in zip(fully_shard_calls, plan.calls, strict=True):
        members = list(target) if isinstance(target, list) else [target]
        assert members == [model.get_submodule(p) for p in call.paths]
        assert kwargs["mesh"] is hsdp_mesh
        assert kwargs["mp_policy"] == call.mp_policy
        assert kwargs["reshard_after_forward"] == call.reshard_after_forward
        assert "ignored_params" not in kwargs
        assert type(kwargs["offload_policy"]) is OffloadPolicy  # no offload
    for unit in plan.units:
        for path in unit.paths:
            assert isinstance(model.get_submodule(path), FSDPModule), path
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.device_mesh == hsdp_mesh, name
        assert param.placements == (Replicate(), Shard(0)), name
    out = _run(model)
    assert out.dtype is BF16
    assert all(p.grad is not None for p in model.parameters())


def test_parallelize_1d_mesh_with_ignored_params(
    mesh4: DeviceMesh, fully_shard_calls: Recorded
) -> None:
    model = Model()
    ignored = {model.layers[1].attn.weight, model.head.bias}
    parallelizer = ModelParallelizer()
    parallelizer.parallelize(model, mesh=mesh4, ignored_params=ignored, reshard_after_forward=2)
    by_members = {
        tuple(id(m) for m in (t if isinstance(t, list) else [t])): kw for t, kw in fully_shard_calls
    }
    assert by_members[(id(model.layers[1]),)]["ignored_params"] == {model.layers[1].attn.weight}
    assert by_members[(id(model),)]["ignored_params"] == ignored
    assert by_members[(id(model.layers[0]),)].get("ignored_params") is None
    for name, param in model.named_parameters():
        if param in ignored:
            assert not isinstance(param, DTensor), name
        else:
            assert isinstance(param, DTensor), name
            assert param.device_mesh == mesh4
            assert param.placements == (Shard(0),)
    _run(model)


def test_parallelize_island_policies(mesh4: DeviceMesh) -> None:
    model = _mixed(Model())
    ModelParallelizer().parallelize(model, mesh=mesh4, mp_policy=default_mp_policy())
    layer = model.layers[0]
    assert isinstance(layer.norm1, FSDPModule)
    assert layer.norm1._get_fsdp_state() is layer.norm2._get_fsdp_state()
    param_group = layer.norm1._get_fsdp_state()._fsdp_param_group
    assert param_group is not None
    assert param_group.mp_policy == fp32_island_policy(default_mp_policy())
    assert model.layers[0].norm1.weight.dtype is FP32
    assert model.layers[0].attn.weight.dtype is BF16
    assert _run(model).dtype is BF16


def test_parallelize_dtype_unsafe_fails_at_forward(mesh4: DeviceMesh) -> None:
    model = _mixed(Model())
    ModelParallelizer(dtype_safe=False).parallelize(
        model, mesh=mesh4, mp_policy=default_mp_policy()
    )
    with pytest.raises(AssertionError, match=r"FSDP expects uniform original parameter dtype"):
        model(torch.randn(2, DIM))


def test_parallelize_checks_reshard_against_the_mesh(hsdp_mesh: DeviceMesh) -> None:
    model = Model()
    with pytest.raises(ValueError, match=r"reshard_after_forward=4 must be a positive divisor"):
        ModelParallelizer().parallelize(model, mesh=hsdp_mesh, reshard_after_forward=4)
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


def test_parallelize_bad_mesh() -> None:
    with pytest.raises(TypeError, match=r"mesh must be a DeviceMesh, got str"):
        ModelParallelizer().parallelize(Model(), mesh="cpu")  # type: ignore[arg-type]


def test_apply_plan_bad_plan(mesh4: DeviceMesh) -> None:
    with pytest.raises(TypeError, match=r"plan must be a ShardingPlan, got list"):
        ModelParallelizer().apply_plan(Model(), [], mesh=mesh4)  # type: ignore[arg-type]


def test_apply_plan_runs_before_apply_once_and_uses_hooks(mesh4: DeviceMesh) -> None:
    model = Model()
    parallelizer = SharedFirst()
    plan = parallelizer.plan(model)
    assert parallelizer.apply_plan(model, plan, mesh=mesh4) is model
    assert parallelizer.before_apply == [plan]
    assert isinstance(model.towers["b"], FSDPModule)
    assert not isinstance(model.embed.weight, DTensor)
    assert isinstance(model.head.weight, DTensor)
    _run(model)


# ------------------------------------------------------------- applied units = plan
class _ExtraUnit(ModelParallelizer):
    """Makes a unit the plan does not list: what the apply-time check refuses."""

    def _before_apply(self, model: nn.Module, plan: ShardingPlan, *, mesh: DeviceMesh) -> None:
        assert isinstance(model, nn.Sequential)
        self._fully_shard_module(model[0], mesh=mesh, mp_policy=MixedPrecisionPolicy())


def test_applied_units_equal_the_plan(mesh2: DeviceMesh) -> None:
    from fsdp_core.internals import applied_unit_paths

    model = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    plan = ModelParallelizer().plan(model)
    ModelParallelizer().apply_plan(model, plan, mesh=mesh2)
    assert sorted(applied_unit_paths(model)) == sorted(u.paths for u in plan.units)
    assert sorted(applied_unit_paths(model)) == [("",), ("1.0",), ("1.1",)]


def test_a_unit_made_outside_the_plan_is_refused(mesh2: DeviceMesh) -> None:
    from fsdp_core import PlanMismatchError

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    parallelizer = _ExtraUnit()
    plan = parallelizer.plan(model)
    with pytest.raises(
        PlanMismatchError, match=r"made but not planned \['0'\].*_units or _plan_calls"
    ):
        parallelizer.apply_plan(model, plan, mesh=mesh2)


@pytest.mark.parametrize(
    "change",
    [
        {"replicated_param_names": ("0.weight",)},
        {"replicated_param_names": ("0.weight",), "sync_replicated": False},
        {
            "replicated_param_names": ("0.weight",),
            "replicated_param_dtypes": (("0.weight", torch.bfloat16),),
        },
    ],
)
def test_the_plan_digest_covers_what_changes_apply(change: dict[str, object]) -> None:
    """apply_plan's ranks agree on the plan's digest before acting: every field that
    changes what apply does (which parameters are replicated, whether they are
    broadcast, their dtype) must change the digest, or ranks holding different plans
    would go on and meet in different collectives (a broadcast on some ranks only)."""
    import dataclasses

    from fsdp_core.parallelizer import _plan_digest

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = ModelParallelizer().plan(model)
    base = dataclasses.replace(plan, replicated_param_names=("0.weight",))
    other = dataclasses.replace(plan, **change)  # type: ignore[arg-type]
    reference = base if "replicated_param_names" in change and len(change) > 1 else plan
    assert _plan_digest(other) != _plan_digest(reference)
    assert _plan_digest(other) == _plan_digest(dataclasses.replace(other))
