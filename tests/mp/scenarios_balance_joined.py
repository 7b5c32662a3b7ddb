"""balance_media=True with joined modules (``balanced_joined``): each case as a scenario
``balance_joined_<case>`` (``scenarios_loops.run_case``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import balanced_joined
from registry import scenario
from scenarios_loops import run_case

from fsdp_core import DistributedContext

for _name in balanced_joined.CASES:

    def _scenario(ctx: DistributedContext, out: Path, _case: str = _name) -> dict[str, Any]:
        if importlib.util.find_spec("transformers") is None:
            return {"skipped": "transformers"}
        return run_case(balanced_joined.CASES[_case], ctx)

    scenario(f"balance_joined_{_name}")(_scenario)
