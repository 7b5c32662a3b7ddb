"""fsdp_core.internals: the only module that reads private FSDP2 state, checked up front.

Units are sharded under the single-process ``fake`` backend (exact collectives,
meaningless numbers).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import Shard

from fsdp_core import (
    FSDPInternalsError,
    ModelParallelizer,
    build_mesh,
    internals,
    mixed_precision_policy,
)
from fsdp_core.accumulation import AccumulationWarmupRuntimeHook, install_unshard_warmup
from fsdp_core.fake_group import fake_process_group
from fsdp_core.forward_agreement import ForwardAgreementRuntimeHook
from fsdp_core.internals import check_internals, torch_modules
from fsdp_core.unused_params import UnusedParamsRuntimeHook, install_unused_params_hook

ALL_HOOKS = {hook.name: hook.reads for hook in ModelParallelizer.HOOKS}


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_process_group(2):
        yield build_mesh()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def sharded(mesh: DeviceMesh) -> Net:
    model = Net()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_everything_the_hooks_need_is_there_on_this_torch(mesh: DeviceMesh) -> None:
    model = sharded(mesh)
    assert internals.missing_internals(model, ALL_HOOKS) == {}
    check_internals(model, ALL_HOOKS)


def test_a_missing_attribute_is_named_with_the_hook_to_switch_off(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = sharded(mesh)
    for unit in internals.distinct_units(model):
        for group in internals.param_groups(unit):
            monkeypatch.delattr(group, "reduce_grads")
    with pytest.raises(FSDPInternalsError) as info:
        check_internals(model, ALL_HOOKS)
    message = str(info.value)
    assert "accumulation_warmup needs FSDPParamGroup.reduce_grads" in message
    assert "forward_agreement needs FSDPParamGroup.reduce_grads" in message
    assert "unused_params needs FSDPParamGroup.reduce_grads" in message
    assert "disabled_hooks=('accumulation_warmup', 'unused_params', 'forward_agreement')" in message
    # Hooks that need none of it are fine.
    check_internals(model, {"reads_nothing": (), "reads_autograd": (internals.GRAPH_TASK,)})
    # The accessors raise the same error instead of guessing a default.
    with pytest.raises(FSDPInternalsError, match=r"FSDPParamGroup\.reduce_grads"):
        internals.reduces_gradients(model)


def test_the_parallelizer_fails_at_apply_time_when_an_internal_was_renamed(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not at the first forward, and not by silently switching the fix off."""
    renamed = internals.Probe("group", "reduce_grads_renamed")
    for hook in (
        AccumulationWarmupRuntimeHook,
        UnusedParamsRuntimeHook,
        ForwardAgreementRuntimeHook,
    ):
        monkeypatch.setattr(
            hook,
            "reads",
            tuple(renamed if p is internals.GROUP_REDUCE else p for p in hook.reads),
        )
    with pytest.raises(FSDPInternalsError, match="reduce_grads_renamed"):
        ModelParallelizer().parallelize(Net(), mesh=mesh)
    # Opting out of the three hooks shards and trains (without what they fix).
    model = Net()
    ModelParallelizer(
        disabled_hooks=("accumulation_warmup", "unused_params", "forward_agreement")
    ).parallelize(model, mesh=mesh)
    model(torch.randn(2, 4)).sum().backward()


def test_hooks_work_on_a_unit_with_two_parameter_groups(mesh: DeviceMesh) -> None:
    """Per-parameter meshes give a unit several groups; FSDP's single-group accessor then
    raises, which would have crashed every forward of the accumulation fix."""
    other = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu", mesh_dim_names=("expert",))
    info = FSDPMeshInfo(other, shard_mesh_dim=0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    expert = model[1].weight

    def place(param: nn.Parameter) -> ShardPlacementResult | None:
        return ShardPlacementResult(Shard(0), info) if param is expert else None

    fully_shard(model, mesh=mesh, shard_placement_fn=place, mp_policy=mixed_precision_policy())
    assert len(internals.param_groups(model)) == 2  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="at most 1 param group"):
        _ = model._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
    install_unshard_warmup(model)
    install_unused_params_hook(model, mesh=mesh)
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    model(torch.randn(2, 4)).sum().backward()
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_in_backward_and_the_end_of_backward_callback() -> None:
    seen: list[str] = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(f"hook in_backward={internals.in_backward()}")
        internals.queue_end_of_backward(lambda: seen.append("end"))
        return grad

    y = (x * 2).sum()
    y.register_hook(hook)
    assert internals.in_backward() is False
    y.backward()
    assert seen == ["hook in_backward=True", "end"]


# That no other module reads private torch is checked for every package by
# tests/test_private_torch_access.py (from the sources' syntax trees).


def test_private_torch_modules_come_through_internals() -> None:
    assert torch_modules.has_fake_store()
    assert internals.fsdp_state_module() is not None
    assert internals.has_grouped_forward_hooks()
    assert internals.casts_per_grouped_module()
    assert internals.tracks_grouped_passes()
    assert issubclass(internals.TorchDispatchMode, object)
    tracker = torch_modules.fsdp_mem_tracker_class(("track_inputs",), user="this test")
    assert tracker.__name__ == "FSDPMemTracker"
    with pytest.raises(FSDPInternalsError, match=r"lacks \['no_such_hook'\], which this test"):
        torch_modules.fsdp_mem_tracker_class(("no_such_hook",), user="this test")


def test_a_torch_without_the_fake_store_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)
    assert not torch_modules.has_fake_store()
    with pytest.raises(FSDPInternalsError, match="FakeStore"):
        torch_modules.fake_store()
    with pytest.raises(FSDPInternalsError, match="FakeStore"), fake_process_group(2):
        pass
    assert not dist.is_initialized()
