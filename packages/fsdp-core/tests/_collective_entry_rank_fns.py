"""Functions run on spawned gloo ranks by ``test_collective_entry`` (importable by the
children, unlike test modules)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_core.collective_entry import CollectiveCallError, enter_collective


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None, "message": ""}


def _still_works(rank: int) -> bool:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return bool(value.item() == 3.0)


def protocol_cases(rank: int, world_size: int, out_dir: str) -> None:
    """Every case of the arrival check and the agreement, in one process group."""
    results: dict[str, Any] = {}

    def together() -> None:
        call = enter_collective("together", timeout=20)
        call.agree(step="nothing")
        assert call.run(lambda: rank * 2, step="double") == rank * 2

    results["together"] = _outcome(together)

    def one_fails() -> None:
        call = enter_collective("fails", timeout=20)

        def step() -> None:
            if rank == 1:
                raise PermissionError(13, "Permission denied", "/x")

        call.run(step, step="writing")

    results["one_fails"] = _outcome(one_fails)

    if rank == 0:  # the usual Hugging Face habit: only rank 0 calls
        results["alone"] = _outcome(lambda: enter_collective("alone", timeout=1.5))
    dist.barrier()
    results["after_alone"] = _outcome(lambda: enter_collective("next", timeout=20))
    results["after_alone_all_reduce"] = _still_works(rank)

    name = "save_pretrained" if rank == 0 else "load_pretrained"
    results["different"] = _outcome(lambda: enter_collective(name, timeout=20))
    results["after_different"] = _outcome(lambda: enter_collective("again", timeout=20))

    def values() -> None:
        call = enter_collective("values", timeout=20)
        call.agree_on("abc" if rank == 0 else "abd", what="plan fingerprint")

    results["values"] = _outcome(values)

    def escapes() -> None:
        with enter_collective("escapes", timeout=20) as call:
            if rank == 1:
                raise KeyError("boom")
            call.agree(step="after the boom")

    results["escapes"] = _outcome(escapes)
    results["final_all_reduce"] = _still_works(rank)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


__all__ = ["CollectiveCallError", "protocol_cases"]
