"""torchrun entry point: run the named scenarios in one process group, save results.

Usage: torchrun --nproc-per-node N worker.py OUT_DIR scenario [scenario ...]
Rank 0 writes OUT_DIR/<scenario>.pt; a scenario that raises is recorded as an
error (the others still run), so one launch serves many tests.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

import scenarios_core  # noqa: F401  (registers scenarios)
from registry import SCENARIOS

from fsdp_core import exit_rank, init_distributed

for optional in (
    "scenarios_vlm",
    "scenarios_training",
    "scenarios_init",
    "scenarios_loops",
    "scenarios_pretrained",
    "scenarios_checkpoint_safety",
    "scenarios_hf_export",
    "scenarios_inference",
    "scenarios_misuse",
    "scenarios_lora_load",
):
    try:
        __import__(optional)
    except ModuleNotFoundError as exc:
        if exc.name != optional:
            raise


def _install_sabotage(kind: str) -> None:
    """Deliberately break FSDP (to prove the tests catch it): ``reduction`` sums
    gradients instead of averaging; ``layout`` swaps two elements of every local shard
    on rank 0 after sharding."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from fsdp_core import ModelParallelizer

    original = ModelParallelizer.apply_plan

    def apply_plan(self: Any, model: Any, plan: Any, **kwargs: Any) -> Any:
        result = original(self, model, plan, **kwargs)
        if kind == "reduction":
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
                    module.set_gradient_divide_factor(1.0)  # sum, not mean
        elif kind == "layout" and dist.get_rank() == 0:
            with torch.no_grad():
                for param in model.parameters():
                    if isinstance(param, DTensor) and param.to_local().numel() > 1:
                        flat = param.to_local().view(-1)
                        flat[:2] = flat[:2].flip(0).clone()
        return result

    ModelParallelizer.apply_plan = apply_plan  # type: ignore[method-assign]


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}")
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"))
    if os.environ.get("FSDP_TEST_SABOTAGE"):
        _install_sabotage(os.environ["FSDP_TEST_SABOTAGE"])
    backend = os.environ.get("FSDP_TEST_BACKEND") or None
    ctx = init_distributed(backend=backend)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        torch.manual_seed(0)
        start = time.perf_counter()
        try:
            result = SCENARIOS[name](ctx, out)
        except Exception:  # recorded for the test to report, the job continues
            result = {"error": traceback.format_exc()}
            if ctx.world_size > 1:
                # A rank that failed mid-collective may leave the group unusable.
                torch.save(result, out / f"{name}.rank{ctx.rank}.pt")
                raise
        result["seconds"] = time.perf_counter() - start
        result["world_size"] = ctx.world_size
        if ctx.rank == 0:
            torch.save(result, out / f"{name}.pt")
    exit_rank(0)


if __name__ == "__main__":
    main()
