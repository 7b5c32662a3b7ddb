"""Every remedy an fsdp_core error message proposes works, in the configuration that
raised it: trigger the message, apply what it proposes, and check the call then works.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import (
    MixedDtypeError,
    ModelParallelizer,
    PlanMismatchError,
    build_mesh,
    compat,
    destroy_distributed,
    init_distributed,
)
from fsdp_core.dtype_units import group_islands
from fsdp_core.fake_group import fake_process_group
from fsdp_core.hf import load_pretrained
from fsdp_core.plan import ShardCall, ShardingPlan
from fsdp_core.plan_context import PlanContext
from fsdp_core.sharding import apply_fully_shard
from fsdp_core.testing import TORCHRUN_ENV

safetensors_torch = pytest.importorskip("safetensors.torch")

BF16, FP32 = torch.bfloat16, torch.float32
DIM = 8


@pytest.fixture
def fake2() -> Iterator[None]:
    with fake_process_group(2):
        yield


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM, dtype=FP32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(x.dtype)


class Scaled(nn.Module):
    """bf16 layers and an fp32 ``scale`` held directly by the root (or by a submodule)."""

    def __init__(self, *, in_submodule: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)]).to(BF16)
        self.head = nn.Linear(DIM, 2).to(BF16)
        self.holder: Holder | None = None
        if in_submodule:
            self.holder = Holder()
        else:
            self.scale = nn.Parameter(torch.ones(DIM, dtype=FP32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if isinstance(self.holder, Holder):
            return self.head(self.holder(x))
        return self.head(x * self.scale.to(x.dtype))


def trains(model: nn.Module) -> None:
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    model(torch.randn(2, DIM, dtype=BF16)).float().sum().backward()


# --- MixedDtypeError: "Move them into a submodule, cast them to one dtype, or freeze them" ----


def test_mixed_dtype_remedies(fake2: None) -> None:
    with pytest.raises(MixedDtypeError) as info:
        ModelParallelizer().plan(Scaled())
    message = str(info.value)
    assert "Move them into a submodule, cast them to one dtype, or freeze them" in message
    trains(Scaled(in_submodule=True))  # moved into a submodule: an fp32 island unit
    cast = Scaled()
    cast.scale.data = cast.scale.data.to(BF16)
    trains(cast)
    frozen = Scaled()
    frozen.scale.requires_grad_(False)
    trains(frozen)


# --- PlanMismatchError: "Plan every unit ... so that applying the plan makes only those" ----


class HeadInShard(ModelParallelizer):
    """Makes a unit the plan does not list: the head, before the plan's units."""

    def _before_apply(self, model: nn.Module, plan: ShardingPlan, *, mesh: DeviceMesh) -> None:
        assert isinstance(model, Scaled)
        apply_fully_shard(model.head, mesh=mesh, mp_policy=plan.calls[-1].mp_policy)


class HeadPlanned(ModelParallelizer):
    """The remedy: the head planned as a unit, applied as planned."""

    def _units(self, ctx: PlanContext) -> list[str | ShardCall]:
        return ["head", *super()._units(ctx)]


def test_plan_mismatch_remedy(fake2: None) -> None:
    model = Scaled(in_submodule=True)
    with pytest.raises(PlanMismatchError, match=r"_units or _plan_calls"):
        HeadInShard().parallelize(model, mesh=build_mesh())
    model = Scaled(in_submodule=True)
    plan = HeadPlanned().plan(model)
    assert "head" in plan.unit_labels()
    HeadPlanned().apply_plan(model, plan, mesh=build_mesh())
    model(torch.randn(2, DIM, dtype=BF16)).float().sum().backward()


# --- group_islands: "pass grouped=False" -------------------------------------------------------


def test_grouped_islands_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_core.dtype_units import DtypeIsland

    islands = [DtypeIsland("a", FP32), DtypeIsland("b", FP32)]
    monkeypatch.setattr(compat, "GROUPED_PER_MODULE_CASTING", False)
    with pytest.raises(ValueError, match="pass grouped=False"):
        group_islands(islands, grouped=True)
    assert group_islands(islands, grouped=False) == [(FP32, ("a",)), (FP32, ("b",))]


# --- load_pretrained: "pass key_mapping= ... or strict=False" ----------------------------------


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 2)


def write(directory: Path, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True)
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors")
    )
    return directory


def test_renamed_keys_remedies(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = Small()
    state = {f"backbone.{k}": v.clone() for k, v in saved.state_dict().items()}
    directory = write(tmp_path / "renamed", state)
    with pytest.raises(ValueError, match="pass key_mapping=") as info:
        load_pretrained(Small(), directory)
    assert "strict=False" in str(info.value)
    model = Small()
    load_pretrained(model, directory, key_mapping=lambda name: f"backbone.{name}")
    assert torch.equal(model.body.weight, saved.body.weight)
    report = load_pretrained(Small(), directory, strict=False)
    assert len(report.missing) == 4


def test_missing_keys_advise_strict_false_only(tmp_path: Path) -> None:
    """key_mapping cannot bring back a tensor the checkpoint lacks: not proposed."""
    torch.manual_seed(0)
    saved = Small()
    state = {k: v.clone() for k, v in saved.state_dict().items() if not k.startswith("head.")}
    directory = write(tmp_path / "partial", state)
    with pytest.raises(ValueError, match="strict=False") as info:
        load_pretrained(Small(), directory)
    assert "key_mapping" not in str(info.value).split("; ")[-1]
    model = Small()
    report = load_pretrained(model, directory, strict=False)
    assert report.missing == ("head.weight", "head.bias")
    assert torch.equal(model.body.weight, saved.body.weight)


# --- load_pretrained: "pass buffers={name: tensor}" -------------------------------------------


class WithRotary(Small):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


def test_meta_buffer_remedy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    directory = write(tmp_path / "ckpt", {k: v.clone() for k, v in Small().state_dict().items()})
    with torch.device("meta"):
        model = WithRotary()
    with pytest.raises(ValueError, match=r"pass buffers=\{name: tensor\}"):
        load_pretrained(model, directory)
    with torch.device("meta"):
        model = WithRotary()
    load_pretrained(model, directory, buffers={"inv_freq": torch.arange(4.0)})
    assert torch.equal(model.inv_freq, torch.arange(4.0))


# --- process groups and meshes ----------------------------------------------------------------


def test_mesh_without_a_process_group_remedy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_ENV:  # a one-process group, as under plain ``python``
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match=r"call init_distributed\(\) first"):
        build_mesh()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA, which is not available; use 'gloo'"):
            init_distributed(backend="nccl")
    init_distributed(backend="gloo")
    try:
        assert build_mesh().mesh_dim_names == ("dp_shard",)
        with pytest.raises(ValueError, match=r"call destroy_distributed\(\) first"):
            init_distributed(backend="fake")
        with pytest.raises(ValueError, match=r"pass 'cpu' or None"):
            build_mesh(device_type="cuda")
        assert build_mesh(device_type="cpu").device_type == "cpu"
    finally:
        destroy_distributed()
    init_distributed(backend="fake")
    destroy_distributed()
