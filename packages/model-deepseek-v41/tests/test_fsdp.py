"""model_deepseek_v41.fsdp under the fake process group (world size 2).

Layout, precision and dtype checks of the DeepSeek-V4.1 parallelizer and of
``fully_shard_deepseek_v41`` on the tiny reference model built in bf16 (its
vision norms stay fp32). The fake group shards and communicates exactly like a
real one, but the numbers it computes are meaningless, so only dtypes, units,
policies and the fact that a step runs are asserted here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
from torch.distributed.tensor import DTensor

import fsdp_core.sharding as fsdp_sharding
from fsdp_core import ShardingPlan, build_mesh, compat, mixed_precision_policy
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
from model_deepseek_v41.fsdp import (
    NormGroup,
    is_norm_module,
    is_vision_block,
    plan_fp32_norm_groups,
    vision_norm_paths,
)
from model_deepseek_v41.layers import RMSNorm, TextRMSNorm

TINY = DeepseekV41Config.tiny()
L = TINY.vision_layers
NUM_NORMS = 2 * L + 1
POLICIES = ("root", "per_layer", "replicate")
#: The caller's policy: one object, so identity (``is``) can be checked downstream.
MP = mixed_precision_policy("bf16", "fp32")
NORM_POLICY = MixedPrecisionPolicy(
    param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.bfloat16
)
NORM_PATHS = tuple(
    [f"vision.blocks.{i}.norm{j}" for i in range(L) for j in (1, 2)] + ["vision.norm"]
)
NORM_GROUP_LABEL = f"vision[{NUM_NORMS} modules]"
NORM_WEIGHTS = tuple(f"{path}.weight" for path in NORM_PATHS)  # sorted, as plans list them
TEXT_LAYERS = tuple(f"model.layers.{i}" for i in range(TINY.text_layers))
VISION_BLOCKS = tuple(f"vision.blocks.{i}" for i in range(L))
#: Units of the tiny model, in plan order, and their roles. The aligner (a projector MLP
#: without a layer container) is no unit of its own: it stays in the root unit.
TRAINABLE_UNITS = (NORM_GROUP_LABEL, *TEXT_LAYERS, *VISION_BLOCKS, "<root>")
TRAINABLE_ROLES = {"fp32_norms": 1, "layer": len(TEXT_LAYERS) + L, "root": 1}
#: A frozen tower's fp32 norms are replicated under every policy: no norm unit.
FROZEN_ROOT_UNITS = (*TEXT_LAYERS, "<root>")
FROZEN_ROOT_ROLES = {"layer": len(TEXT_LAYERS), "root": 1}
FROZEN_PER_LAYER_UNITS = (*TEXT_LAYERS, *VISION_BLOCKS, "<root>")
FROZEN_PER_LAYER_ROLES = {"layer": len(TEXT_LAYERS) + L, "root": 1}

#: (policy, frozen tower) -> (unit labels in plan order, role counts).
EXPECTED_UNITS: dict[tuple[str, bool], tuple[tuple[str, ...], dict[str, int]]] = {
    ("root", False): (TRAINABLE_UNITS, TRAINABLE_ROLES),
    ("per_layer", False): (TRAINABLE_UNITS, TRAINABLE_ROLES),
    ("replicate", False): (TRAINABLE_UNITS, TRAINABLE_ROLES),
    ("root", True): (FROZEN_ROOT_UNITS, FROZEN_ROOT_ROLES),
    # per_layer shards the frozen blocks like trainable ones (their norms replicated).
    ("per_layer", True): (FROZEN_PER_LAYER_UNITS, FROZEN_PER_LAYER_ROLES),
    ("replicate", True): (FROZEN_ROOT_UNITS, FROZEN_ROOT_ROLES),
}
CASES = list(EXPECTED_UNITS)
CASE_IDS = [f"{policy}-{'frozen' if frozen else 'trainable'}" for policy, frozen in CASES]


# Fixtures and helpers ----------------------------------------------------------------


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh of size 2 over the fake process group (destroyed afterwards)."""
    with fake_process_group(2):
        yield build_mesh()


def _model(
    *, frozen_tower: bool = False, dtype: torch.dtype = torch.bfloat16
) -> DeepseekV41ForCausalLM:
    model = build_deepseek_v41(TINY, dtype=dtype)
    if frozen_tower:
        model.vision.requires_grad_(False)
    return model


def _parallelizer(policy: str) -> DeepseekV41ModelParallelizer:
    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
    assert isinstance(parallelizer, DeepseekV41ModelParallelizer)
    return parallelizer


def _parallelize(model: nn.Module, mesh: DeviceMesh, policy: str = "root") -> ShardingPlan:
    """Plan (for the test to compare with), then parallelize (which plans again and applies)."""
    parallelizer = _parallelizer(policy)
    plan = parallelizer.plan(model, mp_policy=MP)
    parallelizer.parallelize(model, mesh=mesh, mp_policy=MP)
    return plan


def _state(module: object) -> FSDPState:
    """The FSDP state of a module that must be a unit (or a member of a grouped unit)."""
    assert isinstance(module, FSDPModule), type(module).__name__
    return module._get_fsdp_state()


