"""The multimodal-fsdp benchmark: communication, memory and time of each sharding plan.

Run with ``nox -s bench`` (or ``python benchmarks/bench.py [--out FILE]``). It
prints one report of Markdown tables and writes the same numbers as JSON
(``bench-results/bench-<time>.json`` by default) for comparison between
versions. Sections:

1. Frozen-tower policies on the DeepSeek-V4.1 reference model (``small`` preset,
   vision tower of 4 and 16 blocks, frozen; world sizes 2, 8, 64): units,
   collectives and bytes of one training step measured under the fake process
   group, the plan's analytic minimum, their ratio, FSDP2's default (without the
   prefetch guard) for comparison, and peak gathered parameter bytes per rank.
2. DeepSeek-V4.1 fp32 vision norms (trainable tower): the grouped norm unit
   against one unit per norm (2L+1 units).
3. Peak parameter memory per rank of each policy on the ``base`` preset (plan only).
4. Plan-and-shard time on the meta device at 1x, 2x, 4x the ``base`` depth
   (4x = 96 text layers, 48 vision blocks) under a fake group of 64 ranks.
5. Step time on 2 real gloo ranks: the parallelizer against hand-written
   ``fully_shard`` calls of the same units, in the same run.
6. The runtime hooks' collectives per step, from the same gloo runs.
7. Memory per rank of one AdamW step on the ``small`` preset, predicted by the
   plan and measured by ``FSDPMemTracker`` under the fake group, per policy, and
   a chart of per-rank parameter memory over the step (``--chart``, default
   docs/img/memory-timeline.png; needs matplotlib, a benchmark-only dependency).
8. Balanced media on 2 and 4 real gloo ranks (``balance_media.py``, one launch per world
   size): step time with ``balance_media=True`` over step time without, for an even
   distribution of images, a 3:1 skew and all images on one rank; the tower's time per
   rank (max / mean); the exchange's collectives, bytes, time and share of the step, with
   the machine's load per row; and a chart of each rank's step timeline under the skew
   (``--balance-chart``, default docs/img/balanced-media-timeline.png). 8b: the exchange
   per rank at 64, 256 and 1,024 ranks under the fake group, balanced within groups of 8,
   the default group (``"auto"``) and over every rank, with the balance each group
   reaches under skewed media (``balance_scale.py``; ``python benchmarks/balance_scale.py``
   runs 8b alone). ``--only balance-media`` runs this section
   alone (``--balance-steps N`` timed steps per variant).

The analytic minimum of section 1 comes from ``analytic_minimum.py``, written
apart from the cost model it checks (docs/benchmark.md derives it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from analytic_minimum import analytic_minimum, minimum_totals
from balance_scale import measure_all as measure_balance_scale
from balance_scale import report as report_balance_scale
from torch import nn

from fsdp_core import ShardingPlan, build_mesh, mixed_precision_policy
from fsdp_core.collective_count import CommTally
from fsdp_core.fake_group import fake_process_group
from fsdp_core.testing import run_torchrun
from model_deepseek_v41 import PARALLELIZER, DeepseekV41Config, build_deepseek_v41, make_batch
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.estimate.costs import PlanCosts, plan_costs
from multimodal_fsdp.estimate.render import format_bytes
from multimodal_fsdp.estimate.rewrite import ungroup_units
from multimodal_fsdp.measure.comm import Measurement, measure_plan
from multimodal_fsdp.measure.memory import measure_plan_memory

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("root", "per_layer", "replicate")
TOWER_DEPTHS = (4, 16)
WORLD_SIZES = (2, 8, 64)
MP = mixed_precision_policy("bf16", "fp32")
SCALES = (1, 2, 4)

logger = logging.getLogger("bench")


# --------------------------------------------------------------------------- helpers
def _meta_to_cpu(config: DeepseekV41Config, *, frozen_tower: bool) -> Callable[[], nn.Module]:
    """A builder of the reference model with uninitialised CPU storage.

    Under the fake process group the values are meaningless anyway, so the
    (slow) deterministic init is skipped: only shapes, dtypes and the step's
    control flow matter for the collectives.
    """

    def build() -> nn.Module:
        model = build_deepseek_v41(config, dtype=torch.float32, device="meta")
        model.to_empty(device="cpu")
        if frozen_tower:
            model.vision.requires_grad_(False)
        return model

    return build


def _plan_and_measure(
    build: Callable[[], nn.Module],
    parallelizer: MultimodalParallelizer,
    loss: Callable[[nn.Module], torch.Tensor],
    *,
    world: int,
    transform: Callable[[ShardingPlan], ShardingPlan] | None = None,
    prefetch_guard: bool = True,
) -> Measurement:
    """Plan a fresh model (optionally rewriting the plan), then measure that plan: the
    measurement takes the plan and the model, no parallelizer."""
    model = build()
    plan = parallelizer.plan(model, mp_policy=MP)
    if transform is not None:
        plan = transform(plan)
    return measure_plan(plan, model, loss, world_size=world, prefetch_guard=prefetch_guard)


def _loss(config: DeepseekV41Config) -> Callable[[nn.Module], torch.Tensor]:
    batch = make_batch(config, batch_size=1, seq_len=64)

    def loss(model: nn.Module) -> torch.Tensor:
        value: torch.Tensor = model(**batch)
        return value

    return loss


def _ratio(measured: float, minimum: float) -> float:
    return 1.0 if measured == minimum else (measured / minimum if minimum else float("inf"))


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]
    lines = ["| " + " | ".join(h.ljust(widths[c]) for c, h in enumerate(header)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        lines.append("| " + " | ".join(str(v).ljust(widths[c]) for c, v in enumerate(row)) + " |")
    return "\n".join(lines)


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


# --------------------------------------------------------------------------- 1. policies
def bench_policies(depths: tuple[int, ...], worlds: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for depth in depths:
        config = DeepseekV41Config.small(vision_layers=depth)
        loss = _loss(config)
        build = _meta_to_cpu(config, frozen_tower=True)
        for world in worlds:
            for policy in POLICIES:
                parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
                guarded = _plan_and_measure(build, parallelizer, loss, world=world)
                default = _plan_and_measure(
                    build, parallelizer, loss, world=world, prefetch_guard=False
                )
                shapes = build_deepseek_v41(config, dtype=torch.float32, device="meta")
                shapes.vision.requires_grad_(False)
                count, nbytes = minimum_totals(analytic_minimum(guarded.plan, shapes, world))
                fsdp = _fsdp_only(guarded.measured.comm)
                fsdp_default = _fsdp_only(default.measured.comm)
                row = {
                    "vision_layers": depth,
                    "world_size": world,
                    "policy": policy,
                    "units": len(guarded.costs.units),
                    "measured_collectives": fsdp.count(),
                    "measured_bytes": fsdp.bytes(),
                    "other_collectives": guarded.measured.comm.count() - fsdp.count(),
                    "minimum_collectives": count,
                    "minimum_bytes": nbytes,
                    "ratio_collectives": _ratio(fsdp.count(), count),
                    "ratio_bytes": _ratio(fsdp.bytes(), nbytes),
                    "plan_matches_measured": guarded.matches and default.matches,
                    "fsdp2_default_collectives": fsdp_default.count(),
                    "fsdp2_default_bytes": fsdp_default.bytes(),
                    "fsdp2_default_ratio_bytes": _ratio(fsdp_default.bytes(), nbytes),
                    "tower_collectives": _tower_collectives(guarded),
                    "peak_gathered_forward_bytes": guarded.costs.peak_gathered_forward_bytes,
                    "peak_gathered_backward_bytes": guarded.costs.peak_gathered_backward_bytes,
                    "collectives": guarded.measured.comm.as_dict(),
                }
                rows.append(row)
                logger.info("policies: %s", {k: row[k] for k in list(row)[:10]})
    return rows


def _fsdp_only(tally: CommTally) -> CommTally:
    """FSDP's own collectives (all-gathers, reduce-scatters): the runtime hooks' all-reduces
    are not part of the minimum and are reported apart."""
    kept = CommTally()
    for (phase, kind), count in tally.counts.items():
        if kind in ("all_gather", "reduce_scatter"):
            kept.add(phase, kind, tally.nbytes.get((phase, kind), 0), count)
    return kept


def _tower_collectives(result: Measurement) -> dict[str, int]:
    """The frozen tower's own collectives (analytic per unit; matches the measured total)."""
    counts: dict[str, int] = {}
    for unit in result.costs.units:
        if unit.paths[0].startswith("vision"):
            for (phase, kind), n in unit.comm.counts.items():
                counts[f"{phase} {kind}"] = counts.get(f"{phase} {kind}", 0) + n
    return counts


