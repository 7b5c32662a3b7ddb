"""What a unit keeps gathered after forward follows one rule
(``multimodal_fsdp.estimate.timeline``),
for the parameter timeline and the activation replay alike, and it is FSDP2's rule: an int
``reshard_after_forward=1`` means "keep everything" (FSDP2 turns it into ``False``) even on
a shard group of one, where it also equals the group size."""

from __future__ import annotations

import pytest

from fsdp_core import mixed_precision_policy
from fsdp_core.plan import UnitPlan
from multimodal_fsdp.estimate import activations, timeline
from multimodal_fsdp.estimate.timeline import effective_reshard, kept_after_forward

MP = mixed_precision_policy("bf16", "fp32")


def unit(reshard: bool | int | None, *, root: bool = False) -> UnitPlan:
    return UnitPlan(("",) if root else ("layers.0",), MP, reshard, role="root" if root else "layer")


@pytest.mark.parametrize(
    ("reshard", "root", "shard", "kept"),
    [
        (None, False, 4, 0),
        (None, True, 4, 64),
        (True, True, 4, 0),
        (False, False, 4, 64),
        (1, False, 4, 64),
        (4, False, 4, 0),
        (2, False, 4, 32),
        (1, False, 1, 64),  # FSDP2: int 1 is False before it is "the group size"
    ],
)
def test_kept_after_forward(reshard: bool | int | None, root: bool, shard: int, kept: int) -> None:
    assert kept_after_forward(unit(reshard, root=root), 64, shard) == kept


def test_the_effective_setting_of_an_int() -> None:
    assert effective_reshard(unit(1), 1) is False
    assert effective_reshard(unit(4), 4) is True
    assert effective_reshard(unit(2), 4) == 2


def test_the_activation_replay_uses_the_same_rule() -> None:
    assert activations.kept_after_forward is timeline.kept_after_forward
