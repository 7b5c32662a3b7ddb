"""``plan``'s job dimensions: ``--world-size``/``--dp-replicate``/``--tp``/``--cp``/``--ep``/
``--pp`` make the job's [`ParallelDims`][fsdp_core.parallel_dims.ParallelDims]; ``--tp`` and
``--ep`` apply the model's TP or EP plan to the meta model, ``--pp`` cuts it into stages.
"""

from __future__ import annotations

import argparse
import contextlib
import copy

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

from fsdp_core.containers import is_module_container, is_under
from fsdp_core.fake_group import fake_process_group
from fsdp_core.mesh import resolve_mesh_shape
from fsdp_core.parallel_dims import ParallelDims
from multimodal_fsdp.cli.presets import model_presets
from multimodal_fsdp.offload import PartOffload
from multimodal_fsdp.parallelizer import MultimodalParallelizer
from multimodal_fsdp.pipeline import check_stages, split_stages, stage_layer_ranges
from multimodal_fsdp.tensor_parallel import apply_tensor_parallel, llama_style_plan


class CliError(Exception):
    """A user error: printed as ``error: ...`` with exit status 2."""


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def _add_parallel_options(plan: argparse.ArgumentParser) -> None:
    """``--dp-replicate``, ``--tp`` and ``--ep``: how ``--world-size`` is split."""
    plan.add_argument(
        "--dp-replicate",
        type=_positive_int,
        default=1,
        help=("HSDP replicas; the shard group is world-size / (dp-replicate x tp) (default 1)"),
    )
    plan.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help=(
            "tensor-parallel ranks: apply the model's TP plan (the preset's, else the "
            "Llama/Qwen2-style one) before planning, on a ('dp', 'tp') mesh; per-rank "
            "figures count TP-sharded parameters by 1/tp (default 1)"
        ),
    )
    plan.add_argument(
        "--cp",
        type=_positive_int,
        default=1,
        help=(
            "context-parallel ranks: each sample's sequence split over cp ranks, which hold "
            "the same batch; FSDP shards over the data-parallel ranks x cp (default 1)"
        ),
    )
    plan.add_argument(
        "--pp",
        type=_positive_int,
        default=1,
        help=(
            "pipeline stages: the model is cut along its decoder layers (towers, projectors "
            "and embeddings on the first stage, final norm and head on the last) and each "
            "stage is planned and costed per rank of its world-size / pp ranks (default 1)"
        ),
    )
    plan.add_argument(
        "--ep",
        type=_positive_int,
        default=1,
        help=(
            "expert-parallel ranks, borrowed from the data-parallel ones: apply the "
            "preset's EP plan (its routed experts sharded over ep) before planning; the "
            "experts stay out of FSDP and count per rank by their 1/ep shard (default 1)"
        ),
    )


def _options(
    args: argparse.Namespace, parallelizer: MultimodalParallelizer
) -> MultimodalParallelizer:
    """A copy of ``parallelizer`` with ``--balance-media`` and ``--offload`` (host memory)."""
    clone = copy.copy(parallelizer)
    clone.balance_media = clone.balance_media or args.balance_media
    if args.offload:
        clone.offload = PartOffload.parse(dict.fromkeys(args.offload, CPUOffloadPolicy()))
    return clone


