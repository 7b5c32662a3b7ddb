"""The models, batches and single-process reference of the balanced-media scenarios.

The tiny DeepSeek-V4.1 VLM in fp32, its tower frozen, trainable, or frozen with a small
trainable adapter inside block 0 (LoRA-like); ``per_image`` makes the forward call the
tower once per image (several tower calls per forward). Each step of a case has its own
media distribution (images per sample on each rank; ``per_image`` steps call the tower
once per image), so one case covers even, text-only and all-on-one-rank steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional
from vlm import CONFIG, LR, SEQ

from model_deepseek_v41 import make_batch
from model_deepseek_v41.modeling import IGNORE_INDEX, Batch, DeepseekV41ForCausalLM

#: Per step: (images per sample on rank 0, on rank 1, one tower call per image).
DISTRIBUTIONS: tuple[tuple[int | bool, ...], ...] = (
    (1, 1, False),  # even
    (1, 0, False),  # rank 1 text-only
    (0, 2, False),  # all media on rank 1, rank 0 text-only
    (2, 1, True),  # one call per image: 4 calls on rank 0, 2 on rank 1
    (2, 0, True),  # 4 calls on rank 0 only
)
#: The same on 4 ranks (an HSDP 2x2 mesh): all on one rank, skewed, calls per image.
HSDP_DISTRIBUTIONS: tuple[tuple[int | bool, ...], ...] = (
    (1, 0, 0, 0, False),
    (0, 2, 1, 0, False),
    (2, 0, 0, 1, True),
)
POLICIES = ("root", "per_layer", "replicate")
TOWERS = ("frozen", "trainable", "adapter")


class Adapted(nn.Module):
    """``base(x)`` plus a small trainable low-rank branch (the frozen block keeps its
    weights; only the branch trains), like LoRA on the tower."""

    def __init__(self, base: nn.Module, dim: int, rank: int = 4) -> None:
        super().__init__()
        self.base = base
        generator = torch.Generator().manual_seed(7)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)
        with torch.no_grad():
            self.lora_a.weight.copy_(torch.randn(rank, dim, generator=generator) * 0.1)
            self.lora_b.weight.copy_(torch.randn(dim, rank, generator=generator) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.base(x) + self.lora_b(self.lora_a(x))
        return out


class PerImageVLM(DeepseekV41ForCausalLM):
    """The DeepSeek-V4.1 VLM; with ``per_image`` set, one tower call per image."""

    per_image = False

    def forward(
        self, input_ids: Tensor, pixel_values: Tensor | None = None, labels: Tensor | None = None
    ) -> Tensor:
        if pixel_values is None or not self.per_image:
            return super().forward(input_ids, pixel_values, labels)
        features = torch.cat([self.aligner(self.vision(image[None])) for image in pixel_values])
        hidden = self.model(input_ids, features.reshape(-1, features.shape[-1]))
        logits: Tensor = self.lm_head(hidden)
        assert labels is not None
        return functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )


def build(tower: str) -> PerImageVLM:
    torch.manual_seed(0)
    model = PerImageVLM(CONFIG)
    if tower in ("frozen", "adapter"):
        model.vision.requires_grad_(False)
    if tower == "adapter":
        block = model.vision.blocks[0]
        block.mlp = Adapted(block.mlp, CONFIG.vision_hidden)  # type: ignore[assignment]
    return model


def batch(step: int, rank: int, images: int, *, seed: int = 9000) -> Batch:
    return make_batch(
        CONFIG,
        batch_size=2,
        seq_len=SEQ,
        num_images_per_sample=images,
        seed=seed + 97 * step + rank,
    )


def step_loss(
    model: nn.Module,
    step: int,
    rank: int,
    table: tuple[tuple[int | bool, ...], ...] = DISTRIBUTIONS,
) -> Tensor:
    """Rank ``rank``'s loss of step ``step`` (the distribution of ``table``)."""
    images = int(table[step][rank])
    model.per_image = bool(table[step][-1])  # type: ignore[assignment]
    loss: Tensor = model(**batch(step, rank, images))
    return loss


