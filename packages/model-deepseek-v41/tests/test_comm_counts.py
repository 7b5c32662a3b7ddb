"""FSDP units and collectives per training step, counted under the fake process group.

One step = forward + backward of one batch with images (2 samples x 1 image,
16 tokens), ``mixed_precision_policy("bf16", "fp32")``, world size 2, tiny text
model (2 layers), the model built in bf16 (vision norms fp32).

With a *trainable* vision tower (``PARALLELIZER``, frozen policy ``root``,
irrelevant here) three layouts of the vision norms are compared:

- ``grouped``: the shipped behaviour on torch 2.13, all 2L+1 fp32 norms in one unit;
- ``per_norm``: ``compat.GROUPED_PER_MODULE_CASTING`` patched to False, one unit per norm;
- ``none``: baseline without fp32 units: the norm weights cast to bf16 through
  ``.data`` (bypassing the fp32 pin) and sharded by the plain
  ``MultimodalParallelizer``, which has no norm rule, so they stay in the blocks.

With a *frozen* tower each frozen-tower policy is measured; its 2L+1 fp32 norms
are replicated (no unit, no collective after the one broadcast at setup).

The runtime hooks that guard diverging ranks (the forward agreement before every call
of the model; where the tower's blocks are units, the schedule check at the tower's
entry and the first text layer after it) meet at the c10d store: no collective in
forward beside FSDP's own. Every step ends its backward with one all-reduce of the
usage flags of the trainable parameters (the ``unused_params`` hook).

The numbers are exact (collectives are counted as ``c10d`` ops by
:class:`fsdp_core.CommCounter`) and are quoted in the package README (checked
here); run ``pytest -s -k table`` on this file to print the tables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from fsdp_core import CommCounter, build_mesh, compat, mixed_precision_policy
from fsdp_core.fake_group import fake_process_group
from model_deepseek_v41 import PARALLELIZER, DeepseekV41Config, build_deepseek_v41, make_batch
from model_deepseek_v41.layers import RMSNorm
from multimodal_fsdp import MultimodalParallelizer

WORLD_SIZE = 2
TOWER_DEPTHS = (4, 8)
MODES = ("grouped", "per_norm", "none")
POLICIES = ("root", "per_layer", "replicate")
README = Path(__file__).resolve().parents[1] / "README.md"


@dataclass(frozen=True)
class StepCounts:
    """Units and collectives of one training step."""

    planned_units: int
    units: int  # distinct FSDP states after applying the plan
    fp32_norm_units: int
    replicated_params: int
    broadcasts_setup: int  # while parallelizing (replicated parameters, from rank 0)
    all_reduces_forward: int
    all_reduces_backward: int
    all_gathers_forward: int
    all_gathers_backward: int
    reduce_scatters: int
    broadcast_bytes_setup: int
    all_gather_bytes_forward: int
    all_gather_bytes_backward: int
    reduce_scatter_bytes: int


#: What was measured (torch 2.13, CPU), trainable tower: (vision blocks L, mode) -> counts.
#: units = L + 4 grouped (1 norm unit + L blocks + 2 text layers + root, which holds the
#: aligner), 3L + 4 one unit per norm, L + 3 without fp32 units. The root is not
#: re-gathered in backward (it keeps its parameters after forward), hence one all-gather
#: fewer. No all-reduce in forward: the forward agreement and the two schedule
#: checkpoints (the blocks are units) meet at the c10d store.
EXPECTED: dict[tuple[int, str], tuple[int, int, int, int, int, int]] = {
    # (units, fp32 norm units, all-gathers fwd, all-gathers bwd, reduce-scatters,
    #  all-reduces fwd)
    (4, "grouped"): (8, 1, 8, 7, 8, 0),
    (4, "per_norm"): (16, 9, 16, 15, 16, 0),
    (4, "none"): (7, 0, 7, 6, 7, 0),
    (8, "grouped"): (12, 1, 12, 11, 12, 0),
    (8, "per_norm"): (28, 17, 28, 27, 28, 0),
    (8, "none"): (11, 0, 11, 10, 11, 0),
}

#: Frozen tower, grouped norms: (vision blocks L, policy) -> counts. Only the text layers
#: and the root are trainable (3 reduce-scatters); in backward only the text layers are
#: re-gathered (no gradient reaches the frozen tower, and the backward-prefetch guard
#: keeps FSDP from prefetching its last block).
EXPECTED_FROZEN: dict[tuple[int, str], tuple[int, int, int, int, int, int, int, int]] = {
    # (units, fp32 norm units, replicated params, broadcasts at setup, all-gathers fwd,
    #  all-gathers bwd, reduce-scatters, all-reduces fwd)
    (4, "root"): (3, 0, 9, 9, 3, 2, 3, 0),
    (4, "per_layer"): (7, 0, 9, 9, 7, 2, 3, 0),
    (4, "replicate"): (3, 0, 43, 43, 3, 2, 3, 0),
    (8, "root"): (3, 0, 17, 17, 3, 2, 3, 0),
    (8, "per_layer"): (11, 0, 17, 17, 11, 2, 3, 0),
    (8, "replicate"): (3, 0, 83, 83, 3, 2, 3, 0),
}


def _dtensors(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    from torch.distributed.tensor import DTensor

    return {p for p in model.parameters() if isinstance(p, DTensor)}


def _count_step(counter: CommCounter, model: torch.nn.Module, config: DeepseekV41Config) -> None:
    batch = make_batch(config, batch_size=2, seq_len=16, num_images_per_sample=1, seed=0)
    with counter:
        with counter.phase("forward"):
            loss = model(**batch)
        with counter.phase("backward"):
            loss.backward()
    model.zero_grad(set_to_none=True)


def _run(vision_layers: int, *, frozen_tower: bool, policy: str, bf16_norms: bool) -> StepCounts:
    """Build, parallelize and run two steps; return the counts of the second (steady) one."""
    config = DeepseekV41Config.tiny(vision_layers=vision_layers)
    mp_policy = mixed_precision_policy("bf16", "fp32")
    parallelizer: MultimodalParallelizer = PARALLELIZER.with_options(
        frozen_multimodal_sharding=policy
    )
    if bf16_norms:
        parallelizer = MultimodalParallelizer(
            frozen_multimodal_sharding=policy, extra_tower_names=("vision",)
        )
    with fake_process_group(WORLD_SIZE):
        model = build_deepseek_v41(config, dtype=torch.bfloat16)
        if frozen_tower:
            model.vision.requires_grad_(False)
        if bf16_norms:
            for module in model.vision.modules():
                if isinstance(module, RMSNorm):
                    module.weight.data = module.weight.data.to(torch.bfloat16)
        plan = parallelizer.plan(model, mp_policy=mp_policy)
        setup = CommCounter()
        with setup:
            parallelizer.parallelize(model, mesh=build_mesh(), mp_policy=mp_policy)
        states = {id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)}
        first, second = CommCounter(), CommCounter()
        _count_step(first, model, config)
        _count_step(second, model, config)
    # Every step issues the same collectives (the first one included).
    assert [(r.kind, r.phase, r.nbytes) for r in first.records] == [
        (r.kind, r.phase, r.nbytes) for r in second.records
    ]
    # Setup only broadcasts (the replicated parameters, once each).
    assert set(setup.counts()) <= {"broadcast"}
    # A step: all-gathers and reduce-scatters (the runtime hooks' agreement meets at the
    # store, no collective in forward) and the usage flags of the trainable parameters at
    # the end of backward; no broadcast.
    assert second.records[0].kind == "all_gather"
    assert [r for r in second.records if r.kind == "all_reduce" and r.phase == "forward"] == []
    flags = [r for r in second.records if r.kind == "all_reduce" and r.phase == "backward"]
    trainable = sum(1 for p in model.parameters() if p.requires_grad and p in _dtensors(model))
    assert [(r.nbytes, r.dtype) for r in flags] == [(trainable, torch.uint8)]
    assert second.records[-1].kind == "all_reduce"  # the flags come last
    assert set(second.counts()) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert "reduce_scatter" not in second.counts("forward")
    forward, backward = second.counts("forward"), second.counts("backward")
    return StepCounts(
        planned_units=len(plan.units),
        units=len(states),
        fp32_norm_units=plan.role_counts().get("fp32_norms", 0),
        replicated_params=len(plan.replicated_param_names),
        broadcasts_setup=setup.counts().get("broadcast", 0),
        all_reduces_forward=forward.get("all_reduce", 0),
        all_reduces_backward=backward.get("all_reduce", 0),
        all_gathers_forward=forward["all_gather"],
        all_gathers_backward=backward.get("all_gather", 0),
        reduce_scatters=backward["reduce_scatter"],
        broadcast_bytes_setup=setup.bytes().get("broadcast", 0),
        all_gather_bytes_forward=second.bytes("forward")["all_gather"],
        all_gather_bytes_backward=second.bytes("backward").get("all_gather", 0),
        reduce_scatter_bytes=second.bytes("backward")["reduce_scatter"],
    )


@functools.cache
def measure(vision_layers: int, mode: str) -> StepCounts:
    """A trainable tower with its norms laid out as ``mode`` says."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    with pytest.MonkeyPatch.context() as patch:
        if mode == "per_norm":
            patch.setattr(compat, "GROUPED_PER_MODULE_CASTING", False)
        return _run(vision_layers, frozen_tower=False, policy="root", bf16_norms=mode == "none")


