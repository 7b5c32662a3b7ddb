"""Pipeline stages of a vision-language model, for torch's ``pipelining``.

Pipeline parallelism (PP) runs consecutive parts of the model on different ranks. For a
VLM the natural cut keeps the towers and projectors with the first decoder layers on
stage 0 (a stage's media never leave it; only hidden states travel) and the last
layers with the final norm and the head on the last stage. ``split_stages`` makes one
module per stage from the whole model (build it on ``meta``: the copies cost nothing),
each keeping the model's qualified names (``model.layers.3`` stays ``model.layers.3``:
checkpoints, plans and per-module policies read the same names), and checks the cut
before any rank builds a ``PipelineStage``. What a stage *computes* is model code: the
caller gives each stage its ``forward``. Each stage module is then sharded by the
library over the stage's data-parallel ranks, like any model
(``parallelize(stage, mesh=world, dp_dims="dp")`` on a ``('pp', 'dp')`` mesh), and
driven by torch's schedules (``ScheduleGPipe``, ``Schedule1F1B``).

An error raised inside one stage's step stops that stage's ranks while the others wait
in the pipeline's send and receive, so what the library would stop at run time is
refused before: ``check_stages`` plans every stage on every rank (the same answer
everywhere, no communication) and refuses towers off the first stage and media regions
(units that run only with media, whose uneven steps the ``schedule_check`` hook stops).
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
    sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    return [range(s, s + n) for s, n in zip(starts, sizes, strict=True)]


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

    Stage ``i`` holds the items of ``layers`` in its range (``boundaries``: the first
    layer index of stages 1..n-1; default even, see ``stage_layer_ranges``), the
    container kept as an ``nn.ModuleDict`` keyed by the items' original indices. The
    other modules with parameters go by where they are registered: before ``layers``
    (embeddings, towers, projectors) to stage 0, after it (final norm, head) to the last
    stage; ``first_stage`` names more paths for stage 0. Modules without parameters
    (rotary tables) stay on every stage. A module that leaves a stage is set to ``None``.

    ``forwards[i]`` becomes stage ``i``'s ``forward`` (called as ``forward(stage,
    *inputs)``); without ``forwards`` the stages keep the model's, for planning and
    estimates only.

    Args:
        model: the whole model (on ``meta``: each stage starts as a copy of it).
        layers: path of the decoder layer container, e.g. ``"model.layers"``.
        num_stages: pipeline stages.
        forwards: each stage's forward, as functions of ``(stage, *inputs)``.
        first_stage: paths of more modules for stage 0 (a tower registered late).
        boundaries: the first layer index of each stage after the first.

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
    """The stage of each maximal module with parameters: layer items by range, ``first``
    on stage 0, the rest by registration order around the layer container."""
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
    """Plan every stage with ``parallelizer`` and refuse what would stop one stage in the
    middle of a pipeline step; returns the plans (stage ``i``'s for its ranks'
    ``parallelizer.apply_plan``, or for the estimates). Call it on every rank with all
    stages (on ``meta``): every rank raises the same error, before any stage runs.

    Args:
        stages: every stage module of the pipeline, stage 0 first.
        parallelizer: the parallelizer that will shard each stage.

    Returns:
        Each stage's plan, in stage order.

    Raises:
        ValueError: a tower or projector on a stage other than the first (media enter
            at stage 0), or a stage whose plan has media regions (a step where some
            ranks' microbatches have media and others' not would raise
            ``UnevenMediaError`` on that stage only): use ``balance_media=True``,
            ``uneven_media=True`` or the ``root`` / ``replicate`` policy.
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