def _states(model: nn.Module) -> dict[int, tuple[FSDPState, list[str]]]:
    """Distinct FSDP states of ``model``: id -> (state, names of the modules sharing it)."""
    found: dict[int, tuple[FSDPState, list[str]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            found.setdefault(id(state), (state, []))[1].append(name)
    return found


def _unit_names(model: nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if isinstance(module, FSDPModule)}


def _state_params(state: FSDPState) -> list[nn.Parameter]:
    """The (sharded) parameters a state manages, as registered on the modules."""
    return [fp.sharded_param for group in state._fsdp_param_groups for fp in group.fsdp_params]


def _state_param_names(model: nn.Module, state: FSDPState) -> set[str]:
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(p)] for p in _state_params(state)}


def _params_under(model: nn.Module, path: str) -> list[tuple[str, nn.Parameter]]:
    """The parameters under ``path``, with qualified names."""
    module = model.get_submodule(path) if path else model
    return list(module.named_parameters(prefix=path))


def _norm(model: nn.Module, path: str) -> RMSNorm:
    norm = model.get_submodule(path)
    assert isinstance(norm, RMSNorm), path
    return norm


def _vision_norm_paths(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, RMSNorm)]


def _train_step(model: nn.Module, *, seed: int = 0) -> torch.Tensor:
    batch = make_batch(TINY, batch_size=2, seq_len=16, num_images_per_sample=1, seed=seed)
    loss = model(**batch)
    assert isinstance(loss, torch.Tensor)
    loss.backward()  # type: ignore[no-untyped-call]
    return loss


def _record_apply_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, MixedPrecisionPolicy]]:
    """Record (target, mp_policy) of every ``fully_shard`` call, whichever helper makes it.

    ``fsdp_core.sharding`` holds the project's only call site of FSDP2's ``fully_shard``
    (behind ``apply_fully_shard``), so patching it there sees every unit being made.
    """
    calls: list[tuple[Any, MixedPrecisionPolicy]] = []
    original = fsdp_sharding.fully_shard

    def recording(target: Any, **kwargs: Any) -> Any:
        calls.append((target, kwargs["mp_policy"]))
        return original(target, **kwargs)

    monkeypatch.setattr(fsdp_sharding, "fully_shard", recording)
    return calls


# Units and roles -----------------------------------------------------------------------


def test_tiny_model_has_the_expected_norms() -> None:
    assert _vision_norm_paths(_model()) == list(NORM_PATHS)
    assert len(NORM_PATHS) == NUM_NORMS == 5


@pytest.mark.parametrize(("policy", "frozen"), CASES, ids=CASE_IDS)
def test_plan_units_and_roles(policy: str, frozen: bool) -> None:
    """Planning needs no process group and does not touch the model."""
    model = _model(frozen_tower=frozen)
    plan = _parallelizer(policy).plan(model, mp_policy=MP)
    labels, roles = EXPECTED_UNITS[(policy, frozen)]
    assert tuple(plan.unit_labels()) == labels
    assert plan.role_counts() == roles
    norm_units = [unit for unit in plan.units if unit.role == "fp32_norms"]
    if policy == "replicate" and frozen:
        assert norm_units == []
        vision_params = {f"vision.{name}" for name, _ in model.vision.named_parameters()}
        assert set(plan.replicated_param_names) == vision_params
        assert set(plan.ignored_param_names) == vision_params
        assert set(NORM_WEIGHTS) < vision_params
    elif frozen:
        # Only the 2L+1 frozen fp32 norm weights are replicated; the rest is sharded.
        assert norm_units == []
        assert plan.replicated_param_names == NORM_WEIGHTS
        assert plan.ignored_param_names == NORM_WEIGHTS
        # Every call that owns a norm leaves it out.
        for call in plan.calls:
            owned = {
                name
                for path in call.paths
                for name, _ in _params_under(model, path)
                if name in NORM_WEIGHTS
            }
            assert owned <= set(call.ignored_param_names), call.paths
    else:
        assert len(norm_units) == 1
        assert norm_units[0].paths == NORM_PATHS
        assert norm_units[0].mp_policy == NORM_POLICY
        assert plan.replicated_param_names == ()
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


@pytest.mark.parametrize(("policy", "frozen"), CASES, ids=CASE_IDS)
def test_applied_units_match_the_plan(policy: str, frozen: bool, mesh: DeviceMesh) -> None:
    model = _model(frozen_tower=frozen)
    plan = _parallelize(model, mesh, policy)
    states = _states(model)
    assert len(states) == len(plan.units)
    # Every planned module is an FSDPModule, and nothing else is.
    planned_paths = {path for unit in plan.units for path in unit.paths}
    assert _unit_names(model) == planned_paths
    # Modules of one unit share one state; different units have different states.
    unit_states = [{id(_state(model.get_submodule(p))) for p in unit.paths} for unit in plan.units]
    assert all(len(ids) == 1 for ids in unit_states)
    assert len(set().union(*unit_states)) == len(plan.units)
    # The grouped norm unit: all 2L+1 vision norms share ONE state.
    norms = [model.get_submodule(path) for path in NORM_PATHS]
    if frozen:
        # Replicated under every policy: plain fp32 parameters outside every unit.
        assert not any(isinstance(norm, FSDPModule) for norm in norms)
        for norm in norms:
            assert type(norm.weight) is nn.Parameter
            assert norm.weight.dtype == torch.float32
        managed = {id(p) for state, _ in states.values() for p in _state_params(state)}
        assert not any(id(norm.weight) in managed for norm in norms)
    else:
        norm_state = _state(norms[0])
        assert all(_state(norm) is norm_state for norm in norms)
        assert sorted(states[id(norm_state)][1]) == sorted(NORM_PATHS)
        assert norm_state is not _state(model)