def eval_loss(model: nn.Module, rank: int) -> Tensor:
    """The eval pass after step 1: media on rank 0 only."""
    model.per_image = False  # type: ignore[assignment]
    loss: Tensor = model(**batch(99, rank, 1 if rank == 0 else 0, seed=5))  # rank 0 only
    return loss


def micro_batches(rank: int) -> list[Batch]:
    """Gradient accumulation: rank 0 text-only then images, rank 1 the reverse."""
    order = (0, 1) if rank == 0 else (1, 0)
    return [batch(50 + index, rank, images) for index, images in enumerate(order)]


def reference(
    tower: str, *, table: tuple[tuple[int | bool, ...], ...] = DISTRIBUTIONS
) -> dict[str, Any]:
    """One process running each step's whole global batch: the mean of the ranks' losses
    (FSDP averages the ranks' gradients), SGD with the scenarios' rate."""
    world = len(table[0]) - 1
    model = build(tower)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads = [], []
    eval_value = 0.0
    for step in range(len(table)):
        loss = sum(step_loss(model, step, r, table) for r in range(world)) / world
        loss.backward()  # type: ignore[union-attr]
        losses.append(float(loss.detach()))
        grads.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        opt.step()
        opt.zero_grad()
        if step == 1:
            model.eval()
            with torch.no_grad():
                eval_value = float(sum(eval_loss(model, r) for r in range(world)) / world)
            model.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "eval_loss": eval_value}


def accumulation_reference(tower: str, *, world: int = 2) -> dict[str, Any]:
    model = build(tower)
    total = sum(
        (model(**micro) for r in range(world) for micro in micro_batches(r)),
        start=torch.zeros(()),
    )
    (total / world).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# --- tiny transformers LLaVA and Qwen2-VL (images and videos: two tower calls) -----------
#: Per model, per step, each rank's media: LLaVA images; Qwen2-VL (images, videos).
HF_MEDIA: dict[str, tuple[tuple[Any, ...], ...]] = {
    "llava": ((2, 0), (0, 1), (1, 1)),
    "qwen2_vl": (((1, 1), (0, 0)), ((2, 0), (0, 1)), ((0, 0), (1, 1))),
}
HF_CASES = (
    *(f"{model}/{tower}" for model in HF_MEDIA for tower in ("frozen", "trainable")),
    "llava/checkpointed",  # trainable, transformers gradient_checkpointing_enable()
)


def hf_build(name: str, tower: str) -> nn.Module:
    from hf_vlms import HF_VLMS

    vlm = HF_VLMS[name]
    model = vlm.build()
    if tower == "frozen":
        model.get_submodule(vlm.tower).requires_grad_(False)
    if tower == "checkpointed":
        model.gradient_checkpointing_enable()  # type: ignore[operator]
        model.train()
    return model


def hf_step_loss(model: nn.Module, name: str, step: int, rank: int) -> Tensor:
    from hf_vlms import HF_VLMS, hf_loss

    media = HF_MEDIA[name][step][rank]
    seed = 300 + 10 * step + rank
    if name == "llava":
        batch = HF_VLMS[name].batch(seed, images=media)
    else:
        batch = HF_VLMS[name].batch(seed, images=media[0], videos=media[1])
    return hf_loss(model, batch)


def hf_reference(name: str, tower: str, *, world: int = 2) -> dict[str, Any]:
    model = hf_build(name, tower)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads = [], []
    for step in range(len(HF_MEDIA[name])):
        loss = sum(hf_step_loss(model, name, step, r) for r in range(world)) / world
        loss.backward()  # type: ignore[union-attr]
        losses.append(float(loss.detach()))  # type: ignore[union-attr]
        grads.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}
