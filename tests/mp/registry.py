"""Scenario registry shared by the torchrun worker and the pytest side."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_core import DistributedContext

Scenario = Callable[[DistributedContext, Path], dict[str, Any]]
SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        if name in SCENARIOS:
            raise ValueError(f"duplicate scenario {name!r}")
        SCENARIOS[name] = fn
        return fn

    return register