@pytest.mark.parametrize(("policy", "frozen"), CASES, ids=CASE_IDS)
def test_forward_backward_runs_under_each_policy(
    policy: str, frozen: bool, mesh: DeviceMesh
) -> None:
    model = _model(frozen_tower=frozen)
    plan = _parallelize(model, mesh, policy)
    for seed in (0, 1):  # a second step re-runs the lazily initialised hooks
        loss = _train_step(model, seed=seed)
        assert loss.dtype == torch.float32
        assert loss.dim() == 0
    for name, param in model.named_parameters():
        if name.startswith("vision.") and frozen:
            assert not param.requires_grad
            assert param.grad is None, name
        else:
            assert param.grad is not None, name
            assert param.grad.dtype == param.dtype, name
    assert len(_states(model)) == len(plan.units)


# Mixed precision of each unit ----------------------------------------------------------


@pytest.mark.parametrize(("policy", "frozen"), CASES, ids=CASE_IDS)
def test_unit_policies(policy: str, frozen: bool, mesh: DeviceMesh) -> None:
    """Norm unit: fp32 params and reduction, bf16 output; every other unit: the caller's object."""
    model = _model(frozen_tower=frozen)
    _parallelize(model, mesh, policy)
    norm_states = 0
    for state, names in _states(model).values():
        if set(names) <= set(NORM_PATHS):
            assert state._mp_policy == NORM_POLICY
            norm_states += 1
        else:
            assert state._mp_policy is MP, names
    assert norm_states == (0 if frozen else 1)


