"""Which FSDP2 features the installed torch provides.

Every feature test of the project lives here (private torch modules are reached through
[`fsdp_core.internals`][fsdp_core.internals]). Each flag is computed once at import by
introspection, not from the version string, so a backport or a nightly is judged by what it has.
"""

from __future__ import annotations

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


#: ``fully_shard([m1, m2])``: several modules share one unit (one all-gather).
FULLY_SHARD_GROUPED_MODULES: Final[bool] = FSDP2_AVAILABLE and internals.has_grouped_forward_hooks()

#: Grouped units cast inputs and outputs around *each* member module. Without it,
#: a group of fp32 islands would only cast at the group's first and last call.
GROUPED_PER_MODULE_CASTING: Final[bool] = (
    FULLY_SHARD_GROUPED_MODULES and internals.casts_per_grouped_module()
)


#: A grouped unit stays correct when one of its modules runs again in the same iteration
#: (a tower run once per image starts a new pass, pytorch issue 183702; the multi-process
#: tests run that reuse); without it, groups whose modules may run twice are split.
GROUPED_UNIT_REUSE: Final[bool] = FULLY_SHARD_GROUPED_MODULES and internals.tracks_grouped_passes()


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
    flags = globals()
    return {name: flags[name] for name in __all__ if isinstance(flags[name], bool)}
