"""Context parallelism: a tiny LLaVA-style model with its sequence split over ``cp``.

4 gloo ranks on a ``('dp', 'cp')`` 2x2 mesh (rank ``2 * d + c``). Each DP coordinate
holds one sample; its two CP ranks hold torch's load-balanced halves of the sequence
(four chunks, rank ``c`` gets chunks ``c`` and ``3 - c``, as ``context_parallel`` splits
a causal sequence). torch's ring attention has no CPU kernel in 2.13
(``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy), so the
model's attention all-gathers K and V over the CP group and masks by global position,
which is what ring attention computes. The library shards over ``dp`` x ``cp`` and
balances the frozen tower over each CP group (the data group): every image encoded once
in the world, each rank given only the images its shard's image tokens come from
(``context_parallel_media``). ``tests/test_cp_distributed.py`` compares losses,
first-step gradients and parameters with one process on both samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import functional

from fsdp_core import DistributedContext
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.balance.context_parallel import context_parallel_media, items_of_tokens

DIM, PATCH, TOKENS, VOCAB, IMAGE_ID = 16, 8, 4, 32, 1
SEQ, CP, STEPS, LR = 24, 2, 2, 0.1
#: Per case: the items (images or frames, ``TOKENS`` tokens each) of each DP
#: coordinate's sample, and where its media tokens start.
MEDIA = {
    "images": ([2, 1], [(2, 13), (5,)]),
    "one_image": ([1, 0], [(3,), ()]),
    "video_frames": ([4, 2], [(1, 5, 9, 13), (10, 14)]),
}
VARIANTS = ("root", "per_layer", "trainable")


class Gathered(torch.autograd.Function):
    """All-gather along dim 0 over a CP group; the gradient of this rank's chunk is the
    sum of every rank's gradient for it."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rows = group, local.shape[0]
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        me = dist.get_rank(ctx.group)
        return grad[me * ctx.rows : (me + 1) * ctx.rows], None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, group: Any) -> torch.Tensor:
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        keys = positions
        if group is not None:  # what ring attention computes: every key, masked by position
            k, v = Gathered.apply(k, group), Gathered.apply(v, group)
            keys = torch.cat(_gather_plain(positions, group))
        mask = keys[None, :] <= positions[:, None]
        scores = (q @ k.T / DIM**0.5).masked_fill(~mask, float("-inf"))
        h = h + self.out(scores.softmax(-1) @ v)
        return h + torch.tanh(self.mlp(h))


def _gather_plain(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return parts


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(PATCH, DIM), nn.Linear(DIM, DIM)])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # one row per image
        h = pixel_values
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block() for _ in range(2)])


class CPVLM(nn.Module):
    """LLaVA-shaped: ``TOKENS`` feature rows per image, scattered into the image tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = Tower()
        self.multi_modal_projector = nn.Linear(DIM, DIM)
        self.language_model = Decoder()
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        group: Any = None,
    ) -> torch.Tensor:
        h = self.language_model.embed_tokens(input_ids)
        if pixel_values is not None:
            features = self.multi_modal_projector(self.vision_tower(pixel_values))
            features = features.reshape(-1, DIM)
            if rows is not None:
                features = features[rows]
            h = h.masked_scatter((input_ids == IMAGE_ID)[:, None], features)
        for layer in self.language_model.layers:
            h = layer(h, positions, group)
        return self.lm_head(h)


def build(trainable: bool) -> CPVLM:
    torch.manual_seed(0)
    model = CPVLM()
    model.vision_tower.requires_grad_(trainable)
    return model


def samples(case: str, step: int) -> list[dict[str, torch.Tensor]]:
    """Each DP coordinate's sample: ``input_ids``, ``labels`` (next token, -100 last and
    on image tokens) and ``pixel_values`` (``TOKENS`` patches per item) when it has items."""
    counts, starts = MEDIA[case]
    out = []
    for d, (count, first) in enumerate(zip(counts, starts, strict=True)):
        g = torch.Generator().manual_seed(100 * step + d)
        ids = torch.randint(2, VOCAB, (SEQ,), generator=g)
        for start in first:
            ids[start : start + TOKENS] = IMAGE_ID
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        labels[labels == IMAGE_ID] = -100
        sample = {"input_ids": ids, "labels": labels}
        if count:
            sample["pixel_values"] = torch.randn(count, TOKENS, PATCH, generator=g)
        out.append(sample)
    return out


def shard_positions(cp_rank: int) -> torch.Tensor:
    """torch's load-balanced split of a causal sequence: chunks ``c`` and ``2cp-1-c``."""
    chunks = torch.arange(SEQ).chunk(2 * CP)
    return torch.cat([chunks[cp_rank], chunks[2 * CP - 1 - cp_rank]])