def test_caller_policy_object_reaches_apply_fully_shard(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _record_apply_calls(monkeypatch)
    model = _model()
    plan = _parallelize(model, mesh)
    assert len(calls) == len(plan.units)
    group_calls = [(t, p) for t, p in calls if isinstance(t, list)]
    assert len(group_calls) == 1
    members, policy = group_calls[0]
    assert members == [model.get_submodule(path) for path in NORM_PATHS]
    assert policy == NORM_POLICY
    assert policy is not MP
    others = [p for t, p in calls if not isinstance(t, list)]
    assert len(others) == len(plan.units) - 1
    assert all(p is MP for p in others)


def test_norms_compute_in_fp32_and_linears_in_bf16(mesh: DeviceMesh) -> None:
    model = _model()
    _parallelize(model, mesh)
    seen: dict[str, tuple[torch.dtype, torch.dtype]] = {}

    def record(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            assert not isinstance(weight, DTensor), name  # unsharded inside forward
            seen[name] = (weight.dtype, args[0].dtype)

        return hook

    linears = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name.startswith(("vision.blocks.", "model.layers.", "aligner.", "vision.patch_embed."))
    ]
    assert len(linears) == 4 * L + 4 * TINY.text_layers + 3
    for name in (*NORM_PATHS, *linears):
        model.get_submodule(name).register_forward_pre_hook(record(name))
    _train_step(model)
    assert set(seen) == {*NORM_PATHS, *linears}
    for name in NORM_PATHS:
        assert seen[name] == (torch.float32, torch.float32), name
    for name in linears:
        assert seen[name][0] == torch.bfloat16, name
    # What each norm hands to the next Linear is bf16.
    after_norm = [
        f"vision.blocks.{i}.{sub}" for i in range(L) for sub in ("attn.qkv", "mlp.gate_up")
    ]
    for name in (*after_norm, "aligner.fc1"):
        assert seen[name][1] == torch.bfloat16, name
    # Stored norm weights stay fp32 (sharded); the rest is bf16.
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        expected = torch.float32 if name.rsplit(".", 1)[0] in NORM_PATHS else torch.bfloat16
        assert param.dtype == expected, name


@pytest.mark.parametrize(("policy", "frozen"), CASES, ids=CASE_IDS)
def test_no_unit_mixes_trainable_dtypes(policy: str, frozen: bool, mesh: DeviceMesh) -> None:
    model = _model(frozen_tower=frozen)
    _parallelize(model, mesh, policy)
    for state, names in _states(model).values():
        params = _state_params(state)
        assert params, names
        trainable = {p.dtype for p in params if p.requires_grad}
        if any(p.requires_grad for p in params):
            assert len(trainable) == 1, (names, trainable)
        expected = torch.float32 if set(names) <= set(NORM_PATHS) else torch.bfloat16
        assert {p.dtype for p in params} == {expected}, names
    _train_step(model)  # FSDP's own uniform-dtype check runs at the first forward


# Frozen towers ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_frozen_tower_keeps_replicated_fp32_norms(policy: str, mesh: DeviceMesh) -> None:
    """Under every policy the frozen norms stay whole fp32 tensors (not rounded) on every
    rank and compute in fp32; under replicate the rest of the tower is plain bf16 too."""
    model = _model(frozen_tower=True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for path in NORM_PATHS:
            weight = _norm(model, path).weight
            weight.copy_(torch.rand(weight.shape, generator=generator) + 0.5)  # not bf16 values
    originals = {path: _norm(model, path).weight.detach().clone() for path in NORM_PATHS}
    assert all(not torch.equal(w, w.bfloat16().float()) for w in originals.values())
    plan = _parallelize(model, mesh, policy)
    tower_units = {name for name in _unit_names(model) if name.startswith("vision.")}
    assert tower_units == (set(VISION_BLOCKS) if policy == "per_layer" else set())
    for name, param in model.vision.named_parameters():
        is_norm = f"vision.{name}".rsplit(".", 1)[0] in NORM_PATHS
        # Norms are plain tensors everywhere; the rest only under replicate.
        assert isinstance(param, DTensor) == (policy != "replicate" and not is_norm), name
        assert param.dtype == (torch.float32 if is_norm else torch.bfloat16), name
    for path in NORM_PATHS:
        weight = _norm(model, path).weight
        assert type(weight) is nn.Parameter
        assert torch.equal(weight, originals[path]), path  # not rounded
    if policy == "replicate":
        assert len(plan.replicated_param_names) == len(list(model.vision.parameters()))
    else:
        assert plan.replicated_param_names == NORM_WEIGHTS

    checked: list[str] = []

    def check(name: str) -> Callable[[nn.Module, tuple[Any, ...], torch.Tensor], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            assert isinstance(module, RMSNorm)
            x = args[0]
            assert module.weight.dtype == torch.float32
            assert out.dtype == x.dtype == torch.bfloat16  # handed on in bf16
            xf = x.float()
            ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)
            assert torch.equal(out, (ref * module.weight).to(x.dtype))  # fp32 math, fp32 weight
            rounded = (ref * module.weight.bfloat16().float()).to(x.dtype)
            assert not torch.equal(out, rounded)  # the check above would see a bf16 weight
            checked.append(name)

        return hook

    for path in NORM_PATHS:
        model.get_submodule(path).register_forward_hook(check(path))
    _train_step(model)
    assert checked == list(NORM_PATHS)
    assert all(p.grad is None for p in model.vision.parameters())


def test_replicate_casts_the_frozen_tower_of_an_fp32_model(mesh: DeviceMesh) -> None:
    """The cast is visible on an fp32 build: non-norm tower weights become bf16, norms stay."""
    model = _model(frozen_tower=True, dtype=torch.float32)
    assert {p.dtype for p in model.vision.parameters()} == {torch.float32}
    _parallelize(model, mesh, "replicate")
    for name, param in model.vision.named_parameters():
        assert not isinstance(param, DTensor), name
        is_norm = f"vision.{name}".rsplit(".", 1)[0] in NORM_PATHS
        assert param.dtype == (torch.float32 if is_norm else torch.bfloat16), name
    assert torch.isfinite(_train_step(model))


def test_root_frozen_tower_sits_in_the_root_unit_without_its_norms(mesh: DeviceMesh) -> None:
    model = _model(frozen_tower=True)
    _parallelize(model, mesh, "root")
    norm_weights = set(NORM_WEIGHTS)
    # No norm unit: the norms are replicated, in no unit at all.
    assert _unit_names(model) == {"", *TEXT_LAYERS}
    assert not any(isinstance(model.get_submodule(path), FSDPModule) for path in NORM_PATHS)
    # The rest of the tower is no unit of its own and sits in the root unit, as does the
    # trainable aligner.
    root_names = _state_param_names(model, _state(model))
    tower_rest = {f"vision.{name}" for name, _ in model.vision.named_parameters()} - norm_weights
    assert len(tower_rest) == len(list(model.vision.parameters())) - NUM_NORMS
    assert tower_rest <= root_names
    assert {f"aligner.{name}" for name, _ in model.aligner.named_parameters()} <= root_names
    assert root_names.isdisjoint(norm_weights)
    assert {p.dtype for p in _state_params(_state(model))} == {torch.bfloat16}
    assert len(_states(model)) == len(FROZEN_ROOT_UNITS)
    assert torch.isfinite(_train_step(model))
    for path in NORM_PATHS:
        weight = _norm(model, path).weight
        assert type(weight) is nn.Parameter
        assert weight.dtype == torch.float32
        assert weight.grad is None


# Fallback without grouped per-module casting ----------------------------------------------


def test_one_unit_per_norm_when_torch_cannot_group(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "GROUPED_PER_MODULE_CASTING", False)
    model = _model()
    plan = _parallelize(model, mesh)
    norm_units = [unit for unit in plan.units if unit.role == "fp32_norms"]
    assert [unit.paths for unit in norm_units] == [(path,) for path in NORM_PATHS]
    assert len(plan.units) == len(TRAINABLE_UNITS) - 1 + NUM_NORMS
    norm_states = {id(_state(model.get_submodule(path))) for path in NORM_PATHS}
    assert len(norm_states) == NUM_NORMS
    for path in NORM_PATHS:
        assert _state(model.get_submodule(path))._mp_policy == NORM_POLICY
    assert len(_states(model)) == len(plan.units)
    assert torch.isfinite(_train_step(model))


def test_frozen_tower_has_no_norm_unit_when_torch_cannot_group(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "GROUPED_PER_MODULE_CASTING", False)
    model = _model(frozen_tower=True)
    plan = _parallelize(model, mesh)
    assert tuple(plan.unit_labels()) == FROZEN_ROOT_UNITS
    assert plan.replicated_param_names == NORM_WEIGHTS
    assert not any(isinstance(model.get_submodule(path), FSDPModule) for path in NORM_PATHS)
    assert torch.isfinite(_train_step(model))


# Partly trainable towers -------------------------------------------------------------------

#: Tower frozen but its final norm: (policy) -> unit labels in plan order.
TRAINABLE_FINAL_NORM_UNITS = {
    "root": ("vision.norm", *TEXT_LAYERS, "<root>"),
    # The blocks' units, as for the fully frozen tower; the frozen patch embedding is
    # outside every layer, so it joins the root unit.
    "per_layer": ("vision.norm", *TEXT_LAYERS, *VISION_BLOCKS, "<root>"),
    "replicate": ("vision.norm", *TEXT_LAYERS, "<root>"),
}


@pytest.mark.parametrize("policy", POLICIES)
def test_only_trainable_norms_get_the_fp32_unit(policy: str, mesh: DeviceMesh) -> None:
    """A trainable final norm in a frozen tower: it alone is the fp32 unit; the frozen
    block norms are replicated (under replicate with the rest of the frozen tower)."""
    model = _model(frozen_tower=True)
    model.vision.norm.requires_grad_(True)
    plan = _parallelize(model, mesh, policy)
    assert tuple(plan.unit_labels()) == TRAINABLE_FINAL_NORM_UNITS[policy]
    (norm_unit,) = [unit for unit in plan.units if unit.role == "fp32_norms"]
    assert norm_unit.paths == ("vision.norm",)
    assert norm_unit.mp_policy == NORM_POLICY
    frozen = sorted(
        f"vision.{name}" for name, p in model.vision.named_parameters() if not p.requires_grad
    )
    expected = tuple(frozen) if policy == "replicate" else NORM_WEIGHTS[:-1]
    assert plan.replicated_param_names == expected
    assert "vision.norm.weight" not in plan.ignored_param_names
    assert _state(model.vision.norm)._mp_policy == NORM_POLICY
    assert _state_param_names(model, _state(model.vision.norm)) == {"vision.norm.weight"}
    for path in NORM_PATHS[:-1]:
        assert type(_norm(model, path).weight) is nn.Parameter
        assert _norm(model, path).weight.dtype == torch.float32
    assert torch.isfinite(_train_step(model))
    grad = model.vision.norm.weight.grad
    assert isinstance(grad, DTensor)
    assert grad.dtype == torch.float32
    assert all(_norm(model, path).weight.grad is None for path in NORM_PATHS[:-1])


# Meta device -------------------------------------------------------------------------------


@pytest.mark.parametrize(("policy", "frozen"), CASES, ids=CASE_IDS)
def test_parallelize_on_the_meta_device(policy: str, frozen: bool, mesh: DeviceMesh) -> None:
    model = build_deepseek_v41(TINY, dtype=torch.bfloat16, device="meta")
    if frozen:
        model.vision.requires_grad_(False)
    plan = _parallelize(model, mesh, policy)
    assert tuple(plan.unit_labels()) == EXPECTED_UNITS[(policy, frozen)][0]
    for name, param in model.named_parameters():
        assert param.device.type == "meta", name
        is_norm = name.rsplit(".", 1)[0] in NORM_PATHS
        replicated = name in plan.replicated_param_names
        assert isinstance(param, DTensor) != replicated, name
        assert param.dtype == (torch.float32 if is_norm else torch.bfloat16), name
    assert len(_states(model)) == len(plan.units)


# fully_shard_deepseek_v41 used directly ---------------------------------------------------


def test_direct_on_a_vision_block(mesh: DeviceMesh) -> None:
    block = _model().vision.blocks[0]
    assert fully_shard_deepseek_v41(block, mesh, MP) is block
    norm_state = _state(block.norm1)
    assert _state(block.norm2) is norm_state
    assert norm_state._mp_policy == NORM_POLICY
    assert _state(block) is not norm_state
    assert _state(block)._mp_policy is MP
    assert _unit_names(block) == {"", "norm1", "norm2"}
    assert {p.dtype for p in _state_params(norm_state)} == {torch.float32}
    assert {p.dtype for p in _state_params(_state(block))} == {torch.bfloat16}


def test_direct_on_a_whole_tower(mesh: DeviceMesh) -> None:
    tower = _model().vision
    assert fully_shard_deepseek_v41(tower, mesh, MP) is tower
    states = _states(tower)
    assert len(states) == 2
    norm_state = _state(tower.norm)
    assert sorted(states[id(norm_state)][1]) == sorted(
        p.removeprefix("vision.") for p in NORM_PATHS
    )
    assert norm_state._mp_policy == NORM_POLICY
    assert _state(tower)._mp_policy is MP
    assert not any(isinstance(block, FSDPModule) for block in tower.blocks)


@pytest.mark.parametrize("path", ["model.layers.0", "aligner"])
def test_direct_on_an_ordinary_module(
    path: str, mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _record_apply_calls(monkeypatch)
    module = _model().get_submodule(path)
    assert fully_shard_deepseek_v41(module, mesh, MP) is module
    assert _unit_names(module) == {""}
    assert _state(module)._mp_policy is MP
    assert len(calls) == 1
    assert calls[0][0] is module
    assert calls[0][1] is MP


def test_direct_on_checkpoint_wrapped_blocks(mesh: DeviceMesh) -> None:
    model = _model()
    for index, block in enumerate(list(model.vision.blocks)):
        wrapped = checkpoint_wrapper(block)
        model.vision.blocks[index] = wrapped
        assert is_vision_block(wrapped)
        assert fully_shard_deepseek_v41(wrapped, mesh, MP) is wrapped
        assert _state(block.norm1) is _state(block.norm2)
        assert _state(block.norm1)._mp_policy == NORM_POLICY
        assert _state(wrapped)._mp_policy is MP
    fully_shard_deepseek_v41(model.vision, mesh, MP)  # only the final norm is left
    assert _state(model.vision.norm)._mp_policy == NORM_POLICY
    assert len(_states(model.vision)) == 2 * L + 2


def test_parallelizer_recognises_checkpoint_wrapped_blocks(mesh: DeviceMesh) -> None:
    model = _model()
    for index, block in enumerate(list(model.vision.blocks)):
        model.vision.blocks[index] = checkpoint_wrapper(block)
    plan = _parallelize(model, mesh)
    assert plan.role_counts() == TRAINABLE_ROLES
    norm_unit = plan.units[0]
    assert norm_unit.role == "fp32_norms"
    assert len(norm_unit.paths) == NUM_NORMS
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len({id(_state(norm)) for norm in norms}) == 1
    assert len(_states(model)) == len(plan.units)
    assert torch.isfinite(_train_step(model))


@pytest.mark.parametrize("path", ["vision.blocks.0", "vision", "model.layers.0", "aligner"])
def test_direct_twice_is_a_no_op(
    path: str, mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _model().get_submodule(path)
    fully_shard_deepseek_v41(module, mesh, MP)
    states = _states(module)
    calls = _record_apply_calls(monkeypatch)
    assert fully_shard_deepseek_v41(module, mesh, MP) is module
    assert calls == []
    assert _states(module).keys() == states.keys()
    # Wrapped once: one FSDP class in the MRO below FSDPModule itself.
    wrappers = [
        c for c in type(module).__mro__ if issubclass(c, FSDPModule) and c is not FSDPModule
    ]
    assert len(wrappers) == 1, wrappers


def test_direct_parallelized_model_twice_is_a_no_op(mesh: DeviceMesh) -> None:
    model = _model()
    _parallelize(model, mesh)
    before = _states(model).keys()
    names = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert len(names) == len(TRAINABLE_UNITS) - 1 + NUM_NORMS
    for name in names:
        module = model.get_submodule(name)
        assert fully_shard_deepseek_v41(module, mesh, MP) is module
        assert _states(model).keys() == before, name


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (3, TypeError, r"module must be an nn\.Module, got int"),
        ("vision", TypeError, r"module must be an nn\.Module, got str"),
        (None, TypeError, r"module must be an nn\.Module, got NoneType"),
        ([], ValueError, r"cannot shard an empty group of modules"),
        ([nn.Linear(2, 2), 3], TypeError, r"group members must be nn\.Module, got int"),
    ],
)
def test_direct_rejects_bad_modules(
    bad: object, error: type[Exception], match: str, mesh: DeviceMesh
) -> None:
    with pytest.raises(error, match=match):
        fully_shard_deepseek_v41(bad, mesh, MP)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["vision.blocks.0", "model.layers.0"])
def test_direct_rejects_a_bad_mesh(path: str, mesh: DeviceMesh) -> None:
    module = _model().get_submodule(path)
    with pytest.raises(TypeError, match=r"mesh must be a DeviceMesh, got str"):
        fully_shard_deepseek_v41(module, "dp_shard", MP)  # type: ignore[arg-type]
    assert _unit_names(module) == set()


def test_direct_rejects_a_bad_reshard_value_before_sharding(mesh: DeviceMesh) -> None:
    block = _model().vision.blocks[0]
    with pytest.raises(ValueError, match=r"reshard_after_forward=3 must be a positive divisor"):
        fully_shard_deepseek_v41(block, mesh, MP, reshard_after_forward=3)
    assert _unit_names(block) == set()


def test_direct_rejects_a_bad_policy_on_an_ordinary_module(mesh: DeviceMesh) -> None:
    layer = _model().model.layers[0]
    with pytest.raises(TypeError, match=r"mp_policy must be a MixedPrecisionPolicy, got str"):
        fully_shard_deepseek_v41(layer, mesh, "bf16")  # type: ignore[arg-type]
    assert _unit_names(layer) == set()


@pytest.mark.parametrize("path", ["vision.blocks.0", "vision"])
@pytest.mark.parametrize(
    ("bad", "name"), [("bf16", "str"), (torch.bfloat16, "dtype"), ({}, "dict")]
)
def test_direct_rejects_a_bad_policy_on_a_vision_module_before_sharding(
    path: str, bad: object, name: str, mesh: DeviceMesh
) -> None:
    """Checked before the norm units are made, so nothing is sharded."""
    module = _model().get_submodule(path)
    with pytest.raises(TypeError, match=rf"mp_policy must be a MixedPrecisionPolicy, got {name}"):
        fully_shard_deepseek_v41(module, mesh, bad)  # type: ignore[arg-type]
    assert _unit_names(module) == set()
    assert not any(isinstance(p, DTensor) for p in module.parameters())


def test_direct_rejects_a_missing_policy_without_sharding_anything(mesh: DeviceMesh) -> None:
    block = _model().vision.blocks[0]
    with pytest.raises(TypeError, match=r"mp_policy must be a MixedPrecisionPolicy, got NoneType"):
        fully_shard_deepseek_v41(block, mesh, None)  # type: ignore[arg-type]
    assert _unit_names(block) == set()


@pytest.mark.parametrize("argument", ["extra_projector_names", "exclude"])
def test_parallelizer_rejects_a_bare_string_name_option(argument: str) -> None:
    with pytest.raises(TypeError, match=rf"{argument} must be a collection of str, got str"):
        DeepseekV41ModelParallelizer(**{argument: "aligner"})


def test_parallelizer_rejects_a_bare_string_extra_tower_name() -> None:
    with pytest.raises(TypeError, match=r"extra_tower_names must be a collection of str, got str"):
        DeepseekV41ModelParallelizer(extra_tower_names="siglip")


def test_with_options_rejects_an_unknown_policy() -> None:
    with pytest.raises(ValueError, match=r"unknown frozen multimodal sharding 'bogus'"):
        PARALLELIZER.with_options(frozen_multimodal_sharding="bogus")
    with pytest.raises(TypeError, match=r"frozen multimodal sharding must be a str, got int"):
        PARALLELIZER.with_options(frozen_multimodal_sharding=1)  # type: ignore[arg-type]


# Structural recognition --------------------------------------------------------------------


class _BiasOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))


