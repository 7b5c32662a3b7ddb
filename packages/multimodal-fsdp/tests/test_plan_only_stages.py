"""``plan()`` records what later stages need, and those stages take ``(plan, model)``.

The plan carries the discovered towers and projectors (path, the rule that found each,
modality, role, frozen/trainable split, policy) and the media regions, so reading them
runs no discovery; applying needs the plan alone (replicated placement included); the
estimates and measurements take no parallelizer.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from _mm_toy_vlm import ToyVLM
from torch import nn

import multimodal_fsdp.model_discovery as discovery_module
from fsdp_core import CommCounter, build_mesh, internals, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.discovery.walk import resolve_multimodal_modules
from multimodal_fsdp.parts import split_frozen_parts

MP = mixed_precision_policy("bf16", "fp32")
POLICIES = ("root", "per_layer", "replicate")


def _plan(policy: str = "root", **options: object) -> tuple[nn.Module, object]:
    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy, **options)  # type: ignore[arg-type]
    return model, parallelizer.plan(model, mp_policy=MP)


def _loss(model: nn.Module) -> torch.Tensor:
    out: torch.Tensor = model(torch.ones(2, 3, 4), torch.ones(2, 5, dtype=torch.long))
    return out.float().square().mean()


# --- the plan records the discovered parts -------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_the_plan_records_the_discovered_parts(policy: str) -> None:
    from multimodal_fsdp.record import plan_record

    model = ToyVLM(frozen_tower=True)
    model.vision_tower.blocks[0].fc.requires_grad_(True)  # partly trainable
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy)  # type: ignore[arg-type]
    plan = parallelizer.plan(model, mp_policy=MP)
    record = plan_record(plan)
    assert record is not None
    fresh = resolve_multimodal_modules(model)
    got = [(p.path, p.rule, p.modality, p.role) for p in record.parts]
    assert got == [(f.path, f.rule, f.modality, f.role) for f in fresh]
    for part, found in zip(record.parts, fresh, strict=True):
        frozen, trainable = split_frozen_parts(found.module, found.path)
        assert (list(part.frozen), list(part.trainable)) == (frozen, trainable)
        assert part.policy == policy
    assert record.policies == parallelizer.frozen_policies
    assert list(record.media_regions) == parallelizer.media_regions(model, plan)


def test_the_record_is_outside_plan_equality() -> None:
    """Plans compare and hash as before: the record is not part of equality."""
    _, plan = _plan("per_layer")
    assert plan.records  # type: ignore[attr-defined]
    bare = type(plan)(
        calls=plan.calls,  # type: ignore[attr-defined]
        ignored_param_names=plan.ignored_param_names,  # type: ignore[attr-defined]
        notes=plan.notes,  # type: ignore[attr-defined]
        replicated_param_names=plan.replicated_param_names,  # type: ignore[attr-defined]
        hooks=plan.hooks,  # type: ignore[attr-defined]
    )
    assert bare == plan


# --- reading the plan runs no discovery ----------------------------------------------------


def test_media_regions_read_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    model, plan = _plan("per_layer")
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding="per_layer")
    calls: list[str] = []

    def counting(*args: object, **kwargs: object) -> object:
        calls.append("discovery")
        return resolve_multimodal_modules(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(discovery_module, "resolve_multimodal_modules", counting)
    regions = parallelizer.media_regions(model, plan)  # type: ignore[arg-type]
    owners = parallelizer.modules_with_units(model, plan)  # type: ignore[arg-type]
    assert [r.path for r in regions] == owners == ["vision_tower"]
    assert calls == []


# --- applying needs the plan alone -----------------------------------------------------------


def _applied(model: nn.Module) -> tuple[list[tuple[str, ...]], dict[str, tuple[str, str]]]:
    units = sorted(internals.applied_unit_paths(model))
    placed = {
        name: (str(p.dtype), p.device.type)
        for name, p in model.named_parameters()
        if name.startswith("vision_tower.")
    }
    return units, placed


@pytest.mark.parametrize("policy", POLICIES)
def test_apply_from_the_plan_alone(policy: str) -> None:
    """The free function, and a parallelizer with other options, apply a multimodal plan
    as its planner does: the same units, replicated parameters placed and cast, the same
    hooks."""
    from fsdp_core.parallelizer import apply_plan

    other = "root" if policy != "root" else "per_layer"
    results = []
    for apply in ("planner", "function", "other"):
        model, plan = _plan(policy)
        with fake_process_group(2):
            mesh = build_mesh()
            if apply == "planner":
                MultimodalParallelizer(frozen_multimodal_sharding=policy).apply_plan(  # type: ignore[arg-type]
                    model,
                    plan,  # type: ignore[arg-type]
                    mesh=mesh,
                )
            elif apply == "function":
                apply_plan(model, plan, mesh=mesh)  # type: ignore[arg-type]
            else:
                MultimodalParallelizer(
                    frozen_multimodal_sharding=other,  # type: ignore[arg-type]
                    exclude=("multi_modal_projector",),
                    sync_replicated=False,
                ).apply_plan(model, plan, mesh=mesh)  # type: ignore[arg-type]
            results.append((_applied(model), sorted(internals_hooks(model))))
    assert results[1] == results[0]
    assert results[2] == results[0]
    if policy == "replicate":
        (_, placed), _ = results[0]
        assert {dtype for dtype, _ in placed.values()} == {"torch.bfloat16"}


def internals_hooks(model: nn.Module) -> list[str]:
    from fsdp_core.runtime import installed_hooks

    return list(installed_hooks(model))


@pytest.mark.parametrize("sync", [True, False])
def test_the_plan_says_whether_replicated_parameters_are_broadcast(sync: bool) -> None:
    """``sync_replicated`` is decided when planning: applying with another parallelizer
    (other options) broadcasts as the plan says."""
    model, plan = _plan("replicate", sync_replicated=sync)
    replicated = len(plan.replicated_param_names)  # type: ignore[attr-defined]
    assert replicated > 0
    with fake_process_group(2), CommCounter() as counter:
        MultimodalParallelizer(sync_replicated=not sync).apply_plan(
            model,
            plan,  # type: ignore[arg-type]
            mesh=build_mesh(),
        )
    assert counter.counts().get("broadcast", 0) == (replicated if sync else 0)


# --- the stages take (plan, model) -----------------------------------------------------------


def test_stages_take_no_parallelizer() -> None:
    from multimodal_fsdp.estimate.activations import trace_activations
    from multimodal_fsdp.estimate.costs import plan_costs
    from multimodal_fsdp.estimate.predict import inspect_model
    from multimodal_fsdp.measure.comm import measure_plan
    from multimodal_fsdp.measure.memory import measure_plan_memory

    for stage in (plan_costs, trace_activations, inspect_model, measure_plan, measure_plan_memory):
        names = list(inspect.signature(stage).parameters)
        assert names[:2] == ["plan", "model"], (stage.__name__, names)
        assert "parallelizer" not in names, stage.__name__


def test_costs_carry_the_planned_policy() -> None:
    """The costs' policy label comes from the plan, not from a parallelizer argument."""
    from multimodal_fsdp.estimate.costs import plan_costs

    policy = {"vision_tower": "per_layer", "*": "replicate"}
    model = ToyVLM(frozen_tower=True)
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy)  # type: ignore[arg-type]
    plan = parallelizer.plan(model, mp_policy=MP)
    costs = plan_costs(plan, model, world_size=2)
    assert costs.policy == parallelizer.frozen_policies.label