@functools.cache
def measure_frozen(vision_layers: int, policy: str) -> StepCounts:
    """A frozen tower under the frozen-tower ``policy`` (norms grouped where trainable)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    return _run(vision_layers, frozen_tower=True, policy=policy, bf16_norms=False)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("vision_layers", TOWER_DEPTHS)
def test_exact_counts(vision_layers: int, mode: str) -> None:
    counts = measure(vision_layers, mode)
    assert counts.units == counts.planned_units
    assert (
        counts.units,
        counts.fp32_norm_units,
        counts.all_gathers_forward,
        counts.all_gathers_backward,
        counts.reduce_scatters,
        counts.all_reduces_forward,
    ) == EXPECTED[(vision_layers, mode)]
    # One all-gather per unit in forward, every unit but the root re-gathered in
    # backward, one reduce-scatter per (trainable) unit, one flags.
    assert counts.all_gathers_forward == counts.units
    assert counts.all_gathers_backward == counts.units - 1
    assert counts.reduce_scatters == counts.units
    assert counts.all_reduces_forward == 0
    assert counts.all_reduces_backward == 1
    # Nothing is replicated: the tower is trainable.
    assert (counts.replicated_params, counts.broadcasts_setup) == (0, 0)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("vision_layers", TOWER_DEPTHS)
def test_exact_counts_with_a_frozen_tower(vision_layers: int, policy: str) -> None:
    counts = measure_frozen(vision_layers, policy)
    assert counts.units == counts.planned_units
    assert (
        counts.units,
        counts.fp32_norm_units,
        counts.replicated_params,
        counts.broadcasts_setup,
        counts.all_gathers_forward,
        counts.all_gathers_backward,
        counts.reduce_scatters,
        counts.all_reduces_forward,
    ) == EXPECTED_FROZEN[(vision_layers, policy)]
    norms = 2 * vision_layers + 1
    # No fp32 norm unit under any policy: the frozen norms are replicated, broadcast once
    # at setup in fp32 (under replicate together with the rest of the frozen tower).
    assert counts.fp32_norm_units == 0
    assert counts.broadcasts_setup == counts.replicated_params
    if policy != "replicate":
        assert counts.replicated_params == norms
        hidden = DeepseekV41Config.tiny().vision_hidden
        assert counts.broadcast_bytes_setup == norms * hidden * 4
    # The forward agreement and the schedule check meet at the store under every policy.
    assert counts.all_reduces_forward == 0
    assert counts.all_reduces_backward == 1
    assert counts.all_gathers_forward == counts.units
    # Only the text layers are re-gathered in backward; text layers and root reduce.
    text_layers = DeepseekV41Config.tiny().text_layers
    assert counts.all_gathers_backward == text_layers
    assert counts.reduce_scatters == text_layers + 1


@pytest.mark.parametrize("vision_layers", TOWER_DEPTHS)
def test_frozen_norms_move_no_bytes(vision_layers: int) -> None:
    """Frozen, the 2L+1 fp32 norms leave the step's all-gathers; gradients are only
    reduced for the text layers and the root, whatever the policy."""
    trainable = measure(vision_layers, "grouped")
    root, per_layer, replicate = (measure_frozen(vision_layers, p) for p in POLICIES)
    hidden = DeepseekV41Config.tiny().vision_hidden
    norms = 2 * vision_layers + 1
    assert trainable.all_gather_bytes_forward - root.all_gather_bytes_forward == norms * hidden * 4
    # per_layer gathers the same bytes as root, block by block (L more all-gathers).
    assert per_layer.all_gather_bytes_forward == root.all_gather_bytes_forward
    assert per_layer.all_gathers_forward - root.all_gathers_forward == vision_layers
    # replicate gathers no tower bytes at all: it broadcast them (bf16, norms fp32) once.
    tower_bytes = replicate.broadcast_bytes_setup
    assert root.all_gather_bytes_forward - replicate.all_gather_bytes_forward == (
        tower_bytes - norms * hidden * 4
    )
    for frozen in (root, per_layer, replicate):
        assert frozen.all_gather_bytes_backward == root.all_gather_bytes_backward
        assert frozen.reduce_scatter_bytes == root.reduce_scatter_bytes


@pytest.mark.parametrize("vision_layers", TOWER_DEPTHS)
def test_grouping_saves_2l_units(vision_layers: int) -> None:
    grouped = measure(vision_layers, "grouped")
    per_norm = measure(vision_layers, "per_norm")
    saved = 2 * vision_layers  # 2L + 1 norm units become 1
    assert per_norm.fp32_norm_units == 2 * vision_layers + 1
    assert grouped.fp32_norm_units == 1
    assert per_norm.units - grouped.units == saved
    assert per_norm.all_gathers_forward - grouped.all_gathers_forward == saved
    assert per_norm.all_gathers_backward - grouped.all_gathers_backward == saved
    assert per_norm.reduce_scatters - grouped.reduce_scatters == saved
    # Grouping changes the number of collectives, not the volume.
    assert per_norm.all_gather_bytes_forward == grouped.all_gather_bytes_forward
    assert per_norm.all_gather_bytes_backward == grouped.all_gather_bytes_backward
    assert per_norm.reduce_scatter_bytes == grouped.reduce_scatter_bytes


@pytest.mark.parametrize("vision_layers", TOWER_DEPTHS)
def test_grouped_norm_overhead_is_one_collective_each(vision_layers: int) -> None:
    """Against no fp32 units: +1 all-gather forward, +1 backward, +1 reduce-scatter per tower."""
    grouped = measure(vision_layers, "grouped")
    baseline = measure(vision_layers, "none")
    assert grouped.units - baseline.units == 1
    assert grouped.all_gathers_forward - baseline.all_gathers_forward == 1
    assert grouped.all_gathers_backward - baseline.all_gathers_backward == 1
    assert grouped.reduce_scatters - baseline.reduce_scatters == 1
    # The 2L+1 norm weights travel in fp32 instead of bf16 (2 more bytes per element);
    # gradients are reduced in fp32 either way.
    hidden = DeepseekV41Config.tiny().vision_hidden
    norms = 2 * vision_layers + 1
    assert (
        grouped.all_gather_bytes_forward - baseline.all_gather_bytes_forward == norms * hidden * 2
    )
    # In backward the baseline re-gathers only the 2L block norms (bf16, inside the blocks):
    # its final norm lives in the root unit, which is not re-gathered. The norm unit is.
    assert grouped.all_gather_bytes_backward - baseline.all_gather_bytes_backward == (
        norms * hidden * 4 - (norms - 1) * hidden * 2
    )
    assert grouped.reduce_scatter_bytes == baseline.reduce_scatter_bytes


def test_measure_rejects_an_unknown_mode_or_policy() -> None:
    with pytest.raises(ValueError, match=r"unknown mode 'bogus'; expected one of"):
        measure(4, "bogus")
    with pytest.raises(ValueError, match=r"unknown policy 'bogus'; expected one of"):
        measure_frozen(4, "bogus")


def table_lines() -> list[str]:
    """The README table of the trainable tower."""
    labels = {
        "grouped": "fp32, grouped",
        "per_norm": "fp32, one unit each",
        "none": "bf16 (baseline)",
    }
    lines = [
        "| vision blocks | vision norms | fp32 norm units | FSDP units | all-gathers fwd "
        "| all-gathers bwd | reduce-scatters | all-reduces fwd | all-gather bytes fwd |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for depth in TOWER_DEPTHS:
        for mode in MODES:
            c = measure(depth, mode)
            lines.append(
                f"| {depth} | {labels[mode]} | {c.fp32_norm_units} | {c.units} "
                f"| {c.all_gathers_forward} | {c.all_gathers_backward} | {c.reduce_scatters} "
                f"| {c.all_reduces_forward} | {c.all_gather_bytes_forward:,} |"
            )
    return lines


def frozen_table_lines() -> list[str]:
    """The README table of the frozen tower."""
    lines = [
        "| vision blocks | frozen policy | replicated params | FSDP units | broadcasts at setup "
        "| all-gathers fwd | all-gathers bwd | reduce-scatters | all-reduces fwd "
        "| all-gather bytes fwd |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for depth in TOWER_DEPTHS:
        for policy in POLICIES:
            c = measure_frozen(depth, policy)
            lines.append(
                f"| {depth} | `{policy}` | {c.replicated_params} | {c.units} "
                f"| {c.broadcasts_setup} | {c.all_gathers_forward} | {c.all_gathers_backward} "
                f"| {c.reduce_scatters} | {c.all_reduces_forward} "
                f"| {c.all_gather_bytes_forward:,} |"
            )
    return lines


def test_table() -> None:
    """Print the README table of the trainable tower (visible with ``pytest -s``)."""
    lines = table_lines()
    print("\n" + "\n".join(lines))
    assert len(lines) == 2 + len(TOWER_DEPTHS) * len(MODES)


def test_frozen_table() -> None:
    """Print the README table of the frozen tower (visible with ``pytest -s``)."""
    lines = frozen_table_lines()
    print("\n" + "\n".join(lines))
    assert len(lines) == 2 + len(TOWER_DEPTHS) * len(POLICIES)


@pytest.mark.parametrize("lines", [table_lines, frozen_table_lines], ids=["trainable", "frozen"])
def test_readme_quotes_the_measured_tables(lines: Callable[[], list[str]]) -> None:
    table = "\n".join(lines())
    assert table in README.read_text(encoding="utf-8"), f"README.md should quote:\n{table}"