def _parallel_dims(args: argparse.Namespace) -> ParallelDims:
    """The job's dimensions: ``--world-size`` split into ``--tp`` and the data-parallel
    ranks (``--dp-replicate`` x the shard group), of which ``--ep`` shard the experts."""
    if args.world_size % args.pp:
        raise CliError(
            f"--pp {args.pp} does not divide --world-size {args.world_size}: each pipeline "
            "stage runs on world-size / pp ranks"
        )
    if args.pp > 1 and (args.batch is not None or args.memory_budget is not None):
        raise CliError(
            f"--pp {args.pp} plans each stage on its own: --batch traces the whole model "
            "(give --activations SIZE) and --memory-budget chooses for the whole model "
            "(give --policy)"
        )
    args.world_size //= args.pp  # the ranks of one stage, which the figures are for
    if args.ep > 1 and args.tp > 1:
        raise CliError(
            f"--ep {args.ep} with --tp {args.tp}: expert and tensor parallelism are not "
            "planned together; plan one of them (--tp 1 or --ep 1)"
        )
    if args.world_size % args.ep:
        raise CliError(
            f"--ep {args.ep} does not divide --world-size {args.world_size}: EP borrows "
            "data-parallel ranks, world-size / ep of them per expert shard"
        )
    if args.world_size % args.tp:
        raise CliError(
            f"--tp {args.tp} does not divide --world-size {args.world_size}: the "
            "data-parallel ranks are world-size / tp"
        )
    if args.world_size % (args.tp * args.ep * args.cp):
        raise CliError(
            f"--cp {args.cp} does not divide --world-size {args.world_size} (with --tp "
            f"{args.tp}, --ep {args.ep}): the data-parallel ranks are world-size / (tp x ep x cp)"
        )
    if args.batch is not None and args.batch[1] % args.cp:
        samples, tokens = args.batch
        raise CliError(
            f"--batch {samples}x{tokens}: --cp {args.cp} does not divide {tokens} tokens (a CP "
            f"rank holds 1/{args.cp} of each sequence): give a multiple of {args.cp} tokens"
        )
    try:
        mesh = resolve_mesh_shape(
            world_size=args.world_size // (args.tp * args.ep * args.cp),
            dp_replicate=args.dp_replicate,
        )
    except ValueError as error:
        raise CliError(f"{error} (with --tp {args.tp})" if args.tp > 1 else str(error)) from None
    return ParallelDims.from_sizes(
        dp_replicate=mesh.dp_replicate,
        dp_shard=mesh.dp_shard,
        tp=args.tp,
        ep=args.ep,
        cp=args.cp,
        pp=args.pp,
    )


def _pipeline_stages(
    args: argparse.Namespace, model: nn.Module, parallelizer: MultimodalParallelizer
) -> list[tuple[str | None, nn.Module]]:
    """``--pp``'s stages of the meta model, each with the note that says what it holds
    (the model alone, without a note, at ``--pp 1``); refused, as a job would be, when a
    stage could stop alone (``check_stages``)."""
    if args.pp == 1:
        return [(None, model)]
    found = parallelizer.discover(model).paths
    containers = [
        (len(module), path)
        for path, module in model.named_modules()
        if path and is_module_container(module) and not any(is_under(path, f) for f in found)
    ]
    if not containers:
        raise CliError(f"--pp {args.pp}: {type(model).__name__} has no decoder layer container")
    count, layers = max(containers, key=lambda c: c[0])
    chosen = parallelizer.with_options(frozen_multimodal_sharding=args.policy or "root")
    try:
        stages = split_stages(model, layers=layers, num_stages=args.pp)
        check_stages(stages, parallelizer=chosen)
    except ValueError as error:
        raise CliError(f"--pp {args.pp}: {error}") from None
    ranges = stage_layer_ranges(count, args.pp)
    where = {0: "; with the towers, projectors and embeddings", args.pp - 1: "; with the head"}
    return [
        (
            f"pipeline stage {i} of {args.pp} ({args.world_size} ranks each, "
            f"{args.world_size * args.pp} in all): {layers} {r.start}..{r.stop - 1}"
            f"{where.get(i, '')}; figures per rank of this stage, its gathers per "
            "microbatch (torch's schedules run each microbatch's forward and backward; they "
            "reduce-scatter once per step), beside the pipeline's send/recv of each "
            "microbatch's hidden states",
            stage,
        )
        for i, (r, stage) in enumerate(zip(ranges, stages, strict=True))
    ]


