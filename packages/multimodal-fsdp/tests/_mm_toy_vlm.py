"""The small toy VLM of the multimodal-fsdp tests, in the shapes of real model families.

LLaVA-shaped by default (``vision_tower``, ``multi_modal_projector``, ``language_model``,
``lm_head``); ``qwen=True`` gives the Qwen-VL shape (``visual`` with its projector
``merger`` inside, no separate projector). The options switch the parts real models
have or lack (a tower's patch embedding and final norm, the decoder's final norm, a
GELU in the projector), so each test keeps the exact tree its numbers are about.
Test modules import it after putting this folder on ``sys.path`` (the test folders
are not packages).
"""

from __future__ import annotations

import torch
from torch import nn

DIM = 8
PATCH = 4
VOCAB = 16
TOWER_DEPTH = 3
TEXT_DEPTH = 2


class Block(nn.Module):
    """A pre-norm residual layer (norm + linear), for tower blocks and decoder layers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc(self.norm(x))
        return out


class VisionTower(nn.Module):
    """``patch_embed`` (optional), ``blocks``, then ``post_norm`` or Qwen's ``merger``."""

    def __init__(
        self, *, depth: int, patch_embed: bool = True, post_norm: bool = True, merger: bool = False
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(PATCH, DIM) if patch_embed else None
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])
        self.post_norm = nn.LayerNorm(DIM) if post_norm else None
        self.merger = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM)) if merger else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        hidden = pixels if self.patch_embed is None else self.patch_embed(pixels)
        for block in self.blocks:
            hidden = block(hidden)
        if self.post_norm is not None:
            hidden = self.post_norm(hidden)
        if self.merger is not None:
            hidden = self.merger(hidden)
        return hidden


class LanguageModel(nn.Module):
    """``embed_tokens``, ``layers`` and an optional final ``norm``; takes hidden states."""

    def __init__(self, *, depth: int = 2, norm: bool = True) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(depth)])
        self.norm = nn.LayerNorm(DIM) if norm else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden if self.norm is None else self.norm(hidden)


class ToyVLM(nn.Module):
    """Image tokens first, then the text tokens, through the decoder and ``lm_head``;
    ``pixel_values=None`` is a text-only batch."""

    def __init__(
        self,
        *,
        tower_depth: int = TOWER_DEPTH,
        text_depth: int = TEXT_DEPTH,
        patch_embed: bool = True,
        tower_norm: bool = True,
        text_norm: bool = True,
        projector_gelu: bool = True,
        qwen: bool = False,
        frozen_tower: bool = False,
    ) -> None:
        super().__init__()
        tower = VisionTower(
            depth=tower_depth,
            patch_embed=patch_embed,
            post_norm=tower_norm and not qwen,
            merger=qwen,
        )
        if qwen:
            self.visual = tower
        else:
            self.vision_tower = tower
            middle = (nn.GELU(),) if projector_gelu else ()
            self.multi_modal_projector = nn.Sequential(
                nn.Linear(DIM, DIM), *middle, nn.Linear(DIM, DIM)
            )
        self.language_model = LanguageModel(depth=text_depth, norm=text_norm)
        self.lm_head = nn.Linear(DIM, VOCAB)
        if frozen_tower:
            tower.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
        embed = self.language_model.embed_tokens
        if pixel_values is None:
            return self.lm_head(self.language_model(embed(input_ids)))  # type: ignore[no-any-return]
        if hasattr(self, "visual"):
            image = self.visual(pixel_values)
        else:
            image = self.multi_modal_projector(self.vision_tower(pixel_values))
        hidden = torch.cat([image, embed(input_ids).to(image.dtype)], dim=1)
        return self.lm_head(self.language_model(hidden))  # type: ignore[no-any-return]
