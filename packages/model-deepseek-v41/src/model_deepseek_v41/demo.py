"""The demo: train the reference DeepSeek-V4.1 model with FSDP2 and check it.

``python -m model_deepseek_v41.demo [options]`` validates the options, then
relaunches itself under torchrun (2 gloo ranks on CPU by default, one NCCL rank
per GPU where GPUs exist). Each rank builds the model on the meta device,
shards it with [`PARALLELIZER`][model_deepseek_v41.fsdp.PARALLELIZER] (frozen vision tower under the
chosen policy), materialises it from the seed, and trains a few steps on synthetic
image+text batches while counting collectives. Rank 0 shows the FSDP units,
the loss and communication per step, and finally compares the losses with a
single-process reference run of the same model and data.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import (
    CommCounter,
    DistributedContext,
    build_mesh,
    exit_rank,
    init_distributed,
    materialize_from_full,
    mixed_precision_policy,
)
from fsdp_core.testing import emulate_data_parallel
from model_deepseek_v41.config import DeepseekV41Config
from model_deepseek_v41.fsdp import PARALLELIZER
from model_deepseek_v41.modeling import (
    Batch,
    build_deepseek_v41,
    iter_initial_parameters,
    make_batch,
)
from multimodal_fsdp import VALID_FROZEN_MULTIMODAL_SHARDING
from multimodal_fsdp.policy import FrozenMultimodalSharding, normalize_frozen_multimodal_sharding

__all__ = ["main", "parse_args"]

SIZES = ("tiny", "small", "base")
PRECISIONS = ("bf16", "fp32")
SEED = 0
LR = 1e-3
#: Each rank cycles over this many batches, so the loss visibly falls in a few steps.
DISTINCT_BATCHES = 2
#: bf16 weights are updated in bf16: one rounding step of 2**-8 relative can differ
#: between the sharded and the reference run, and grows a little over steps.
TOLERANCE = {"bf16": 1e-2, "fp32": 1e-4}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _policy(text: str) -> FrozenMultimodalSharding:
    """Every spelling the parallelizer accepts (``per-layer``, ``Per_Layer`` ...)."""
    try:
        return normalize_frozen_multimodal_sharding(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The demo's options, checked before anything is launched.

    Args:
        argv: the command line without the program name (``sys.argv[1:]`` if None).

    Returns:
        The parsed options.
    """
    parser = argparse.ArgumentParser(
        prog="python -m model_deepseek_v41.demo",
        description="Train DeepSeek-V4.1 (reference model) with FSDP2 and a frozen vision tower.",
    )
    parser.add_argument(
        "--policy",
        default="root",
        type=_policy,
        metavar="{" + ",".join(VALID_FROZEN_MULTIMODAL_SHARDING) + "}",
        help="frozen vision tower sharding (default: root)",
    )
    parser.add_argument(
        "--nproc",
        type=_positive,
        default=None,
        help="ranks to launch (default: one per GPU, else 2)",
    )
    parser.add_argument("--steps", type=_positive, default=8, help="training steps (default 8)")
    parser.add_argument(
        "--precision",
        default="bf16",
        type=str.lower,
        choices=PRECISIONS,
        help="bf16 weights with fp32 vision norms, or fp32 everywhere",
    )
    parser.add_argument(
        "--size", default="tiny", type=str.lower, choices=SIZES, help="model preset (default tiny)"
    )
    parser.add_argument("--batch-size", type=_positive, default=2, help="samples per rank")
    parser.add_argument(
        "--seq-len",
        type=_positive,
        default=None,
        help="tokens per sample (default: fits the images plus 32)",
    )
    parser.add_argument(
        "--no-reference", action="store_true", help="skip the single-process reference check"
    )
    args = parser.parse_args(argv)
    config = _config(args.size)
    tokens = config.image_tokens_per_image
    if args.seq_len is None:
        args.seq_len = min(config.max_seq_len, tokens + 32)
    if not tokens < args.seq_len <= config.max_seq_len:
        parser.error(
            f"--seq-len {args.seq_len} must be greater than the {tokens} image tokens and at "
            f"most max_seq_len={config.max_seq_len} for --size {args.size}"
        )
    if args.nproc is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.nproc = gpus or 2
    return args


def _config(size: str) -> DeepseekV41Config:
    return DeepseekV41Config.preset(size)


