"""Mixed-precision policies from dtype names ("bf16", "fp32"), and the policy of an
island (a unit that computes in its own dtype, e.g. fp32, inside a lower-precision model).
"""

from __future__ import annotations

from typing import Final

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "DTYPE_ALIASES",
    "parse_dtype",
    "mixed_precision_policy",
    "default_mp_policy",
    "fp32_island_policy",
    "island_policy",
    "compute_dtype",
]

#: Accepted names for each dtype (matched case-insensitively, surrounding spaces ignored).
DTYPE_ALIASES: Final[dict[str, torch.dtype]] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}

_FLOATING: Final[frozenset[torch.dtype]] = frozenset(DTYPE_ALIASES.values())


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Return the floating dtype named by ``value`` ("bf16", "torch.float32", a dtype, ...).

    Args:
        value: a dtype, or a name such as ``"bf16"``, ``"float32"``, ``"torch.float16"``.

    Returns:
        The floating ``torch.dtype``.

    Raises:
        TypeError: ``value`` is neither a string nor a dtype.
        ValueError: the name is unknown or not a floating dtype.
    """
    if isinstance(value, torch.dtype):
        if value not in _FLOATING:
            raise ValueError(
                f"dtype {value} is not a supported floating dtype; "
                f"choose one of {sorted(str(d) for d in _FLOATING)}"
            )
        return value
    if not isinstance(value, str):
        raise TypeError(
            f"dtype must be a str or torch.dtype, got {type(value).__name__} ({value!r})"
        )
    key = value.strip().lower().removeprefix("torch.")
    try:
        return DTYPE_ALIASES[key]
    except KeyError:
        raise ValueError(
            f"unknown dtype {value!r}; valid names: {', '.join(sorted(DTYPE_ALIASES))}"
        ) from None


def mixed_precision_policy(
    param_dtype: str | torch.dtype | None = "bf16",
    reduce_dtype: str | torch.dtype | None = "fp32",
    *,
    output_dtype: str | torch.dtype | None = None,
    cast_forward_inputs: bool = True,
) -> MixedPrecisionPolicy:
    """Build a ``MixedPrecisionPolicy`` from dtype names; ``None`` keeps FSDP's default.

    Args:
        param_dtype: the compute dtype of the parameters.
        reduce_dtype: the dtype gradients are reduced in.
        output_dtype: the dtype of the unit's outputs (None: no cast).
        cast_forward_inputs: whether inputs are cast to ``param_dtype``.

    Returns:
        FSDP2's policy.

    Raises:
        TypeError: ``cast_forward_inputs`` is not a bool.
    """
    if not isinstance(cast_forward_inputs, bool):
        raise TypeError(f"cast_forward_inputs must be a bool, got {cast_forward_inputs!r}")
    return MixedPrecisionPolicy(
        param_dtype=None if param_dtype is None else parse_dtype(param_dtype),
        reduce_dtype=None if reduce_dtype is None else parse_dtype(reduce_dtype),
        output_dtype=None if output_dtype is None else parse_dtype(output_dtype),
        cast_forward_inputs=cast_forward_inputs,
    )


def default_mp_policy() -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction: the usual choice for VLM training.

    Returns:
        ``param_dtype=bf16``, ``reduce_dtype=fp32``.
    """
    return mixed_precision_policy("bf16", "fp32")


def compute_dtype(policy: MixedPrecisionPolicy, fallback: torch.dtype) -> torch.dtype:
    """The dtype a unit under ``policy`` computes in (``fallback`` when params are not cast).

    Args:
        policy: the unit's policy.
        fallback: the parameters' own dtype.

    Returns:
        ``policy.param_dtype`` or ``fallback``.
    """
    return policy.param_dtype if policy.param_dtype is not None else fallback


def island_policy(
    island_dtype: str | torch.dtype,
    surrounding: MixedPrecisionPolicy,
    *,
    surrounding_dtype: torch.dtype | None = None,
) -> MixedPrecisionPolicy:
    """Policy for a unit that computes in ``island_dtype`` inside a model run by ``surrounding``.

    Parameters and gradient reduction stay in the island's dtype; the output is cast
    back to the surrounding compute dtype, which the next layer expects.

    Args:
        island_dtype: the dtype the island's parameters compute in.
        surrounding: the policy of the model around it.
        surrounding_dtype: the surrounding compute dtype when ``surrounding`` casts
            nothing (the model's parameter dtype).

    Returns:
        The island's policy.
    """
    dtype = parse_dtype(island_dtype)
    outer = surrounding.param_dtype or surrounding_dtype
    reduce = torch.promote_types(dtype, surrounding.reduce_dtype or dtype)
    return MixedPrecisionPolicy(
        param_dtype=dtype,
        reduce_dtype=reduce,
        output_dtype=outer if outer is not None and outer != dtype else None,
        cast_forward_inputs=True,
    )


def fp32_island_policy(
    surrounding: MixedPrecisionPolicy | None = None,
    *,
    surrounding_dtype: torch.dtype | None = None,
) -> MixedPrecisionPolicy:
    """fp32 params and reduction, output in the surrounding compute dtype (bf16 by default).

    Args:
        surrounding: the policy of the model around the island (bf16 if None).
        surrounding_dtype: as for ``island_policy``.

    Returns:
        The fp32 island's policy.
    """
    surrounding = surrounding or default_mp_policy()
    return island_policy(torch.float32, surrounding, surrounding_dtype=surrounding_dtype)
