"""torchrun script of the benchmark: step time on real gloo ranks, ours vs hand-written.

Usage: torchrun --nproc-per-node 2 gloo_step.py OUT.json [--steps N] [--policy P]

Both variants shard the same DeepSeek-V4.1 model (frozen vision tower) into the
same units, in the same process, with the same weights and batches:

- ``ours``: ``PARALLELIZER.with_options(frozen_multimodal_sharding=P).parallelize``,
  i.e. everything the product adds (prefetch guard, uneven-media guard,
  accumulation safety);
- ``manual``: the plan's calls issued by hand with ``torch.distributed.fsdp.fully_shard``
  (same modules, mixed-precision policies, reshard settings and ignored
  parameters), nothing else.

Steps alternate between the variants so that drift in machine load hits both
alike; rank 0 writes the median step times, the collectives of one step of each
(counted on the real gloo group) and the plan's prediction for both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_core import CommCounter, build_mesh, exit_rank, init_distributed, mixed_precision_policy
from fsdp_core.collective_count import CommTally
from fsdp_core.forward_agreement import TRAINING_FORWARD, ForwardAgreement
from fsdp_core.mesh import all_reduce_max_over_mesh
from fsdp_core.runtime import installed_hooks
from model_deepseek_v41 import PARALLELIZER, DeepseekV41Config, build_deepseek_v41, make_batch
from multimodal_fsdp.estimate.costs import plan_costs

#: A small model whose step is not all Python overhead, still quick on 2 CPU cores.
CONFIG = DeepseekV41Config.tiny(
    image_size=64,
    patch_size=8,
    vision_hidden=128,
    vision_intermediate=256,
    vision_layers=4,
    text_hidden=128,
    text_intermediate=256,
    text_layers=4,
    vocab_size=2048,
    max_seq_len=128,
)
MP = mixed_precision_policy("bf16", "fp32")
LR = 1e-3


def build() -> nn.Module:
    model = build_deepseek_v41(CONFIG, seed=0, dtype=torch.float32)
    model.vision.requires_grad_(False)
    return model


def manual(model: nn.Module, policy: str, mesh: Any) -> None:
    """The same units as the parallelizer's plan, made with plain ``fully_shard`` calls."""
    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=policy)
    plan = parallelizer.plan(model, mp_policy=MP)
    named = dict(model.named_parameters())
    # Replicated parameters (frozen fp32 norms, a replicated tower) stay plain tensors,
    # cast to the compute dtype unless they are fp32 islands - as a user would do by hand.
    for name, dtype in plan.replicated_param_dtypes:
        named[name].data = named[name].data.to(dtype)
    for call in plan.calls:
        members = [model.get_submodule(p) if p else model for p in call.paths]
        ignored = {named[n] for n in call.ignored_param_names}
        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "mp_policy": call.mp_policy,
            "reshard_after_forward": call.reshard_after_forward,
        }
        if ignored:
            kwargs["ignored_params"] = ignored
        fully_shard(members[0] if len(members) == 1 else members, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--policy", default="per_layer")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ctx = init_distributed(backend="gloo")
    mesh = build_mesh()
    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=args.policy)

    reference = build()
    plan = parallelizer.plan(reference, mp_policy=MP)
    guarded = plan_costs(plan, reference, world_size=ctx.world_size)
    # The hand-written variant: FSDP2's default prefetch and no uneven-media guard.
    manual_expected = CommTally()
    for unit in guarded.units:
        manual_expected.merge(unit.comm)
        manual_expected.merge(unit.wasted)

    ours = parallelizer.parallelize(build(), mesh=mesh, mp_policy=MP)
    hand = build()
    manual(hand, args.policy, mesh)
    variants = {"ours": ours, "manual": hand}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=LR) for k, m in variants.items()}
    batches = [
        make_batch(CONFIG, batch_size=2, seq_len=64, seed=1000 + 97 * s + ctx.rank)
        for s in range(args.warmup + args.steps)
    ]
    times: dict[str, list[float]] = {k: [] for k in variants}
    losses: dict[str, list[float]] = {k: [] for k in variants}
    comm: dict[str, Any] = {}
    for step, batch in enumerate(batches):
        # Alternate which variant goes first, so neither always follows the other.
        order = list(variants.items())
        for name, model in order if step % 2 == 0 else order[::-1]:
            counter = CommCounter() if step == args.warmup else None
            dist.barrier()
            start = time.perf_counter()
            with counter if counter is not None else _Null():
                if counter is not None:
                    with counter.phase("forward"):
                        loss = model(**batch)
                    with counter.phase("backward"):
                        loss.backward()
                else:
                    loss = model(**batch)
                    loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            if counter is not None:
                comm[name] = counter.tally()
            if step >= args.warmup:
                times[name].append(elapsed)
            losses[name].append(float(loss.detach()))
    hooks = hook_costs(ours, mesh, batches[0])
    # The runtime hooks' own collectives in the counted step (FSDP issues no all-reduce on
    # a 1-D mesh): the divergence guards meet at the store, so only unused_params' flags.
    hooks["all_reduces_per_step"] = comm["ours"].count("all_reduce")
    if ctx.rank == 0:
        median = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "policy": args.policy,
            "world_size": ctx.world_size,
            "steps": args.steps,
            "config": {"vision_layers": CONFIG.vision_layers, "text_layers": CONFIG.text_layers},
            "params": sum(p.numel() for p in reference.parameters()),
            "median_step_s": median,
            # Median of per-step ratios: each pair ran back to back, so load drift cancels.
            "ratio_ours_to_manual": statistics.median(
                a / b for a, b in zip(times["ours"], times["manual"], strict=True)
            ),
            "ratio_of_medians": median["ours"] / median["manual"],
            "max_loss_difference": max(
                abs(a - b) for a, b in zip(losses["ours"], losses["manual"], strict=True)
            ),
            "collectives": {k: v.as_dict() for k, v in comm.items()},
            "ours_matches_plan": comm["ours"] == guarded.comm,
            "manual_matches_plan_without_guard": comm["manual"] == manual_expected,
            "ours_differences": guarded.comm.differences(comm["ours"]),
            "manual_differences": manual_expected.differences(comm["manual"]),
            "hooks": hooks,
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
    exit_rank(0)


