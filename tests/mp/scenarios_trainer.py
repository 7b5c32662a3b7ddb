"""transformers Trainer, TRL SFTTrainer and accelerate on a sharded tiny LLaVA (issue 25).

Every case trains the fine-tune of :mod:`trainer_cases` on 2 ranks and records what the
tests (``tests/test_trainer_distributed.py``) compare with one process on the global
batch: the loss of each step, the gradients of step 0 after clipping, the trained
parameters; and what the run wrote (exports, checkpoints).

- ``trainer_<case>``: ``ShardedTrainer`` (``ShardedSFTTrainer`` for ``sft``), 3 steps of
  2 micro-batches per rank, clipped; ``save_model``; ``evaluate()`` and ``predict()``
  with images on rank 0 only.
- ``trainer_resume``: LoRA; a checkpoint at step 2 (``save_steps``), then a fresh model
  resumes from it and takes step 3, beside the uninterrupted run.
- ``trainer_unmodified``: the errors an unmodified ``Trainer``, ``SFTTrainer``,
  ``accelerator.prepare(model)`` and ``DistributedDataParallel`` raise on every rank.
- ``accelerate_loop``: ``fsdp_core.integrations.accelerate.prepare`` on CPU (accelerate
  prepares optimizer and loader), ``save_state`` at step 2, a fresh run ``load_state``s
  and takes step 3; ``load_state`` of a directory accelerate saved alone is refused.
- ``accelerate_fsdp2_plugin``: the FSDP2-plugin path (accelerate's GPU path, emulated on
  CPU by setting its distributed type in this test only): ``prepare`` hands the sharded
  model to ``accelerator.prepare``, which passes it through; what accelerate's own
  ``get_state_dict`` returns there on each rank (the contract the routed one keeps).
- ``accelerate_exports``: after one step of the ``accelerate_loop`` run, the export calls
  an accelerate user makes (``get_state_dict``, ``save_model`` with its options,
  ``unwrap_model(model).save_pretrained`` as accelerate's examples call it,
  ``accelerator.save`` of state dicts, ``register_for_checkpointing``,
  ``clip_grad_norm_``'s norm): what each returns or raises on every rank, and the files.
- ``accelerate_exports_lora``: ``get_state_dict``, ``save_model`` and
  ``unwrap_model(model).save_pretrained`` of a sharded ``PeftModel``.

transformers, TRL, accelerate and datasets are imported inside: without them a scenario
reports ``skipped``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from torch import nn
from torch.distributed.tensor import DTensor
from trainer_cases import CASES

from fsdp_core import DistributedContext, build_mesh

EVAL_SAMPLES = 5  # odd: accelerate pads rank 1's last batch, gather_for_metrics drops it
NEEDS = ("transformers", "trl", "accelerate", "datasets", "peft", "safetensors")


def _missing() -> list[str]:
    return [m for m in NEEDS if importlib.util.find_spec(m) is None]


def case_dir(out: Path, name: str) -> Path:
    return out / "trainer" / name


def _sharded(build: str, policy: str, balance: bool) -> nn.Module:
    from trainer_cases import BUILDERS

    from multimodal_fsdp import MultimodalParallelizer

    model = BUILDERS[build]()
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy, balance_media=balance)
    parallelizer.parallelize(model, mesh=build_mesh())
    return model


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters() if p.requires_grad}


def _recorder() -> Any:
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):  # type: ignore[misc]
        """The clipped gradients of the first optimizer step (gathered, every rank)."""

        def __init__(self) -> None:
            self.grads0: dict[str, torch.Tensor] | None = None

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.grads0 is None:
                model = kw["model"]
                self.grads0 = {
                    n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None
                }

    return Recorder()


def _args(ctx: DistributedContext, output_dir: Path, sft: bool = False, **overrides: Any) -> Any:
    from trainer_cases import training_arguments

    args = training_arguments(str(output_dir), use_cpu=ctx.device.type == "cpu", **overrides)
    if not sft:
        return args
    from trl import SFTConfig

    fields = {k: v for k, v in args.to_dict().items() if k in SFTConfig.__dataclass_fields__}
    fields.update(use_cpu=args.use_cpu, dataset_kwargs={"skip_prepare_dataset": True})
    return SFTConfig(**fields)


def _trainer(
    ctx: DistributedContext, model: nn.Module, output_dir: Path, kind: str, images: str, **kw: Any
) -> Any:
    import trainer_cases as tc

    from fsdp_core.integrations.transformers import ShardedTrainer

    count = tc.STEPS * tc.STEP_SAMPLES
    if kind == "sft":
        from fsdp_core.integrations.trl import ShardedSFTTrainer

        return ShardedSFTTrainer(
            model=model,
            args=_args(ctx, output_dir, sft=True, **kw.pop("args", {})),
            train_dataset=tc.hf_dataset(count, images=images),
            data_collator=tc.collate_rows,
            processing_class=tc.tokenizer(),
            **kw,
        )
    return ShardedTrainer(
        model=model,
        args=_args(ctx, output_dir, **kw.pop("args", {})),
        train_dataset=tc.LlavaSamples(count, images=images),
        data_collator=tc.collate,
        **kw,
    )


def _losses(trainer: Any) -> list[float]:
    return [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]


def _everywhere(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _errors(call: Callable[[], Any]) -> list[str | None]:
    try:
        call()
        mine = None
    except Exception as exc:  # recorded for the test
        mine = f"{type(exc).__name__}: {exc}"
    return _everywhere(mine)


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _case(ctx: DistributedContext, out: Path, name: str) -> dict[str, Any]:
    import trainer_cases as tc

    if _missing():
        return {"skipped": f"needs {_missing()}"}
    build, policy, balance, images, kind, eval_images = CASES[name]
    root = case_dir(out, name)
    model = _sharded(build, policy, balance)
    recorder = _recorder()
    trainer = _trainer(ctx, model, root / "run", kind, images, callbacks=[recorder])
    trainer.train()
    result: dict[str, Any] = {
        "losses": _losses(trainer),
        "grads0": recorder.grads0,
        "params": _trainable(model),
    }
    trainer.save_model(str(root / "export"))
    data = (
        tc.hf_dataset(EVAL_SAMPLES, images=eval_images)
        if kind == "sft"
        else tc.LlavaSamples(EVAL_SAMPLES, images=eval_images)
    )
    metrics = trainer.evaluate(data)
    prediction = trainer.predict(data)
    result.update(
        resharded=all(isinstance(p, DTensor) for p in model.parameters() if p.requires_grad),
        eval_loss=_everywhere(float(metrics["eval_loss"])),
        predictions=torch.as_tensor(prediction.predictions),
        export=_listing(root / "export") if ctx.rank == 0 else None,
    )
    return result


for _name in CASES:

    def _run(ctx: DistributedContext, out: Path, _n: str = _name) -> dict[str, Any]:
        return _case(ctx, out, _n)

    scenario(f"trainer_{_name}")(_run)


@scenario("trainer_resume")
def trainer_resume(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """LoRA with images on rank 0: save at step 2, resume, step 3."""
    if _missing():
        return {"skipped": f"needs {_missing()}"}
    root = case_dir(out, "resume")
    options = {"args": {"save_strategy": "steps", "save_steps": 2}}
    model = _sharded("lora", "root", False)
    trainer = _trainer(ctx, model, root / "run", "trainer", "rank0", **options)
    trainer.train()
    uninterrupted = {"losses": _losses(trainer), "params": _trainable(model)}
    checkpoint = root / "run" / "checkpoint-2"
    listing = _listing(checkpoint) if ctx.rank == 0 else None

    model = _sharded("lora", "root", False)
    trainer = _trainer(ctx, model, root / "resumed", "trainer", "rank0", **options)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    resumed = {"losses": _losses(trainer), "params": _trainable(model)}
    return {
        "uninterrupted": uninterrupted,
        "resumed": resumed,
        "checkpoint": listing,
        "step": trainer.state.global_step,
    }


def _step_recorder() -> Any:
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):  # type: ignore[misc]
        """The trainable parameters after every optimizer step (gathered, every rank)."""

        def __init__(self) -> None:
            self.params: dict[int, dict[str, torch.Tensor]] = {}

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.params[int(state.global_step)] = _trainable(kw["model"])

    return StepRecorder()


@scenario("trainer_checkpoint_variants")
def trainer_checkpoint_variants(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """``load_best_model_at_end`` (evaluated and saved every step), and a resume from a
    ``save_only_model`` checkpoint (weights from the export, a new optimizer)."""
    if _missing():
        return {"skipped": f"needs {_missing()}"}
    import trainer_cases as tc

    root = case_dir(out, "checkpoint_variants")
    model = _sharded("frozen", "root", False)
    steps = _step_recorder()
    best = {
        "save_strategy": "steps",
        "save_steps": 1,
        "eval_strategy": "steps",
        "eval_steps": 1,
        "load_best_model_at_end": True,
        "metric_for_best_model": "eval_loss",
        "greater_is_better": True,  # the highest loss: not the last step's
    }
    trainer = _trainer(
        ctx,
        model,
        root / "best",
        "trainer",
        "rank0",
        args=best,
        callbacks=[steps],
        eval_dataset=tc.LlavaSamples(EVAL_SAMPLES, images="rank0"),
    )
    trainer.train()
    best_step = int(Path(trainer.state.best_model_checkpoint).name.split("-")[1])
    result: dict[str, Any] = {
        "best_step": best_step,
        "best_params": steps.params[best_step],
        "loaded_params": _trainable(model),
    }

    only_model = {"save_strategy": "steps", "save_steps": 2, "save_only_model": True}
    model = _sharded("frozen", "root", False)
    steps = _step_recorder()
    trainer = _trainer(
        ctx, model, root / "only_model", "trainer", "rank0", args=only_model, callbacks=[steps]
    )
    trainer.train()
    checkpoint = root / "only_model" / "checkpoint-2"
    result["only_model_listing"] = _listing(checkpoint) if ctx.rank == 0 else None
    result["step2_params"] = steps.params[2]
    model = _sharded("frozen", "root", False)
    trainer = _trainer(ctx, model, root / "only_model_resumed", "trainer", "rank0", args=only_model)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    result["resumed_params"] = _trainable(model)
    return result


@scenario("trainer_unmodified")
def trainer_unmodified(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """A sharded model handed to the frameworks as they are."""
    if _missing():
        return {"skipped": f"needs {_missing()}"}
    import trainer_cases as tc
    from accelerate import Accelerator
    from transformers import Trainer
    from trl import SFTTrainer

    model = _sharded("frozen", "root", False)
    root = case_dir(out, "unmodified")
    data = tc.LlavaSamples(tc.STEP_SAMPLES, images="all")
    before = _trainable(model)

    def trainer() -> None:
        Trainer(
            model=model, args=_args(ctx, root), train_dataset=data, data_collator=tc.collate
        ).train()

    def sft() -> None:
        SFTTrainer(
            model=model,
            args=_args(ctx, root, sft=True),
            train_dataset=tc.hf_dataset(tc.STEP_SAMPLES, images="all"),
            data_collator=tc.collate_rows,
            processing_class=tc.tokenizer(),
        ).train()

    def accelerate() -> None:
        Accelerator(cpu=ctx.device.type == "cpu").prepare(model)

    def ddp() -> None:
        torch.nn.parallel.DistributedDataParallel(model)

    return {
        "errors": {
            "trainer": _errors(trainer),
            "sft": _errors(sft),
            "accelerate": _errors(accelerate),
            "ddp": _errors(ddp),
        },
        "unchanged": all(torch.equal(before[n], p) for n, p in _trainable(model).items()),
    }


# --------------------------------------------------------------------------- accelerate
def _accelerate_run(ctx: DistributedContext, plugin: Any) -> tuple[Any, nn.Module, Any, Any]:
    import trainer_cases as tc
    from accelerate import Accelerator

    from fsdp_core.integrations.accelerate import prepare

    model = _sharded("frozen", "root", False)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=tc.LR, weight_decay=0.0
    )
    loader = torch.utils.data.DataLoader(
        tc.LlavaSamples(tc.STEPS * tc.STEP_SAMPLES, images="all"),
        batch_size=tc.PER_DEVICE,
        collate_fn=tc.collate,
    )
    accelerator = Accelerator(
        cpu=ctx.device.type == "cpu",
        gradient_accumulation_steps=tc.ACCUMULATION,
        fsdp_plugin=plugin,
    )
    if plugin is not None:
        _emulate_fsdp2(accelerator, plugin)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)
    return accelerator, model, optimizer, loader


def _emulate_fsdp2(accelerator: Any, plugin: Any) -> None:
    """accelerate's FSDP2 path on CPU (it takes it on GPUs only): this test only."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def _restore_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _accelerate_step(
    accelerator: Any,
    model: nn.Module,
    optimizer: Any,
    batches: Any,
    grads: dict[str, torch.Tensor] | None = None,
) -> float:
    """One optimizer step of micro-batches, the documented loop; the mean loss. ``grads``
    receives the clipped gradients."""
    import trainer_cases as tc

    total = torch.zeros(())
    for _ in range(tc.ACCUMULATION):
        batch = next(batches)
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), tc.MAX_GRAD_NORM)
                if grads is not None:
                    grads.update(
                        (n, full(p.grad)) for n, p in model.named_parameters() if p.grad is not None
                    )
            optimizer.step()
            optimizer.zero_grad()
        total += loss.detach() / tc.ACCUMULATION
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _accelerate_case(ctx: DistributedContext, out: Path, name: str, plugin: Any) -> dict[str, Any]:
    import trainer_cases as tc

    state_dir = case_dir(out, name) / "state"
    try:
        accelerator, model, optimizer, loader = _accelerate_run(ctx, plugin)
        batches = iter(loader)
        losses = []
        grads0: dict[str, torch.Tensor] = {}
        for step in range(tc.STEPS):
            record = grads0 if step == 0 else None
            losses.append(_accelerate_step(accelerator, model, optimizer, batches, record))
            if step == 1:
                accelerator.save_state(str(state_dir))
        result: dict[str, Any] = {
            "losses": losses,
            "grads0": grads0,
            "params": _trainable(model),
            "state": _listing(state_dir) if ctx.rank == 0 else None,
        }
        accelerator, model, optimizer, loader = _accelerate_run(ctx, plugin)
        accelerator.load_state(str(state_dir))
        skipped = accelerator.skip_first_batches(loader, 2 * tc.ACCUMULATION)
        result["resumed_loss"] = _accelerate_step(accelerator, model, optimizer, iter(skipped))
        result["resumed_params"] = _trainable(model)
        if plugin is None:
            result["refused"] = _refused_plain_state(ctx, out, accelerator)
        else:
            result.update(_fsdp2_exports(ctx, out, accelerator, model))
        return result
    finally:
        _restore_accelerate()


