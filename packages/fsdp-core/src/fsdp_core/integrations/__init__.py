"""Adapters to the training frameworks users already run, one module per framework.

The library shards the model; the framework trains it. Each module imports its
framework only when used (the Lightning and torchtitan adapters import neither), so
importing this package imports no framework; install the extra of the same name.
"""

from __future__ import annotations

__all__: list[str] = []
