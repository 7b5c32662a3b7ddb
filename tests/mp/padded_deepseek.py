"""The DeepSeek-V4.1 tiny preset with widths that no small world size divides evenly
(36, 131, ...), so FSDP pads dim 0 and byte counts exercise the padding rules."""

from __future__ import annotations

from model_deepseek_v41 import DeepseekV41Config

PADDED_TINY = DeepseekV41Config.tiny(
    vision_hidden=36,
    vision_heads=3,
    vision_intermediate=70,
    vision_layers=3,
    text_hidden=40,
    text_heads=2,
    text_intermediate=90,
    vocab_size=131,
)
