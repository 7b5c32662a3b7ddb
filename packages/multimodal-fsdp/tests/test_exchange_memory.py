"""The memory model of the balanced exchange against the exchange itself.

``exchange_buffer_bytes`` says which buffers one balanced tower call that moves items
allocates (inputs sent and received, outputs sent and received, the kept items'
rows); the activation trace adds them around each such call. Here a real
``balanced_call`` runs under the fake process group inside the trace's byte follower,
with the slot gather patched to show a second, text-only rank (the fake group shows
every rank as this one, and nothing would move) and the all_to_alls moving no data
(only their buffers matter): its peak is the model's, up to the few kilobytes of the
slot gathers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

import multimodal_fsdp.balance._metadata as metadata
from fsdp_core.fake_group import fake_process_group
from multimodal_fsdp.balance import balanced_call
from multimodal_fsdp.estimate.activations import _LiveBytes, exchange_buffer_bytes

#: The slot gather of one call: this rank's slot and one per rank gathered (2 ranks),
#: and a few hundred bytes of status and bookkeeping.
METADATA = 3 * metadata.SLOT_INTS * 8 + 512


class _Tower(nn.Module):
    """A batch-first tower whose output has ``width`` elements per image."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()), requires_grad=False)
        self.width = width

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = pixel_values.flatten(1)[:, : self.width] * self.scale
        return out


class _Done:
    def wait(self) -> None:
        return None


def _text_only_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    real = metadata.gather

    def gather(tensor: Tensor, group: Any) -> list[Tensor]:
        slots = real(tensor, group)
        if tensor.numel() == metadata.SLOT_INTS:  # rank 1 brings no call
            other = torch.zeros_like(tensor)
            for field in (metadata._Header.MAGIC, metadata._Header.GRAD):
                other[field] = tensor[field]
            other[metadata._Header.MODULE] = -1
            slots[1] = other
        return slots

    def all_to_all(*_: Any, **kwargs: Any) -> _Done | None:
        return _Done() if kwargs.get("async_op") else None

    monkeypatch.setattr(metadata, "gather", gather)
    monkeypatch.setattr(dist, "all_to_all_single", all_to_all)


@pytest.mark.parametrize("width", [3 * 64 * 64, 3 * 64 * 32, 16])
def test_the_exchange_allocates_what_the_model_says(
    width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _text_only_peer(monkeypatch)
    with fake_process_group(2, rank=0):
        pixels = torch.randn(3, 3, 64, 64)
        live = _LiveBytes({pixels.untyped_storage().data_ptr()})
        with live:
            out = balanced_call(_Tower(width), (pixels,), {})
    assert out.shape == (3, min(width, 3 * 64 * 64))
    image, piece = pixels.nbytes // 3, out.nbytes // 3
    # Rank 0 keeps two images and sends one to the text-only rank, which sends it back.
    in_peak, during, after, out_peak = exchange_buffer_bytes(
        (image, 0), (0, piece), (2 * image, 2 * piece)
    )
    assert (in_peak, during, after) == (2 * image, 3 * image, image)
    tower_output = 2 * piece
    predicted = max(in_peak, during + tower_output, after + tower_output + out_peak)
    assert 0 <= live.peak - predicted <= METADATA, (live.peak, predicted)


def test_a_call_that_moves_nothing_allocates_no_buffer() -> None:
    with fake_process_group(2, rank=0):  # every rank has the same three images
        pixels = torch.randn(3, 3, 64, 64)
        live = _LiveBytes({pixels.untyped_storage().data_ptr()})
        with live:
            out = balanced_call(_Tower(16), (pixels,), {})
    assert 0 <= live.peak - out.nbytes <= METADATA, live.peak
