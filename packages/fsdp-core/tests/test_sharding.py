"""fsdp_core.sharding: the checked call site of ``fully_shard``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_core import compat, sharding
from fsdp_core.precision import default_mp_policy
from fsdp_core.sharding import (
    apply_fully_shard,
    check_reshard_after_forward,
    is_sharded,
    owned_ignored_params,
    shard_group_size,
)

NO_MP = MixedPrecisionPolicy()


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def _forward_backward(model: nn.Module, dim: int = 8) -> torch.Tensor:
    out = model(torch.randn(2, dim))
    out.float().sum().backward()
    return out


# pure helpers ------------------------------------------------------------------------------------


def test_owned_ignored_params_none_when_empty() -> None:
    model = _mlp()
    assert owned_ignored_params([model], None) is None
    assert owned_ignored_params([model], set()) is None
    assert owned_ignored_params([model], []) is None


def test_owned_ignored_params_none_when_not_owned() -> None:
    model, other = _mlp(), nn.Linear(2, 2)
    assert owned_ignored_params([model], {other.weight}) is None


def test_owned_ignored_params_keeps_only_owned() -> None:
    model, other = _mlp(), nn.Linear(2, 2)
    ignored = {model[0].weight, model[2].bias, other.weight}
    assert owned_ignored_params([model[0]], ignored) == {model[0].weight}
    assert owned_ignored_params([model[0], model[2]], ignored) == {
        model[0].weight,
        model[2].bias,
    }
    # Any iterable works, e.g. a generator.
    assert owned_ignored_params([model], (p for p in ignored)) == {
        model[0].weight,
        model[2].bias,
    }


def test_is_sharded_before_and_after(mesh2: DeviceMesh) -> None:
    model = _mlp()
    assert not is_sharded(model)
    apply_fully_shard(model, mesh=mesh2, mp_policy=NO_MP)
    assert is_sharded(model)
    assert isinstance(model, FSDPModule)
    assert not is_sharded(model[0])


def test_shard_group_size(fake_pg4: None) -> None:
    from fsdp_core.mesh import build_mesh

    assert shard_group_size(build_mesh()) == 4
    assert shard_group_size(build_mesh(dp_replicate=2)) == 2
    assert shard_group_size(build_mesh(dp_replicate=4)) == 1


@pytest.mark.parametrize("value", [None, True, False, 1, 2, 4])
def test_check_reshard_after_forward_accepts(value: object) -> None:
    check_reshard_after_forward(value, 4)


@pytest.mark.parametrize("value", [3, 8, 0, -1, -2])
def test_check_reshard_after_forward_refuses_bad_ints(value: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"reshard_after_forward={value} must be a positive divisor of the shard "
        r"group size 4 \(or True/False/None\)",
    ):
        check_reshard_after_forward(value, 4)


@pytest.mark.parametrize("value", [2.0, "2", [2]])
def test_check_reshard_after_forward_refuses_other_types(value: object) -> None:
    with pytest.raises(
        TypeError, match=r"reshard_after_forward must be a bool, an int or None, got "
    ):
        check_reshard_after_forward(value, 4)


def test_usable_offload() -> None:
    assert type(sharding._usable_offload(None)) is OffloadPolicy
    unpinned = CPUOffloadPolicy(pin_memory=False)
    assert sharding._usable_offload(unpinned) is unpinned
    with pytest.raises(TypeError, match=r"offload_policy must be an OffloadPolicy, got str"):
        sharding._usable_offload("cpu")  # type: ignore[arg-type]


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the no-accelerator path")
def test_usable_offload_drops_pinning_without_accelerator() -> None:
    policy = sharding._usable_offload(CPUOffloadPolicy(pin_memory=True))
    assert isinstance(policy, CPUOffloadPolicy)
    assert policy.pin_memory is False


# apply_fully_shard: refusals before any state changes --------------------------------------------


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        ("layer", TypeError, r"expected an nn.Module or a sequence of them, got str"),
        (b"layer", TypeError, r"expected an nn.Module or a sequence of them, got bytes"),
        (5, TypeError, r"expected an nn.Module or a sequence of them, got int"),
        ({nn.Linear(2, 2)}, TypeError, r"expected an nn.Module or a sequence of them, got set"),
        ([], ValueError, r"cannot shard an empty group of modules"),
        ((), ValueError, r"cannot shard an empty group of modules"),
        ([nn.Linear(2, 2), "x"], TypeError, r"group members must be nn.Module, got str"),
    ],
)
def test_apply_fully_shard_bad_targets(
    mesh2: DeviceMesh, target: object, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        apply_fully_shard(target, mesh=mesh2, mp_policy=NO_MP)  # type: ignore[arg-type]


def test_apply_fully_shard_bad_mesh(fake_pg2: None) -> None:
    model = _mlp()
    with pytest.raises(TypeError, match=r"mesh must be a DeviceMesh, got NoneType"):
        apply_fully_shard(model, mesh=None, mp_policy=NO_MP)  # type: ignore[arg-type]
    assert not is_sharded(model)


def test_apply_fully_shard_bad_policy(mesh2: DeviceMesh) -> None:
    model = _mlp()
    with pytest.raises(TypeError, match=r"mp_policy must be a MixedPrecisionPolicy, got str"):
        apply_fully_shard(model, mesh=mesh2, mp_policy="bf16")  # type: ignore[arg-type]
    assert not is_sharded(model)


def test_apply_fully_shard_bad_offload_policy(mesh2: DeviceMesh) -> None:
    model = _mlp()
    with pytest.raises(
        TypeError, match=r"offload_policy must be an OffloadPolicy or None, got str"
    ):
        apply_fully_shard(
            model,
            mesh=mesh2,
            mp_policy=NO_MP,
            offload_policy="cpu",  # type: ignore[arg-type]
        )
    assert not is_sharded(model)


@pytest.mark.parametrize("value", [3, 8, 0, -1])
def test_apply_fully_shard_reshard_int_must_divide_shard_size(
    mesh4: DeviceMesh, value: int
) -> None:
    model = _mlp()
    with pytest.raises(
        ValueError,
        match=rf"reshard_after_forward={value} must be a positive divisor of the shard "
        r"group size 4",
    ):
        apply_fully_shard(model, mesh=mesh4, mp_policy=NO_MP, reshard_after_forward=value)
    assert not is_sharded(model)
    assert not isinstance(model[0].weight, DTensor)


def test_apply_fully_shard_reshard_uses_the_shard_dim_of_hsdp(hsdp_mesh: DeviceMesh) -> None:
    # The shard group of a 2x2 mesh has 2 ranks: 4 divides the world, not the shard group.
    with pytest.raises(ValueError, match=r"shard group size 2"):
        apply_fully_shard(_mlp(), mesh=hsdp_mesh, mp_policy=NO_MP, reshard_after_forward=4)


@pytest.mark.parametrize("value", [1.0, "yes"])
def test_apply_fully_shard_reshard_wrong_type(mesh2: DeviceMesh, value: object) -> None:
    with pytest.raises(TypeError, match=r"reshard_after_forward must be a bool, an int or None"):
        apply_fully_shard(
            _mlp(),
            mesh=mesh2,
            mp_policy=NO_MP,
            reshard_after_forward=value,  # type: ignore[arg-type]
        )


def test_apply_fully_shard_refuses_double_wrap(mesh2: DeviceMesh) -> None:
    model = _mlp()
    apply_fully_shard(model, mesh=mesh2, mp_policy=NO_MP)
    state = model._get_fsdp_state()
    with pytest.raises(
        ValueError,
        match=r"FSDPSequential is already an FSDP unit; sharding it again would wrap it twice",
    ):
        apply_fully_shard(model, mesh=mesh2, mp_policy=default_mp_policy())
    assert model._get_fsdp_state() is state
    assert type(model).__mro__.count(FSDPModule) == 1


def test_apply_fully_shard_refuses_group_with_a_sharded_member(mesh2: DeviceMesh) -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    apply_fully_shard(a, mesh=mesh2, mp_policy=NO_MP)
    with pytest.raises(ValueError, match=r"FSDPLinear is already an FSDP unit"):
        apply_fully_shard([b, a], mesh=mesh2, mp_policy=NO_MP)
    assert not is_sharded(b)


# apply_fully_shard: what it does -----------------------------------------------------------------


@pytest.mark.parametrize("reshard", [None, True, False, 1, 2, 4])
def test_apply_fully_shard_shards_and_runs(mesh4: DeviceMesh, reshard: bool | int | None) -> None:
    model = _mlp()
    apply_fully_shard(
        model, mesh=mesh4, mp_policy=default_mp_policy(), reshard_after_forward=reshard
    )
    for param in model.parameters():
        assert isinstance(param, DTensor)
        assert param.device_mesh == mesh4
        assert param.placements == (Shard(0),)
        assert param.dtype == torch.float32
    out = _forward_backward(model)
    assert out.dtype == torch.bfloat16
    assert all(p.grad is not None for p in model.parameters())


def test_apply_fully_shard_hsdp_placements(hsdp_mesh: DeviceMesh) -> None:
    model = _mlp()
    apply_fully_shard(model, mesh=hsdp_mesh, mp_policy=NO_MP, reshard_after_forward=2)
    for param in model.parameters():
        assert isinstance(param, DTensor)
        assert param.placements == (Replicate(), Shard(0))
    _forward_backward(model)


def test_apply_fully_shard_grouped_units_share_one_state(mesh2: DeviceMesh) -> None:
    model = _mlp()
    apply_fully_shard([model[0], model[2]], mesh=mesh2, mp_policy=NO_MP)
    assert isinstance(model[0], FSDPModule)
    assert isinstance(model[2], FSDPModule)
    assert not isinstance(model, FSDPModule)
    assert model[0]._get_fsdp_state() is model[2]._get_fsdp_state()
    param_group = model[0]._get_fsdp_state()._fsdp_param_group
    assert param_group is not None
    assert len(param_group.fsdp_params) == 4
    apply_fully_shard(model, mesh=mesh2, mp_policy=NO_MP)
    _forward_backward(model)


def test_apply_fully_shard_tuple_group(mesh2: DeviceMesh) -> None:
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    apply_fully_shard((a, b), mesh=mesh2, mp_policy=NO_MP)
    assert a._get_fsdp_state() is b._get_fsdp_state()  # type: ignore[operator]


def test_apply_fully_shard_single_member_list(mesh2: DeviceMesh) -> None:
    model = _mlp()
    apply_fully_shard([model], mesh=mesh2, mp_policy=NO_MP)
    assert is_sharded(model)
    assert isinstance(model[0].weight, DTensor)


def test_apply_fully_shard_grouped_refused_without_torch_support(
    mesh2: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "FULLY_SHARD_GROUPED_MODULES", False)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"cannot put several modules in one FSDP unit"):
        apply_fully_shard([a, b], mesh=mesh2, mp_policy=NO_MP)
    assert not is_sharded(a)
    assert not is_sharded(b)
    # One module is still fine.
    apply_fully_shard(a, mesh=mesh2, mp_policy=NO_MP)


def test_apply_fully_shard_owned_ignored_params_stay_plain(mesh2: DeviceMesh) -> None:
    model = _mlp()
    ignored = model[0].weight
    apply_fully_shard(model, mesh=mesh2, mp_policy=NO_MP, ignored_params={ignored})
    assert model[0].weight is ignored
    assert not isinstance(model[0].weight, DTensor)
    assert isinstance(model[0].bias, DTensor)
    assert isinstance(model[2].weight, DTensor)
    _forward_backward(model)


def test_apply_fully_shard_unowned_ignored_params_are_dropped(
    mesh2: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, other = _mlp(), nn.Linear(8, 8)
    seen: list[dict[str, object]] = []
    real = sharding.fully_shard

    def spy(module: object, **kwargs: object) -> object:
        seen.append(kwargs)
        return real(module, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(sharding, "fully_shard", spy)
    # Only parameters that the target does not own: no error, nothing ignored.
    apply_fully_shard(model[0], mesh=mesh2, mp_policy=NO_MP, ignored_params={other.weight})
    assert "ignored_params" not in seen[-1]
    # A mix: only the owned one is passed on.
    apply_fully_shard(
        model, mesh=mesh2, mp_policy=NO_MP, ignored_params={other.weight, model[2].bias}
    )
    assert seen[-1]["ignored_params"] == {model[2].bias}
    assert all(isinstance(p, DTensor) for p in model[0].parameters())
    assert isinstance(model[2].weight, DTensor)
    assert not isinstance(model[2].bias, DTensor)
    assert not isinstance(other.weight, DTensor)


def test_apply_fully_shard_empty_ignored_set_passes_nothing(
    mesh2: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, object]] = []
    real = sharding.fully_shard

    def spy(module: object, **kwargs: object) -> object:
        seen.append(kwargs)
        return real(module, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(sharding, "fully_shard", spy)
    apply_fully_shard(_mlp(), mesh=mesh2, mp_policy=NO_MP, ignored_params=set())
    assert "ignored_params" not in seen[-1]
    assert seen[-1]["reshard_after_forward"] is None
    assert type(seen[-1]["offload_policy"]) is OffloadPolicy


def test_apply_fully_shard_ignored_refused_without_torch_support(
    mesh2: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "FULLY_SHARD_IGNORED_PARAMS", False)
    model = _mlp()
    with pytest.raises(ValueError, match=r"has no fully_shard\(ignored_params=\.\.\.\)"):
        apply_fully_shard(model, mesh=mesh2, mp_policy=NO_MP, ignored_params={model[0].weight})
    assert not is_sharded(model)
    # Ignored parameters the target does not own need no support.
    apply_fully_shard(model, mesh=mesh2, mp_policy=NO_MP, ignored_params={nn.Linear(1, 1).weight})


def test_apply_fully_shard_cpu_offload_with_pinning_runs_without_accelerator(
    mesh2: DeviceMesh,
) -> None:
    model = _mlp()
    apply_fully_shard(
        model, mesh=mesh2, mp_policy=NO_MP, offload_policy=CPUOffloadPolicy(pin_memory=True)
    )
    param_group = model._get_fsdp_state()._fsdp_param_group
    assert param_group is not None
    assert isinstance(param_group.offload_policy, CPUOffloadPolicy)
    if not torch.accelerator.is_available():
        assert param_group.offload_policy.pin_memory is False
    for param in model.parameters():
        assert isinstance(param, DTensor)
        assert param.device.type == "cpu"
    _forward_backward(model)
    _forward_backward(model)
