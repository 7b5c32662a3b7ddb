"""Hand-made VLMs whose control flow depends on the batch, for the training-loop tests.

:class:`ToyVLM` is small and deterministic, with the shapes that break a runtime layer
built for one loop shape:

- a vision tower (patch embedding, a list of blocks, a final norm) and a projector;
- ``tower_calls="per_kind"`` runs the tower once for ``pixel_values`` and once more for
  ``pixel_values_videos`` (Qwen2-VL style); ``"per_image"`` runs it once per image;
- ``cross_every=k`` interleaves cross-attention decoder layers (every ``k``-th layer) that
  only run when the batch has media (Mllama style): a text-only batch skips them;
- ``lm_head`` may be tied to the token embedding.

Batches are dicts of keyword arguments; :func:`toy_vlm_batch` builds them with any
number of images and videos per rank.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn import functional

PATCH = 8
DIM = 16
TOKENS_PER_IMAGE = 2
IMAGE_TOKEN = 1
VOCAB = 37

TowerCalls = Literal["per_kind", "per_image"]


class ToyNorm(nn.Module):
    """RMSNorm computing in fp32 whatever the weight dtype."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * self.weight.float()).to(x.dtype)


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = ToyNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(functional.gelu(self.fc1(self.norm1(x))))


class ToyTower(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(PATCH, DIM)
        self.blocks = nn.ModuleList(ToyBlock(DIM) for _ in range(layers))
        self.norm = ToyNorm(DIM)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """[N, TOKENS_PER_IMAGE, PATCH] -> [N, TOKENS_PER_IMAGE, DIM]."""
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.norm(x)
        return out


class SelfLayer(nn.Module):
    """A decoder layer that always runs."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = ToyBlock(dim)

    def forward(self, x: Tensor, media: Tensor | None = None) -> Tensor:
        out: Tensor = self.block(x)
        return out


class CrossLayer(nn.Module):
    """A decoder layer that attends (here: adds a pooled projection of) the media features;
    it needs them, so the decoder skips it on text-only batches."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = ToyNorm(dim)
        self.kv = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)

    def forward(self, x: Tensor, media: Tensor) -> Tensor:
        pooled = self.kv(media).mean(dim=(0, 1))
        out: Tensor = x + self.gate(self.norm(x)) * pooled
        return out


class ToyDecoder(nn.Module):
    def __init__(self, layers: int, cross_every: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            CrossLayer(DIM) if cross_every and (index + 1) % cross_every == 0 else SelfLayer(DIM)
            for index in range(layers)
        )
        self.norm = ToyNorm(DIM)

    def forward(self, input_ids: Tensor, media: Tensor | None) -> Tensor:
        x = self.embed_tokens(input_ids)
        if media is not None:
            mask = (input_ids == IMAGE_TOKEN).unsqueeze(-1)
            x = x.masked_scatter(mask, media.reshape(-1, media.shape[-1]).to(x.dtype))
        for layer in self.layers:
            if isinstance(layer, CrossLayer):
                if media is None:
                    continue
                x = layer(x, media)
            else:
                x = layer(x)
        out: Tensor = self.norm(x)
        return out


class ToyVLM(nn.Module):
    """Tower + projector + decoder + head; see the module docstring for the variants."""

    def __init__(
        self,
        *,
        tower_calls: TowerCalls = "per_kind",
        text_layers: int = 3,
        cross_every: int = 0,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        if tower_calls not in ("per_kind", "per_image"):
            raise ValueError(f"tower_calls must be 'per_kind' or 'per_image', got {tower_calls!r}")
        self.tower_calls = tower_calls
        self.vision_tower = ToyTower()
        self.multi_modal_projector = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU())
        self.language_model = ToyDecoder(text_layers, cross_every)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def _encode(self, pixels: Tensor) -> Tensor:
        if self.tower_calls == "per_image":
            return torch.cat([self.vision_tower(pixels[i : i + 1]) for i in range(len(pixels))])
        out: Tensor = self.vision_tower(pixels)
        return out

    def forward(
        self,
        input_ids: Tensor,
        pixel_values: Tensor | None = None,
        pixel_values_videos: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        features = [self._encode(p) for p in (pixel_values, pixel_values_videos) if p is not None]
        media = self.multi_modal_projector(torch.cat(features)) if features else None
        logits: Tensor = self.lm_head(self.language_model(input_ids, media))
        if labels is None:
            return logits
        return functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )


def build_toy_vlm(seed: int = 0, *, dtype: torch.dtype = torch.float32, **kwargs: Any) -> ToyVLM:
    torch.manual_seed(seed)
    model = ToyVLM(**kwargs)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
            elif name.endswith("bias"):
                param.uniform_(-0.1, 0.1)
    return model.to(dtype)


def toy_vlm_batch(
    *, images: int = 1, videos: int = 0, seq: int = 12, seed: int = 0
) -> dict[str, Any]:
    """A batch of 2 samples; ``images`` + ``videos`` media items fill image-token runs."""
    gen = torch.Generator().manual_seed(seed)
    media = images + videos
    ids = torch.randint(2, VOCAB, (2, seq), generator=gen)
    positions = media * TOKENS_PER_IMAGE
    if positions > 2 * seq:
        raise ValueError(f"{media} media items do not fit in 2 x {seq} tokens")
    flat = ids.view(-1)
    flat[:positions] = IMAGE_TOKEN
    labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
    batch: dict[str, Any] = {"input_ids": ids, "labels": labels}
    if images:
        batch["pixel_values"] = torch.randn(images, TOKENS_PER_IMAGE, PATCH, generator=gen)
    if videos:
        batch["pixel_values_videos"] = torch.randn(videos, TOKENS_PER_IMAGE, PATCH, generator=gen)
    return batch


def per_image_deepseek(model: nn.Module) -> nn.Module:
    """Make a DeepSeek-V4.1 reference model run its vision tower once per image (the
    grouped fp32-norm unit's modules then run several times per iteration)."""
    from model_deepseek_v41.modeling import DeepseekV41VisionTower

    class PerImageTower(DeepseekV41VisionTower):
        def forward(self, pixel_values: Tensor) -> Tensor:
            one = super().forward
            return torch.cat([one(pixel_values[i : i + 1]) for i in range(len(pixel_values))])

    model.vision.__class__ = PerImageTower  # type: ignore[assignment]
    return model
