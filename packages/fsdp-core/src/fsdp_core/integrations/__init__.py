"""Adapters to the training frameworks users already run, one module per framework.

The library shards the model, the framework trains it, and checkpoints and exports go
through the library's collective, atomic functions. Importing this package imports no
framework; each module imports its own (install the extra of the same name). A framework
that would mishandle a sharded model on its own (wrap it in `DistributedDataParallel`)
stops with [`IntegrationRequiredError`][fsdp_core.integrations.IntegrationRequiredError],
which names the adapter to use.
"""

from __future__ import annotations

import importlib

__all__ = ["IntegrationRequiredError"]


class IntegrationRequiredError(RuntimeError):
    """A framework is about to mishandle a model the library sharded (for example wrap it
    in ``DistributedDataParallel``); the message names the integration to use instead."""


def _require_release(package: str, supported: str, low: tuple[int, int], high: int) -> None:
    """An ImportError unless ``low <= package's (major, minor) < (high, 0)``."""
    version = importlib.import_module(package).__version__
    parts = version.split(".")
    release = tuple(int(p) if p.isdigit() else 0 for p in [*parts, "0"][:2])
    if not low <= release < (high, 0):
        raise ImportError(
            f"fsdp_core.integrations.{package} supports {package}{supported}, found {version}"
        )
