"""Configuration for the DeepSeek-V4.1 multimodal reference model.

The config is a frozen dataclass so it can be hashed, shared between ranks and
varied safely with ``dataclasses.replace`` (which re-runs validation).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["DeepseekV41Config"]

_INT_FIELDS: tuple[str, ...] = (
    "image_size",
    "patch_size",
    "in_channels",
    "vision_hidden",
    "vision_layers",
    "vision_heads",
    "vision_intermediate",
    "downsample_ratio",
    "vocab_size",
    "text_hidden",
    "text_layers",
    "text_heads",
    "text_intermediate",
    "max_seq_len",
    "image_token_id",
    "num_experts",
    "experts_per_token",
    "expert_intermediate",
)
_FLOAT_FIELDS: tuple[str, ...] = ("norm_eps", "rope_theta")


@dataclass(frozen=True)
class DeepseekV41Config:
    """Sizes of the vision tower, aligner and text decoder.

    Invalid values fail fast in ``__post_init__`` so that a bad benchmark
    sweep is rejected before any (possibly meta-device) model is built.
    """

    # Vision tower.
    image_size: int = 32
    patch_size: int = 8
    in_channels: int = 3
    vision_hidden: int = 64
    vision_layers: int = 2
    vision_heads: int = 4
    vision_intermediate: int = 128
    # Aligner: merges ``downsample_ratio x downsample_ratio`` neighbouring patches.
    downsample_ratio: int = 2
    # Text decoder.
    vocab_size: int = 512
    text_hidden: int = 64
    text_layers: int = 2
    text_heads: int = 4
    text_intermediate: int = 128
    max_seq_len: int = 128
    image_token_id: int = 1
    # Routed experts (model_deepseek_v41.moe) in place of every text MLP when > 0.
    num_experts: int = 0
    experts_per_token: int = 2
    expert_intermediate: int = 64
    # Shared.
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"DeepseekV41Config.{name} must be an int, got {type(value).__name__} "
                    f"({value!r})"
                )
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"DeepseekV41Config.{name} must be a float, got {type(value).__name__} "
                    f"({value!r})"
                )
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if name in ("image_token_id", "num_experts"):
                continue
            if value <= 0:
                raise ValueError(f"DeepseekV41Config.{name}={value} must be > 0")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"DeepseekV41Config.{name}={value} must be a finite number > 0")

        self._check_divisible("image_size", "patch_size")
        grid = self.image_size // self.patch_size
        if self.downsample_ratio > grid:
            raise ValueError(
                f"DeepseekV41Config.downsample_ratio={self.downsample_ratio} must be <= the "
                f"patch grid side image_size // patch_size = {grid}"
            )
        self._check_divisible("vision_hidden", "vision_heads")
        vision_head_dim = self.vision_hidden // self.vision_heads
        if vision_head_dim % 4 != 0:
            raise ValueError(
                f"DeepseekV41Config.vision_hidden // vision_heads = {vision_head_dim} (vision head "
                "dim) must be divisible by 4: 2-D rotary splits it into even row/column halves"
            )
        self._check_divisible("text_hidden", "text_heads")
        text_head_dim = self.text_hidden // self.text_heads
        if text_head_dim % 2 != 0:
            raise ValueError(
                f"DeepseekV41Config.text_hidden // text_heads = {text_head_dim} (text head dim) "
                "must be even for rotary embeddings"
            )
        if not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(
                f"DeepseekV41Config.image_token_id={self.image_token_id} must be in "
                f"[0, vocab_size={self.vocab_size})"
            )
        if self.num_experts < 0 or (self.num_experts and self.experts_per_token > self.num_experts):
            raise ValueError(
                f"DeepseekV41Config.num_experts={self.num_experts} must be >= 0 (0: dense "
                f"MLPs) and experts_per_token={self.experts_per_token} at most num_experts"
            )
        if self.vocab_size < 2:
            raise ValueError(
                f"DeepseekV41Config.vocab_size={self.vocab_size} must be >= 2 (the image token "
                "plus at least one text token)"
            )
        if self.max_seq_len < self.image_tokens_per_image:
            raise ValueError(
                f"DeepseekV41Config.max_seq_len={self.max_seq_len} must be >= the tokens per "
                f"image ({self.image_tokens_per_image}) so one image fits in a sequence"
            )

    def _check_divisible(self, num: str, den: str) -> None:
        a, b = getattr(self, num), getattr(self, den)
        if a % b != 0:
            raise ValueError(f"DeepseekV41Config.{num}={a} must be divisible by {den}={b}")

    # Derived sizes -------------------------------------------------------

    @property
    def patch_grid(self) -> int:
        """Patches per image side."""
        return self.image_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        """Flattened pixel values per patch (input width of the patch Linear)."""
        return self.in_channels * self.patch_size * self.patch_size

    @property
    def vision_head_dim(self) -> int:
        return self.vision_hidden // self.vision_heads

    @property
    def text_head_dim(self) -> int:
        return self.text_hidden // self.text_heads

    @property
    def merged_grid(self) -> int:
        """Aligner output side: the patch grid padded up to a multiple of the ratio, then merged."""
        return -(-self.patch_grid // self.downsample_ratio)

    @property
    def image_tokens_per_image(self) -> int:
        """Text positions one image occupies after the aligner merge."""
        return self.merged_grid * self.merged_grid

    def num_parameters(self) -> int:
        """Analytic parameter count; lets benchmarks size a model without building it.

        Returns:
            The number of parameters the model built from this config has.
        """
        v, vi, t, ti = (
            self.vision_hidden,
            self.vision_intermediate,
            self.text_hidden,
            self.text_intermediate,
        )
        patch_embed = self.patch_dim * v + v
        vision_block = (
            v  # norm1
            + v * 3 * v
            + 3 * v  # qkv (with bias)
            + v * v
            + v  # proj
            + v  # norm2
            + v * 2 * vi
            + 2 * vi  # gate_up
            + vi * v
            + v  # down
        )
        vision = patch_embed + self.vision_layers * vision_block + v
        merged = v * self.downsample_ratio**2
        aligner = merged * t + t + t * t + t
        mlp = t * 2 * ti + ti * t
        if self.num_experts:
            mlp = t * self.num_experts + self.num_experts * 3 * t * self.expert_intermediate
        text_layer = t + t * 3 * t + t * t + t + mlp
        text = self.vocab_size * t + self.text_layers * text_layer + t
        lm_head = t * self.vocab_size
        return vision + aligner + text + lm_head

    def replace(self, **changes: Any) -> DeepseekV41Config:
        """Validated copy with some fields changed (e.g. ``vision_layers=8``).

        Args:
            **changes: the fields to change.

        Returns:
            The new config (checked like a new one).
        """
        return dataclasses.replace(self, **changes)

    # Presets ---------------------------------------------------------------

    @classmethod
    def tiny(cls, **overrides: Any) -> DeepseekV41Config:
        """~0.25M parameters, 4 image tokens per 32x32 image: fast CPU unit tests.

        Args:
            **overrides: fields to change from the preset.

        Returns:
            The config.
        """
        return cls(**overrides)

    @classmethod
    def small(cls, **overrides: Any) -> DeepseekV41Config:
        """~30M parameters, 49 image tokens per 224x224 image: quick multi-GPU smoke runs.

        Args:
            **overrides: fields to change from the preset.

        Returns:
            The config.
        """
        sizes: dict[str, Any] = {
            "image_size": 224,
            "patch_size": 16,
            "vision_hidden": 256,
            "vision_layers": 4,
            "vision_heads": 4,
            "vision_intermediate": 704,
            "vocab_size": 8192,
            "text_hidden": 512,
            "text_layers": 6,
            "text_heads": 8,
            "text_intermediate": 1408,
            "max_seq_len": 1024,
        }
        return cls(**{**sizes, **overrides})

    @classmethod
    def base(cls, **overrides: Any) -> DeepseekV41Config:
        """~310M parameters, 144 image tokens per 384x384 image: benchmark size.

        Args:
            **overrides: fields to change from the preset.

        Returns:
            The config.
        """
        sizes: dict[str, Any] = {
            "image_size": 384,
            "patch_size": 16,
            "vision_hidden": 768,
            "vision_layers": 12,
            "vision_heads": 12,
            "vision_intermediate": 2048,
            "vocab_size": 32000,
            "text_hidden": 1024,
            "text_layers": 12,
            "text_heads": 16,
            "text_intermediate": 2816,
            "max_seq_len": 2048,
        }
        return cls(**{**sizes, **overrides})

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> DeepseekV41Config:
        """Look a preset up by name (``"tiny"``, ``"small"`` or ``"base"``), e.g. from a CLI.

        Args:
            name: the preset's name.
            **overrides: fields to change from the preset.

        Returns:
            The config.

        Raises:
            ValueError: ``name`` is not a preset (the message lists them).
        """
        factories = {"tiny": cls.tiny, "small": cls.small, "base": cls.base}
        if name not in factories:
            raise ValueError(
                f"unknown DeepseekV41Config preset {name!r}; expected one of {sorted(factories)}"
            )
        return factories[name](**overrides)
