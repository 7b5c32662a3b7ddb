"""Functions run on spawned gloo ranks by ``test_collective_entry`` (importable by the
children, unlike test modules)."""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_core.collective_entry import enter_collective
from fsdp_core.rank_agreement import CollectiveCallError
from fsdp_core.rank_wait import WARN_ENV


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
    results.update(_waits_that_warn(rank))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


class _Warnings(logging.Handler):
    """The shared wait's warnings on this rank; the first one also posts ``key``."""

    def __init__(self, key: str) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.key = key

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        dist.group.WORLD.get_group_store().set(self.key, "1")  # type: ignore[union-attr]


def _waits_that_warn(rank: int) -> dict[str, Any]:
    """A rank that never arrives and a step a rank reaches late, with the first warning
    after 0.3 s: the waiting rank names the other and what it did last."""
    store: Any = dist.group.WORLD.get_group_store()  # type: ignore[union-attr]
    results: dict[str, Any] = {}
    handler = _Warnings("cases/warned")
    logger = logging.getLogger("fsdp_core.rank_wait")
    logger.addHandler(handler)
    os.environ[WARN_ENV] = "0.3"
    try:
        if rank == 0:
            results["warn_alone"] = _outcome(lambda: enter_collective("alone again", timeout=1.5))
        dist.barrier()
        results["warn_alone_messages"] = list(handler.messages)
        store.delete_key("cases/warned")
        handler.messages.clear()

        def slow_step() -> None:
            call = enter_collective("slow step", timeout=20)
            if rank == 1:  # slow: it reaches the step only once rank 0 warned about it
                store.wait(["cases/warned"], timedelta(seconds=20))
            call.agree(step="writing")

        results["warn_slow"] = _outcome(slow_step)
        results["warn_slow_messages"] = list(handler.messages)
    finally:
        os.environ.pop(WARN_ENV, None)
        logger.removeHandler(handler)
    return results


__all__ = ["CollectiveCallError", "protocol_cases"]
