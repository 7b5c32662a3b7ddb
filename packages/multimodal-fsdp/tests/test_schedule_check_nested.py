"""Which units the schedule check leaves unhooked: those inside another hooked unit whose
hook always runs first in the same state (``_covered``), so a compiled block traces none
of the check's code."""

from __future__ import annotations

from multimodal_fsdp.runtime.schedule_check import MediaRegion, ScheduleLayout, _covered

TOWER = MediaRegion(path="vision", kind="tower", units=("vision.blocks.0",))


def _layout(
    units: tuple[str, ...],
    *,
    regions: tuple[MediaRegion, ...] = (TOWER,),
    successors: frozenset[str] = frozenset(),
    parts: tuple[tuple[str, str], ...] = (),
) -> ScheduleLayout:
    return ScheduleLayout(
        regions=regions, units=units, successors=successors, end_check=False, parts=parts
    )


def test_a_norm_unit_inside_a_block_unit_is_covered() -> None:
    parts = (("vision.blocks.0", "vision.blocks"), ("vision.blocks.0.norm1", "vision.blocks"))
    layout = _layout(("vision.blocks.0", "vision.blocks.0.norm1"), parts=parts)
    assert _covered("vision.blocks.0.norm1", layout)
    assert not _covered("vision.blocks.0", layout)  # nothing outside it but the root


def test_a_unit_in_another_part_than_its_outer_unit_is_hooked() -> None:
    """The region is a unit and holds an encoder: the encoder's first unit starts a part."""
    parts = (("vision", "vision"), ("vision.blocks.0", "vision.blocks"))
    layout = _layout(("vision", "vision.blocks.0"), parts=parts)
    assert not _covered("vision.blocks.0", layout)


def test_a_unit_after_a_region_inside_its_outer_unit_is_hooked() -> None:
    """A region inside the outer unit re-arms the check on exit: the next unit checks."""
    cross = MediaRegion(path="layers.0.cross", kind="decoder layer", units=("layers.0.cross",))
    layout = _layout(("layers.0", "layers.0.cross", "layers.0.mlp"), regions=(cross,))
    assert not _covered("layers.0.mlp", layout)
    successor = _layout(("layers.0", "layers.0.mlp"), successors=frozenset({"layers.0.mlp"}))
    assert not _covered("layers.0.mlp", successor)


def test_a_unit_nested_outside_any_region_is_covered() -> None:
    layout = _layout(("layers.0", "layers.0.norm"))
    assert _covered("layers.0.norm", layout)