# ----------------------------------------------------------------------- launcher
#: The workers read their options from here: torchrun would parse some of them itself.
WORKER_ARGS_ENV = "MODEL_DEEPSEEK_V41_DEMO_ARGS"


def launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Re-run this module under torchrun with the same options."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        "model_deepseek_v41.demo",
    ]
    env = {
        **os.environ,
        WORKER_ARGS_ENV: json.dumps(list(argv)),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    return subprocess.call(command, env=env)


# ------------------------------------------------------------------------- worker
def _batches(config: DeepseekV41Config, args: argparse.Namespace, world: int) -> list[list[Batch]]:
    return [
        [
            make_batch(
                config,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                num_images_per_sample=1,
                seed=10_000 + 131 * step + rank,
            )
            for rank in range(world)
        ]
        for step in range(args.steps)
    ]


def _to(batch: Batch, device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = round(width * done / total)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def _build(config: DeepseekV41Config, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    model = build_deepseek_v41(config, seed=SEED, dtype=dtype, device=device)
    model.vision.requires_grad_(False)
    return model


def worker(args: argparse.Namespace) -> int:
    ctx: DistributedContext = init_distributed()
    show = ctx.rank == 0
    config = _config(args.size)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    policy = mixed_precision_policy("bf16", "fp32") if args.precision == "bf16" else None
    parallelizer = PARALLELIZER.with_options(frozen_multimodal_sharding=args.policy)

    model = _build(config, dtype, "meta")
    plan = parallelizer.plan(model, mp_policy=policy)
    if show:
        print(
            f"DeepSeek-V4.1 reference ({args.size}), {ctx.world_size} x {ctx.backend} on "
            f"{ctx.device_type}, precision {args.precision}, frozen vision tower: {args.policy}"
        )
        print(plan.format(model))
    parallelizer.apply_plan(model, plan, mesh=build_mesh())
    materialize_from_full(model, iter_initial_parameters(model, SEED), device=ctx.device)
    optimizer = _optimizer([p for p in model.parameters() if p.requires_grad])

    batches = _batches(config, args, ctx.world_size)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        counter = CommCounter()
        with counter:
            loss = model(**_to(batches[step][ctx.rank], ctx.device))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
        if show:
            counts, sizes = counter.counts(), counter.bytes()
            comm = "  ".join(
                f"{kind} {counts[kind]} ({_mb(sizes[kind])})" for kind in sorted(counts)
            )
            print(
                f"{_bar(step + 1, args.steps)} step {step + 1}/{args.steps} "
                f"loss {losses[-1]:.5f} | {comm}",
                flush=True,
            )
    elapsed = time.perf_counter() - start
    status = 0
    if show:
        print(f"trained {args.steps} steps in {elapsed:.1f} s")
        if not args.no_reference:
            status = _check_reference(config, args, dtype, losses, ctx.world_size, batches)
    exit_rank(status)


def _check_reference(
    config: DeepseekV41Config,
    args: argparse.Namespace,
    dtype: torch.dtype,
    losses: list[float],
    world: int,
    batches: list[list[Batch]],
) -> int:
    compute = torch.bfloat16 if args.precision == "bf16" else None
    reference = emulate_data_parallel(
        lambda: _build(config, dtype, "cpu"),
        batches,
        lambda model, batch: model(**batch),
        compute_dtype=None if dtype == torch.bfloat16 else compute,
        lr=LR,
        optimizer=_optimizer,
    )
    worst = max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True))
    tolerance = TOLERANCE[args.precision]
    verdict = "PASS" if worst <= tolerance else "FAIL"
    print(
        f"single-process reference: max |loss difference| = {worst:.2e} "
        f"(tolerance {tolerance:.0e}) -> {verdict}"
    )
    return 0 if verdict == "PASS" else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Launch the demo under torchrun, or, inside the launch, run one rank of it.

    Args:
        argv: the command line without the program name (``sys.argv[1:]`` if None).

    Returns:
        The exit status.
    """
    if WORKER_ARGS_ENV in os.environ and "LOCAL_RANK" in os.environ:
        return worker(parse_args(json.loads(os.environ[WORKER_ARGS_ENV])))
    raw = list(sys.argv[1:] if argv is None else argv)
    return launch(parse_args(raw), raw)


if __name__ == "__main__":
    raise SystemExit(main())
