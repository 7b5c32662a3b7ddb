"""torchrun script of the benchmark: balanced media on real gloo ranks.

Usage: torchrun --nproc-per-node W balance_media.py OUT.json [--steps N] [--warmup K]
[--policy P] [--images M] [--tp T]

``--tp T`` (T > 1): a ``('dp', 'tp')`` mesh of ``W/T x T`` ranks; torch's
``parallelize_module`` shards the decoder's MLPs over ``tp`` before the library shards
over ``dp``, and the ``T`` ranks of a TP group hold the same batch (their DP
coordinate's; the distributions below count DP coordinates, not ranks). Per-rank
figures cover all ``W`` ranks: without balancing each image is encoded on every rank
of its TP group, with it once in the world.

One launch per world size. Two copies of the same small VLM, with the same weights and
batches, are sharded by ``MultimodalParallelizer(frozen_multimodal_sharding=P)``: one with
``balance_media=True`` (*balanced*), one without (*unbalanced*). The model's frozen vision
tower dominates the step (CPU, float32, one torch thread per rank). Each rank's batch has
the same text and a number of same-sized images that depends on the distribution:

- ``even``: ``M`` images on every rank;
- ``skew``: 3:1, ranks alternately ``3M/2`` and ``M/2`` images;
- ``one``: all ``W*M`` images on rank 0, the other ranks text-only.

Steps alternate between the variants (so drift in machine load hits both alike), after
warm-up steps. What is measured, outside the library:

- the step time of every rank (forward, backward, optimizer step), after a barrier; a
  step takes the slowest rank's time;
- the tower's compute per rank: forward pre/post hooks on the tower's ``encoder``, the
  module that does all of its work (it runs on whatever share the rank encodes), in
  wall time and in the CPU time of the rank's thread (time spent waiting for a core
  that other processes hold is not counted; shared caches still slow it);
- the exchange: every ``all_gather`` / ``all_to_all_single`` issued from
  ``multimodal_fsdp.balance``, timed (waiting for other ranks included; for an
  all_to_all started asynchronously, its call and the wait for it, not the tower work a
  rank does meanwhile), counted, with the bytes each rank puts in and gets, and its
  share of the step (the slowest rank's exchange time over the step's time);
- the collectives of one extra, untimed step of each variant with
  ``fsdp_core.CommCounter`` (all-gathers, reduce-scatters, all-reduces).

Rank 0 writes medians, per-step figures and, for the chart, every rank's timeline
(tower, exchange, forward end, step end) of the median step of each variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn import functional

from fsdp_core import CommCounter, build_mesh, exit_rank, init_distributed
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.balance import exchange_traffic, media_layout_for

#: The tower: PATCHES patches of PATCH_DIM pixels per image, VISION_BLOCKS MLP blocks of
#: width VISION_DIM. The decoder: TEXT_LAYERS layers of width TEXT_DIM over BATCH x SEQ
#: tokens (the same on every rank; each image adds one pooled token in place of one).
PATCHES = 576
PATCH_DIM = 48
VISION_DIM = 192
VISION_BLOCKS = 8
TEXT_DIM = 128
TEXT_LAYERS = 2
VOCAB = 512
BATCH = 2
SEQ = 64
LR = 1e-3
DISTRIBUTIONS = ("even", "skew", "one")
VARIANTS = ("unbalanced", "balanced")


# --------------------------------------------------------------------------- the model
class MLPBlock(nn.Module):
    """A pre-norm residual MLP (the tower's blocks and the decoder's layers)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(functional.gelu(self.up(self.norm(x))))
        return out


