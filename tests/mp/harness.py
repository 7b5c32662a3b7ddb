"""One scenario's failure stays that scenario's: agreement in the worker, relaunch outside.

In the worker, after every scenario the ranks meet over the c10d store (never a
collective, so a rank stuck in one cannot block the meeting) and exchange whether the
scenario passed. If every rank arrived (and, after a failure, a probe all-reduce gives
the right sum on every rank), the process group is healthy: an error is recorded for
that scenario only and the launch goes on. If a rank did not arrive in time (it died,
or hangs in a collective the failing rank never joined) or a probe failed, the group is
not usable: the scenario's error is recorded and the ranks exit non-zero, which makes
torchrun stop the whole launch.

Outside, ``run_scenarios`` relaunches torchrun with the scenarios that have no result
yet (a few times at most), so every scenario ends with a result or its own error.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_core import DistributedContext
from fsdp_core.testing import run_torchrun

#: How long the ranks wait for each other at the end of a scenario (a rank that is
#: later than this is taken as dead or stuck). The harness test sets it lower.
AGREE_TIMEOUT_ENV = "FSDP_TEST_AGREE_TIMEOUT_S"
DEFAULT_AGREE_TIMEOUT_S = 120.0
#: Extra comma-separated scenario modules the worker imports (test-only scenarios).
EXTRA_SCENARIOS_ENV = "FSDP_TEST_EXTRA_SCENARIOS"
#: Which launch of a ``run_scenarios`` call this is (0 first, then 1, 2 ...).
ATTEMPT_ENV = "FSDP_TEST_LAUNCH_ATTEMPT"
#: At most this many fresh launches after launches that stopped early.
MAX_RELAUNCHES = 3
_PREFIX = "fsdp_tests/scenario"
#: Rank 0 writes the name of the scenario it starts here (``OUT/.running``).
RUNNING_FILE = ".running"


def save_result(out: Path, name: str, result: dict[str, Any]) -> None:
    """Write ``OUT/<name>.pt`` whole or not at all (several ranks may write it)."""
    target = out / f"{name}.pt"
    partial = out / f".{name}.{os.getpid()}.partial"
    torch.save(result, partial)
    os.replace(partial, target)


def _probe_ok(ctx: DistributedContext, index: int) -> bool:
    """A small all-reduce gives the expected sum: no collective is left half done."""
    try:
        value = torch.tensor([1000.0 * (ctx.rank + 1) + index], device=ctx.device)
        dist.all_reduce(value)
        n = ctx.world_size
        return bool(value.item() == 1000.0 * n * (n + 1) / 2 + n * index)
    except Exception:  # the group is broken: a fresh launch runs the rest
        return False


def _all_arrive(store: Any, key: str, ctx: DistributedContext, timeout: float) -> bool:
    """Mark this rank at ``key`` and wait until every rank is there (False: timed out)."""
    store.set(f"{key}/at/{ctx.rank}", "1")
    if store.add(f"{key}/count", 1) == ctx.world_size:
        store.set(f"{key}/done", "1")
    try:
        store.wait([f"{key}/done"], timedelta(seconds=timeout))
        return True
    except RuntimeError:  # DistStoreError: a rank is dead or stuck
        return False


def agree_after(
    ctx: DistributedContext, index: int, name: str, error: str | None
) -> tuple[str | None, bool]:
    """Exchange the outcome of scenario number ``index`` among all ranks.

    Returns the scenario's error text (every failing rank's traceback, or ``None``)
    and whether the process group is still healthy. A single rank or the ``fake``
    backend has nothing to exchange.
    """
    if ctx.world_size == 1 or ctx.backend == "fake":
        return error, True
    store: Any = dist.group.WORLD.get_group_store()  # type: ignore[union-attr]
    base = f"{_PREFIX}/{index}"
    if error is not None:
        store.set(f"{base}/error/{ctx.rank}", error)
    timeout = float(os.environ.get(AGREE_TIMEOUT_ENV, DEFAULT_AGREE_TIMEOUT_S))
    arrived = _all_arrive(store, base, ctx, timeout)
    texts = []
    late = []
    for rank in range(ctx.world_size):
        if store.check([f"{base}/error/{rank}"]):
            texts.append(f"--- rank {rank} ---\n{store.get(f'{base}/error/{rank}').decode()}")
        elif not store.check([f"{base}/at/{rank}"]):
            late.append(rank)
    if late:
        texts.append(
            f"ranks {late} did not finish scenario {name!r} within {timeout:g} s "
            "(dead, or stuck in a collective another rank left); the launch stops here"
        )
    healthy = arrived
    if arrived and texts:  # every rank is here, but a collective may be half done
        if not _probe_ok(ctx, index):
            store.set(f"{base}/probe_failed", "1")
        # Every rank takes the same decision: unhealthy if any rank's probe failed.
        healthy = _all_arrive(store, f"{base}/probe", ctx, timeout) and not store.check(
            [f"{base}/probe_failed"]
        )
        if not healthy:
            texts.append("the process group failed a probe all-reduce; the launch stops here")
    return ("\n".join(texts) or None), healthy


def run_scenarios(
    script: Path,
    *,
    world_size: int,
    out: Path,
    scenarios: list[str],
    env: dict[str, str],
    timeout_s: float,
) -> None:
    """Launch ``script`` on ``world_size`` ranks until every scenario has a result.

    A launch that stops early (a rank died or hung, the group broke) may leave the
    scenario it was running without a result: that scenario gets the launch's
    output as its error, and the scenarios after it run in a fresh launch, at most
    ``MAX_RELAUNCHES`` times.
    """
    out.mkdir(parents=True, exist_ok=True)
    remaining = list(scenarios)
    for attempt in range(MAX_RELAUNCHES + 1):
        start = time.perf_counter()
        try:
            run_torchrun(
                str(script),
                nproc=world_size,
                args=[str(out), *remaining],
                timeout_s=timeout_s,
                env={**env, ATTEMPT_ENV: str(attempt)},
            )
            failure = "the launch ended without writing this scenario's result"
        except AssertionError as exc:
            failure = str(exc)
        missing = [name for name in remaining if not (out / f"{name}.pt").exists()]
        running = out / RUNNING_FILE
        current = running.read_text() if running.exists() else (missing or [""])[0]
        running.unlink(missing_ok=True)
        if current in missing:  # killed in this scenario: nobody wrote its result
            save_result(
                out,
                current,
                {
                    "error": f"launch {attempt} stopped in this scenario after "
                    f"{time.perf_counter() - start:.0f} s:\n{failure[-20000:]}"
                },
            )
            missing.remove(current)
        if not missing:
            return
        remaining = missing
    for name in remaining:
        save_result(
            out,
            name,
            {"error": f"not run: {MAX_RELAUNCHES + 1} launches stopped before this scenario"},
        )
