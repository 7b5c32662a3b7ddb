"""The memory model of the balanced exchange against the exchange itself.

``exchange_buffer_bytes`` says which buffers one balanced tower call allocates (inputs
sent and received, outputs sent and received); the activation trace adds them around
each balanced call. Here a real ``balanced_call`` runs under the fake process group
inside the trace's byte follower: its peak is the model's, up to the few hundred bytes
of the size gathers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_core.fake_group import fake_process_group
from multimodal_fsdp.balance import balanced_call
from multimodal_fsdp.estimate.activations import _LiveBytes, exchange_buffer_bytes

#: The header, item-table and status gathers of one call (a few int64 per rank).
METADATA = 256


class _Tower(nn.Module):
    """A batch-first tower whose output has ``width`` elements per image."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()), requires_grad=False)
        self.width = width

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = pixel_values.flatten(1)[:, : self.width] * self.scale
        return out


@pytest.mark.parametrize("width", [3 * 64 * 64, 3 * 64 * 32, 16])
def test_the_exchange_allocates_what_the_model_says(width: int) -> None:
    with fake_process_group(2, rank=0):
        pixels = torch.randn(3, 3, 64, 64)
        live = _LiveBytes({pixels.untyped_storage().data_ptr()})
        with live:
            out = balanced_call(_Tower(width), (pixels,), {})
    # Under the fake group this rank sends its three images and gets three back.
    inputs = (pixels.nbytes, pixels.nbytes)
    outputs = (out.nbytes, out.nbytes)
    in_peak, kept, out_peak = exchange_buffer_bytes(inputs, outputs)
    assert in_peak == 5 * pixels.nbytes
    assert kept == 3 * pixels.nbytes
    predicted = max(in_peak, kept + out_peak)
    assert 0 <= live.peak - predicted <= METADATA, (live.peak, predicted)