class VisionTower(nn.Module):
    """``pixel_values`` of shape (images, PATCHES, PATCH_DIM), one row per image (the
    batch-first layout); all the work is in ``encoder``, which the benchmark times."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(PATCH_DIM, VISION_DIM),
            *(MLPBlock(VISION_DIM) for _ in range(VISION_BLOCKS)),
            nn.LayerNorm(VISION_DIM),
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.encoder(pixel_values)
        return out


class LanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, TEXT_DIM)
        self.layers = nn.ModuleList(MLPBlock(TEXT_DIM) for _ in range(TEXT_LAYERS))
        self.norm = nn.LayerNorm(TEXT_DIM)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        out: torch.Tensor = self.norm(hidden)
        return out


class BenchVLM(nn.Module):
    """LLaVA-shaped: each image's tower output, pooled and projected, is added to the
    embedding of its placeholder token; a text-only batch (``pixel_values=None``) never
    calls the tower. The loss is next-token cross-entropy over the text."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = VisionTower()
        self.multi_modal_projector = nn.Sequential(
            nn.Linear(VISION_DIM, TEXT_DIM), nn.GELU(), nn.Linear(TEXT_DIM, TEXT_DIM)
        )
        self.language_model = LanguageModel()
        self.lm_head = nn.Linear(TEXT_DIM, VOCAB)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.language_model.embed_tokens(input_ids)
        if pixel_values is not None and image_positions is not None:
            image = self.multi_modal_projector(self.vision_tower(pixel_values).mean(dim=1))
            flat = hidden.reshape(-1, TEXT_DIM).index_add(0, image_positions, image)
            hidden = flat.view_as(hidden)
        logits = self.lm_head(self.language_model(hidden))
        loss: torch.Tensor = functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return loss


def tensor_parallel(model: BenchVLM, tp_mesh: Any) -> None:
    """Shard the decoder's MLPs over ``tp_mesh`` (``up`` by columns, ``down`` by rows)."""
    plan: dict[str, Any] = {}
    for i in range(TEXT_LAYERS):
        plan[f"language_model.layers.{i}.up"] = ColwiseParallel()
        plan[f"language_model.layers.{i}.down"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)


def build(seed: int = 0) -> BenchVLM:
    torch.manual_seed(seed)
    model = BenchVLM()
    model.vision_tower.requires_grad_(False)
    return model