class _NormWithChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.inner = nn.Linear(4, 4)


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        (lambda: RMSNorm(8), True),
        (lambda: TextRMSNorm(8), True),
        (lambda: TextRMSNorm(8).bfloat16(), True),
        (lambda: nn.LayerNorm(8), True),
        (lambda: nn.BatchNorm1d(8), True),
        (lambda: nn.LayerNorm(8, elementwise_affine=False), False),
        (lambda: nn.Linear(8, 8), False),
        (lambda: nn.Embedding(8, 8), False),
        (lambda: nn.GELU(), False),
        (_BiasOnly, False),
        (_NormWithChild, False),
    ],
    ids=[
        "RMSNorm",
        "TextRMSNorm",
        "TextRMSNorm-bf16",
        "LayerNorm",
        "BatchNorm1d",
        "LayerNorm-no-affine",
        "Linear",
        "Embedding",
        "GELU",
        "bias-only",
        "norm-with-child",
    ],
)
def test_is_norm_module(factory: Callable[[], nn.Module], expected: bool) -> None:
    assert is_norm_module(factory()) is expected


def test_is_vision_block() -> None:
    bf16 = _model()
    fp32 = _model(dtype=torch.float32)
    assert all(is_vision_block(block) for block in bf16.vision.blocks)
    assert is_vision_block(checkpoint_wrapper(bf16.vision.blocks[0]))
    # Structure, not storage dtype: fp32 master weights are vision blocks too.
    assert all(is_vision_block(block) for block in fp32.vision.blocks)
    # Text layers have their own norm names (input_layernorm, post_attention_layernorm).
    assert not is_vision_block(bf16.model.layers[0])
    assert not is_vision_block(fp32.model.layers[0])
    for path in ("vision", "vision.blocks", "vision.blocks.0.attn", "aligner"):
        assert not is_vision_block(bf16.get_submodule(path)), path
    assert not is_vision_block(bf16)