def format_policies(rows: list[dict[str, Any]]) -> str:
    header = [
        "L",
        "world",
        "policy",
        "units",
        "FSDP coll. measured",
        "MiB measured",
        "coll. minimum",
        "MiB minimum",
        "ratio",
        "FSDP2 default coll. / ratio",
        "hook all-reduces",
        "tower coll.",
        "peak fwd MiB",
        "peak bwd MiB",
    ]
    table = []
    for r in rows:
        tower = ", ".join(f"{v} {k}" for k, v in sorted(r["tower_collectives"].items())) or "0"
        table.append(
            [
                str(r["vision_layers"]),
                str(r["world_size"]),
                r["policy"],
                str(r["units"]),
                str(r["measured_collectives"]),
                _mib(r["measured_bytes"]),
                str(r["minimum_collectives"]),
                _mib(r["minimum_bytes"]),
                f"{r['ratio_collectives']:.2f} / {r['ratio_bytes']:.2f}"
                + ("" if r["plan_matches_measured"] else " (!)"),
                f"{r['fsdp2_default_collectives']} / {r['fsdp2_default_ratio_bytes']:.3f}",
                str(r["other_collectives"]),
                tower,
                _mib(r["peak_gathered_forward_bytes"]),
                _mib(r["peak_gathered_backward_bytes"]),
            ]
        )
    return _table(header, table)


