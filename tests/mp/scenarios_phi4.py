"""Phi-4-multimodal on 2 gloo ranks (``phi4``): encoders inside a module every rank calls.

Each case of ``phi4.CASES`` runs as ``loops`` cases do (``scenarios_loops.run_case``). The
case that must stop runs on a mesh over its own gloo group whose collectives time out
after ``phi4.SHORT_TIMEOUT_S``: were the ranks to issue mismatched all-gathers, the
scenario would end with gloo's timeout error, not hang the launch.
"""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from phi4 import CASES, SHORT_TIMEOUT_S
from registry import scenario
from scenarios_loops import run_case
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import DistributedContext
from fsdp_core.mesh import SHARD_DIM


def _short_timeout_mesh(ctx: DistributedContext) -> DeviceMesh:
    """A 1-D mesh over a new gloo group of every rank with a short timeout (the group
    stays until the launch ends: destroying it breaks the meshes built after it)."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=SHORT_TIMEOUT_S))
    assert group is not None
    return DeviceMesh.from_group(group, ctx.device.type, mesh_dim_names=(SHARD_DIM,))


def _run(name: str, ctx: DistributedContext) -> dict[str, Any]:
    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers"}
    case = CASES[name]
    if case.expect != "uneven_error":
        return run_case(case, ctx)
    return run_case(case, ctx, mesh=_short_timeout_mesh(ctx))


for _name in CASES:

    def _scenario(ctx: DistributedContext, out: Path, _case: str = _name) -> dict[str, Any]:
        return _run(_case, ctx)

    scenario(_name)(_scenario)