def test_vision_norm_paths_read_the_layout_inside_a_tower() -> None:
    """Which modules are towers is the discovery's decision; inside one (or a block) the
    norms are found by the V4 layout, whatever the storage dtype."""
    for dtype in (torch.bfloat16, torch.float32):
        model = _model(dtype=dtype)
        assert vision_norm_paths(model.vision, "vision") == list(NORM_PATHS)
        wrapped = vision_norm_paths(checkpoint_wrapper(model.vision), "vision")
        assert wrapped == [
            p.replace("vision.", "vision._checkpoint_wrapped_module.", 1) for p in NORM_PATHS
        ]
        assert vision_norm_paths(model.vision.blocks[0]) == ["norm1", "norm2"]
        for path in ("", "model", "vision.blocks", "aligner", "model.layers.0"):
            assert vision_norm_paths(model.get_submodule(path)) == [], path


def test_plan_fp32_norm_groups_grouped_and_not() -> None:
    model = _model()
    grouped = plan_fp32_norm_groups(model.vision, mp_policy=MP, prefix="vision", grouped=True)
    assert grouped == [NormGroup(NORM_PATHS, NORM_POLICY)]
    single = plan_fp32_norm_groups(model.vision, mp_policy=MP, prefix="vision", grouped=False)
    assert single == [NormGroup((path,), NORM_POLICY) for path in NORM_PATHS]
    # Without a prefix the paths are relative to the module.
    relative = plan_fp32_norm_groups(model.vision, mp_policy=MP, grouped=True)
    assert relative[0].paths == tuple(path.removeprefix("vision.") for path in NORM_PATHS)
    # A block: its two norms.
    block = plan_fp32_norm_groups(model.vision.blocks[0], mp_policy=MP, grouped=True)
    assert block == [NormGroup(("norm1", "norm2"), NORM_POLICY)]
    # No fp32 norms: nothing to plan.
    assert plan_fp32_norm_groups(model.model.layers[0], mp_policy=MP) == []
    assert plan_fp32_norm_groups(model.aligner, mp_policy=MP) == []


