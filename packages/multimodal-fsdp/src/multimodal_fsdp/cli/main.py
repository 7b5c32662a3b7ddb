"""Command line: what a sharding plan costs, before a job is launched.

    python -m multimodal_fsdp plan --model deepseek-v41-base --world-size 8 \\
        --policy per_layer --freeze vision
    multimodal-fsdp plan --model llava --world-size 64 --dp-replicate 8 --json
    multimodal-fsdp plan --model path/to/config.json --world-size 8
    multimodal-fsdp plan --model deepseek-v41-base --world-size 16 --tp 2

The model is built on the meta device (no memory, no weights). ``--model`` takes a preset
an installed model package registers (see
[`multimodal_fsdp.cli.presets`][multimodal_fsdp.cli.presets]), a transformers
``model_type`` or a local ``config.json`` / model directory (needs the
``multimodal-fsdp[transformers]`` extra). ``--tp N`` applies the model's TP plan on the
meta model over a fake ``tp`` group first, as a job does, so every figure counts a
TP-sharded parameter by its local shard.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from fsdp_core.parallel_dims import ParallelDims
from fsdp_core.precision import DTYPE_ALIASES, mixed_precision_policy, parse_dtype
from fsdp_core.sharding import check_reshard_after_forward
from fsdp_core.sizes import parse_size
from multimodal_fsdp.cli._parallel import (
    CliError,
    _add_parallel_options,
    _options,
    _parallel_dims,
    _pipeline_stages,
    _positive_int,
    _tensor_parallel,
)
from multimodal_fsdp.cli.presets import model_presets
from multimodal_fsdp.estimate.choose import PolicyChoice, choose_frozen_policy
from multimodal_fsdp.estimate.costs import PlanCosts
from multimodal_fsdp.estimate.memory import OPTIMIZER_STATES
from multimodal_fsdp.estimate.predict import inspect_model
from multimodal_fsdp.offload import OFFLOAD_PARTS
from multimodal_fsdp.parallelizer import MultimodalParallelizer
from multimodal_fsdp.policy import (
    VALID_FROZEN_MULTIMODAL_SHARDING,
    normalize_frozen_multimodal_sharding,
)

__all__ = ["FREEZE_CHOICES", "build_parser", "main"]

logger = logging.getLogger(__name__)

#: What ``--freeze`` can freeze: nothing, the towers of one modality, all towers,
#: or all towers and projectors.
FREEZE_CHOICES: tuple[str, ...] = ("none", "vision", "audio", "video", "towers", "multimodal")
_TRANSFORMERS_EXTRA = "pip install 'multimodal-fsdp[transformers]'"
_T = TypeVar("_T")


def _dtype_name(value: str) -> str:
    try:
        parse_dtype(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"unknown dtype {value!r}; valid names: {', '.join(sorted(DTYPE_ALIASES))}"
        ) from None
    return value


def _argument(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """``parse`` as an argparse type: its ValueError's message is the usage error."""

    def convert(value: str) -> _T:
        try:
            return parse(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def _batch(value: str) -> tuple[int, int]:
    parts = value.lower().split("x")
    if len(parts) == 2 and all(p.strip().isdigit() and int(p) > 0 for p in parts):
        return int(parts[0]), int(parts[1])
    raise argparse.ArgumentTypeError(
        f"invalid batch {value!r}; write samples x tokens per sample, e.g. 4x2048"
    )


def _reshard(value: str) -> bool | int | None:
    key = value.strip().lower()
    if key in ("auto", "none", "default"):
        return None
    if key in ("true", "yes", "1x", "on"):
        return True
    if key in ("false", "no", "off"):
        return False
    try:
        number = int(key)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid reshard setting {value!r}; valid choices: auto, true, false or a "
            "positive divisor of the shard-group size"
        ) from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"reshard group size must be positive, got {value!r}")
    return number


