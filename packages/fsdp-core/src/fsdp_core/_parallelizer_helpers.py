"""Small pure helpers of ``fsdp_core.parallelizer``: hook-name checks, the plan digest
that ranks agree on and unit-path text for errors."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from fsdp_core.plan import ShardingPlan
from fsdp_core.runtime import RuntimeHook


def _paths_text(units: list[tuple[str, ...]], limit: int = 4) -> str:
    if not units:
        return "none"
    shown = ", ".join(
        "[" + ", ".join(repr(p or "<root>") for p in paths) + "]" for paths in units[:limit]
    )
    return shown + (f" and {len(units) - limit} more" if len(units) > limit else "")


def _names(hooks: Iterable[type[RuntimeHook]]) -> tuple[str, ...]:
    return tuple(hook.name for hook in hooks)


def _check_hook_names(names: Iterable[str], known: tuple[str, ...]) -> frozenset[str]:
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(
            f"disabled_hooks must be a collection of hook names, got {type(names).__name__} "
            f"({names!r}); valid names: {', '.join(known)}"
        )
    checked = []
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"disabled_hooks entries must be str, got {type(name).__name__}")
        if name not in known:
            raise ValueError(f"unknown runtime hook {name!r}; valid names: {', '.join(known)}")
        checked.append(name)
    return frozenset(checked)


def _plan_digest(plan: ShardingPlan) -> str:
    """A hash of what applying ``plan`` does (its calls, units, ignored parameters,
    replicated parameters with their dtypes and broadcast, and hooks), the same on every
    rank that holds the same plan: ranks that differ in any of these would meet in
    different collectives."""
    text = repr(
        (
            plan.calls,
            plan.ignored_param_names,
            plan.replicated_param_names,
            plan.replicated_param_dtypes,
            plan.sync_replicated,
            plan.hook_names(),
        )
    )
    return hashlib.sha256(re.sub(r" at 0x[0-9a-f]+", "", text).encode()).hexdigest()