def test_plan_fp32_norm_groups_default_follows_compat(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    assert compat.GROUPED_PER_MODULE_CASTING  # torch 2.13 groups
    assert len(plan_fp32_norm_groups(model.vision, mp_policy=MP)) == 1
    monkeypatch.setattr(compat, "GROUPED_PER_MODULE_CASTING", False)
    assert len(plan_fp32_norm_groups(model.vision, mp_policy=MP)) == NUM_NORMS


def test_norms_are_ungrouped_where_grouped_units_cannot_be_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pytorch issue 183702: where a grouped unit breaks when one of its modules runs again
    in the iteration (a tower run once per image), each norm gets its own unit."""
    model = _model()
    assert compat.GROUPED_UNIT_REUSE  # torch 2.13 (checked against a reference in tests/)
    monkeypatch.setattr(compat, "GROUPED_UNIT_REUSE", False)
    groups = plan_fp32_norm_groups(model.vision, mp_policy=MP, prefix="vision")
    assert [group.paths for group in groups] == [(path,) for path in NORM_PATHS]
    plan = PARALLELIZER.plan(model, mp_policy=MP)
    assert plan.role_counts()["fp32_norms"] == NUM_NORMS


def test_plan_fp32_norm_groups_leaves_out_ignored_and_planned_norms() -> None:
    model = _model()
    groups = plan_fp32_norm_groups(
        model.vision,
        mp_policy=MP,
        prefix="vision",
        ignored_param_names=["vision.norm.weight"],
        planned={id(model.vision.blocks[0])},
        grouped=True,
    )
    assert groups == [NormGroup(tuple(NORM_PATHS[2:-1]), NORM_POLICY)]
    every = {id(block) for block in model.vision.blocks}
    assert (
        plan_fp32_norm_groups(
            model.vision,
            mp_policy=MP,
            ignored_param_names=["norm.weight"],
            planned=every,
        )
        == []
    )


def test_plan_fp32_norm_groups_policy_follows_the_surroundings() -> None:
    """Without a param dtype in the caller's policy, the output goes back to the model dtype."""
    bf16 = _model()
    (group,) = plan_fp32_norm_groups(bf16.vision, mp_policy=MixedPrecisionPolicy(), grouped=True)
    assert group.mp_policy == MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.bfloat16
    )
    fp32 = _model(dtype=torch.float32)
    (group,) = plan_fp32_norm_groups(fp32.vision, mp_policy=MP, grouped=True)
    assert group.mp_policy == NORM_POLICY  # the caller computes in bf16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32-master"])
