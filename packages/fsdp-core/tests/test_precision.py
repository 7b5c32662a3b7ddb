"""fsdp_core.precision: dtype names, mixed-precision and island policies."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core.precision import (
    DTYPE_ALIASES,
    compute_dtype,
    default_mp_policy,
    fp32_island_policy,
    island_policy,
    mixed_precision_policy,
    parse_dtype,
)

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


# parse_dtype -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "dtype"), sorted(DTYPE_ALIASES.items()))
def test_parse_dtype_every_alias(name: str, dtype: torch.dtype) -> None:
    assert parse_dtype(name) is dtype


@pytest.mark.parametrize(
    ("text", "dtype"),
    [
        ("BF16", BF16),
        ("  fp32 ", FP32),
        ("torch.float32", FP32),
        ("torch.bfloat16", BF16),
        ("Torch.Float16", FP16),
        ("torch.double", FP64),
    ],
)
def test_parse_dtype_is_case_and_space_insensitive(text: str, dtype: torch.dtype) -> None:
    assert parse_dtype(text) is dtype


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32, FP64])
def test_parse_dtype_passes_floating_dtypes_through(dtype: torch.dtype) -> None:
    assert parse_dtype(dtype) is dtype


@pytest.mark.parametrize("name", ["bf8", "int8", "fp8", "", "float128", "torch."])
def test_parse_dtype_unknown_name_lists_valid_names(name: str) -> None:
    with pytest.raises(ValueError, match=r"unknown dtype .*; valid names: ") as info:
        parse_dtype(name)
    message = str(info.value)
    assert repr(name) in message
    for alias in DTYPE_ALIASES:
        assert alias in message


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_parse_dtype_refuses_non_floating_dtypes(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=r"is not a supported floating dtype; choose one of"):
        parse_dtype(dtype)


@pytest.mark.parametrize("value", [16, 1.5, None, b"bf16", ["bf16"]])
def test_parse_dtype_refuses_other_types(value: object) -> None:
    with pytest.raises(TypeError, match=r"dtype must be a str or torch.dtype, got "):
        parse_dtype(value)  # type: ignore[arg-type]


# mixed_precision_policy --------------------------------------------------------------------------


def test_mixed_precision_policy_defaults() -> None:
    policy = mixed_precision_policy()
    assert policy == MixedPrecisionPolicy(
        param_dtype=BF16, reduce_dtype=FP32, output_dtype=None, cast_forward_inputs=True
    )


def test_mixed_precision_policy_none_keeps_fsdp_defaults() -> None:
    assert mixed_precision_policy(None, None) == MixedPrecisionPolicy()


def test_mixed_precision_policy_all_fields() -> None:
    policy = mixed_precision_policy(
        "fp16", torch.float32, output_dtype="bf16", cast_forward_inputs=False
    )
    assert policy.param_dtype is FP16
    assert policy.reduce_dtype is FP32
    assert policy.output_dtype is BF16
    assert policy.cast_forward_inputs is False


def test_mixed_precision_policy_bad_cast_flag() -> None:
    with pytest.raises(TypeError, match=r"cast_forward_inputs must be a bool, got 1"):
        mixed_precision_policy(cast_forward_inputs=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"param_dtype": "bf17"}, {"reduce_dtype": "x"}, {"output_dtype": "int"}]
)
def test_mixed_precision_policy_bad_dtype_names(kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"unknown dtype"):
        mixed_precision_policy(**kwargs)  # type: ignore[arg-type]


def test_default_mp_policy_is_bf16_compute_fp32_reduce() -> None:
    policy = default_mp_policy()
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (BF16, FP32, None)
    assert policy.cast_forward_inputs is True


def test_compute_dtype() -> None:
    assert compute_dtype(default_mp_policy(), FP32) is BF16
    assert compute_dtype(MixedPrecisionPolicy(), FP16) is FP16


# island policies ---------------------------------------------------------------------------------


def test_fp32_island_policy_default_surrounding() -> None:
    policy = fp32_island_policy()
    assert policy == MixedPrecisionPolicy(
        param_dtype=FP32, reduce_dtype=FP32, output_dtype=BF16, cast_forward_inputs=True
    )


def test_fp32_island_policy_in_fp32_model_has_no_output_cast() -> None:
    policy = fp32_island_policy(mixed_precision_policy("fp32", "fp32"))
    assert policy.output_dtype is None
    assert policy.param_dtype is FP32


def test_island_policy_without_param_cast_uses_surrounding_dtype() -> None:
    policy = island_policy("fp32", MixedPrecisionPolicy(), surrounding_dtype=BF16)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (FP32, FP32, BF16)
    # Without any hint there is nothing to cast back to.
    bare = island_policy("fp32", MixedPrecisionPolicy())
    assert bare.output_dtype is None


def test_island_policy_surrounding_param_dtype_wins_over_hint() -> None:
    policy = island_policy(FP32, mixed_precision_policy("fp16", None), surrounding_dtype=BF16)
    assert policy.output_dtype is FP16
    assert policy.reduce_dtype is FP32


def test_island_policy_reduce_dtype_is_promoted() -> None:
    # A bf16 island inside an fp32-reduced model reduces in fp32 ...
    low = island_policy("bf16", mixed_precision_policy("fp32", "fp32"))
    assert (low.param_dtype, low.reduce_dtype, low.output_dtype) == (BF16, FP32, FP32)
    # ... and an fp32 island never reduces in less than fp32.
    high = island_policy("fp32", mixed_precision_policy("bf16", "bf16"))
    assert high.reduce_dtype is FP32
    assert island_policy("fp64", default_mp_policy()).reduce_dtype is FP64


def test_island_policy_bad_dtype() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'fp31'"):
        island_policy("fp31", default_mp_policy())
