"""Frame-level splitting of a long video for context parallelism (issue 35 item 1).

A ``packed-by-grid`` video is one ``(t, h, w)`` item; inside
``context_parallel_media(..., frames=True)`` it is cut into ``t`` one-frame items, which
a CP group can share and each CP rank can name. Qwen2-VL's vision tower attends within a
frame, so the frames' outputs, in order, must be the video's: checked on a tiny real
tower, and each frame's rows are the video's rows of that frame."""

from __future__ import annotations

import pytest
import torch
from hf_vlms import QWEN_GRID, QWEN_PATCH_DIM, build_qwen2_vl

from multimodal_fsdp.balance._data_group import select_items
from multimodal_fsdp.balance.context_parallel import (
    context_parallel_media,
    split_frames,
)
from multimodal_fsdp.balance.generic_layouts import PackedByGridLayout

FRAMES = 3


pytest.importorskip("transformers")


def _video() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    visual = build_qwen2_vl().model.visual.eval()
    grid = torch.tensor([[FRAMES, QWEN_GRID, QWEN_GRID], [1, QWEN_GRID, QWEN_GRID]])
    patches = torch.randn(
        int(grid.prod(-1).sum()), QWEN_PATCH_DIM, generator=torch.Generator().manual_seed(0)
    )
    return visual, patches, grid


def test_a_video_cut_into_frames_encodes_as_the_video() -> None:
    visual, patches, grid = _video()
    layout = PackedByGridLayout().bind(visual)
    call = layout.split_call(visual, (patches,), {"grid_thw": grid})
    assert split_frames(layout, call) is call  # outside the context: one item per video
    with context_parallel_media(frames=True):
        frames = split_frames(layout, call)
    assert [item.sizes for item in frames.items] == [(1, QWEN_GRID, QWEN_GRID)] * (FRAMES + 1)
    args, kwargs = layout.build_call(frames.spec, frames.items)
    with torch.no_grad():
        whole = visual(patches, grid_thw=grid)
        framed = visual(*args, **kwargs)
    whole_rows = whole.pooler_output if hasattr(whole, "pooler_output") else whole
    framed_rows = framed.pooler_output if hasattr(framed, "pooler_output") else framed
    torch.testing.assert_close(framed_rows, whole_rows)
    weights = [item.fields[0].shape[0] for item in frames.items]
    second = select_items(layout, framed, weights, [1])
    second_rows = second.pooler_output if hasattr(second, "pooler_output") else second
    per_frame = whole_rows.shape[0] // (FRAMES + 1)
    torch.testing.assert_close(second_rows, whole_rows[per_frame : 2 * per_frame])


def test_frames_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="frames must be a bool"), context_parallel_media(frames=1):  # type: ignore[arg-type]
        pass
