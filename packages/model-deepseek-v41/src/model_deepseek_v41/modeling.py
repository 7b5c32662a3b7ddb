"""Pure-PyTorch reference of the DeepSeek-V4.1 multimodal layout.

Layout (module names are part of the contract for sharding plans and tests)::

    vision.patch_embed.proj        Linear over flattened patches
    vision.blocks[i].norm1/attn/norm2/mlp
    vision.norm
    aligner.fc1 / aligner.fc2      merge r x r neighbouring patches -> text width
    model.embed_tokens / model.layers[i] / model.norm
    lm_head

The norms, rotary embeddings and MLP both parts share are in
[`model_deepseek_v41.layers`][model_deepseek_v41.layers].
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypedDict

import torch
from torch import Tensor, nn
from torch.nn import functional

from fsdp_core.materialize import copy_full_into_
from model_deepseek_v41.config import DeepseekV41Config
from model_deepseek_v41.layers import (
    RMSNorm,
    SwiGLU,
    TextRMSNorm,
    _apply_rope_1d,
    _apply_rope_2d,
    _grid_rope_tables,
    _rope_tables,
)
from model_deepseek_v41.moe import MoE

__all__ = [
    "INIT_STD",
    "Batch",
    "DeepseekV41Aligner",
    "DeepseekV41ForCausalLM",
    "DeepseekV41TextModel",
    "DeepseekV41VisionTower",
    "PatchEmbed",
    "TextAttention",
    "TextDecoderLayer",
    "VisionAttention",
    "VisionBlock",
    "build_deepseek_v41",
    "init_parameters_",
    "iter_initial_parameters",
    "make_batch",
    "num_image_tokens",
]

INIT_STD = 0.02
"""Standard deviation of every Linear / Embedding weight drawn by
[`init_parameters_`][model_deepseek_v41.modeling.init_parameters_]."""

IGNORE_INDEX = -100


# Vision tower ------------------------------------------------------------------


class PatchEmbed(nn.Module):
    """Patchify by reshaping (no conv) so the embedding is a plain, easily sharded Linear.

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.proj = nn.Linear(config.patch_dim, config.vision_hidden, bias=True)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """[N, C, H, W] -> [N, H/p * W/p, D] in the Linear's dtype."""
        n, c, h, w = pixel_values.shape
        p = self.patch_size
        if h % p or w % p:
            raise ValueError(f"image height/width ({h}, {w}) must be divisible by patch_size={p}")
        x = pixel_values.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        x = x.reshape(n, (h // p) * (w // p), c * p * p).to(self.proj.weight.dtype)
        out: Tensor = self.proj(x)
        return out


class VisionAttention(nn.Module):
    """Bidirectional self-attention over the patch grid with 2-D rotary positions.

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.num_heads = config.vision_heads
        self.head_dim = config.vision_head_dim
        self.rope_theta = config.rope_theta
        self.qkv = nn.Linear(config.vision_hidden, 3 * config.vision_hidden, bias=True)
        self.proj = nn.Linear(config.vision_hidden, config.vision_hidden, bias=True)

    def forward(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        """``grid`` is the (rows, cols) patch grid; the rotary tables are built here in fp32
        from integers, so a mixed-precision wrapper that casts floating inputs cannot
        round them."""
        n, length, dim = x.shape
        rope = _grid_rope_tables(grid[0], grid[1], self.head_dim, self.rope_theta, x.device)
        qkv = self.qkv(x).view(n, length, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = _apply_rope_2d(q, rope), _apply_rope_2d(k, rope)
        out = functional.scaled_dot_product_attention(q, k, v, is_causal=False)
        result: Tensor = self.proj(out.transpose(1, 2).reshape(n, length, dim))
        return result


class VisionBlock(nn.Module):
    """Pre-norm transformer block; norms are fp32-pinned
    [`RMSNorm`][model_deepseek_v41.layers.RMSNorm].

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.vision_hidden, config.norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = RMSNorm(config.vision_hidden, config.norm_eps)
        self.mlp = SwiGLU(config.vision_hidden, config.vision_intermediate, bias=True)

    def forward(self, x: Tensor, grid: tuple[int, int]) -> Tensor:
        x = x + self.attn(self.norm1(x), grid)
        out: Tensor = x + self.mlp(self.norm2(x))
        return out


class DeepseekV41VisionTower(nn.Module):
    """Images -> per-patch features laid out on the grid ([N, H/p, W/p, vision_hidden]).

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.vision_layers))
        self.norm = RMSNorm(config.vision_hidden, config.norm_eps)

    def forward(self, pixel_values: Tensor) -> Tensor:
        if pixel_values.dim() != 4:
            raise ValueError(
                f"pixel_values must be [num_images, channels, height, width], got shape "
                f"{tuple(pixel_values.shape)}"
            )
        p = self.config.patch_size
        grid_h, grid_w = pixel_values.shape[-2] // p, pixel_values.shape[-1] // p
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, (grid_h, grid_w))
        # The grid shape is taken before the final norm, so the tower returns the norm's
        # own output, never a view of it (FSDP2 warns about a unit that returns a view).
        out: Tensor = self.norm(x.view(x.shape[0], grid_h, grid_w, x.shape[-1]))
        return out


class DeepseekV41Aligner(nn.Module):
    """Merge ``ratio x ratio`` neighbouring patches (4x fewer tokens at ratio 2), then an MLP.

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.ratio = config.downsample_ratio
        merged = config.vision_hidden * self.ratio * self.ratio
        self.fc1 = nn.Linear(merged, config.text_hidden, bias=True)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(config.text_hidden, config.text_hidden, bias=True)

    def forward(self, grid_features: Tensor) -> Tensor:
        """[N, gh, gw, D] -> [N * ceil(gh/r) * ceil(gw/r), text_hidden], image-major."""
        n, gh, gw, d = grid_features.shape
        r = self.ratio
        pad_h, pad_w = (-gh) % r, (-gw) % r
        x = grid_features
        if pad_h or pad_w:
            x = functional.pad(x, (0, 0, 0, pad_w, 0, pad_h))
        mh, mw = (gh + pad_h) // r, (gw + pad_w) // r
        x = x.reshape(n, mh, r, mw, r, d).permute(0, 1, 3, 2, 4, 5).reshape(n * mh * mw, r * r * d)
        # 2-D through the MLP so the result is a fresh tensor, not a view: FSDP2 hooks the
        # unit's output for backward, and a view invites in-place edits that bypass the hook.
        out: Tensor = self.fc2(self.act(self.fc1(x)))
        return out


# Text decoder ------------------------------------------------------------------


class TextAttention(nn.Module):
    """Causal self-attention with 1-D rotary positions.

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.num_heads = config.text_heads
        self.head_dim = config.text_head_dim
        self.rope_theta = config.rope_theta
        self.qkv = nn.Linear(config.text_hidden, 3 * config.text_hidden, bias=False)
        self.o_proj = nn.Linear(config.text_hidden, config.text_hidden, bias=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """``positions`` are integer token positions; rotary tables are built here in fp32."""
        b, s, dim = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = _rope_tables(positions, self.head_dim, self.rope_theta)
        q, k = _apply_rope_1d(q, cos, sin), _apply_rope_1d(k, cos, sin)
        out = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        result: Tensor = self.o_proj(out.transpose(1, 2).reshape(b, s, dim))
        return result


class TextDecoderLayer(nn.Module):
    """Pre-norm decoder layer: attention, then the MLP (routed experts when the config has any).

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.input_layernorm = TextRMSNorm(config.text_hidden, config.norm_eps)
        self.self_attn = TextAttention(config)
        self.post_attention_layernorm = TextRMSNorm(config.text_hidden, config.norm_eps)
        self.mlp: nn.Module = (
            MoE(config)
            if config.num_experts
            else SwiGLU(config.text_hidden, config.text_intermediate, bias=False)
        )

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class DeepseekV41TextModel(nn.Module):
    """Token embedding + image splice + causal decoder stack + final norm.

    The splice happens inside this forward (not in the parent) so that every
    parameter of this module is used within its own ``forward``: FSDP2 only
    unshards a module's parameters around that call.

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.text_hidden)
        self.layers = nn.ModuleList(TextDecoderLayer(config) for _ in range(config.text_layers))
        self.norm = TextRMSNorm(config.text_hidden, config.norm_eps)

    def forward(self, input_ids: Tensor, image_features: Tensor | None = None) -> Tensor:
        """input_ids [B, S], image_features [num_image_tokens, text_hidden] -> hidden [B, S, H]."""
        seq_len = input_ids.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.config.max_seq_len}"
            )
        x = self.embed_tokens(input_ids)
        image_mask = input_ids == self.config.image_token_id
        num_positions = int(image_mask.sum().item())
        num_features = 0 if image_features is None else image_features.shape[0]
        if num_positions != num_features:
            raise ValueError(
                f"input_ids contain {num_positions} image token positions "
                f"(image_token_id={self.config.image_token_id}) but {num_features} image "
                "features were given"
            )
        if image_features is not None and num_features:
            # Out of place so the embedding output (and its autograd graph) stays intact.
            x = x.masked_scatter(image_mask.unsqueeze(-1), image_features.to(x.dtype))
        positions = torch.arange(seq_len, device=input_ids.device)
        for layer in self.layers:
            x = layer(x, positions)
        out: Tensor = self.norm(x)
        return out


# Top level ---------------------------------------------------------------------


def num_image_tokens(config: DeepseekV41Config) -> int:
    """Image-token positions one image occupies in ``input_ids`` (after the aligner merge).

    Args:
        config: the model's configuration.

    Returns:
        The number of positions.
    """
    return config.image_tokens_per_image


class DeepseekV41ForCausalLM(nn.Module):
    """Vision tower + aligner + text decoder + LM head.

    Built eagerly (not on meta) it is initialised with
    [`init_parameters_`][model_deepseek_v41.modeling.init_parameters_] at seed 0, i.e. identical to
    ``build_deepseek_v41(config, seed=0)``.

    Args:
        config: the model's configuration.
    """

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.config = config
        self.vision = DeepseekV41VisionTower(config)
        self.aligner = DeepseekV41Aligner(config)
        self.model = DeepseekV41TextModel(config)
        self.lm_head = nn.Linear(config.text_hidden, config.vocab_size, bias=False)
        if not any(p.is_meta for p in self.parameters()):
            init_parameters_(self, 0)

    def init_weights(self, seed: int = 0) -> None:
        """Deterministic re-init of every parameter (see
        [`init_parameters_`][model_deepseek_v41.modeling.init_parameters_]).

        Args:
            seed: the generator's seed.
        """
        init_parameters_(self, seed)

    def forward(
        self,
        input_ids: Tensor,
        pixel_values: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        """Return the mean fp32 next-token loss if ``labels`` is given, else logits [B, S, V].

        ``pixel_values`` is [num_images, C, image_size, image_size]; image ``i``
        fills the ``i``-th run of ``num_image_tokens(config)`` image-token
        positions (row-major over the batch). ``None`` skips the vision tower.
        """
        image_features: Tensor | None = None
        if pixel_values is not None:
            cfg = self.config
            if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (
                cfg.in_channels,
                cfg.image_size,
                cfg.image_size,
            ):
                raise ValueError(
                    f"pixel_values must have shape [num_images, {cfg.in_channels}, "
                    f"{cfg.image_size}, {cfg.image_size}], got {tuple(pixel_values.shape)}"
                )
            # Check counts before paying for the vision tower.
            num_positions = int((input_ids == cfg.image_token_id).sum().item())
            num_features = pixel_values.shape[0] * num_image_tokens(cfg)
            if num_positions != num_features:
                raise ValueError(
                    f"input_ids contain {num_positions} image token positions but "
                    f"pixel_values give {num_features} image features "
                    f"({pixel_values.shape[0]} images x {num_image_tokens(cfg)} tokens)"
                )
            features = self.aligner(self.vision(pixel_values))
            image_features = features.reshape(-1, features.shape[-1])
        hidden = self.model(input_ids, image_features)
        logits: Tensor = self.lm_head(hidden)
        if labels is None:
            return logits
        vocab = logits.shape[-1]
        return functional.cross_entropy(
            logits[:, :-1].float().reshape(-1, vocab),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )


# Initialisation / construction ---------------------------------------------------


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (RMSNorm, TextRMSNorm))


def iter_initial_parameters(model: nn.Module, seed: int) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, full fp32 CPU tensor)`` in ``named_parameters()`` order.

    One CPU ``torch.Generator`` seeded with ``seed`` draws every random tensor
    at its full (global, for DTensor) shape, so values depend only on the
    seed and the layout -- never on the device, dtype or sharding. Norm weights
    are ones, biases zeros, every other weight ~ N(0, INIT_STD).

    Args:
        model: the reference model (plain or sharded).
        seed: the generator's seed.

    Yields:
        ``(name, tensor)`` per parameter.
    """
    owners: dict[str, tuple[nn.Module, str]] = {}
    for module_name, module in model.named_modules():
        for local_name, _ in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{local_name}" if module_name else local_name
            owners[full_name] = (module, local_name)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    for name, param in model.named_parameters():
        module, local_name = owners[name]
        shape = tuple(param.shape)
        if _is_norm(module):
            full = torch.ones(shape, dtype=torch.float32, device="cpu")
        elif local_name == "bias":
            full = torch.zeros(shape, dtype=torch.float32, device="cpu")
        else:
            full = torch.empty(shape, dtype=torch.float32, device="cpu")
            full.normal_(0.0, INIT_STD, generator=generator)
        yield name, full


def init_parameters_(model: nn.Module, seed: int) -> nn.Module:
    """(Re)initialise every parameter in place, deterministically from ``seed``.

    Full tensors come from
    [`iter_initial_parameters`][model_deepseek_v41.modeling.iter_initial_parameters] and are copied
    (cast) into the existing storage, so a CPU model, a meta-built model after ``to_empty``, a bf16
    model and a DTensor/FSDP2-sharded model all end up with the same values. Returns ``model`` for
    chaining.

    Args:
        model: the reference model, allocated (not on ``meta``).
        seed: the generator's seed.

    Returns:
        ``model``.

    Raises:
        ValueError: a parameter is still on the meta device.
    """
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in iter_initial_parameters(model, seed):
            param = params[name]
            if param.is_meta:
                raise ValueError(
                    f"parameter {name!r} is on the meta device; materialise the model "
                    "(e.g. model.to_empty(device=...)) before init_parameters_"
                )
            copy_full_into_(param, full)
    return model


def build_deepseek_v41(
    config: DeepseekV41Config,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> DeepseekV41ForCausalLM:
    """Build a model deterministically: same ``config``/``seed`` -> bit-identical parameters.

    Construction happens on meta (no wasted default init), then the model is
    cast to ``dtype`` (vision norms stay fp32), materialised on ``device`` and
    filled by [`init_parameters_`][model_deepseek_v41.modeling.init_parameters_]. ``device="meta"``
    stops before allocating anything.

    Args:
        config: the model's configuration.
        seed: the generator's seed.
        dtype: the floating dtype of the model (vision norms stay fp32).
        device: where the model is allocated (``"meta"``: nowhere).

    Returns:
        The model.

    Raises:
        TypeError: ``dtype`` is not a floating dtype.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(config)
    model.to(dtype=dtype)
    target = torch.device(device)
    if target.type == "meta":
        return model
    model.to_empty(device=target)
    init_parameters_(model, seed)
    return model


# Synthetic data ----------------------------------------------------------------


class Batch(TypedDict):
    """Keyword arguments for
    [`forward`][model_deepseek_v41.modeling.DeepseekV41ForCausalLM.forward]."""

    input_ids: Tensor
    pixel_values: Tensor | None
    labels: Tensor


def make_batch(
    config: DeepseekV41Config,
    *,
    batch_size: int,
    seq_len: int,
    num_images_per_sample: int = 1,
    seed: int = 0,
) -> Batch:
    """Deterministic synthetic batch (CPU) with image-token runs at random offsets.

    Every sample holds ``num_images_per_sample`` contiguous runs of
    ``num_image_tokens(config)`` image tokens; text tokens never equal the
    image token; labels mask image positions with -100. ``pixel_values`` is
    fp32 ``[batch_size * num_images_per_sample, C, H, W]`` or ``None`` for a
    text-only batch.

    Args:
        config: the model's configuration.
        batch_size: samples in the batch.
        seq_len: tokens per sample.
        num_images_per_sample: images per sample (0: a text-only batch).
        seed: the generator's seed.

    Returns:
        ``input_ids``, ``pixel_values`` and ``labels``.

    Raises:
        ValueError: a size is out of range, or the images do not fit ``seq_len``.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size={batch_size} must be > 0")
    if num_images_per_sample < 0:
        raise ValueError(f"num_images_per_sample={num_images_per_sample} must be >= 0")
    if not 0 < seq_len <= config.max_seq_len:
        raise ValueError(f"seq_len={seq_len} must be in [1, max_seq_len={config.max_seq_len}]")
    tokens_per_image = num_image_tokens(config)
    image_positions = num_images_per_sample * tokens_per_image
    if image_positions > seq_len:
        raise ValueError(
            f"seq_len={seq_len} cannot hold {num_images_per_sample} images x "
            f"{tokens_per_image} image tokens = {image_positions} positions"
        )
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    # Text tokens from the vocabulary minus the image token.
    text = torch.randint(
        0, config.vocab_size - 1, (batch_size, seq_len), generator=gen, device="cpu"
    )
    text = text + (text >= config.image_token_id).long()
    input_ids = text.clone()
    num_text = seq_len - image_positions
    for b in range(batch_size):
        # Sorted insertion points among the text tokens, one per image run.
        cuts = torch.randint(0, num_text + 1, (num_images_per_sample,), generator=gen, device="cpu")
        for i, cut in enumerate(sorted(int(c) for c in cuts)):
            start = cut + i * tokens_per_image
            input_ids[b, start : start + tokens_per_image] = config.image_token_id
    labels = input_ids.masked_fill(input_ids == config.image_token_id, IGNORE_INDEX)
    pixel_values: Tensor | None = None
    if num_images_per_sample:
        pixel_values = torch.randn(
            batch_size * num_images_per_sample,
            config.in_channels,
            config.image_size,
            config.image_size,
            generator=gen,
            device="cpu",
        )
    return Batch(input_ids=input_ids, pixel_values=pixel_values, labels=labels)