def images_per_rank(distribution: str, world: int, mean: int) -> list[int]:
    """How many images each rank holds (``mean`` per rank on average)."""
    if distribution == "even":
        return [mean] * world
    if distribution == "skew":
        if mean % 2 or world % 2:
            raise ValueError(f"the 3:1 skew needs an even world size and --images, got {mean}")
        return [3 * mean // 2 if r % 2 == 0 else mean // 2 for r in range(world)]
    if distribution == "one":
        return [mean * world] + [0] * (world - 1)
    raise ValueError(f"unknown distribution {distribution!r}; valid choices: {DISTRIBUTIONS}")


def make_batch(images: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    if images:
        batch["pixel_values"] = torch.randn(images, PATCHES, PATCH_DIM, generator=generator)
        batch["image_positions"] = torch.randperm(BATCH * SEQ, generator=generator)[:images]
    return batch


# --------------------------------------------------------------------------- instruments
class Recorder:
    """Intervals of one step on this rank, in seconds from the step's start."""

    def __init__(self) -> None:
        self.origin = 0.0
        self.active = False
        self.events: list[tuple[str, float, float]] = []
        self.exchange: list[dict[str, Any]] = []
        #: CPU time of this rank's thread in the tower (waiting for a core not counted).
        self.tower_cpu = 0.0
        self._tower_start = 0.0
        self._tower_cpu_start = 0.0

    def start(self) -> None:
        self.events, self.exchange, self.active, self.tower_cpu = [], [], True, 0.0
        self.origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def mark(self, name: str) -> None:
        if self.active:
            now = self.now()
            self.events.append((name, now, now))

    def tower_pre(self, *_: Any) -> None:
        self._tower_start = self.now()
        self._tower_cpu_start = time.thread_time()

    def tower_post(self, *_: Any) -> None:
        if self.active:
            self.events.append(("tower", self._tower_start, self.now()))
            self.tower_cpu += time.thread_time() - self._tower_cpu_start

    def total(self, name: str) -> float:
        return sum(end - start for kind, start, end in self.events if kind == name)


RECORDER = Recorder()


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _from_balance() -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return "balance" in str(caller) and str(caller).startswith("multimodal_fsdp.")


class _TimedWork:
    """The work of an asynchronous collective of the exchange: its wait is exchange time."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self) -> Any:
        start = RECORDER.now()
        result = self._work.wait()
        if RECORDER.active:
            RECORDER.events.append(("exchange", start, RECORDER.now()))
        return result


def _timed(kind: str, original: Callable[..., Any], sent: int, received: int) -> Callable[..., Any]:
    """``original`` (a ``torch.distributed`` collective) recording calls from the balance
    exchange: kind, interval and bytes put in (``sent``) / got (``received``) per rank."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not (RECORDER.active and _from_balance()):
            return original(*args, **kwargs)
        start = RECORDER.now()
        result = original(*args, **kwargs)
        end = RECORDER.now()
        RECORDER.events.append(("exchange", start, end))
        RECORDER.exchange.append(
            {"kind": kind, "sent": _nbytes(args[sent]), "received": _nbytes(args[received])}
        )
        if kwargs.get("async_op") and result is not None:
            return _TimedWork(result)
        return result

    return wrapper


def instrument(model: nn.Module) -> None:
    encoder = model.get_submodule("vision_tower.encoder")
    encoder.register_forward_pre_hook(RECORDER.tower_pre)
    encoder.register_forward_hook(RECORDER.tower_post)


def patch_collectives() -> None:
    # all_gather(tensor_list, tensor), all_to_all_single(output, input): what the
    # exchange calls; FSDP2 and the runtime hooks use other collectives.
    dist.all_gather = _timed("all_gather", dist.all_gather, 1, 0)  # type: ignore[assignment]
    dist.all_to_all_single = _timed(  # type: ignore[assignment]
        "all_to_all", dist.all_to_all_single, 1, 0
    )


# --------------------------------------------------------------------------- steps
def parallelizer(policy: str, balanced: bool) -> MultimodalParallelizer:
    if balanced:
        return MultimodalParallelizer(frozen_multimodal_sharding=policy, balance_media=True)
    return MultimodalParallelizer(frozen_multimodal_sharding=policy)


def one_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> float:
    loss = model(**batch)
    RECORDER.mark("forward_end")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def counted_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """Collectives of one step: CommCounter's kinds plus the exchange's all-to-alls."""
    counter = CommCounter()
    RECORDER.start()
    with counter:
        one_step(model, optimizer, batch)
    RECORDER.active = False
    counts = counter.counts()
    nbytes = counter.bytes()
    a2a = [e for e in RECORDER.exchange if e["kind"] == "all_to_all"]
    if a2a:
        counts["all_to_all"] = len(a2a)
        nbytes["all_to_all"] = sum(e["sent"] for e in a2a)
    return {
        "counts": counts,
        "bytes": nbytes,
        "exchange_collectives": len(RECORDER.exchange),
        "exchange_sent": sum(e["sent"] for e in RECORDER.exchange),
        "exchange_received": sum(e["received"] for e in RECORDER.exchange),
        "exchange_by_kind": {
            kind: sum(1 for e in RECORDER.exchange if e["kind"] == kind)
            for kind in ("all_gather", "all_to_all")
        },
    }


def predicted_exchange(counts: list[int], rank: int, run_when_empty: bool) -> dict[str, int]:
    """The exchange of one forward on ``rank`` as ``exchange_traffic`` predicts it: the
    tower call (when any rank has images; a rank without images joins it) and the last
    round of the join barrier (one slot all_gather). The tower is frozen and its
    inputs need no gradient, so nothing moves in backward."""
    tower = BenchVLM().vision_tower
    spec = media_layout_for(tower).split_call(tower, (torch.zeros(1, PATCHES, PATCH_DIM),), {})
    costs = [[PATCHES * PATCH_DIM] * n for n in counts]
    inputs = [[PATCHES * PATCH_DIM * 4] * n for n in counts]
    outputs = [[PATCHES * VISION_DIM * 4] * n for n in counts]
    rounds = []
    if any(counts):
        rounds += exchange_traffic(
            costs,
            rank=rank,
            spec=spec.spec,
            input_bytes=inputs,
            output_bytes=outputs,
            run_when_empty=run_when_empty,
            callers=[r for r, n in enumerate(counts) if n],
        )
    empty: list[list[int]] = [[] for _ in counts]
    rounds += exchange_traffic(empty, rank=rank, spec=None, input_bytes=empty, output_bytes=empty)
    return {
        "collectives": len(rounds),
        "sent": sum(r.sent for r in rounds),
        "received": sum(r.received for r in rounds),
    }


@contextmanager
def _quiet() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        yield


def run_distribution(
    name: str,
    counts: list[int],
    variants: dict[str, nn.Module],
    optimizers: dict[str, torch.optim.Optimizer],
    args: argparse.Namespace,
    rank: int,
) -> dict[str, Any]:
    """One distribution's timed steps; ``rank`` is this rank's DP coordinate (its batch)."""
    steps: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    losses: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants.items())
    for step in range(args.warmup + args.steps):
        seed = 10_000 * (1 + DISTRIBUTIONS.index(name)) + 97 * step + rank
        batch = make_batch(counts[rank], seed=seed)
        for variant, model in order if step % 2 == 0 else order[::-1]:
            dist.barrier()
            RECORDER.start()
            loss = one_step(model, optimizers[variant], batch)
            elapsed = RECORDER.now()
            RECORDER.active = False
            mine = {
                "step_s": elapsed,
                "tower_s": RECORDER.total("tower"),
                "tower_cpu_s": RECORDER.tower_cpu,
                "exchange_s": RECORDER.total("exchange"),
                "events": RECORDER.events,
            }
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            losses[variant].append(loss)
            if step >= args.warmup:
                steps[variant].append({"ranks": everyone})
    comm = {
        variant: counted_step(model, optimizers[variant], make_batch(counts[rank], seed=7 + rank))
        for variant, model in variants.items()
    }
    if args.tp == 1:  # the prediction covers the data-parallel exchange alone
        comm["balanced"]["predicted"] = predicted_exchange(
            counts, rank, run_when_empty=args.policy == "per_layer"
        )
    comm_all: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(comm_all, comm)
    return summarise(name, counts, steps, comm_all, losses)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _max_over_mean(values: list[float]) -> float:
    mean = statistics.mean(values)
    return max(values) / mean if mean > 0 else 0.0


def summarise(
    name: str,
    counts: list[int],
    steps: dict[str, list[dict[str, Any]]],
    comm_all: list[Any],
    losses: dict[str, list[float]],
) -> dict[str, Any]:
    result: dict[str, Any] = {"distribution": name, "images_per_rank": counts, "variants": {}}
    world = len(comm_all)
    for variant, records in steps.items():
        step_s = [max(r["step_s"] for r in s["ranks"]) for s in records]
        # The slowest rank's exchange (waiting included) over the step: the exchange's share.
        shares = [
            max(r["exchange_s"] for r in s["ranks"]) / max(r["step_s"] for r in s["ranks"])
            for s in records
        ]
        tower = [[r["tower_s"] for r in s["ranks"]] for s in records]
        exchange = [[r["exchange_s"] for r in s["ranks"]] for s in records]
        cpu = [[r["tower_cpu_s"] for r in s["ranks"]] for s in records]
        median_index = sorted(range(len(step_s)), key=lambda i: step_s[i])[len(step_s) // 2]
        result["variants"][variant] = {
            "median_step_s": _median(step_s),
            "step_s": step_s,
            "median_tower_s_per_rank": [_median([t[r] for t in tower]) for r in range(world)],
            "median_tower_max_over_mean": _median([_max_over_mean(t) for t in tower]),
            "median_tower_cpu_s_per_rank": [_median([t[r] for t in cpu]) for r in range(world)],
            "median_tower_cpu_max_over_mean": _median([_max_over_mean(t) for t in cpu]),
            "median_exchange_s_per_rank": [_median([x[r] for x in exchange]) for r in range(world)],
            "median_exchange_share": _median(shares),
            "timeline": [
                {"step_s": r["step_s"], "events": r["events"]}
                for r in records[median_index]["ranks"]
            ],
            "comm_per_rank": [c[variant] for c in comm_all],
        }
    bal, unbal = result["variants"]["balanced"], result["variants"]["unbalanced"]
    # Median of per-step ratios: the pair ran back to back, so load drift cancels.
    result["ratio_balanced_to_unbalanced"] = _median(
        [b / u for b, u in zip(bal["step_s"], unbal["step_s"], strict=True)]
    )
    result["ratio_of_medians"] = bal["median_step_s"] / unbal["median_step_s"]
    result["max_loss_difference"] = max(
        abs(a - b) for a, b in zip(losses["balanced"], losses["unbalanced"], strict=True)
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--policy", default="replicate", help="frozen_multimodal_sharding")
    parser.add_argument("--images", type=int, default=4, help="images per rank on average")
    parser.add_argument(
        "--distributions", default=",".join(DISTRIBUTIONS), help="comma-separated subset"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per batch")
    parser.add_argument(
        "--no-option",
        action="store_true",
        help="both variants without balance_media (checks the measurement code alone)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_at_start = os.getloadavg()[0]
    ctx = init_distributed(backend="gloo")
    if args.tp < 1 or ctx.world_size % args.tp:
        raise ValueError(f"--tp {args.tp} must be positive and divide {ctx.world_size} ranks")
    world = None
    if args.tp > 1:
        world = init_device_mesh(
            "cpu", (ctx.world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp")
        )
        mesh = world["dp"]
    else:
        mesh = build_mesh()
    data_rank = ctx.rank // args.tp
    patch_collectives()
    variants: dict[str, nn.Module] = {}
    with _quiet():
        for variant in VARIANTS:
            model = build()
            if world is not None:
                tensor_parallel(model, world["tp"])
            balanced = variant == "balanced" and not args.no_option
            variants[variant] = parallelizer(args.policy, balanced).parallelize(model, mesh=mesh)
            instrument(model)
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=LR) for k, m in variants.items()}
    distributions = []
    for name in args.distributions.split(","):
        counts = images_per_rank(name, ctx.world_size // args.tp, args.images)
        before = os.getloadavg()[0]
        with _quiet():
            distributions.append(
                run_distribution(name, counts, variants, optimizers, args, data_rank)
            )
        # The machine's 1-minute load around this row (other processes slow every time).
        distributions[-1]["load_average"] = [before, os.getloadavg()[0]]
    if ctx.rank == 0:
        reference = build()
        tower = sum(p.numel() for p in reference.vision_tower.parameters())
        result = {
            "world_size": ctx.world_size,
            "tp": args.tp,
            "policy": args.policy,
            "steps": args.steps,
            "warmup": args.warmup,
            "images_per_rank_mean": args.images,
            # The machine's 1-minute load average at the start and the end of the launch:
            # other processes on the same cores make every time here noisier.
            "load_average": [load_at_start, os.getloadavg()[0]],
            "cpus": os.cpu_count(),
            "option": not args.no_option,
            "params": sum(p.numel() for p in reference.parameters()),
            "tower_params": tower,
            "model": {
                "patches": PATCHES,
                "vision_dim": VISION_DIM,
                "vision_blocks": VISION_BLOCKS,
                "text_dim": TEXT_DIM,
                "text_layers": TEXT_LAYERS,
                "tokens": BATCH * SEQ,
            },
            "distributions": distributions,
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
    exit_rank(0)


if __name__ == "__main__":
    main()