def _fsdp2_exports(ctx: DistributedContext, out: Path, accelerator: Any, model: nn.Module) -> Any:
    """On accelerate's FSDP2 path: its own ``get_state_dict`` (what each rank gets) and
    ``save_model`` (its files), and ``unwrap_model(model).save_pretrained`` (the library's)."""
    root = case_dir(out, "accelerate_fsdp2_plugin")
    state = accelerator.get_state_dict(model)
    found: dict[str, Any] = {
        "state_dict_sizes": _everywhere(len(state)),
        "gathered": dict(state) if ctx.rank == 0 else None,
        "errors": {
            "save_model": _errors(lambda: accelerator.save_model(model, root / "save_model")),
            "save_pretrained": _errors(
                lambda: accelerator.unwrap_model(model).save_pretrained(
                    root / "save_pretrained",
                    is_main_process=accelerator.is_main_process,
                    save_function=accelerator.save,
                )
            ),
        },
    }
    if ctx.rank == 0:
        found["listings"] = {name: _listing(root / name) for name in found["errors"]}
    return found


def _refused_plain_state(ctx: DistributedContext, out: Path, routed: Any) -> list[str | None]:
    """accelerate's own save_state of an optimizer over sharded parameters, then the
    routed accelerator's load_state of it."""
    from accelerate import Accelerator

    plain_dir = case_dir(out, "accelerate_plain") / "state"
    model = _sharded("frozen", "root", False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    plain = Accelerator(cpu=ctx.device.type == "cpu")
    plain.prepare(optimizer)
    plain.save_state(str(plain_dir))
    return _errors(lambda: routed.load_state(str(plain_dir)))


@scenario("accelerate_loop")
def accelerate_loop(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    if _missing():
        return {"skipped": f"needs {_missing()}"}
    return _accelerate_case(ctx, out, "accelerate_loop", None)


@scenario("accelerate_fsdp2_plugin")
def accelerate_fsdp2_plugin(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    if _missing():
        return {"skipped": f"needs {_missing()}"}
    from accelerate import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    return _accelerate_case(ctx, out, "accelerate_fsdp2_plugin", plugin)


# ------------------------------------------------------- accelerate's own export calls
#: ``max_shard_size`` that splits the tiny LLaVA's export into several files.
EXPORT_SHARD_SIZE = "200KB"
#: The directories ``accelerate_exports`` writes (or must not write), under its case_dir.
EXPORT_DIRS = (
    "save_model",
    "save_model_shards",
    "save_model_bin",
    "save_pretrained",
    "save_pretrained_accelerate",
    "save_pretrained_state_dict",
)


def _state_dicts(accelerator: Any, model: nn.Module) -> dict[str, Any]:
    """``get_state_dict`` (``unwrap`` both ways): the main process's dict; on every rank its
    size and whether it holds plain CPU tensors only."""
    found: dict[str, Any] = {}
    for unwrap in (True, False):
        state = accelerator.get_state_dict(model, unwrap=unwrap)
        plain = all(type(v) is torch.Tensor and v.device.type == "cpu" for v in state.values())
        found[f"unwrap={unwrap}"] = {
            "sizes": _everywhere(len(state)),
            "plain": _everywhere(plain),
            "state": dict(state) if accelerator.is_main_process else None,
        }
    return found


def _clip_norm(accelerator: Any, model: nn.Module, batches: Any) -> dict[str, Any]:
    """``clip_grad_norm_``'s result (not clipping) beside the norm of the gathered gradients."""
    model(**next(batches)).loss.backward()
    grads = [full(p.grad) for p in model.parameters() if p.grad is not None]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    got = accelerator.clip_grad_norm_(model.parameters(), 1e6)
    model.zero_grad()
    return {"type": type(got).__name__, "got": _everywhere(float(full(got))), "want": float(want)}


def _unsharded_exports(accelerator: Any, root: Path) -> dict[str, Any]:
    """A model without FSDP units through the routed accelerator: accelerate's own."""
    torch.manual_seed(0)
    plain = nn.Linear(3, 2)
    state = accelerator.get_state_dict(plain)
    accelerator.save_model(plain, root / "unsharded")
    accelerator.save(plain.state_dict(), root / "unsharded.bin")
    accelerator.wait_for_everyone()
    return {
        "same": all(torch.equal(state[k], v) for k, v in plain.state_dict().items()),
        "listing": _listing(root / "unsharded") if accelerator.is_main_process else None,
        "saved": torch.load(root / "unsharded.bin") if accelerator.is_main_process else None,
        "want": plain.state_dict(),
    }


@scenario("accelerate_exports")
def accelerate_exports(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    if _missing():
        return {"skipped": f"needs {_missing()}"}
    root = case_dir(out, "accelerate_exports")
    try:
        accelerator, model, optimizer, loader = _accelerate_run(ctx, None)
        batches = iter(loader)
        _accelerate_step(accelerator, model, optimizer, batches)
        unwrapped = accelerator.unwrap_model(model)
        result: dict[str, Any] = {
            "full": {name: full(value) for name, value in model.state_dict().items()},
            "unwrapped_is_model": unwrapped is model,
        }
        result["get_state_dict"] = _errors(lambda: result.update(_state_dicts(accelerator, model)))
        calls: dict[str, Callable[[], Any]] = {
            "save_model": lambda: accelerator.save_model(model, root / "save_model"),
            "save_model_shards": lambda: accelerator.save_model(
                model, root / "save_model_shards", max_shard_size=EXPORT_SHARD_SIZE
            ),
            "save_model_bin": lambda: accelerator.save_model(
                model, root / "save_model_bin", safe_serialization=False
            ),
            "save_pretrained": lambda: unwrapped.save_pretrained(root / "save_pretrained"),
            # accelerate's examples: the main process flag and accelerate's save function
            "save_pretrained_accelerate": lambda: unwrapped.save_pretrained(
                root / "save_pretrained_accelerate",
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
            ),
            # ... and, for sharded models, accelerate's gathered state dict
            "save_pretrained_state_dict": lambda: unwrapped.save_pretrained(
                root / "save_pretrained_state_dict",
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
                state_dict=accelerator.get_state_dict(model),
            ),
            "save_full": lambda: accelerator.save(
                accelerator.get_state_dict(model), root / "full.bin"
            ),
            "save_sharded_model_state": lambda: accelerator.save(
                model.state_dict(), root / "sharded_model.bin"
            ),
            "save_sharded_optimizer_state": lambda: accelerator.save(
                optimizer.state_dict(), root / "sharded_optimizer.bin"
            ),
            "register_model": lambda: accelerator.register_for_checkpointing(model),
            "register_optimizer": lambda: accelerator.register_for_checkpointing(optimizer),
        }
        result["errors"] = {name: _errors(call) for name, call in calls.items()}
        result["norm"] = _clip_norm(accelerator, model, batches)
        result["unsharded"] = _unsharded_exports(accelerator, root)
        if ctx.rank == 0:
            result["listings"] = {
                name: _listing(root / name) if (root / name).exists() else None
                for name in EXPORT_DIRS
            }
            result["files"] = sorted(p.name for p in root.iterdir() if p.is_file())
        return result
    finally:
        _restore_accelerate()


@scenario("accelerate_exports_lora")
def accelerate_exports_lora(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    if _missing():
        return {"skipped": f"needs {_missing()}"}
    from accelerate import Accelerator

    from fsdp_core.integrations.accelerate import prepare

    root = case_dir(out, "accelerate_exports_lora")
    try:
        accelerator = Accelerator(cpu=ctx.device.type == "cpu")
        (model,) = prepare(accelerator, _sharded("lora", "root", False))
        result: dict[str, Any] = {
            "full": {name: full(value) for name, value in model.state_dict().items()}
        }
        result["get_state_dict"] = _errors(lambda: result.update(_state_dicts(accelerator, model)))
        unwrapped = accelerator.unwrap_model(model)
        calls: dict[str, Callable[[], Any]] = {
            "save_model": lambda: accelerator.save_model(model, root / "save_model"),
            "save_pretrained": lambda: unwrapped.save_pretrained(
                root / "save_pretrained",
                is_main_process=accelerator.is_main_process,
                save_function=accelerator.save,
            ),
        }
        result["errors"] = {name: _errors(call) for name, call in calls.items()}
        if ctx.rank == 0:
            result["listings"] = {name: _listing(root / name) for name in calls}
        return result
    finally:
        _restore_accelerate()