# --------------------------------------------------------------------------- 2. fp32 norms
def bench_norms(depths: tuple[int, ...], world: int) -> list[dict[str, Any]]:
    rows = []
    for depth in depths:
        config = DeepseekV41Config.small(vision_layers=depth)
        loss = _loss(config)
        build = _meta_to_cpu(config, frozen_tower=False)
        for layout in ("grouped", "per_norm"):
            transform = (
                (lambda p: ungroup_units(p, role="fp32_norms")) if layout == "per_norm" else None
            )
            result = _plan_and_measure(build, PARALLELIZER, loss, world=world, transform=transform)
            norm_units = [u for u in result.costs.units if u.role == "fp32_norms"]
            extra = {
                "all_gather_forward": sum(
                    u.comm.count("all_gather", "forward") for u in norm_units
                ),
                "all_gather_backward": sum(
                    u.comm.count("all_gather", "backward") for u in norm_units
                ),
                "reduce_scatter": sum(u.comm.count("reduce_scatter") for u in norm_units),
                "bytes": sum(u.comm.bytes() for u in norm_units),
            }
            rows.append(
                {
                    "vision_layers": depth,
                    "world_size": world,
                    "layout": layout,
                    "norm_units": len(norm_units),
                    "extra": extra,
                    "measured_collectives": result.measured.comm.count(),
                    "measured_bytes": result.measured.comm.bytes(),
                    "plan_matches_measured": result.matches,
                }
            )
    return rows


def format_norms(rows: list[dict[str, Any]]) -> str:
    header = [
        "L",
        "layout",
        "fp32-norm units",
        "extra AG fwd",
        "extra AG bwd",
        "extra RS",
        "extra KiB",
        "step coll. measured",
        "vs grouped",
    ]
    grouped = {r["vision_layers"]: r for r in rows if r["layout"] == "grouped"}
    table = []
    for r in rows:
        base = grouped[r["vision_layers"]]
        e = r["extra"]
        table.append(
            [
                str(r["vision_layers"]),
                r["layout"] + ("" if r["plan_matches_measured"] else " (!)"),
                str(r["norm_units"]),
                str(e["all_gather_forward"]),
                str(e["all_gather_backward"]),
                str(e["reduce_scatter"]),
                f"{e['bytes'] / 1024:.1f}",
                str(r["measured_collectives"]),
                f"+{r['measured_collectives'] - base['measured_collectives']}",
            ]
        )
    return _table(header, table)


# --------------------------------------------------------------------------- 3. memory
def bench_memory(depths: tuple[int, ...], worlds: tuple[int, ...]) -> list[dict[str, Any]]:
    rows = []
    for depth in depths:
        config = DeepseekV41Config.base(vision_layers=depth)
        for world in worlds:
            for policy in POLICIES:
                model = build_deepseek_v41(config, dtype=torch.float32, device="meta")
                model.vision.requires_grad_(False)
                parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
                plan = parallelizer.plan(model, mp_policy=MP)
                costs = plan_costs(plan, model, world_size=world)
                rows.append(_memory_row(costs, depth, world, policy, model))
    return rows


def _memory_row(
    costs: PlanCosts, depth: int, world: int, policy: str, model: nn.Module
) -> dict[str, Any]:
    tower = sum(p.numel() for p in model.get_submodule("vision").parameters())
    return {
        "vision_layers": depth,
        "world_size": world,
        "policy": policy,
        "tower_params": tower,
        "sharded_param_bytes": costs.sharded_param_bytes,
        "replicated_param_bytes": costs.replicated_param_bytes,
        "peak_gathered_forward_bytes": costs.peak_gathered_forward_bytes,
        "peak_gathered_backward_bytes": costs.peak_gathered_backward_bytes,
        "total_backward_peak_bytes": costs.sharded_param_bytes
        + costs.replicated_param_bytes
        + costs.peak_gathered_backward_bytes,
        "collectives": costs.comm.count(),
        "bytes": costs.comm.bytes(),
    }


def format_memory(rows: list[dict[str, Any]]) -> str:
    header = [
        "L",
        "world",
        "policy",
        "sharded MiB",
        "replicated MiB",
        "peak gathered fwd MiB",
        "peak gathered bwd MiB",
        "params at bwd peak MiB",
        "vs per_layer",
    ]
    ref = {
        (r["vision_layers"], r["world_size"]): r["total_backward_peak_bytes"]
        for r in rows
        if r["policy"] == "per_layer"
    }
    table = []
    for r in rows:
        delta = r["total_backward_peak_bytes"] - ref[(r["vision_layers"], r["world_size"])]
        table.append(
            [
                str(r["vision_layers"]),
                str(r["world_size"]),
                r["policy"],
                _mib(r["sharded_param_bytes"]),
                _mib(r["replicated_param_bytes"]),
                _mib(r["peak_gathered_forward_bytes"]),
                _mib(r["peak_gathered_backward_bytes"]),
                _mib(r["total_backward_peak_bytes"]),
                ("+" if delta >= 0 else "-") + format_bytes(abs(delta)),
            ]
        )
    return _table(header, table)


