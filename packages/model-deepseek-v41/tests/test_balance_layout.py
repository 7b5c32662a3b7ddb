"""The DeepSeek-V4.1 reference tower's call (``self.vision(pixel_values)``, a tensor
``[N, gh, gw, D]`` back) is covered by the generic ``batch-first`` layout adapter, so
the package registers no adapter of its own."""

from __future__ import annotations

import torch

from model_deepseek_v41 import DeepseekV41Config, build_deepseek_v41
from multimodal_fsdp.balance import media_layout_for


def test_the_batch_first_layout_splits_and_joins_the_reference_tower() -> None:
    config = DeepseekV41Config.tiny()
    tower = build_deepseek_v41(config, seed=0).vision
    layout = media_layout_for(tower)
    assert layout.name == "batch-first"
    pixels = torch.randn(3, config.in_channels, config.image_size, config.image_size)
    call = layout.split_call(tower, (pixels,), {})
    assert call.spec.fields == ("pixel_values",)
    assert len(call.items) == 3
    with torch.no_grad():
        full = tower(pixels)
        pieces = []
        for item in reversed(call.items):  # encoded in another order, as on other ranks
            args, kwargs = layout.build_call(call.spec, [item])
            spec, parts = layout.split_output(tower(*args, **kwargs), [1])
            pieces[:0] = parts
        joined = layout.join_output(spec, pieces)
    assert isinstance(joined, torch.Tensor)
    assert joined.shape == full.shape
    torch.testing.assert_close(joined, full, rtol=1e-4, atol=1e-5)
