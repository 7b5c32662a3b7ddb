"""The frozen-tower policy and the small questions it asks of modules."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, Literal, TypeAlias, get_args

from torch import nn

from fsdp_core.sharding import owned_ignored_params

__all__ = [
    "FrozenMultimodalSharding",
    "VALID_FROZEN_MULTIMODAL_SHARDING",
    "normalize_frozen_multimodal_sharding",
    "FrozenShardingSpec",
    "DEFAULT_FROZEN_SHARDING_KEY",
    "normalize_frozen_sharding_spec",
    "frozen_sharding_label",
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


#: ``frozen_multimodal_sharding`` as the parallelizer takes it: one policy for every
#: frozen part, or a mapping from discovered multimodal module paths (such as
#: ``"model.vision_tower"``) to policies, with ``"*"`` for the rest (default ``root``).
FrozenShardingSpec: TypeAlias = str | Mapping[str, str]

#: The mapping key of the policy for multimodal modules the mapping does not name.
DEFAULT_FROZEN_SHARDING_KEY: Final = "*"


def normalize_frozen_sharding_spec(
    value: FrozenShardingSpec,
) -> tuple[FrozenMultimodalSharding, dict[str, FrozenMultimodalSharding]]:
    """The default policy and the per-path policies of ``value``.

    A string is one policy for every frozen part (no per-path entries). A mapping
    gives policies per multimodal module path, ``"*"`` the default (``root`` when
    absent). Only the values can be checked here; whether each path is a
    discovered multimodal module depends on the model and is checked when planning.
    """
    if not isinstance(value, Mapping):
        return normalize_frozen_multimodal_sharding(value), {}
    if not value:
        raise ValueError(
            "frozen multimodal sharding mapping is empty; give a policy "
            f"({', '.join(VALID_FROZEN_MULTIMODAL_SHARDING)}) or map multimodal module "
            f"paths (and {DEFAULT_FROZEN_SHARDING_KEY!r} for the rest) to policies"
        )
    default: FrozenMultimodalSharding = "root"
    by_path: dict[str, FrozenMultimodalSharding] = {}
    for path, policy in value.items():
        if not isinstance(path, str):
            raise TypeError(
                f"frozen multimodal sharding keys must be module paths (str) or "
                f"{DEFAULT_FROZEN_SHARDING_KEY!r}, got {type(path).__name__} ({path!r})"
            )
        try:
            normalized = normalize_frozen_multimodal_sharding(policy)
        except ValueError as error:
            raise type(error)(f"{path!r}: {error}") from None
        if path == DEFAULT_FROZEN_SHARDING_KEY:
            default = normalized
        else:
            by_path[path] = normalized
    return default, by_path


def frozen_sharding_label(
    default: FrozenMultimodalSharding, by_path: Mapping[str, FrozenMultimodalSharding]
) -> str:
    """``per_layer`` for one policy, ``vision=per_layer, *=root`` for a mapping whose
    entries differ from its default (plan headers, choices and errors)."""
    if all(policy == default for policy in by_path.values()):
        return default
    entries = [f"{path}={policy}" for path, policy in by_path.items()]
    return ", ".join([*entries, f"{DEFAULT_FROZEN_SHARDING_KEY}={default}"])


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