# --------------------------------------------------------------------------- 4. scaling
def bench_scaling(scales: tuple[int, ...], world: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for scale in scales:
        config = DeepseekV41Config.base(text_layers=24 * scale, vision_layers=12 * scale)
        plan_s, cost_s, shard_s = [], [], []
        modules = units = 0
        for _ in range(repeats):
            model = build_deepseek_v41(config, dtype=torch.bfloat16, device="meta")
            model.vision.requires_grad_(False)
            parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding="per_layer")
            with fake_process_group(world):
                mesh = build_mesh()
                t0 = time.perf_counter()
                plan = parallelizer.plan(model, mp_policy=MP)
                t1 = time.perf_counter()
                plan_costs(plan, model, world_size=world)
                t2 = time.perf_counter()
                parallelizer.apply_plan(model, plan, mesh=mesh)
                t3 = time.perf_counter()
            plan_s.append(t1 - t0)
            cost_s.append(t2 - t1)
            shard_s.append(t3 - t2)
            modules = sum(1 for _ in model.modules())
            units = len(plan.units)
        rows.append(
            {
                "scale": scale,
                "text_layers": config.text_layers,
                "vision_layers": config.vision_layers,
                "world_size": world,
                "modules": modules,
                "units": units,
                "plan_s": min(plan_s),
                "costs_s": min(cost_s),
                "shard_s": min(shard_s),
            }
        )
    base = rows[0]
    per_module = (base["plan_s"] + base["shard_s"]) / base["modules"]
    for row in rows:
        total = row["plan_s"] + row["shard_s"]
        row["plan_and_shard_s"] = total
        row["time_per_module_vs_1x"] = total / row["modules"] / per_module
    return rows


def format_scaling(rows: list[dict[str, Any]]) -> str:
    header = [
        "size",
        "text layers",
        "vision blocks",
        "modules",
        "units",
        "plan s",
        "shard s",
        "plan+shard s",
        "costs s",
        "time/module vs 1x",
    ]
    table = [
        [
            f"{r['scale']}x",
            str(r["text_layers"]),
            str(r["vision_layers"]),
            str(r["modules"]),
            str(r["units"]),
            f"{r['plan_s']:.3f}",
            f"{r['shard_s']:.3f}",
            f"{r['plan_and_shard_s']:.3f}",
            f"{r['costs_s']:.3f}",
            f"{r['time_per_module_vs_1x']:.2f}",
        ]
        for r in rows
    ]
    return _table(header, table)


