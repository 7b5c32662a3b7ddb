"""balance_media=True on real models (``balanced_hf``, with the tower families of
``balanced_families``): each loop case as a scenario ``balance_hf_<case>``
(``scenarios_loops.run_case`` plus the tokens ``generate()`` produced on every rank),
and gradient accumulation with text-only micro-batches."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import balanced_hf
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from scenarios_loops import run_case

from fsdp_core import DistributedContext, build_mesh
from multimodal_fsdp import MultimodalParallelizer


def _missing() -> list[str]:
    return [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is None]


def _gathered(value: Any, ctx: DistributedContext) -> list[Any]:
    parts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(parts, value)
    return parts


def _run(name: str, ctx: DistributedContext) -> dict[str, Any]:
    if _missing():
        return {"skipped": ", ".join(_missing())}
    balanced_hf.GENERATED.clear()
    result = run_case(balanced_hf.ALL_CASES[name], ctx)
    result["generated"] = _gathered(list(balanced_hf.GENERATED), ctx)
    return result


for _name in balanced_hf.ALL_CASES:

    def _scenario(ctx: DistributedContext, out: Path, _case: str = _name) -> dict[str, Any]:
        return _run(_case, ctx)

    scenario(f"balance_hf_{_name}")(_scenario)


@scenario("balance_hf_accumulation")
def balance_hf_accumulation(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Two micro-batches per step, one text-only on each rank (at different places), no
    gradient sync for the first; per_layer, LLaVA with LoRA in the tower and Qwen2-VL
    with a trainable tower."""
    if _missing():
        return {"skipped": ", ".join(_missing())}
    from hf_vlms import hf_loss

    results: dict[str, Any] = {}
    for name in balanced_hf.ACCUMULATION:
        model = balanced_hf.accumulation_model(name)
        parallelizer = MultimodalParallelizer(
            frozen_multimodal_sharding="per_layer", balance_media=True
        )
        plan = parallelizer.plan(model)
        parallelizer.apply_plan(model, plan, mesh=build_mesh())
        micro = balanced_hf.micro_batches(name, ctx.rank)
        for index, batch in enumerate(micro):
            model.set_requires_gradient_sync(index == len(micro) - 1)  # type: ignore[operator]
            hf_loss(model, batch).backward()
        results[name] = {
            "grads": {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None},
            "hooks": plan.hook_names(),
        }
    return results


#: The trainers of ``balance_trainer_checkpointing``: transformers' with
#: ``gradient_checkpointing=True`` and TRL's (``SFTConfig``'s default is True).
CHECKPOINTED_TRAINERS = ("trainer", "sft")


@scenario("balance_trainer_checkpointing")
def balance_trainer_checkpointing(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """``ShardedTrainer`` and ``ShardedSFTTrainer`` with ``gradient_checkpointing=True`` on
    the tiny LLaVA fine-tune of ``trainer_cases`` (frozen tower, ``per_layer``,
    ``balance_media=True``, every image on rank 0): the first backward hung (issue 33)."""
    from scenarios_trainer import _losses, _missing, _recorder, _sharded, _trainable, _trainer

    if _missing():
        return {"skipped": f"needs {_missing()}"}
    results: dict[str, Any] = {}
    for kind in CHECKPOINTED_TRAINERS:
        model = _sharded("frozen", "per_layer", True)
        recorder = _recorder()
        trainer = _trainer(
            ctx,
            model,
            out / "balance_trainer_checkpointing" / kind,
            kind,
            "rank0",
            callbacks=[recorder],
            args={"gradient_checkpointing": True},
        )
        trainer.train()
        results[kind] = {
            "losses": _losses(trainer),
            "grads0": recorder.grads0,
            "params": _trainable(model),
            # the layers the trainer checkpointed (it enables checkpointing in train())
            "checkpointed": sum(
                getattr(m, "gradient_checkpointing", False) is True for m in model.modules()
            ),
        }
    return results