def build_parser() -> argparse.ArgumentParser:
    """The ``multimodal-fsdp`` argument parser (one sub-command: ``plan``).

    Returns:
        The parser.
    """
    parser = argparse.ArgumentParser(
        prog="multimodal-fsdp",
        description="Inspect FSDP2 sharding plans of multimodal models before launching a job.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan_command(commands)
    return parser


def _add_plan_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``plan`` and its options, group by group in the order ``plan --help`` lists them."""
    plan = commands.add_parser(
        "plan",
        help="print the FSDP units of a model and what they cost per rank and step",
        description=(
            "Plan a model on the meta device and print every FSDP unit with its per-rank "
            "sharded bytes and collectives per training step (one forward + backward), "
            "with totals and peak gathered parameter memory."
        ),
    )
    for add_options in (
        _add_model_options,
        _add_precision_options,
        _add_policy_options,
        _add_unit_options,
        _add_memory_options,
    ):
        add_options(plan)
    plan.add_argument("--json", action="store_true", help="print JSON instead of the tree")


def _add_model_options(plan: argparse.ArgumentParser) -> None:
    """Which model, on how many ranks."""
    plan.add_argument(
        "--model",
        required=True,
        help=(
            "a registered preset ("
            + (", ".join(model_presets()) or "none installed")
            + ") | a transformers model_type (e.g. llava, qwen2_vl) | path to a "
            "config.json or model directory"
        ),
    )
    plan.add_argument("--world-size", type=_positive_int, default=8, help="ranks (default 8)")
    _add_parallel_options(plan)


def _add_precision_options(plan: argparse.ArgumentParser) -> None:
    """The mixed-precision policy and the storage dtype."""
    plan.add_argument(
        "--precision",
        type=_dtype_name,
        default="bf16",
        help="compute (all-gather) dtype of the mixed-precision policy (default bf16)",
    )
    plan.add_argument(
        "--reduce-precision",
        type=_dtype_name,
        default="fp32",
        help="gradient reduction dtype (default fp32)",
    )
    plan.add_argument(
        "--storage-dtype",
        type=_dtype_name,
        default="fp32",
        help="dtype the model's parameters are stored in (default fp32)",
    )


def _add_policy_options(plan: argparse.ArgumentParser) -> None:
    """How frozen towers are sharded (a policy, or a budget that chooses one per module),
    whether tower calls are balanced, and what is frozen."""
    plan.add_argument(
        "--policy",
        type=_argument(normalize_frozen_multimodal_sharding),  # per-layer, Per_Layer ...
        default=None,
        metavar="{" + ",".join(VALID_FROZEN_MULTIMODAL_SHARDING) + "}",
        help="frozen-tower policy (default root, or the one --memory-budget chooses)",
    )
    plan.add_argument(
        "--memory-budget",
        type=_argument(parse_size),
        default=None,
        metavar="SIZE",
        help=(
            "per-rank memory budget, e.g. 40GiB: choose a policy for each frozen tower and "
            "projector, the combination with the least communication whose predicted peak "
            "fits; the notes say why for each (instead of --policy)"
        ),
    )
    plan.add_argument(
        "--balance-media",
        action="store_true",
        help=(
            "plan with balance_media=True: every tower call spread over the data-parallel "
            "ranks of its balance group (the default: every rank up to 64, groups of up to "
            "64 beyond; the notes say which); the plan lists the balanced towers and their "
            "collectives per call (with --batch, the exchange of that batch on every rank "
            "is counted)"
        ),
    )
    plan.add_argument(
        "--freeze",
        choices=FREEZE_CHOICES,
        default="none",
        help="freeze these multimodal modules before planning (default none)",
    )


def _add_unit_options(plan: argparse.ArgumentParser) -> None:
    """How every unit reshards and prefetches, and how the units are listed."""
    plan.add_argument(
        "--reshard-after-forward",
        type=_reshard,
        default=None,
        metavar="{auto,true,false,N}",
        help="FSDP reshard_after_forward for every unit (default auto)",
    )
    plan.add_argument(
        "--no-prefetch-guard",
        action="store_true",
        help="count FSDP2's default backward prefetch of frozen units (the waste)",
    )
    plan.add_argument(
        "--no-collapse",
        action="store_true",
        help="list identical numbered layers one by one",
    )


def _add_memory_options(plan: argparse.ArgumentParser) -> None:
    """What the memory estimate counts (optimizer state, activations, a traced batch)."""
    plan.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZER_STATES),
        default="adamw",
        help="optimizer whose state the memory estimate counts (default adamw)",
    )
    plan.add_argument(
        "--offload",
        choices=OFFLOAD_PARTS,
        action="append",
        default=[],
        help=(
            "keep this part's shards (and gradients and optimizer state, when trainable) "
            "in host memory: CPUOffloadPolicy for its units (repeat for several parts); "
            "the memory estimate counts them as host bytes"
        ),
    )
    plan.add_argument(
        "--activations",
        type=_argument(parse_size),
        default=None,
        metavar="SIZE",
        help=(
            "activation bytes per rank to add to the predicted peak, e.g. 12GiB "
            "(trace them with multimodal_fsdp.estimate.memory.trace_activations; default: "
            "the peak leaves activations out and says so)"
        ),
    )
    plan.add_argument(
        "--batch",
        type=_batch,
        default=None,
        metavar="BxS",
        help=(
            "DeepSeek-V4.1 presets: trace one step of B samples of S tokens (one image "
            "each) to predict activations and the peak; materialises the model on the CPU"
        ),
    )


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise CliError(
            "transformers models need the optional dependency: " + _TRANSFORMERS_EXTRA
        ) from None
    return transformers


def _cached_hub_config(transformers: Any, repo_id: str) -> str | None:
    """The path of ``repo_id``'s ``config.json`` in the local Hugging Face cache, if any."""
    try:
        found = transformers.utils.try_to_load_from_cache(repo_id, "config.json")
    except (ValueError, OSError):  # not a valid repository name
        return None
    return found if isinstance(found, str) else None


def _hub_id_error(transformers: Any, name: str) -> CliError:
    """What to do instead of a hub ID: the CLI reads local configs and never downloads."""
    cached = _cached_hub_config(transformers, name)
    if cached is not None:
        instead = f"its config.json is in the local cache: --model {cached}"
    else:
        instead = (
            "download its config.json first (huggingface-cli download "
            f"{name} config.json, or any from_pretrained) and pass that file: "
            "--model path/to/config.json"
        )
    return CliError(
        f"--model {name!r} is no local path and looks like a Hugging Face hub ID; the CLI "
        f"never downloads anything: {instead}"
    )


def _hf_config(name: str) -> tuple[Any, str]:
    """The config for ``name`` and where it came from (for the output's notes)."""
    transformers = _transformers()
    path = Path(name)
    if path.exists():
        try:
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as error:
            raise CliError(f"cannot read a transformers config from {name!r}: {error}") from None
        return config, f"{type(config).__name__} read from {name}"
    known = sorted(transformers.CONFIG_MAPPING.keys())
    if name not in known and name.count("/") == 1 and not name.endswith(".json"):
        raise _hub_id_error(transformers, name)
    if name not in known:
        presets = list(model_presets())
        close = difflib.get_close_matches(name, [*presets, *known], n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise CliError(
            f"unknown --model {name!r}: not a path, not a registered preset "
            f"({', '.join(presets) or 'none installed'}), "
            f"and not one of the {len(known)} transformers model types{hint}. Model "
            "packages add presets when installed (the DeepSeek-V4.1 reference presets: "
            "pip install ./packages/model-deepseek-v41 from a source checkout, after "
            "fsdp-core and multimodal-fsdp)"
        )
    config = transformers.AutoConfig.for_model(name)
    return config, (
        f"transformers' default {type(config).__name__} (the model type's defaults, not a "
        "released checkpoint; pass a config.json to plan a real one)"
    )


def _hf_model(name: str, storage: torch.dtype) -> tuple[nn.Module, str]:
    config, source = _hf_config(name)
    transformers = _transformers()
    errors = []
    for auto in ("AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModel"):
        cls = getattr(transformers, auto, None)
        if cls is None:
            continue
        try:
            with torch.device("meta"):
                model: nn.Module = cls.from_config(config, dtype=storage)
        except (ValueError, KeyError) as error:
            errors.append(f"{auto}: {error}")
            continue
        return model, source
    raise CliError(f"no transformers model class for {name!r}: " + "; ".join(errors))


def _build_described(
    name: str, storage: torch.dtype
) -> tuple[nn.Module, MultimodalParallelizer, str]:
    """The meta-device model for ``--model``, its parallelizer, and a note saying which
    model and config were planned (a bare model type plans the type's defaults)."""
    preset = model_presets().get(name)
    if preset is not None:
        model, parallelizer = preset.build(storage)
        source = f"the registered preset {name!r}"
    else:
        model, source = _hf_model(name, storage)
        parallelizer = MultimodalParallelizer()
    count = sum(p.numel() for p in model.parameters())
    note = f"model: {type(model).__name__} from {source}; {_count(count)} parameters"
    return model, parallelizer, note


def _count(number: int) -> str:
    """``73.4B`` / ``812.0M`` / ``5.1K``: a parameter count at a glance."""
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if number >= scale:
            return f"{number / scale:.1f}{suffix} ({number:,})"
    return str(number)


def freeze(model: nn.Module, parallelizer: MultimodalParallelizer, what: str) -> list[str]:
    """Freeze the multimodal modules ``what`` names; returns their paths."""
    if what not in FREEZE_CHOICES:
        raise ValueError(f"unknown freeze choice {what!r}; valid choices: {FREEZE_CHOICES}")
    if what == "none":
        return []
    found = [part.found for part in parallelizer.multimodal_parts(model)]
    if what == "multimodal":
        chosen = found
    elif what == "towers":
        chosen = [m for m in found if m.role == "tower"]
    else:
        chosen = [m for m in found if m.role == "tower" and m.modality == what]
    if not chosen:
        listed = ", ".join(f"{m.path} ({m.role}, {m.modality})" for m in found) or "none"
        raise CliError(
            f"--freeze {what}: no such module in {type(model).__name__}; found: {listed}"
        )
    for module in chosen:
        module.module.requires_grad_(False)
    return [m.path for m in chosen]


def _batch_loss(args: argparse.Namespace) -> Callable[[nn.Module], torch.Tensor] | None:
    """The loss of one ``--batch`` for the activation trace (DeepSeek-V4.1 presets)."""
    if args.batch is None:
        return None
    preset = model_presets().get(args.model)
    if preset is None or preset.batch_loss is None:
        with_batches = [name for name, p in model_presets().items() if p.batch_loss is not None]
        raise CliError(
            f"--batch works with presets that make their own batches "
            f"({', '.join(with_batches) or 'none installed'}); "
            "for other models give --activations SIZE"
        )
    if args.activations is not None:
        raise CliError("give --batch (to trace activations) or --activations, not both")
    samples, tokens = args.batch
    try:  # a CP rank's share: 1/cp of each sequence's tokens (see ``inspect_model``)
        return preset.batch_loss(samples, tokens // args.cp)
    except ValueError as error:
        shard = f" (1/{args.cp} of each sequence: --cp {args.cp})" if args.cp > 1 else ""
        raise CliError(f"--batch {samples}x{tokens}{shard}: {error}") from None


def _costs(
    args: argparse.Namespace,
    model: nn.Module,
    parallelizer: MultimodalParallelizer,
    dims: ParallelDims,
) -> tuple[PlanCosts, PolicyChoice | None]:
    """The plan of ``--policy``, or of the policy chosen for ``--memory-budget``: the
    parallelizer plans, the estimates read the plan."""
    loss_fn = _batch_loss(args)
    mesh = dims.dp_shape
    options: dict[str, Any] = {
        "mesh": mesh,
        "prefetch_guard": not args.no_prefetch_guard,
        "optimizer": args.optimizer,
        "loss_fn": loss_fn,
    }
    try:
        if args.memory_budget is not None:
            if args.policy is not None:
                raise CliError("give --policy or --memory-budget (which chooses it), not both")
            choice = choose_frozen_policy(
                model,
                args.memory_budget,
                activations=args.activations,
                precision=args.precision,
                reduce_precision=args.reduce_precision,
                parallelizer=parallelizer,
                reshard_after_forward=args.reshard_after_forward,
                **options,
            )
            return choice.costs, choice
        check_reshard_after_forward(args.reshard_after_forward, mesh.dp_shard)
        chosen = parallelizer.with_options(frozen_multimodal_sharding=args.policy or "root")
        plan = chosen.plan(
            model,
            mp_policy=mixed_precision_policy(args.precision, args.reduce_precision),
            reshard_after_forward=args.reshard_after_forward,
        )
        costs = inspect_model(
            plan,
            model,
            precision=f"param={args.precision} reduce={args.reduce_precision}",
            activations=args.activations,
            **{**options, "mesh": dims},
        )
    except ValueError as error:
        raise CliError(str(error)) from None
    return costs, None


def _plan(
    args: argparse.Namespace, dims: ParallelDims
) -> list[tuple[PlanCosts, PolicyChoice | None]]:
    """The costs of the plan (one per pipeline stage with ``--pp``)."""
    if args.tp > 1 and args.batch is not None:
        raise CliError(
            "--batch traces activations of the whole model, not of its TP shards: with "
            "--tp give --activations SIZE"
        )
    model, parallelizer, described = _build_described(args.model, parse_dtype(args.storage_dtype))
    if args.balance_media or args.offload:
        parallelizer = _options(args, parallelizer)
    frozen = freeze(model, parallelizer, args.freeze)
    frozen_note = (
        f"frozen: {', '.join(frozen)}"
        if frozen
        else "nothing frozen: the frozen-tower policy changes nothing (see --freeze)"
    )
    staged = []
    with contextlib.ExitStack() as stack:
        tensor_parallel = _tensor_parallel(args, model, stack)
        for stage_note, stage in _pipeline_stages(args, model, parallelizer):
            costs, choice = _costs(args, stage, parallelizer, dims)
            first = [described, frozen_note, tensor_parallel, stage_note]
            notes = [n for n in first if n is not None] + list(costs.notes)
            notes.append("memory figures are predicted from the plan; nothing here is measured")
            staged.append((dataclasses.replace(costs, notes=tuple(notes)), choice))
    return staged


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m multimodal_fsdp`` and the ``multimodal-fsdp`` script.

    Args:
        argv: the arguments without the program name (``sys.argv[1:]`` if None).

    Returns:
        The exit status.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        dims = _parallel_dims(args)
        staged = _plan(args, dims)
    except CliError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if args.json:
        stages = [
            {**costs.as_dict(), **({} if choice is None else {"policy_choice": choice.as_dict()})}
            for costs, choice in staged
        ]
        data: dict[str, Any] = stages[0] if len(stages) == 1 else {"stages": stages}
        data["parallel_dims"] = {
            "names": list(dims.names),
            "sizes": list(dims.sizes),
            "dp_names": list(dims.dp_names),
        }
        print(json.dumps(data, indent=2))
    else:
        print("\n\n".join(costs.format(collapse=not args.no_collapse) for costs, _ in staged))
    return 0


if __name__ == "__main__":
    sys.exit(main())
