"""The checks [`choose_frozen_policy`][multimodal_fsdp.estimate.choose.choose_frozen_policy]
makes of its ``budget`` and ``policies`` arguments (moved out of
[`multimodal_fsdp.estimate.choose`][multimodal_fsdp.estimate.choose])."""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_core.sizes import parse_size
from multimodal_fsdp.policy import (
    VALID_FROZEN_MULTIMODAL_SHARDING,
    FrozenMultimodalSharding,
    normalize_frozen_multimodal_sharding,
)


def _budget(value: int | str) -> int:
    if isinstance(value, str):
        return parse_size(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"budget must be a positive number of bytes or a size, got {value!r}")
    return value


def _policies(policies: Sequence[str]) -> tuple[FrozenMultimodalSharding, ...]:
    if isinstance(policies, str) or not policies:
        raise ValueError(
            f"policies must be a non-empty sequence of {VALID_FROZEN_MULTIMODAL_SHARDING}, "
            f"got {policies!r}"
        )
    return tuple(dict.fromkeys(normalize_frozen_multimodal_sharding(p) for p in policies))