def global_tokens(case: str, step: int) -> int:
    return sum(int((s["labels"] != -100).sum()) for s in samples(case, step))


def reference_loss(model: CPVLM, case: str, step: int) -> torch.Tensor:
    """One process on both samples: the summed loss over the global batch's tokens."""
    total = torch.zeros(())
    for sample in samples(case, step):
        logits = model(sample["input_ids"], torch.arange(SEQ), sample.get("pixel_values"))
        total = total + functional.cross_entropy(logits, sample["labels"], reduction="sum")
    return total / global_tokens(case, step)


def _cp_loss(
    model: nn.Module, sample: dict[str, torch.Tensor], case: str, step: int, cp: Any
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This CP rank's loss term (its shard's summed loss, scaled so that FSDP's average
    over the 4 ranks is the global mean) and the items its shard needs."""
    positions = shard_positions(cp.get_local_rank())
    ids = sample["input_ids"]
    media = (ids == IMAGE_ID).nonzero().flatten().tolist()
    ordinals = [media.index(p) for p in positions.tolist() if p in media]
    items: tuple[int, ...] = ()
    rows = None
    pixels = sample.get("pixel_values")
    if pixels is not None:
        items, row_list = items_of_tokens([TOKENS] * pixels.shape[0], ordinals)
        rows = torch.tensor(row_list, dtype=torch.long)
    with context_parallel_media(items):
        logits = model(ids[positions], positions, pixels, rows, cp.get_group())
    loss = functional.cross_entropy(logits, sample["labels"][positions], reduction="sum")
    return loss * dist.get_world_size() / global_tokens(case, step), items


def _case(ctx: DistributedContext, case: str, variant: str) -> dict[str, Any]:
    world = init_device_mesh(ctx.device.type, (2, CP), mesh_dim_names=("dp", "cp"))
    d = world["dp"].get_local_rank()
    trainable = variant == "trainable"
    model = build(trainable)
    policy = "per_layer" if variant == "per_layer" else "root"
    MultimodalParallelizer(frozen_multimodal_sharding=policy, balance_media=True).parallelize(
        model, mesh=world, dp_dims="dp"
    )
    encoded = [0]

    def count(_module: nn.Module, args: tuple[Any, ...]) -> None:
        encoded[0] += int(args[0].shape[0])

    handle = model.vision_tower.blocks[0].register_forward_pre_hook(count)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses, grads0, needs = [], {}, []
    for step in range(STEPS):
        loss, items = _cp_loss(model, samples(case, step)[d], case, step, world["cp"])
        loss.backward()
        if step == 0:
            handle.remove()
            needs.append(list(items))
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / ctx.world_size)
    model.eval()  # an eval forward runs a tower without units locally: its items too
    with torch.no_grad():
        eval_loss, _ = _cp_loss(model, samples(case, 0)[d], case, 0, world["cp"])
    dist.all_reduce(eval_loss)
    return {
        "eval_loss": eval_loss.item() / ctx.world_size,
        "losses": losses,
        "grads0": grads0,
        "params": {n: full(p) for n, p in model.named_parameters()},
        "encoded": _gather_plain(torch.tensor(encoded), None),
        "needs": [n for n in _gather_object(needs[0])],
        "fsdp_ranks": sorted(
            int(r)
            for r in model.language_model.layers[0].qkv.weight.device_mesh.mesh.flatten().tolist()
        ),
    }


def _gather_object(mine: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def cp_cases() -> list[str]:
    return [f"{case}/{variant}" for case in MEDIA for variant in VARIANTS]


@scenario("cp_dp_llava")
def cp_dp_llava(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """Every case of ``cp_cases`` (see the module docstring)."""
    results: dict[str, Any] = {}
    for name in cp_cases():
        case, variant = name.split("/")
        results[name] = _case(ctx, case, variant)
    return results
