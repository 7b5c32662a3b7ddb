"""Run on spawned gloo ranks by ``test_checkpoint_entry``: the DCP checkpoint functions
and the materialisers are collective, with an arrival check and agreement."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_core.checkpoint as checkpoint
from fsdp_core.checkpoint import (
    export_full_state_dict,
    load_checkpoint,
    load_checkpoint_unsharded,
    save_checkpoint,
)
from fsdp_core.materialize import load_full_state_dict, materialize_from_full


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def _weight(model: nn.Module) -> list[float]:
    return [float(v) for v in model.state_dict()["0.weight"].full_tensor().flatten()]


def checkpoint_cases(rank: int, world_size: int, out_dir: str) -> None:
    out = Path(out_dir)
    results: dict[str, Any] = {}
    model = _model()
    good = out / "good"
    results["save"] = _outcome(lambda: save_checkpoint(good, model, step=3))
    results["load"] = _outcome(lambda: load_checkpoint(good, model))
    before = _weight(model)

    for name, call in [
        ("save_alone", lambda: save_checkpoint(out / "alone", model, timeout=1.5)),
        ("load_alone", lambda: load_checkpoint(good, model, timeout=1.5)),
        ("export_alone", lambda: export_full_state_dict(model, timeout=1.5)),
        ("full_alone", lambda: load_full_state_dict(model, {}, timeout=1.5)),
    ]:
        if rank == 0:
            results[name] = _outcome(call)
        dist.barrier()
    results["after_alone"] = _outcome(lambda: load_checkpoint(good, model))
    # rank 0 (the source of the broadcast) has no state dict: every rank raises
    state = None if rank == 0 else {}
    results["full_none"] = _outcome(lambda: load_full_state_dict(model, state))

    # a checkpoint only rank 0 sees (a node-local path): every rank raises
    missing = good if rank == 0 else out / "nowhere"
    results["load_missing"] = _outcome(lambda: load_checkpoint(missing, model))
    blocker = out / "a-file"
    blocker.write_text("x")
    target = out / "fresh" if rank == 0 else blocker
    results["save_not_dir"] = _outcome(lambda: save_checkpoint(target, model))

    # a save that fails midway on rank 1 keeps the previous checkpoint
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    real = checkpoint._save_state

    def failing(state: dict[str, Any], work: Path) -> None:
        real(state, work)
        if rank == 1:
            raise OSError(28, "No space left on device")

    checkpoint._save_state = failing  # type: ignore[assignment]
    try:
        results["save_fails"] = _outcome(lambda: save_checkpoint(good, model, step=4))
    finally:
        checkpoint._save_state = real  # type: ignore[assignment]
    dist.barrier()
    results["left_over"] = sorted(p.name for p in out.iterdir() if "saving" in p.name)
    fresh = _model()
    results["old_step"] = load_checkpoint(good, fresh)
    results["old_kept"] = _weight(fresh) == before
    plain = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    results["unsharded"] = _outcome(lambda: load_checkpoint_unsharded(good, plain))
    results["materialize"] = _outcome(
        lambda: materialize_from_full(
            _model(),
            [(n, torch.zeros(p.shape)) for n, p in _model().named_parameters()],
            device="cpu",
        )
    )
    (out / f"rank{rank}.json").write_text(json.dumps(results))
