"""Pipeline stages of a vision-language model, for torch's ``pipelining``.

The towers and projectors stay with the first decoder layers on stage 0 (media never
leave it), the final norm and head on the last stage. ``split_stages`` makes one module
per stage from the whole model (on ``meta``), keeping the model's qualified names; the
caller gives each stage its ``forward`` and shards it over the stage's data-parallel
ranks. An error inside one stage's step would leave the others waiting in send/recv, so
``check_stages`` plans every stage on every rank first and refuses towers off stage 0
and media regions.
"""

from __future__ import annotations

import copy
import itertools
import types
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from fsdp_core.containers import is_under
from fsdp_core.plan import ShardingPlan
from multimodal_fsdp.parallelizer import MultimodalParallelizer

__all__ = ["check_stages", "split_stages", "stage_layer_ranges"]

#: A stage's forward: the stage module, then the inputs the schedule gives it.
StageForward = Callable[..., Any]


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """The decoder layers of each stage, as even as possible (earlier stages get the
    extra layer: the first stage also runs the towers, the last the head).

    Args:
        num_layers: decoder layers of the model.
        num_stages: pipeline stages (at least two).

    Returns:
        One range of layer indices per stage, in order.

    Raises:
        ValueError: fewer layers than stages, or fewer than two stages.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 2:
        raise ValueError(f"num_stages must be an int >= 2, got {num_stages!r}")
    if num_layers < num_stages:
        raise ValueError(
            f"{num_layers} decoder layers cannot fill {num_stages} pipeline stages: use at "
            f"most {num_layers} stages (pp <= the number of decoder layers)"
        )
    base, extra = divmod(num_layers, num_stages)
    cuts = [i * base + min(i, extra) for i in range(num_stages + 1)]
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def split_stages(
    model: nn.Module,
    *,
    layers: str,
    num_stages: int,
    forwards: Sequence[StageForward] | None = None,
    first_stage: Sequence[str] = (),
    boundaries: Sequence[int] | None = None,
) -> list[nn.Module]:
    """One module per pipeline stage, cut along the decoder layer container ``layers``.

    Stage ``i`` keeps its layer items in an ``nn.ModuleDict`` keyed by their original
    indices; modules registered before ``layers`` go to stage 0, those after it to the
    last stage, modules without parameters stay on every stage, and a module that leaves
    a stage is set to ``None``.

    Args:
        model: the whole model (on ``meta``: each stage starts as a copy of it).
        layers: path of the decoder layer container, e.g. ``"model.layers"``.
        num_stages: pipeline stages.
        forwards: each stage's forward, as functions of ``(stage, *inputs)`` (without:
            the model's, for planning and estimates only).
        first_stage: paths of more modules for stage 0 (a tower registered late).
        boundaries: the first layer index of each stage after the first (default:
            ``stage_layer_ranges``).

    Returns:
        The stage modules, stage 0 first.

    Raises:
        TypeError: ``layers`` is not an ``nn.ModuleList`` or ``nn.ModuleDict``.
        ValueError: a bad stage count or boundary, a ``forwards`` of another length,
            a parameter shared by modules on two stages (tied embeddings and head:
            untie them or keep both on one stage), or a path that is not a module.
    """
    container = model.get_submodule(layers)
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        raise TypeError(
            f"layers={layers!r} is a {type(container).__name__}; give the path of the "
            "decoder layer container (an nn.ModuleList or nn.ModuleDict)"
        )
    keys = [
        str(k)
        for k in (container if isinstance(container, nn.ModuleDict) else range(len(container)))
    ]
    ranges = _ranges(len(keys), num_stages, boundaries)
    if forwards is not None and len(forwards) != num_stages:
        raise ValueError(f"{len(forwards)} forwards for {num_stages} stages")
    placed = _place(model, layers, keys, ranges, tuple(first_stage))
    _check_shared(model, placed)
    stages = []
    parent_path, _, attr = layers.rpartition(".")
    for index in range(num_stages):
        stage = copy.deepcopy(model)
        for path, at in placed.items():
            if at != index and not is_under(path, layers):
                owner, _, name = path.rpartition(".")
                setattr(stage.get_submodule(owner), name, None)
        items = stage.get_submodule(layers)
        kept = dict(zip(keys, items.children(), strict=True))
        mine = nn.ModuleDict({k: m for k, m in kept.items() if placed[f"{layers}.{k}"] == index})
        setattr(stage.get_submodule(parent_path), attr, mine)
        if forwards is not None:
            stage.forward = types.MethodType(forwards[index], stage)
        stages.append(stage)
    return stages


def _ranges(count: int, num_stages: int, boundaries: Sequence[int] | None) -> list[range]:
    if boundaries is None:
        return stage_layer_ranges(count, num_stages)
    cuts = [0, *boundaries, count]
    if len(cuts) != num_stages + 1 or any(b <= a for a, b in itertools.pairwise(cuts)):
        raise ValueError(
            f"boundaries {tuple(boundaries)} must be {num_stages - 1} increasing layer indices "
            f"in 1..{count - 1} (the first layer of each stage after the first)"
        )
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def _place(
    model: nn.Module, layers: str, keys: list[str], ranges: list[range], first: tuple[str, ...]
) -> dict[str, int]:
    """The stage of each maximal module with parameters."""
    for path in first:
        model.get_submodule(path)  # AttributeError names the bad path
    placed = {f"{layers}.{key}": i for i, r in enumerate(ranges) for key in (keys[j] for j in r)}
    after = False

    def walk(module: nn.Module, prefix: str) -> None:
        nonlocal after
        if next(module.parameters(recurse=False), None) is not None:
            raise ValueError(
                f"module {prefix!r} holds parameters of its own beside {layers!r}: "
                "split_stages cannot place them; give first_stage=... a submodule path"
            )
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path == layers:
                after = True
            elif any(is_under(path, p) for p in first):
                placed[path] = 0
            elif is_under(layers, path) or any(is_under(p, path) for p in first):
                walk(child, path)
            elif next(child.parameters(), None) is not None:
                placed[path] = len(ranges) - 1 if after else 0

    walk(model, "")
    return placed


def _check_shared(model: nn.Module, placed: dict[str, int]) -> None:
    where: dict[int, tuple[str, int]] = {}
    for path, stage in placed.items():
        for name, param in model.get_submodule(path).named_parameters(remove_duplicate=False):
            seen = where.setdefault(id(param), (f"{path}.{name}", stage))
            if seen[1] != stage:
                raise ValueError(
                    f"parameter {seen[0]} (stage {seen[1]}) is the same tensor as "
                    f"{path}.{name} (stage {stage}): a parameter cannot live on two "
                    "pipeline stages; untie them (e.g. tie_word_embeddings=False) or keep "
                    "both modules on one stage"
                )


def check_stages(
    stages: Sequence[nn.Module], *, parallelizer: MultimodalParallelizer
) -> list[ShardingPlan]:
    """Plan every stage and refuse what would stop one stage in the middle of a pipeline
    step. Call it on every rank with all stages: every rank raises the same error.

    Args:
        stages: every stage module of the pipeline, stage 0 first.
        parallelizer: the parallelizer that will shard each stage.

    Returns:
        Each stage's plan, in stage order.

    Raises:
        ValueError: a tower or projector off the first stage, or a stage whose plan has
            media regions.
    """
    plans = []
    for index, stage in enumerate(stages):
        found = parallelizer.discover(stage)
        if index and found.paths:
            raise ValueError(
                f"pipeline stage {index} holds the towers or projectors {found.paths}; media "
                "enter the pipeline at its first stage: place them on stage 0 "
                "(split_stages(..., first_stage=(...)))"
            )
        plan = parallelizer.plan(stage, discovery=found)
        if plan.hook("schedule_check") is not None:
            raise ValueError(
                f"pipeline stage {index}'s plan has media regions (units that run only with "
                "media, checked by the schedule_check hook): a step where some data-parallel "
                "ranks' microbatches have media and others' not would stop that stage with "
                "UnevenMediaError while the other stages wait in the pipeline's send/recv. "
                "Use balance_media=True, uneven_media=True, or "
                "frozen_multimodal_sharding='root' or 'replicate' with trainable towers frozen"
            )
        plans.append(plan)
    return plans
