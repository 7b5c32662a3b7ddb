"""A training job that torchrun restarts 10 times (``tests/test_restarts_distributed.py``).

Launched once, on 2 ranks, with ``--max-restarts 10``. On each of the first 10 attempts
(``TORCHELASTIC_RESTART_COUNT``) one rank kills itself with SIGKILL at another point of
the run (``KILLS``): before and after ``init_distributed``, after step 3 was saved,
inside a forward, an optimizer step, ``latest_checkpoint``, ``load_checkpoint``, and in
the middle of ``save_checkpoint`` (before anything was written, and after every rank
wrote step 5 but before it was moved into place: a ``.step-5.saving-checkpoint`` with a
complete ``.metadata``). Each attempt resumes, as docs/restarts.md says, from
``latest_checkpoint``; the 11th finishes, then trains the same model from scratch
without interruption in the same process, the reference. Every rank writes what it did
to ``<out>/rank<r>.jsonl``; rank 0 saves both models' full weights.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fsdp_core.checkpoint as checkpoint_module
from fsdp_core import (
    build_mesh,
    destroy_distributed,
    export_full_state_dict,
    init_distributed,
    load_checkpoint,
    mixed_precision_policy,
    save_checkpoint,
)
from fsdp_core.checkpoint import latest_checkpoint
from model_deepseek_v41 import PARALLELIZER, DeepseekV41Config, build_deepseek_v41, make_batch

STEPS = 8
#: Attempt -> (the rank that kills itself, where). Attempt 10 runs to the end.
KILLS: dict[int, tuple[int, str]] = {
    0: (1, "after step 3"),
    1: (0, "before init_distributed"),
    2: (1, "after init_distributed"),
    3: (0, "after writing step 5"),
    4: (1, "in a forward"),
    5: (0, "in load_checkpoint"),
    6: (1, "before writing step 5"),
    7: (0, "after step 6"),
    8: (1, "in latest_checkpoint"),
    9: (0, "in an optimizer step"),
}

#: This attempt and rank (the test imports ``KILLS`` and ``STEPS`` outside torchrun).
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))
RANK = int(os.environ.get("RANK", "0"))
OUT = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
ROOT = OUT / "checkpoints"
CONFIG = DeepseekV41Config.tiny()


def log(**entry: Any) -> None:
    with open(OUT / f"rank{RANK}.jsonl", "a", encoding="utf-8") as file:
        file.write(json.dumps({"attempt": ATTEMPT, **entry}) + "\n")


def others_started(timeout_s: float = 120.0) -> None:
    """Wait until every other rank logged its start in this attempt: a kill before
    ``init_distributed`` would otherwise make torchrun stop a rank still importing torch
    (a loaded machine), which then never logs that it started."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    deadline = time.monotonic() + timeout_s
    for rank in range(world):
        path = OUT / f"rank{rank}.jsonl"
        while rank != RANK and time.monotonic() < deadline:
            lines = path.read_text().splitlines() if path.exists() else []
            if any(json.loads(line) == {"attempt": ATTEMPT, "started": True} for line in lines):
                break
            time.sleep(0.05)


def die_if(where: str) -> None:
    """SIGKILL this process if this attempt's kill is here, on this rank."""
    if KILLS.get(ATTEMPT) == (RANK, where):
        if where == "before init_distributed":
            others_started()
        log(killed=where)
        os.kill(os.getpid(), signal.SIGKILL)


def die_around(module: Any, name: str, before: str, after: str | None = None) -> None:
    """Wrap ``module.name`` so that ``die_if`` runs before it (and after it)."""
    original: Callable[..., Any] = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        die_if(before)
        result = original(*args, **kwargs)
        if after is not None:
            die_if(after)
        return result

    setattr(module, name, wrapper)


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build_deepseek_v41(CONFIG, seed=0, dtype=torch.bfloat16)
    PARALLELIZER.parallelize(
        model, mesh=build_mesh(), mp_policy=mixed_precision_policy("bf16", "fp32")
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """Step ``step`` (1-based): its batch depends on the step and the rank only."""
    batch = make_batch(CONFIG, batch_size=2, seq_len=16, seed=1000 * step + RANK)
    loss = model(**batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach().float())


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return export_full_state_dict(model)


def main() -> None:
    log(started=True)
    die_if("before init_distributed")
    init_distributed(backend="gloo")
    die_if("after init_distributed")
    die_around(checkpoint_module, "_newest_checkpoint", "in latest_checkpoint")
    die_around(checkpoint_module, "dcp_load", "in load_checkpoint")
    model, optimizer = build()

    # The resume recipe of docs/restarts.md.
    last = latest_checkpoint(ROOT)
    start = 0 if last is None else load_checkpoint(last, model, optimizer)
    assert start is not None
    leftovers = [[p.name, (p / ".metadata").is_file()] for p in sorted(ROOT.glob(".*"))]
    log(resumed_from=None if last is None else last.name, leftovers=leftovers)

    layer = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    layer[len(layer) // 2].register_forward_pre_hook(lambda *_: die_if("in a forward"))
    optimizer.register_step_pre_hook(lambda *_: die_if("in an optimizer step"))
    for step in range(start + 1, STEPS + 1):
        loss = train_step(model, optimizer, step)
        log(step=step, loss=loss.hex())
        if step == 5:
            die_around(
                checkpoint_module, "_save_state", "before writing step 5", "after writing step 5"
            )
        save_checkpoint(ROOT / f"step-{step}", model, optimizer, step=step)
        die_if(f"after step {step}")
    resumed = full_weights(model)

    reference_model, reference_optimizer = build()  # the same run, never interrupted
    for step in range(1, STEPS + 1):
        log(reference_step=step, loss=train_step(reference_model, reference_optimizer, step).hex())
    reference = full_weights(reference_model)
    if RANK == 0:
        torch.save({"resumed": resumed, "reference": reference}, OUT / "weights.pt")
    log(finished=True)
    destroy_distributed()


if __name__ == "__main__":
    main()