# --------------------------------------------------------------------------- 5. gloo
def bench_gloo(steps: int, policies: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    script = Path(__file__).with_name("gloo_step.py")
    for policy in policies:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "gloo.json"
            run_torchrun(
                str(script),
                nproc=2,
                args=[str(out), "--steps", str(steps), "--policy", policy],
                timeout_s=300,
            )
            rows.append(json.loads(out.read_text()))
    return rows


def format_gloo(rows: list[dict[str, Any]]) -> str:
    header = [
        "policy",
        "ranks",
        "params",
        "steps",
        "ours ms",
        "hand-written ms",
        "ratio",
        "loss diff",
        "collectives ours / hand",
        "both match plan",
    ]
    table = []
    for r in rows:
        coll = r["collectives"]
        count = {
            k: sum(v["count"] for phase in coll[k].values() for v in phase.values()) for k in coll
        }
        table.append(
            [
                r["policy"],
                str(r["world_size"]),
                f"{r['params'] / 1e6:.1f}M",
                str(r["steps"]),
                f"{r['median_step_s']['ours'] * 1e3:.1f}",
                f"{r['median_step_s']['manual'] * 1e3:.1f}",
                f"{r['ratio_ours_to_manual']:.2f}",
                f"{r['max_loss_difference']:.1e}",
                f"{count['ours']} / {count['manual']}",
                str(r["ours_matches_plan"] and r["manual_matches_plan_without_guard"]),
            ]
        )
    return _table(header, table)


def format_hooks(rows: list[dict[str, Any]]) -> str:
    """What the runtime hooks cost per step (from the same gloo runs as section 5): the
    divergence guards meet at the c10d store (no collective), so the only hook collective
    of a steady-state step is the usage-flags all-reduce of ``unused_params``."""
    header = [
        "policy",
        "hooks installed",
        "hook collectives / step",
        "agreement meetings / forward",
        "one meeting ms",
        "unused-params all-reduce ms",
        "hook ms / step",
        "share of step",
    ]
    table = []
    for r in rows:
        hooks = r["hooks"]
        meeting = hooks.get("meeting_ms", 0.0)
        per_step = hooks["meetings_per_forward"] * meeting + hooks["unused_params_ms"]
        step_ms = r["median_step_s"]["ours"] * 1e3
        table.append(
            [
                r["policy"],
                ", ".join(hooks["installed"]) or "none",
                str(hooks["all_reduces_per_step"]),
                str(hooks["meetings_per_forward"]),
                f"{meeting:.3f}",
                f"{hooks['unused_params_ms']:.3f} ({hooks['unused_params_flags']} B)",
                f"{per_step:.2f}",
                f"{per_step / step_ms:.1%}",
            ]
        )
    return _table(header, table)


# --------------------------------------------------------------------------- 7. measured memory
CHART = ROOT / "docs" / "img" / "memory-timeline.png"
MEMORY_WORLD = 8
_CHART_POINTS = 600


def bench_measured_memory(depth: int, world: int) -> list[dict[str, Any]]:
    """Predicted and measured per-rank memory of one AdamW step, per policy (fake group)."""
    config = DeepseekV41Config.small(vision_layers=depth)
    loss = _loss(config)
    build = _meta_to_cpu(config, frozen_tower=True)
    rows = []
    for policy in POLICIES:
        parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
        model = build()
        plan = parallelizer.plan(model, mp_policy=MP)
        result = measure_plan_memory(plan, model, loss, world_size=world)
        predicted, measured = result.costs.memory, result.measured
        assert predicted is not None
        resting = measured.sharded_param_bytes + measured.replicated_param_bytes
        points = measured.timeline
        stride = max(1, len(points) // _CHART_POINTS)
        rows.append(
            {
                "vision_layers": depth,
                "world_size": world,
                "policy": policy,
                "predicted": predicted.as_dict(),
                "measured": measured.as_dict(),
                "timeline": [
                    {"phase": p.phase, "param_bytes": resting + p.gathered_bytes}
                    for p in points[::stride]
                ],
            }
        )
    return rows


_MEMORY_FIGURES = (
    ("sharded_param_bytes", "sharded"),
    ("replicated_param_bytes", "replicated"),
    ("peak_gathered_forward_bytes", "gathered fwd"),
    ("peak_gathered_backward_bytes", "gathered bwd"),
    ("gradient_bytes", "grads"),
    ("optimizer_bytes", "AdamW"),
    ("activation_bytes", "activations"),
    ("peak_bytes", "peak total"),
)


def format_measured_memory(rows: list[dict[str, Any]]) -> str:
    header = ["policy", *(label + " MiB pred / meas" for _, label in _MEMORY_FIGURES)]
    table = []
    for r in rows:
        cells = [r["policy"]]
        for key, _ in _MEMORY_FIGURES:
            pred, meas = r["predicted"][key], r["measured"][key]
            cells.append(
                f"{_mib(meas)}"
                if pred == meas
                else f"{_mib(pred)} / {_mib(meas)} ({(pred - meas) / meas * 100:+.1f}%)"
            )
        table.append(cells)
    return _table(header, table)


def _relative_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def write_memory_chart(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Per-rank parameter bytes over one step for each policy (matplotlib, bench-only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib not installed: no memory chart", file=sys.stderr)
        return None
    colours = {"forward": "#dbe9f6", "backward": "#fbe3d6", "optimizer": "#e6f2e0"}
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.2 * len(rows)), sharex=True, sharey=True)
    for ax, row in zip(axes, rows, strict=True):
        points = row["timeline"]
        xs = [i / max(1, len(points) - 1) for i in range(len(points))]
        ys = [p["param_bytes"] / 2**20 for p in points]
        start = 0
        for i in range(1, len(points) + 1):
            if i == len(points) or points[i]["phase"] != points[start]["phase"]:
                ax.axvspan(
                    xs[start], xs[min(i, len(xs) - 1)], color=colours[points[start]["phase"]]
                )
                start = i
        measured = row["measured"]
        resting = (measured["sharded_param_bytes"] + measured["replicated_param_bytes"]) / 2**20
        ax.fill_between(xs, 0, ys, step="post", color="#3b6ea8", alpha=0.85, linewidth=0)
        ax.axhline(resting, color="black", linewidth=0.8, linestyle="--")
        ax.set_title(
            f"{row['policy']}: peak {max(ys):.0f} MiB, resting {resting:.0f} MiB "
            f"(sharded {_mib(measured['sharded_param_bytes'])}, replicated "
            f"{_mib(measured['replicated_param_bytes'])})",
            fontsize=9,
            loc="left",
        )
        ax.set_ylabel("MiB per rank", fontsize=8)
    axes[-1].set_xlabel(
        "one training step (forward blue, backward orange, optimizer green); "
        "dashed: parameters at rest",
        fontsize=8,
    )
    first = rows[0]
    fig.suptitle(
        f"Parameter memory per rank over one step: DeepSeek-V4.1 small, frozen "
        f"{first['vision_layers']}-block tower, {first['world_size']} ranks, bf16 compute",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- 8. balanced media
BALANCE_CHART = ROOT / "docs" / "img" / "balanced-media-timeline.png"
BALANCE_WORLDS = (2, 4)
#: The goals of issue 26: step time balanced / unbalanced per distribution (all media on
#: one of 2 ranks; even: the overhead), the tower's time per rank (max over mean) with
#: balancing, and the exchange's share of the balanced step on 2 ranks.
BALANCE_STEP_GOALS = {"one": 0.60, "even": 1.03}
BALANCE_TOWER_GOAL = 1.15
BALANCE_SHARE_GOAL = 0.08


def bench_balance(steps: int, worlds: tuple[int, ...]) -> list[dict[str, Any]]:
    """One torchrun launch of balance_media.py per world size (gloo, one thread per rank)."""
    rows = []
    script = Path(__file__).with_name("balance_media.py")
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "balance.json"
            run_torchrun(
                str(script), nproc=world, args=[str(out), "--steps", str(steps)], timeout_s=900
            )
            rows.append(json.loads(out.read_text()))
    return rows


def _goal(value: float, limit: float | None) -> str:
    """``value`` with its goal and verdict (three decimals, so that a value just above
    the goal never reads as equal to it)."""
    if limit is None:
        return f"{value:.3f}"
    return f"{value:.3f} (goal <= {limit:.2f}: {'met' if value <= limit else 'MISSED'})"


def _comm_cells(variant: dict[str, Any]) -> tuple[str, str]:
    """The exchange's collectives per step and the most KiB one rank sent / received,
    measured, with ``(!)`` where a rank's figures differ from ``exchange_traffic``'s."""
    per_rank = variant["comm_per_rank"]
    count = max(c["exchange_collectives"] for c in per_rank)
    sent = max(c["exchange_sent"] for c in per_rank)
    received = max(c["exchange_received"] for c in per_rank)
    differ = any(
        "predicted" in c
        and (c["exchange_collectives"], c["exchange_sent"], c["exchange_received"])
        != (c["predicted"]["collectives"], c["predicted"]["sent"], c["predicted"]["received"])
        for c in per_rank
    )
    flag = " (!)" if differ else ""
    return f"{count}{flag}", f"{sent / 1024:.1f} / {received / 1024:.1f}{flag}"


def _other_collectives(variant: dict[str, Any]) -> int:
    """Collectives per step besides the exchange's (FSDP's and the runtime hooks')."""
    counts = variant["comm_per_rank"][0]["counts"]
    exchange = variant["comm_per_rank"][0]["exchange_by_kind"]
    return sum(counts.values()) - exchange["all_gather"] - exchange["all_to_all"]


def format_balance(rows: list[dict[str, Any]]) -> str:
    header = [
        "ranks",
        "media",
        "images per rank",
        "without ms",
        "with ms",
        "with / without",
        "tower max/mean without",
        "tower max/mean with",
        "tower CPU max/mean without / with",
        "exchange ms (max rank)",
        "exchange share of step",
        "exchange coll. / step",
        "exchange KiB sent / received (max rank)",
        "other coll. without / with",
        "loss diff",
        "load start / end",
    ]
    names = {"even": "even", "skew": "3:1 skew", "one": "all on one rank"}
    table = []
    for run in rows:
        for d in run["distributions"]:
            without, with_ = d["variants"]["unbalanced"], d["variants"]["balanced"]
            count, nbytes = _comm_cells(with_)
            table.append(
                [
                    str(run["world_size"]),
                    names.get(d["distribution"], d["distribution"]),
                    ", ".join(str(n) for n in d["images_per_rank"]),
                    f"{without['median_step_s'] * 1e3:.1f}",
                    f"{with_['median_step_s'] * 1e3:.1f}",
                    _goal(
                        d["ratio_balanced_to_unbalanced"],
                        BALANCE_STEP_GOALS.get(d["distribution"]),
                    ),
                    f"{without['median_tower_max_over_mean']:.2f}",
                    _goal(with_["median_tower_max_over_mean"], BALANCE_TOWER_GOAL),
                    f"{without['median_tower_cpu_max_over_mean']:.2f} / "
                    f"{with_['median_tower_cpu_max_over_mean']:.2f}",
                    f"{max(with_['median_exchange_s_per_rank']) * 1e3:.1f}",
                    _share(with_.get("median_exchange_share"), run["world_size"]),
                    count,
                    nbytes,
                    f"{_other_collectives(without)} / {_other_collectives(with_)}",
                    f"{d['max_loss_difference']:.1e}",
                    _load(d.get("load_average")),
                ]
            )
    return _table(header, table)


def _share(value: float | None, world: int) -> str:
    """The exchange's share of the balanced step, with its goal on 2 ranks."""
    if value is None:
        return "-"
    if world != 2:
        return f"{100 * value:.1f}%"
    verdict = "met" if value <= BALANCE_SHARE_GOAL else "MISSED"
    return f"{100 * value:.1f}% (goal <= {100 * BALANCE_SHARE_GOAL:.0f}%: {verdict})"


def _load(value: list[float] | None) -> str:
    return "-" if not value else f"{value[0]:.1f} / {value[1]:.1f}"


def write_balance_chart(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Each rank's timeline of one step (the median one), without and with balance_media,
    under the 3:1 skew: tower compute, exchange (waiting included), rest of the step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        print("[bench] matplotlib not installed: no balanced-media chart", file=sys.stderr)
        return None
    runs = [(run, d) for run in rows for d in run["distributions"] if d["distribution"] == "skew"]
    if not runs:
        return None
    colours = {"rest": "#d9d9d9", "tower": "#3b6ea8", "exchange": "#e08a2c"}
    panels = [(run, d, v) for run, d in runs for v in ("unbalanced", "balanced")]
    heights = [run["world_size"] + 1.2 for run, _, _ in panels]
    fig_height = 0.42 * sum(heights) + 1.2
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(9, fig_height),
        sharex=True,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, (run, d, variant) in zip(axes, panels, strict=True):
        timeline = d["variants"][variant]["timeline"]
        step_ms = max(r["step_s"] for r in timeline) * 1e3
        for rank, record in enumerate(timeline):
            y = len(timeline) - 1 - rank
            ax.barh(y, record["step_s"] * 1e3, left=0, height=0.6, color=colours["rest"])
            for kind, start, end in record["events"]:
                if kind in ("tower", "exchange"):
                    ax.barh(
                        y, (end - start) * 1e3, left=start * 1e3, height=0.6, color=colours[kind]
                    )
                elif kind == "forward_end":
                    ax.plot([start * 1e3] * 2, [y - 0.35, y + 0.35], color="black", linewidth=1)
        ax.set_yticks(
            range(len(timeline)),
            [f"rank {r} ({n} img)" for r, n in reversed(list(enumerate(d["images_per_rank"])))],
            fontsize=8,
        )
        label = "balance_media=True" if variant == "balanced" else "balance_media=False"
        ax.set_title(
            f"{run['world_size']} ranks, {label}: step {step_ms:.0f} ms",
            fontsize=9,
            loc="left",
        )
    axes[-1].set_xlabel("ms from the start of the step (black tick: end of forward)", fontsize=8)
    fig.legend(
        handles=[
            Patch(color=colours["tower"], label="tower compute"),
            Patch(color=colours["exchange"], label="exchange (waiting included)"),
            Patch(color=colours["rest"], label="rest of the step (waiting included)"),
        ],
        loc="upper left",
        bbox_to_anchor=(0.01, 1 - 0.25 / fig_height),
        fontsize=8,
        ncols=3,
        frameon=False,
    )
    fig.suptitle(
        "Each rank's step under a 3:1 media skew, without and with balance_media "
        "(gloo, CPU, one thread per rank; the median step)",
        fontsize=10,
        x=0.01,
        ha="left",
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig_height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def balance_scale_report(rows: list[dict[str, Any]]) -> list[str]:
    """Section 8b's table (``balance_scale.py``, fake process group)."""
    return report_balance_scale(rows, _table)


def balance_report(rows: list[dict[str, Any]], chart: Path | None) -> list[str]:
    first = rows[0]
    model = first["model"]
    return [
        f"## 8. Balanced media on gloo ranks: step time with balance_media=True / without "
        f"(frozen {model['vision_blocks']}-block tower of {first['tower_params'] / 1e6:.1f}M "
        f"parameters, {model['patches']} patches per image, policy {first['policy']}, "
        f"{first['images_per_rank_mean']} images per rank on average, {first['steps']} "
        "timed steps, medians)",
        "",
        format_balance(rows),
        "",
        "Tower max/mean: the tower's wall time per rank, the slowest rank over the mean "
        "(CPU: the ranks' thread CPU time in the tower, which leaves out time spent "
        "waiting for a core). Exchange: the collectives of `multimodal_fsdp.balance` in one step "
        "(the slot all-gather of each round; where items move, the inputs' all-to-all, the "
        "status all-gather and the outputs' all-to-all; the join's last round), counted on "
        "the real group (`(!)`: a rank's count or bytes differ from `exchange_traffic`'s "
        "prediction); exchange ms includes waiting for other ranks (for the inputs' "
        "all-to-all, overlapped with encoding the kept items, only the wait); exchange "
        "share: the slowest rank's exchange time over the step's, median of the steps. "
        "Other coll.: FSDP's and the runtime hooks' (`CommCounter`). Load: the machine's "
        "1-minute load average before and after the row.",
        "",
        "Machine load (1-minute load average at the start / end of each launch): "
        + ", ".join(
            f"{run['world_size']} ranks {run['load_average'][0]:.1f} / {run['load_average'][1]:.1f}"
            for run in rows
            if "load_average" in run
        )
        + f" on {first.get('cpus', '?')} CPUs.",
        "",
        f"Chart: {_relative_path(chart)}" if chart else "Chart: not written (no matplotlib)",
    ]


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON output file")
    parser.add_argument("--quick", action="store_true", help="smallest sizes only (smoke run)")
    parser.add_argument("--skip-gloo", action="store_true", help="no real-gloo step timing")
    parser.add_argument("--gloo-steps", type=int, default=40)
    parser.add_argument(
        "--chart",
        type=Path,
        default=CHART,
        help="where to write the memory-timeline chart (PNG; needs matplotlib)",
    )
    parser.add_argument(
        "--only",
        choices=("balance-media",),
        default=None,
        help="run one section only (balance-media: section 8, 2 and 4 gloo ranks)",
    )
    parser.add_argument(
        "--balance-steps", type=int, default=10, help="timed steps per variant in section 8"
    )
    parser.add_argument(
        "--balance-chart",
        type=Path,
        default=BALANCE_CHART,
        help="where to write the balanced-media timeline chart (PNG; needs matplotlib)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    depths = TOWER_DEPTHS[:1] if args.quick else TOWER_DEPTHS
    worlds = WORLD_SIZES[:2] if args.quick else WORLD_SIZES
    started = time.perf_counter()
    sections: dict[str, Any] = {}
    timings: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        value = fn()
        timings[name] = time.perf_counter() - t0
        print(f"[bench] {name}: {timings[name]:.1f} s", file=sys.stderr, flush=True)
        return value

    if args.only == "balance-media":
        return _balance_only(args, argv, started, timed, timings)
    sections["policies"] = timed("policies", lambda: bench_policies(depths, worlds))
    sections["fp32_norms"] = timed("fp32_norms", lambda: bench_norms(depths, 8))
    sections["memory"] = timed("memory", lambda: bench_memory(depths, (8, 64)))
    scales = SCALES[:2] if args.quick else SCALES
    sections["scaling"] = timed("scaling", lambda: bench_scaling(scales, 64, 3))
    sections["measured_memory"] = timed(
        "measured_memory", lambda: bench_measured_memory(TOWER_DEPTHS[0], MEMORY_WORLD)
    )
    chart = write_memory_chart(sections["measured_memory"], args.chart)
    if not args.skip_gloo:
        steps = 4 if args.quick else args.gloo_steps
        sections["gloo"] = timed("gloo", lambda: bench_gloo(steps, ("per_layer", "root")))
        balance_steps = 3 if args.quick else args.balance_steps
        balance_worlds = BALANCE_WORLDS[:1] if args.quick else BALANCE_WORLDS
        sections["balance_media"] = timed(
            "balance_media", lambda: bench_balance(balance_steps, balance_worlds)
        )
        balance_chart = write_balance_chart(sections["balance_media"], args.balance_chart)
    sections["balance_scale"] = timed("balance_scale", measure_balance_scale)
    total = time.perf_counter() - started

    command = "nox -s bench" + (" -- " + " ".join(argv) if argv else "")
    report = [
        "# multimodal-fsdp benchmark",
        "",
        f"`{command}` - torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs, {total:.0f} s",
        "",
        "## 1. Frozen-tower policies: collectives and bytes per step (DeepSeek-V4.1 small, "
        "frozen tower; ratio = measured / analytic minimum, collectives / bytes)",
        "",
        format_policies(sections["policies"]),
        "",
        "## 2. fp32 vision norms (trainable tower, world 8): grouped unit vs one unit per norm",
        "",
        format_norms(sections["fp32_norms"]),
        "",
        "## 3. Parameter memory per rank (DeepSeek-V4.1 base, frozen tower, plan only)",
        "",
        format_memory(sections["memory"]),
        "",
        "## 4. Plan-and-shard time on the meta device (base widths, fake group of 64 ranks)",
        "",
        format_scaling(sections["scaling"]),
    ]
    if "gloo" in sections:
        report += [
            "",
            "## 5. Step time on 2 gloo ranks: parallelizer vs hand-written fully_shard",
            "",
            format_gloo(sections["gloo"]),
            "",
            "## 6. Runtime hooks on 2 gloo ranks: their collectives per step",
            "",
            format_hooks(sections["gloo"]),
        ]
    report += [
        "",
        f"## 7. Memory per rank of one AdamW step, predicted / measured (DeepSeek-V4.1 small, "
        f"frozen {TOWER_DEPTHS[0]}-block tower, {MEMORY_WORLD} ranks under the fake group, "
        "batch 1 x 64)",
        "",
        format_measured_memory(sections["measured_memory"]),
        "",
        f"Chart: {_relative_path(chart)}" if chart else "Chart: not written (no matplotlib)",
    ]
    if "balance_media" in sections:
        report += ["", *balance_report(sections["balance_media"], balance_chart)]
    if "balance_scale" in sections:
        report += ["", *balance_scale_report(sections["balance_scale"])]
    print("\n".join(report))

    out = args.out or ROOT / "bench-results" / (
        "bench-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + ".json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "seconds": total,
        "section_seconds": timings,
        "median_gloo_ratio": (
            statistics.median(r["ratio_ours_to_manual"] for r in sections["gloo"])
            if "gloo" in sections
            else None
        ),
        **sections,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"\n[bench] wrote {out}", file=sys.stderr)
    ok = all(r["plan_matches_measured"] for r in sections["policies"] + sections["fp32_norms"])
    return 0 if ok else 1


def _balance_only(
    args: argparse.Namespace,
    argv: list[str] | None,
    started: float,
    timed: Callable[[str, Callable[[], Any]], Any],
    timings: dict[str, float],
) -> int:
    """``--only balance-media``: section 8 alone (report, chart and JSON)."""
    rows = timed("balance_media", lambda: bench_balance(args.balance_steps, BALANCE_WORLDS))
    chart = write_balance_chart(rows, args.balance_chart)
    scale = timed("balance_scale", measure_balance_scale)
    total = time.perf_counter() - started
    command = "nox -s bench" + (" -- " + " ".join(argv) if argv else "")
    print(
        "\n".join(
            [
                f"`{command}` - torch {torch.__version__}, {platform.machine()}, "
                f"{os.cpu_count()} CPUs, {total:.0f} s",
                "",
                *balance_report(rows, chart),
                "",
                *balance_scale_report(scale),
            ]
        )
    )
    out = args.out or ROOT / "bench-results" / (
        "bench-balance-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + ".json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "seconds": total,
        "section_seconds": timings,
        "balance_media": rows,
        "balance_scale": scale,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"\n[bench] wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
