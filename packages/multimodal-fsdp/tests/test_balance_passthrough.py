"""Arguments a balanced tower call does not cut by item pass through unchanged, in every
built-in layout: 0-d tensors (transformers' ``Trainer`` passes ``num_items_in_batch``
down to the tower through ``**kwargs``), flags and ``None``.

A 0-d tensor travels with every item (ranks may pass different values: ``Trainer`` with
``average_tokens_across_devices=False``), and a call built from items gets it back as a
0-d tensor, the value of its first item; flags and ``None`` are the call's constants.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from fsdp_core.fake_group import fake_process_group
from multimodal_fsdp.balance import (
    BatchFirstLayout,
    PackedByGridLayout,
    balanced_call,
    media_layout_for,
)


class _Tower(nn.Module):
    """One row of pixels per image; records the pass-through arguments it got."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 8)
        self.seen: list[dict[str, Any]] = []

    def forward(
        self,
        pixel_values: Tensor,
        output_hidden_states: bool = False,
        mask: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        self.seen.append({"output_hidden_states": output_hidden_states, "mask": mask, **kwargs})
        return self.proj(pixel_values)


class _Packed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 4)
        self.seen: list[dict[str, Any]] = []

    def forward(self, hidden_states: Tensor, grid_thw: Tensor, **kwargs: Any) -> Tensor:
        self.seen.append(kwargs)
        return self.proj(hidden_states)


SCALAR = torch.tensor(37)


def _same_scalar(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() == 0 and int(value) == int(SCALAR)


def test_batch_first_passes_scalars_flags_and_none_through() -> None:
    tower = _Tower()
    pixels = torch.randn(3, 12)
    kwargs = {"output_hidden_states": True, "mask": None, "num_items_in_batch": SCALAR}
    call = BatchFirstLayout().split_call(tower, (pixels,), kwargs)
    assert len(call.items) == 3
    assert call.spec.fields[0] == "pixel_values"
    # Rebuilt from the last two items, as a rank encoding them would.
    args, rebuilt = BatchFirstLayout().build_call(call.spec, call.items[1:])
    out = tower(*args, **rebuilt)
    torch.testing.assert_close(out, tower.proj(pixels[1:]))
    seen = tower.seen[-1]
    assert seen["output_hidden_states"] is True
    assert seen["mask"] is None
    assert _same_scalar(seen["num_items_in_batch"])


def test_packed_by_grid_passes_scalars_through() -> None:
    tower = _Packed()
    grid = torch.tensor([[1, 2, 2], [1, 2, 4]])
    patches = torch.randn(12, 6)
    layout = PackedByGridLayout()
    call = layout.split_call(tower, (patches,), {"grid_thw": grid, "num_items_in_batch": SCALAR})
    assert [item.cost for item in call.items] == [4, 8]
    args, kwargs = layout.build_call(call.spec, call.items[::-1])
    tower(*args, **kwargs)
    assert _same_scalar(tower.seen[-1]["num_items_in_batch"])
    assert torch.equal(kwargs["grid_thw"], grid.flip(0))


def test_a_tensor_that_is_not_per_item_is_still_named() -> None:
    """Only 0-d tensors pass through: a tensor with rows that do not match the items is
    an error naming it (it may hold per-item data the layout cannot cut)."""
    with pytest.raises(ValueError, match="'mask' has shape \\(2, 5\\)"):
        BatchFirstLayout().split_call(_Tower(), (torch.randn(3, 12),), {"mask": torch.ones(2, 5)})


def test_a_balanced_call_with_a_scalar_argument() -> None:
    """Under the fake group (every rank looks like this one) the exchange runs end to end
    with ``num_items_in_batch`` among the tower's arguments, as Trainer passes it."""
    torch.manual_seed(0)
    tower = _Tower()
    pixels = torch.randn(3, 12)
    layout = media_layout_for(tower)  # the plan-time probe runs the tower
    assert layout.name == "batch-first"
    tower.seen.clear()
    with fake_process_group(2):
        out = balanced_call(
            tower,
            (pixels,),
            {"num_items_in_batch": SCALAR, "output_hidden_states": False},
            layout=layout,
        )
    assert out.shape == (3, 8)
    assert tower.seen
    assert all(_same_scalar(seen["num_items_in_batch"]) for seen in tower.seen)
