"""The frozen-tower policy and the small questions it asks of modules."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal, get_args

from torch import nn

from fsdp_core.sharding import owned_ignored_params

__all__ = [
    "FrozenMultimodalSharding",
    "VALID_FROZEN_MULTIMODAL_SHARDING",
    "normalize_frozen_multimodal_sharding",
    "module_parameters",
    "module_is_fully_frozen",
    "ignored_params_for_root",
]

#: How fully frozen towers/projectors are sharded:
#: ``root`` (their parameters join the root unit), ``per_layer`` (one unit per
#: layer-container item) or ``replicate`` (kept whole on every rank, no FSDP).
FrozenMultimodalSharding = Literal["root", "per_layer", "replicate"]

VALID_FROZEN_MULTIMODAL_SHARDING: Final[tuple[FrozenMultimodalSharding, ...]] = get_args(
    FrozenMultimodalSharding
)


class _NotAStrError(ValueError, TypeError):
    """A non-string policy value.

    The reference implementation raises ``ValueError`` for every bad value and
    downstream code catches that; it is also a ``TypeError`` because the value
    has the wrong type, so callers catching either see it.
    """


def normalize_frozen_multimodal_sharding(value: str) -> FrozenMultimodalSharding:
    """Accept ``"Per-Layer"``, ``" replicate "`` and the like; reject anything else.

    Case, surrounding whitespace and ``-``/``_`` are not significant. Every bad
    value is a ``ValueError`` listing the valid choices; a non-string one is
    also a ``TypeError``.
    """
    if not isinstance(value, str):
        raise _NotAStrError(
            f"frozen multimodal sharding must be a str, got {type(value).__name__} ({value!r}); "
            f"valid choices: {', '.join(VALID_FROZEN_MULTIMODAL_SHARDING)}"
        )
    key = value.strip().lower().replace("-", "_")
    for choice in VALID_FROZEN_MULTIMODAL_SHARDING:
        if key == choice:
            return choice
    raise ValueError(
        f"unknown frozen multimodal sharding {value!r}; "
        f"valid choices: {', '.join(VALID_FROZEN_MULTIMODAL_SHARDING)}"
    )


def module_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The module's parameters, recursively (shared parameters once)."""
    return list(module.parameters())


def module_is_fully_frozen(module: nn.Module) -> bool:
    """Whether ``module`` owns parameters and none of them requires a gradient.

    A module without parameters is not "frozen": there is nothing to place.
    """
    params = module_parameters(module)
    return bool(params) and not any(p.requires_grad for p in params)


def ignored_params_for_root(
    root: nn.Module, ignored_params: Iterable[nn.Parameter] | None
) -> set[nn.Parameter] | None:
    """The subset of ``ignored_params`` that ``root`` owns; ``None`` when empty.

    FSDP only accepts ignored parameters of the module being sharded, and each
    unit that owns a replicated parameter must list it, or that unit would
    shard it.
    """
    return owned_ignored_params([root], ignored_params)
