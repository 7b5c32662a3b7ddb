"""Which FSDP2 features the installed torch provides.

Every feature test of the project lives here, so no other module compares
version numbers or probes torch features; private torch modules are reached
through [`fsdp_core.internals`][fsdp_core.internals]. Each flag is computed once at
import time by introspection, never from the version string alone, so a
backport or a nightly build is judged by what it actually has.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Final

import torch

from fsdp_core import internals
from fsdp_core.internals import torch_modules

__all__ = [
    "FSDP2_AVAILABLE",
    "FULLY_SHARD_IGNORED_PARAMS",
    "FULLY_SHARD_GROUPED_MODULES",
    "GROUPED_PER_MODULE_CASTING",
    "GROUPED_UNIT_REUSE",
    "REDUCE_SCATTER_UNUSED_PARAMS",
    "FAKE_PROCESS_GROUP",
    "TORCH_VERSION",
    "capabilities",
]


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: Final[tuple[int, int]] = _torch_version()


def _has_fully_shard() -> bool:
    try:
        importlib.import_module("torch.distributed.fsdp")
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


FSDP2_AVAILABLE: Final[bool] = _has_fully_shard()


def _fully_shard_parameters() -> frozenset[str]:
    if not FSDP2_AVAILABLE:
        return frozenset()
    from torch.distributed.fsdp import fully_shard

    return frozenset(inspect.signature(fully_shard).parameters)


#: ``fully_shard(..., ignored_params=...)`` keeps chosen parameters out of a unit.
FULLY_SHARD_IGNORED_PARAMS: Final[bool] = "ignored_params" in _fully_shard_parameters()


def _has_grouped_modules() -> bool:
    """``fully_shard([m1, m2])``: several modules share one unit (one all-gather)."""
    return FSDP2_AVAILABLE and internals.has_grouped_forward_hooks()


FULLY_SHARD_GROUPED_MODULES: Final[bool] = _has_grouped_modules()

#: Grouped units cast inputs and outputs around *each* member module. Without it,
#: a group of fp32 islands would only cast at the group's first and last call.
GROUPED_PER_MODULE_CASTING: Final[bool] = (
    FULLY_SHARD_GROUPED_MODULES and internals.casts_per_grouped_module()
)


def _has_grouped_unit_reuse() -> bool:
    """Grouped units track which members ran in the current pass, so a member called
    again later in the same iteration (a tower run once per image) starts a new pass
    instead of corrupting the unit (pytorch issue 183702). torch 2.13 has the
    per-pass bookkeeping; the multi-process tests run exactly that reuse against a
    reference, so a torch where the flag and the behaviour disagree fails them."""
    return FULLY_SHARD_GROUPED_MODULES and internals.tracks_grouped_passes()


#: A grouped unit stays correct when one of its modules runs again in the same
#: iteration; without it, groups whose modules may run twice are split.
GROUPED_UNIT_REUSE: Final[bool] = _has_grouped_unit_reuse()


def _has_reduce_scatter_unused_params() -> bool:
    if not FSDP2_AVAILABLE:
        return False
    from torch.distributed.fsdp import FSDPModule

    return hasattr(FSDPModule, "set_reduce_scatter_unused_params")


#: Units can reduce-scatter zeros for parameters that got no gradient, so every
#: rank issues the same collectives when some ranks skip a module.
REDUCE_SCATTER_UNUSED_PARAMS: Final[bool] = _has_reduce_scatter_unused_params()


#: The single-process ``"fake"`` backend used for layout and communication tests.
FAKE_PROCESS_GROUP: Final[bool] = torch_modules.has_fake_store()


def capabilities() -> dict[str, bool]:
    """All flags by name, for logs and bug reports.

    Returns:
        ``{flag name: value}``.
    """
    return {
        "FSDP2_AVAILABLE": FSDP2_AVAILABLE,
        "FULLY_SHARD_IGNORED_PARAMS": FULLY_SHARD_IGNORED_PARAMS,
        "FULLY_SHARD_GROUPED_MODULES": FULLY_SHARD_GROUPED_MODULES,
        "GROUPED_PER_MODULE_CASTING": GROUPED_PER_MODULE_CASTING,
        "GROUPED_UNIT_REUSE": GROUPED_UNIT_REUSE,
        "REDUCE_SCATTER_UNUSED_PARAMS": REDUCE_SCATTER_UNUSED_PARAMS,
        "FAKE_PROCESS_GROUP": FAKE_PROCESS_GROUP,
    }
