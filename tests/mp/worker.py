"""torchrun entry point: run the named scenarios in one process group, save results.

Usage: torchrun --nproc-per-node N worker.py OUT_DIR scenario [scenario ...]
Rank 0 writes OUT_DIR/<scenario>.pt. A scenario that raises on any rank is recorded
as that scenario's error; the ranks then agree whether the process group is still
usable (``harness.agree_after``): if so the launch goes on, otherwise it stops and
``harness.run_scenarios`` runs the rest in a fresh launch.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import scenarios_arrival  # noqa: F401  (each module registers its scenarios)
import scenarios_balance  # noqa: F401
import scenarios_balance_hf  # noqa: F401
import scenarios_balance_joined  # noqa: F401
import scenarios_checkpoint_safety  # noqa: F401
import scenarios_core  # noqa: F401
import scenarios_cp  # noqa: F401
import scenarios_crashes  # noqa: F401
import scenarios_ep  # noqa: F401
import scenarios_framework_calls  # noqa: F401
import scenarios_hf_export  # noqa: F401
import scenarios_inference  # noqa: F401
import scenarios_lightning  # noqa: F401
import scenarios_loops  # noqa: F401
import scenarios_lora_load  # noqa: F401
import scenarios_misuse  # noqa: F401
import scenarios_nd  # noqa: F401
import scenarios_phi4  # noqa: F401
import scenarios_pp  # noqa: F401
import scenarios_pretrained  # noqa: F401
import scenarios_staged  # noqa: F401
import scenarios_tensor_parallel  # noqa: F401
import scenarios_torchtitan  # noqa: F401
import scenarios_trainer  # noqa: F401
import scenarios_training  # noqa: F401
import scenarios_vlm  # noqa: F401
from harness import EXTRA_SCENARIOS_ENV, RUNNING_FILE, agree_after, save_result
from registry import SCENARIOS

from fsdp_core import exit_rank, init_distributed

for extra in filter(None, os.environ.get(EXTRA_SCENARIOS_ENV, "").split(",")):
    __import__(extra)  # test-only scenarios (e.g. the harness's own failing ones)


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}")
    logging.basicConfig(level=os.environ.get("LOGLEVEL", "WARNING"))
    backend = os.environ.get("FSDP_TEST_BACKEND") or None
    ctx = init_distributed(backend=backend)
    out.mkdir(parents=True, exist_ok=True)
    for index, name in enumerate(names):
        if ctx.rank == 0:
            (out / RUNNING_FILE).write_text(name)
        torch.manual_seed(0)
        error = None
        try:
            result = SCENARIOS[name](ctx, out)
        except Exception:  # recorded for the test to report, the launch goes on
            error, result = traceback.format_exc(), {}
        error, healthy = agree_after(ctx, index, name, error)
        if error is not None:
            result = {"error": error}
        result["world_size"] = ctx.world_size
        if ctx.rank == 0 or not healthy:
            save_result(out, name, result)
        if not healthy:  # a fresh launch runs the rest; torchrun stops the other ranks
            logging.getLogger(__name__).error("stopping the launch after %s:\n%s", name, error)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
    exit_rank(0)


if __name__ == "__main__":
    main()
