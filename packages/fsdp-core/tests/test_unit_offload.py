"""A plan's per-unit offload (``UnitPlan.offload_policy``): printed, run through the one
sharding path unit by unit, and never mixed with ``offload_policy=`` for every unit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy

from fsdp_core import build_mesh, internals
from fsdp_core.fake_group import fake_process_group
from fsdp_core.plan import ShardCall, ShardingPlan, UnitPlan, format_offload
from fsdp_core.shard_calls import call_units
from fsdp_core.sharding import shard_units

NO_MP = MixedPrecisionPolicy()
CPU = CPUOffloadPolicy(pin_memory=False)


@pytest.fixture
def mesh2() -> Iterator[DeviceMesh]:
    with fake_process_group(2):
        yield build_mesh()


def call(path: str, offload: CPUOffloadPolicy | None) -> ShardCall:
    unit = UnitPlan(paths=(path,), mp_policy=NO_MP, offload_policy=offload)
    return ShardCall(
        paths=(path,),
        mp_policy=NO_MP,
        reshard_after_forward=None,
        ignored_param_names=(),
        units=(unit,),
        offload_policy=offload,
    )


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def offload_of(module: nn.Module) -> object:
    assert isinstance(module, FSDPModule)
    (group,) = internals.param_groups(module)
    return group.offload_policy


def test_format_offload() -> None:
    assert format_offload(CPUOffloadPolicy()) == "cpu"
    assert format_offload(CPU) == "cpu(unpinned)"


def test_the_plan_prints_each_units_offload() -> None:
    plan = ShardingPlan(calls=(call("0", CPU), call("", None)))
    lines = plan.format().splitlines()
    assert "offload=cpu(unpinned)" in lines[1]
    assert "offload" not in lines[2]


def test_each_call_is_offloaded_as_it_says(mesh2: DeviceMesh) -> None:
    net = model()
    shard_units(call_units(net, [call("0", CPU), call("", None)], mesh=mesh2))
    assert isinstance(offload_of(net[0]), CPUOffloadPolicy)
    assert not isinstance(offload_of(net), CPUOffloadPolicy)


def test_offload_for_every_unit_still_offloads_every_unit(mesh2: DeviceMesh) -> None:
    net = model()
    shard_units(call_units(net, [call("0", None), call("", None)], mesh=mesh2, offload_policy=CPU))
    assert isinstance(offload_of(net[0]), CPUOffloadPolicy)
    assert isinstance(offload_of(net), CPUOffloadPolicy)


def test_both_at_once_are_refused_before_any_unit(mesh2: DeviceMesh) -> None:
    net = model()
    with pytest.raises(ValueError, match=r"plan already offloads 1 of its calls \('0'\)"):
        shard_units(
            call_units(net, [call("0", CPU), call("", None)], mesh=mesh2, offload_policy=CPU)
        )
    assert not any(isinstance(m, FSDPModule) for m in net.modules())
