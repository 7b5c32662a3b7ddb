"""FSDP's padding rule exists once (``multimodal_fsdp.estimate.units.padded_shard_numel``),
for the collectives, the activation replay and the memory estimate alike.

FSDP2 pads dim 0 of every parameter to a multiple of the shard-group size. It refuses
scalar (0-d) parameters outright, so a scalar has no padded shard: asking for one is a
``ValueError`` naming FSDP's rule, not a guess (the activation replay used to count one
element, the collectives crashed on ``shape[0]``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multimodal_fsdp.estimate import activations, memory, units
from multimodal_fsdp.estimate.units import padded_shard_numel


@pytest.mark.parametrize(
    ("shape", "shard", "expected"),
    [((5, 3), 2, 9), ((4, 3), 2, 6), ((1,), 4, 1), ((7,), 1, 7), ((3, 2, 2), 4, 4)],
)
def test_dim0_is_padded_to_a_multiple_of_the_shard(
    shape: tuple[int, ...], shard: int, expected: int
) -> None:
    assert padded_shard_numel(nn.Parameter(torch.zeros(shape)), shard) == expected


def test_a_scalar_parameter_has_no_padded_shard() -> None:
    with pytest.raises(ValueError, match="fully_shard does not support scalar parameters"):
        padded_shard_numel(nn.Parameter(torch.tensor(1.0)), 2)


def test_one_rule_serves_every_estimate() -> None:
    assert activations.padded_shard_numel is padded_shard_numel
    assert memory.padded_shard_numel is padded_shard_numel
    assert units.padded_shard_numel is padded_shard_numel