def _tensor_parallel(
    args: argparse.Namespace, model: nn.Module, stack: contextlib.ExitStack
) -> str | None:
    """Apply ``--tp``'s plan (or ``--ep``'s) to the meta model over a fake group that
    ``stack`` keeps open while the plan is costed; returns the note saying what was
    sharded, after ``--cp``'s."""
    sharded = _expert_parallel(args, model, stack) if args.ep > 1 else _tp(args, model, stack)
    return "; ".join(note for note in (_context_parallel(args), sharded) if note) or None


def _context_parallel(args: argparse.Namespace) -> str | None:
    """What ``--cp`` changes: FSDP's ranks, a rank's activations, the media exchange."""
    if args.cp == 1:
        return None
    dp = args.world_size // (args.tp * args.cp)
    return (
        f"context parallel: {args.world_size} ranks as ('dp', 'cp') = ({dp}, {args.cp}) (beside "
        f"tp={args.tp}); FSDP shards over dp x cp = {dp * args.cp} ranks, a rank's activations "
        f"are those of 1/{args.cp} of each sequence (--batch SxT traces S sequences of "
        f"T/{args.cp} tokens, each with its sample's media tokens); with "
        "--balance-media and frozen towers the CP ranks share each tower call and each gets "
        "its shard's items only: per call a header all_gather of 3 + items int64 per rank, "
        "then an all_to_all of the needed items another CP rank encoded (the trace, whose "
        "shard holds every media token, needs every item: its memory counts the all_gather "
        "of every share, an upper bound)"
    )


def _tp(args: argparse.Namespace, model: nn.Module, stack: contextlib.ExitStack) -> str | None:
    """The TP plan applied to the meta model (``_tensor_parallel``)."""
    if args.tp == 1:
        return None
    preset = model_presets().get(args.model)
    source = "the preset's TP plan"
    try:
        if preset is not None and preset.tp_plan is not None:
            plan = preset.tp_plan(model, args.tp)
        else:
            plan = llama_style_plan(model, tp_size=args.tp)
            source = "the Llama/Qwen2-style TP plan (multimodal_fsdp.tensor_parallel)"
    except ValueError as error:
        raise CliError(f"--tp {args.tp}: {error}") from None
    stack.enter_context(fake_process_group(args.tp))
    apply_tensor_parallel(model, init_device_mesh("cpu", (args.tp,), mesh_dim_names=("tp",)), plan)
    return (
        f"tensor parallel: {args.world_size} ranks as ('dp', 'tp') = "
        f"({args.world_size // args.tp}, {args.tp}); {source} applied first ({len(plan)} "
        f"modules), so their parameters count per rank by their 1/{args.tp} TP shard, which "
        f"FSDP shards over the {args.world_size // args.tp} data-parallel ranks (the world "
        "size above)"
    )


def _expert_parallel(
    args: argparse.Namespace, model: nn.Module, stack: contextlib.ExitStack
) -> str:
    """Apply the preset's EP plan to the meta model over a fake ``ep`` group."""
    preset = model_presets().get(args.model)
    if preset is None or preset.ep_plan is None:
        with_plans = sorted(n for n, p in model_presets().items() if p.ep_plan is not None)
        raise CliError(
            f"--ep {args.ep}: the model {args.model!r} has no EP plan (a preset's ep_plan "
            f"shards its routed experts); presets with one: {', '.join(with_plans) or 'none'}"
        )
    stack.enter_context(fake_process_group(args.ep))
    try:
        sharded = preset.ep_plan(model, init_device_mesh("cpu", (args.ep,), mesh_dim_names=("ep",)))
    except ValueError as error:
        raise CliError(f"--ep {args.ep}: {error}") from None
    dp = args.world_size // args.ep
    return (
        f"expert parallel: {args.world_size} ranks as ('dp', 'ep') = ({dp}, {args.ep}); the "
        f"preset's EP plan placed {len(sharded)} expert parameters Shard(0) over ep, so they "
        f"count per rank by their 1/{args.ep} shard, kept out of FSDP (replicated over the "
        f"{dp} ranks of each ep coordinate); FSDP shards the rest over all "
        f"{args.world_size} ranks"
    )