@pytest.mark.parametrize("policy", POLICIES)
def test_measure_plan_takes_the_plan_and_the_model(policy: str) -> None:
    from multimodal_fsdp.measure.comm import measure_plan

    model, plan = _plan(policy)
    result = measure_plan(plan, model, _loss, world_size=2)  # type: ignore[arg-type]
    assert result.matches, result.comparison.format()
    assert result.plan is plan


def test_measure_plan_memory_takes_the_plan_and_the_model() -> None:
    from multimodal_fsdp.measure.memory import measure_plan_memory

    model, plan = _plan("replicate")
    result = measure_plan_memory(plan, model, _loss, world_size=2)  # type: ignore[arg-type]
    assert result.plan is plan
    assert result.costs.memory is not None


class _Planner:
    """A planner that is no MultimodalParallelizer: the chooser needs only the protocol."""

    def __init__(self, inner: MultimodalParallelizer) -> None:
        self.inner = inner

    def plan(self, model: nn.Module, **kwargs: object) -> object:
        return self.inner.plan(model, **kwargs)  # type: ignore[arg-type]

    def with_options(self, **kwargs: object) -> _Planner:
        return _Planner(self.inner.with_options(**kwargs))  # type: ignore[arg-type]


def test_the_chooser_takes_any_planner() -> None:
    from multimodal_fsdp.estimate.choose import choose_frozen_policy

    model = ToyVLM(frozen_tower=True)
    ours = choose_frozen_policy(model, "1GiB", world_size=2, parallelizer=MultimodalParallelizer())
    theirs = choose_frozen_policy(
        model,
        "1GiB",
        world_size=2,
        parallelizer=_Planner(MultimodalParallelizer()),  # type: ignore[arg-type]
    )
    assert theirs.policies == ours.policies
    assert theirs.candidates == ours.candidates
    assert isinstance(theirs.parallelizer, _Planner)
