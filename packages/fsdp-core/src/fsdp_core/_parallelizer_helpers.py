"""Small pure helpers of ``fsdp_core.parallelizer``: hook-name checks, the plan digest
that ranks agree on, unit-path text for errors and a planned hook's object."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fsdp_core.plan import ShardingPlan
from fsdp_core.runtime import HookPlan, RuntimeHook

if TYPE_CHECKING:
    from fsdp_core.parallelizer import ModelParallelizer


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
    names = list(names)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"disabled_hooks entries must be str, got {type(name).__name__}")
        if name not in known:
            raise ValueError(f"unknown runtime hook {name!r}; valid names: {', '.join(known)}")
    return frozenset(names)


def _plan_digest(plan: ShardingPlan) -> str:
    """A hash of what applying ``plan`` does, the same on every rank that holds the same
    plan: ranks that differ in any of it would meet in different collectives."""
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


def _hook_object(planned: HookPlan, parallelizer: ModelParallelizer[Any] | None) -> RuntimeHook:
    """The hook object of a planned hook; with a parallelizer, one of its ``HOOKS``."""
    hook = planned.hook
    if hook is None:
        raise ValueError(
            f"the plan lists a runtime hook {planned.name!r} without its hook object; "
            "plans made by a parallelizer's plan() carry it"
        )
    if parallelizer is not None and not isinstance(hook, parallelizer.HOOKS):
        raise ValueError(
            f"{type(parallelizer).__name__} cannot install a runtime hook named "
            f"{planned.name!r}; it installs {', '.join(_names(parallelizer.HOOKS))}"
        )
    return hook
