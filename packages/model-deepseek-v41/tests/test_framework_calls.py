"""``_fully_shard_module`` called the way frameworks call it, outside any plan.

NeMo Automodel's MoE parallelizer takes ``model_parallelizer=PARALLELIZER`` and calls
``model_parallelizer._fully_shard_module(module, mesh=mesh, mp_policy=mp)`` on each
vision block, then on the tower, then on the root (some calls add ``offload_policy=``).
The reference contract: that call *is* ``fully_shard_deepseek_v41(module, **kwargs)``
and returns the module. Checked here under the fake process group for units and
dtypes; tests/test_framework_calls_distributed.py trains the same calls on 2 gloo ranks
against one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

from fsdp_core import build_mesh, internals, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from model_deepseek_v41 import (
    PARALLELIZER,
    DeepseekV41Config,
    DeepseekV41ForCausalLM,
    DeepseekV41ModelParallelizer,
    build_deepseek_v41,
    fully_shard_deepseek_v41,
    make_batch,
)

TINY = DeepseekV41Config.tiny()
MP = mixed_precision_policy("bf16", "fp32")
NORM_POLICY = MixedPrecisionPolicy(
    param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.bfloat16
)

ShardFn = Callable[..., object]


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_process_group(2):
        yield build_mesh()


def _model(*, frozen_tower: bool = False) -> DeepseekV41ForCausalLM:
    model = build_deepseek_v41(TINY, dtype=torch.bfloat16)
    if frozen_tower:
        model.vision.requires_grad_(False)
    return model


def _states(model: nn.Module) -> dict[int, tuple[FSDPState, list[str]]]:
    found: dict[int, tuple[FSDPState, list[str]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            found.setdefault(id(state), (state, []))[1].append(name)
    return found


def _units(model: nn.Module) -> list[tuple[tuple[str, ...], MixedPrecisionPolicy]]:
    """Every unit of ``model``: its member modules and its policy, sorted."""
    return sorted(
        ((tuple(sorted(names)), state._mp_policy) for state, names in _states(model).values()),
        key=lambda unit: unit[0],
    )


def _nemo_flow(model: DeepseekV41ForCausalLM, shard: ShardFn, **options: object) -> list[object]:
    """What the framework does: each vision block, the tower, each text layer, the root."""
    returned = [shard(block, **options) for block in model.vision.blocks]
    returned.append(shard(model.vision, **options))
    returned += [shard(layer, **options) for layer in model.model.layers]
    returned.append(shard(model, **options))
    return returned


def _expected_units(model: nn.Module) -> list[tuple[tuple[str, ...], MixedPrecisionPolicy]]:
    blocks = [f"vision.blocks.{i}" for i in range(TINY.vision_layers)]
    units = [((f"{b}.norm1", f"{b}.norm2"), NORM_POLICY) for b in blocks]
    units += [((b,), MP) for b in blocks]
    units += [(("vision.norm",), NORM_POLICY), (("vision",), MP)]
    units += [((f"model.layers.{i}",), MP) for i in range(TINY.text_layers)]
    units.append((("",), MP))
    return sorted(units, key=lambda unit: unit[0])


def _train_step(model: nn.Module) -> torch.Tensor:
    batch = make_batch(TINY, batch_size=2, seq_len=8, num_images_per_sample=1, seed=0)
    loss: torch.Tensor = model(**batch)
    loss.backward()
    return loss


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload_policy"])
def test_parallelizer_per_block_then_tower_then_root(mesh: DeviceMesh, offload: bool) -> None:
    model = _model()
    options: dict[str, object] = {"mesh": mesh, "mp_policy": MP}
    if offload:
        options["offload_policy"] = OffloadPolicy()
    modules = [*model.vision.blocks, model.vision, *model.model.layers, model]
    returned = _nemo_flow(model, PARALLELIZER._fully_shard_module, **options)
    assert all(got is want for got, want in zip(returned, modules, strict=True))
    assert _units(model) == _expected_units(model)
    for name, param in model.named_parameters():
        is_norm = name.startswith("vision.") and name.split(".")[-2] in ("norm1", "norm2", "norm")
        assert param.dtype == (torch.float32 if is_norm else torch.bfloat16), name
    assert torch.isfinite(_train_step(model))


def test_the_call_is_fully_shard_deepseek_v41(mesh: DeviceMesh) -> None:
    """The reference implementation is ``fully_shard_deepseek_v41(module, **kwargs)``:
    the same calls give the same units."""
    by_method, by_function = _model(), _model()
    _nemo_flow(by_method, PARALLELIZER._fully_shard_module, mesh=mesh, mp_policy=MP)
    _nemo_flow(by_function, fully_shard_deepseek_v41, mesh=mesh, mp_policy=MP)
    assert _units(by_method) == _units(by_function)


@pytest.mark.parametrize("path", ["vision.blocks.0", "vision", "model.layers.0", "aligner", ""])
def test_one_call_on_any_module_matches_the_function(mesh: DeviceMesh, path: str) -> None:
    by_method, by_function = _model(), _model()
    module = by_method.get_submodule(path)
    assert PARALLELIZER._fully_shard_module(module, mesh=mesh, mp_policy=MP) is module
    fully_shard_deepseek_v41(by_function.get_submodule(path), mesh=mesh, mp_policy=MP)
    assert _units(by_method) == _units(by_function)
    norm_units = [paths for paths, policy in _units(by_method) if policy == NORM_POLICY]
    if path in ("vision.blocks.0", "vision", ""):
        assert norm_units, "a vision module keeps its fp32 norm units"
    else:
        assert norm_units == []


def test_a_root_call_gives_the_unsharded_tower_its_norm_units(mesh: DeviceMesh) -> None:
    """The root call alone (no block or tower call before it): the tower's norms still
    compute in fp32, in their own unit."""
    model = _model()
    PARALLELIZER._fully_shard_module(model, mesh=mesh, mp_policy=MP)
    norm_units = [paths for paths, policy in _units(model) if policy == NORM_POLICY]
    assert [len(paths) for paths in norm_units] == [2 * TINY.vision_layers + 1]
    assert torch.isfinite(_train_step(model))


def test_a_subclass_that_wraps_the_call_works_outside_a_plan(mesh: DeviceMesh) -> None:
    """Frameworks subclass and call ``super()._fully_shard_module(module, **kwargs)``."""
    seen: list[object] = []

    class Framework(DeepseekV41ModelParallelizer):
        def _fully_shard_module(self, module: object, **kwargs: object) -> object:
            seen.append(module)  # a module, or a list of them (a planned grouped unit)
            return super()._fully_shard_module(module, **kwargs)  # type: ignore[arg-type]

    model = _model()
    _nemo_flow(model, Framework()._fully_shard_module, mesh=mesh, mp_policy=MP)
    assert _units(model) == _expected_units(model)
    # Applying a plan makes exactly the planned units, without the framework's entry
    # point (issue 36: apply_plan loops over fully_shard; the override is not consulted).
    planned = _model()
    framework = Framework()
    plan = framework.plan(planned, mp_policy=MP)
    seen.clear()
    framework.apply_plan(planned, plan, mesh=mesh)
    assert seen == []
    made = sorted(tuple(sorted(paths)) for paths in internals.applied_unit_paths(planned))
    assert made == sorted(tuple(sorted(unit.paths)) for unit in plan.units)


def test_exclude_applies_to_the_call(mesh: DeviceMesh) -> None:
    """The parallelizer's own discovery options decide which towers get norm units: a
    frozen tower's fp32 norms are a unit of their own unless the tower is excluded
    (frozen parameters may then share the root unit, as FSDP allows)."""
    default, excluded = _model(frozen_tower=True), _model(frozen_tower=True)
    DeepseekV41ModelParallelizer()._fully_shard_module(default, mesh=mesh, mp_policy=MP)
    DeepseekV41ModelParallelizer(exclude=("vision",))._fully_shard_module(
        excluded, mesh=mesh, mp_policy=MP
    )
    assert [policy for _, policy in _units(default)] == [MP, NORM_POLICY]
    assert [policy for _, policy in _units(excluded)] == [MP]


#: ``mesh=`` is added to every case but the first two (the fixture's mesh).
BAD_CALLS = [
    ({"mp_policy": MP}, False, TypeError, r"needs mesh="),
    ({}, False, TypeError, r"needs mesh=.*and mp_policy="),
    ({"mesh": "dp", "mp_policy": MP}, False, TypeError, r"mesh must be a DeviceMesh, got str"),
    ({"mp_policy": "bf16"}, True, TypeError, r"mp_policy must be a MixedPrecisionPolicy, got str"),
    ({"mp_policy": MP, "reshard": True}, True, TypeError, r"unexpected option 'reshard'.*valid"),
    ({"mp_policy": MP, "reshard_after_forward": 3}, True, ValueError, r"positive divisor"),
]


@pytest.mark.parametrize(("kwargs", "with_mesh", "error", "match"), BAD_CALLS)
def test_bad_calls_fail_before_sharding_anything(
    mesh: DeviceMesh,
    kwargs: dict[str, object],
    with_mesh: bool,
    error: type[Exception],
    match: str,
) -> None:
    block = _model().vision.blocks[0]
    options = {**kwargs, **({"mesh": mesh} if with_mesh else {})}
    with pytest.raises(error, match=match):
        PARALLELIZER._fully_shard_module(block, **options)
    assert not any(isinstance(m, FSDPModule) for m in block.modules())
