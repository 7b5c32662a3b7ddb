"""Scenarios that fail on purpose, to test the harness itself (tests/test_mp_harness.py).

Imported by the worker only when ``FSDP_TEST_EXTRA_SCENARIOS`` names this module, so
no regular launch runs them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from harness import ATTEMPT_ENV
from registry import scenario

from fsdp_core import DistributedContext


def _ran(ctx: DistributedContext) -> dict[str, Any]:
    value = torch.ones(1)
    dist.all_reduce(value)
    return {"sum": value.item(), "launch": int(os.environ[ATTEMPT_ENV])}


@scenario("harness_ok_first")
def _ok_first(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _ran(ctx)


@scenario("harness_fails_cleanly_on_rank1")
def _fails_cleanly(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 1 raises with no collective pending: the group stays usable."""
    if ctx.rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return {}


@scenario("harness_ok_after_clean_failure")
def _ok_after_clean(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _ran(ctx)


@scenario("harness_leaves_rank0_in_a_collective")
def _leaves_rank0_stuck(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Rank 1 raises while rank 0 waits in an all-reduce rank 1 never joins."""
    if ctx.rank == 1:
        raise RuntimeError("deliberate failure on rank 1 before a collective")
    dist.all_reduce(torch.ones(1))
    return {}


@scenario("harness_ok_after_broken_group")
def _ok_after_broken(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    return _ran(ctx)