def _median_ms(fn: Any, repeats: int = 60) -> float:
    """Median wall time of ``fn()`` in milliseconds, each run started in step with the
    other ranks (a barrier before each), after a few warm-up runs."""
    samples = []
    for index in range(repeats + 5):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if index >= 5:
            samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def hook_costs(model: nn.Module, mesh: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """What the runtime hooks of ``model`` cost per step: which are installed, how many
    times one forward meets the other ranks at the agreement (the forward agreement and
    each schedule checkpoint), the time of one meeting (c10d store round trips, no
    collective) and of the usage-flags all-reduce (plus the host sync that reads it)."""
    hooks = installed_hooks(model)
    check = hooks.get("schedule_check")
    checkpoints = 0
    if check is not None:
        with torch.no_grad():
            model(**batch)
        checkpoints = int(getattr(check, "last_checkpoints", 0))
    flags = len(getattr(hooks.get("unused_params"), "_records", ()))

    def unused() -> None:
        used = torch.ones(max(flags, 1), dtype=torch.uint8)
        all_reduce_max_over_mesh(used, mesh)
        used.tolist()

    agreement = hooks.get("forward_agreement")
    costs: dict[str, Any] = {}
    if isinstance(agreement, ForwardAgreement):
        # One meeting before a training forward, timed on the installed hook itself (every
        # rank makes the same calls, in step); a schedule checkpoint meets the same way.
        costs["meeting_ms"] = _median_ms(lambda: agreement.arrive(TRAINING_FORWARD))
    return {
        "installed": sorted(hooks),
        "meetings_per_forward": int(isinstance(agreement, ForwardAgreement)) + checkpoints,
        "unused_params_flags": flags,
        "unused_params_ms": _median_ms(unused) if flags else 0.0,
        **costs,
    }


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