def test_per_block_calls_keep_fp32_norm_units_whatever_the_storage_dtype(
    mesh: DeviceMesh, dtype: torch.dtype
) -> None:
    """Frameworks call the function block by block. With fp32 master weights and a bf16
    policy (the standard recipe) the norms must still get their own fp32 units, or they
    would compute with bf16-rounded weights."""
    model = _model(dtype=dtype)
    for block in model.vision.blocks:
        fully_shard_deepseek_v41(block, mesh, MP)
    for index, block in enumerate(model.vision.blocks):
        for name in ("norm1", "norm2"):
            norm = block.get_submodule(name)
            assert isinstance(norm, FSDPModule), (index, name)
            policy = _state(norm)._mp_policy
            assert policy.param_dtype == torch.float32, (index, name)
            assert policy.output_dtype == torch.bfloat16, (index, name)
        assert _state(block)._mp_policy.param_dtype == torch.bfloat16
    # Text layers are ordinary units under the caller's policy.
    fully_shard_deepseek_v41(model.model.layers[0], mesh, MP)
    assert not isinstance(model.model.layers[0].input_layernorm, FSDPModule)


def test_the_tower_is_found_by_the_shared_name_table() -> None:
    """``vision`` is a built-in tower name now: the parallelizer adds no name of its own."""
    assert DeepseekV41ModelParallelizer().extra_tower_names == ()
    parts = PARALLELIZER.multimodal_parts(_model())
    assert [(part.found.path, part.found.rule) for part in parts] == [
        ("vision", "name:vision"),
        ("aligner", "name:aligner"),
    ]


@pytest.mark.parametrize("path", ["vision", "vision.blocks.0", "model.layers.0", "aligner"])
def test_the_function_shards_the_norm_units_the_parallelizer_plans(
    path: str, mesh: DeviceMesh
) -> None:
    """One planner: the norm units ``fully_shard_deepseek_v41`` makes on a module are the
    ones the parallelizer plans for the same norms."""
    model = _model()
    plan = PARALLELIZER.plan(model, mp_policy=MP)
    planned = [
        tuple(sorted(p.removeprefix(f"{path}.") for p in unit.paths if p.startswith(f"{path}.")))
        for unit in plan.units
        if unit.role == "fp32_norms"
    ]
    planned = [paths for paths in planned if paths]
    module = model.get_submodule(path)
    fully_shard_deepseek_v41(module, mesh, MP)
    made = sorted(tuple(sorted(names)) for _, names in _states(module).values() if "" not in names)
    assert made == sorted(planned)
