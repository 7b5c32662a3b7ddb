"""Checkpoints never lose data, and collective calls fail on every rank (2 gloo ranks).

Each scenario provokes one misuse or failure around ``save_pretrained`` /
``load_pretrained`` / ``apply_plan`` on a tiny transformers Llama, catches what
each rank raises and returns the facts of both ranks (exception type and
message, files on disk, whether the old export still loads): a scenario that
raised would abort the whole launch. transformers is imported inside: without it
a scenario reports ``skipped``.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from torch import nn

from fsdp_core import (
    DistributedContext,
    ModelParallelizer,
    build_mesh,
    mixed_precision_policy,
)
from fsdp_core.collective_count import CommCounter
from fsdp_core.hf import _load, _save, load_pretrained, save_pretrained

#: Small enough that the tiny model's export spans several files.
SHARD_SIZE = "8KB"


def _skip() -> dict[str, Any] | None:
    missing = [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]
    return {"skipped": f"needs {missing}"} if missing else None


def tiny_llama(seed: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """A seeded 2-layer Llama small enough for a quick save."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model: nn.Module = transformers.LlamaForCausalLM(config)
    return model.to(dtype)


def _sharded(seed: int) -> nn.Module:
    model = tiny_llama(seed)
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    return model


def safety_dir(out: Path, name: str) -> Path:
    return out / "checkpoint_safety" / name / "export"


def _outcome(fn: Callable[[], object]) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "errno": getattr(exc, "errno", None),
        }
    return {"type": None, "message": "", "errno": None}


def _both(value: object) -> list[Any]:
    """``value`` of every rank, in rank order."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _listing(directory: Path) -> dict[str, int]:
    if not directory.is_dir():
        return {}
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _siblings(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir() if p.name != directory.name)


def _loads_as(directory: Path, seed: int, dtype: torch.dtype = torch.float32) -> bool:
    """transformers' own from_pretrained of ``directory`` equals the seeded model."""
    import transformers

    loaded = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=dtype)
    expected = tiny_llama(seed, dtype=dtype).state_dict()
    state = loaded.state_dict()
    return state.keys() == expected.keys() and all(
        torch.equal(state[k], expected[k]) for k in expected
    )


@contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@scenario("ckpt_safety_write_failure")
def write_failure(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """The disk fills up on rank 0 after the first file: both ranks raise the same
    error, and the old export (with the user's README) still loads."""
    if (skipped := _skip()) is not None:
        return skipped
    directory = safety_dir(out, "write_failure")
    save_pretrained(_sharded(0), directory, max_shard_size=SHARD_SIZE)
    if ctx.rank == 0:
        (directory / "README.md").write_text("my notes")
    dist.barrier()
    before = _listing(directory)
    real_write = _save.write_file
    calls: list[str] = []

    def failing_write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
        calls.append(path.name)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, tensors)

    model = _sharded(1)
    with _patched(_save, "write_file", failing_write if ctx.rank == 0 else real_write):
        outcome = _outcome(lambda: save_pretrained(model, directory, max_shard_size=SHARD_SIZE))
    outcomes = _both(outcome)
    dist.barrier()
    result: dict[str, Any] = {"outcomes": outcomes, "writes": calls}
    if ctx.rank == 0:
        result.update(
            files_before=before,
            files_after=_listing(directory),
            siblings=_siblings(directory),
            old_loads=_loads_as(directory, 0),
        )
    dist.barrier()
    return result


@scenario("ckpt_safety_load_then_save")
def load_then_save(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Load from ``d`` (rank 1 reads slowly), then save back into ``d`` in bf16."""
    if (skipped := _skip()) is not None:
        return skipped
    directory = safety_dir(out, "load_then_save")
    if ctx.rank == 0:
        tiny_llama(0).save_pretrained(directory, max_shard_size=SHARD_SIZE)
    dist.barrier()
    files_before = _listing(directory)
    model = tiny_llama(0, device="meta", dtype=torch.bfloat16)
    ModelParallelizer().parallelize(
        model, mesh=build_mesh(), mp_policy=mixed_precision_policy("bf16")
    )
    real_open = _load.open_file

    def slow_open(path: Path) -> Any:
        time.sleep(0.2)
        return real_open(path)

    def load_and_save() -> None:
        with _patched(_load, "open_file", slow_open if ctx.rank == 1 else real_open):
            load_pretrained(model, directory)
        save_pretrained(model, directory, max_shard_size=SHARD_SIZE)

    outcomes = _both(_outcome(load_and_save))
    result: dict[str, Any] = {"outcomes": outcomes, "files_before": files_before}
    if ctx.rank == 0:
        result.update(
            files_after=_listing(directory),
            siblings=_siblings(directory),
            loads_bf16=_loads_as(directory, 0, torch.bfloat16),
        )
    dist.barrier()
    return result


@scenario("ckpt_safety_unwritable")
def unwritable(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """An unwritable destination fails on both ranks, before any gather."""
    if (skipped := _skip()) is not None:
        return skipped
    model = _sharded(0)
    target = "/sys/fsdp-core-checkpoint-safety/x" if os.path.isdir("/sys") else "/proc/x/y"
    with CommCounter() as counter:
        outcome = _outcome(lambda: save_pretrained(model, target))
    return {"outcomes": _both(outcome), "collectives": _both(len(counter.records))}


@scenario("ckpt_safety_rank0_only")
def rank0_only(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """``if rank == 0: save_pretrained(...)`` and the same for load_pretrained raise on
    rank 0 naming rank 1; ranks in different calls name each other; afterwards
    the group still works and a save on every rank succeeds."""
    if (skipped := _skip()) is not None:
        return skipped
    directory = safety_dir(out, "rank0_only")
    model = _sharded(0)
    result: dict[str, Any] = {}
    if ctx.rank == 0:
        result["save"] = _outcome(lambda: save_pretrained(model, directory, timeout=3))
    dist.barrier()
    save_pretrained(model, directory)
    fresh = tiny_llama(1, device="meta")
    ModelParallelizer().parallelize(fresh, mesh=build_mesh())
    if ctx.rank == 0:
        result["load"] = _outcome(lambda: load_pretrained(fresh, directory, timeout=3))
    dist.barrier()
    if ctx.rank == 0:
        mixed = _outcome(lambda: save_pretrained(model, directory, timeout=20))
    else:
        mixed = _outcome(lambda: load_pretrained(fresh, directory, timeout=20))
    result["mixed"] = _both(mixed)
    result["final_load"] = _both(_outcome(lambda: load_pretrained(fresh, directory)))
    value = torch.ones(1)
    dist.all_reduce(value)
    result["all_reduce"] = value.item()
    return result


@scenario("ckpt_safety_plan_mismatch")
def plan_mismatch(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 1 applies a plan with another mixed-precision policy: every rank raises."""
    if (skipped := _skip()) is not None:
        return skipped
    model = tiny_llama(0)
    parallelizer = ModelParallelizer()
    plan = parallelizer.plan(model, mp_policy=mixed_precision_policy("fp32"))
    if ctx.rank == 1:
        other = mixed_precision_policy("bf16")
        plan = dataclasses.replace(
            plan, calls=tuple(dataclasses.replace(c, mp_policy=other) for c in plan.calls)
        )
    outcome = _outcome(lambda: parallelizer.apply_plan(model, plan, mesh=build_mesh()))
    return {"outcomes": _both(outcome)}
