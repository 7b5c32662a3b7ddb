"""Unit tests for the DeepSeek-V4.1 reference model (tiny sizes, CPU only)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from model_deepseek_v41.config import DeepseekV41Config
from model_deepseek_v41.layers import RMSNorm, TextRMSNorm
from model_deepseek_v41.modeling import (
    DeepseekV41ForCausalLM,
    build_deepseek_v41,
    init_parameters_,
    iter_initial_parameters,
    make_batch,
    num_image_tokens,
)

TINY = DeepseekV41Config.tiny()


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach() for name, p in model.named_parameters()}


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    pa, pb = _params(a), _params(b)
    assert list(pa) == list(pb)
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        assert torch.equal(pa[name], pb[name]), name


# Config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"image_size": 30}, r"image_size=30 must be divisible by patch_size=8"),
        ({"vision_heads": 3}, r"vision_hidden=64 must be divisible by vision_heads=3"),
        ({"vision_hidden": 24, "vision_heads": 4}, r"= 6 \(vision head dim\).*divisible by 4"),
        ({"text_heads": 5}, r"text_hidden=64 must be divisible by text_heads=5"),
        ({"text_hidden": 12, "text_heads": 4}, r"= 3 \(text head dim\) must be even"),
        ({"image_token_id": 512}, r"image_token_id=512 must be in \[0, vocab_size=512\)"),
        ({"image_token_id": -1}, r"image_token_id=-1 must be in \[0, vocab_size=512\)"),
        ({"vision_layers": 0}, r"vision_layers=0 must be > 0"),
        ({"text_intermediate": -4}, r"text_intermediate=-4 must be > 0"),
        ({"norm_eps": 0.0}, r"norm_eps=0.0 must be a finite number > 0"),
        ({"rope_theta": float("inf")}, r"rope_theta=inf must be a finite number > 0"),
        ({"downsample_ratio": 5}, r"downsample_ratio=5 must be <= the patch grid side .* = 4"),
        ({"max_seq_len": 3}, r"max_seq_len=3 must be >= the tokens per image \(4\)"),
        ({"vocab_size": 1, "image_token_id": 0}, r"vocab_size=1 must be >= 2"),
    ],
)
def test_config_rejects_bad_sizes(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DeepseekV41Config.tiny(**overrides)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"image_size": "32"}, r"image_size must be an int, got str \('32'\)"),
        ({"vision_layers": 2.0}, r"vision_layers must be an int, got float"),
        ({"text_layers": True}, r"text_layers must be an int, got bool"),
        ({"norm_eps": "1e-6"}, r"norm_eps must be a float, got str"),
    ],
)
def test_config_rejects_bad_types(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        DeepseekV41Config.tiny(**overrides)


def test_config_replace_revalidates_and_is_frozen() -> None:
    deeper = dataclasses.replace(TINY, vision_layers=5)
    assert deeper.vision_layers == 5
    assert TINY.replace(text_layers=3).text_layers == 3
    with pytest.raises(ValueError, match="vision_layers=0"):
        TINY.replace(vision_layers=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TINY.vision_layers = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown DeepseekV41Config preset 'huge'"):
        DeepseekV41Config.preset("huge")


@pytest.mark.parametrize(
    ("name", "expected", "tokens"),
    [("tiny", 264_128, 4), ("small", 31_871_488, 49), ("base", 309_538_304, 144)],
)
def test_preset_parameter_counts(name: str, expected: int, tokens: int) -> None:
    config = DeepseekV41Config.preset(name)
    model = build_deepseek_v41(config, device="meta")
    assert sum(p.numel() for p in model.parameters()) == expected == config.num_parameters()
    assert num_image_tokens(config) == tokens


def test_num_parameters_tracks_layer_overrides() -> None:
    config = DeepseekV41Config.base(vision_layers=2, text_layers=3)
    model = build_deepseek_v41(config, device="meta")
    assert len(model.vision.blocks) == 2
    assert len(model.model.layers) == 3
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


# Layout / construction ---------------------------------------------------------------


def test_module_layout() -> None:
    model = build_deepseek_v41(TINY, device="meta")
    names = dict(model.named_modules())
    for name in [
        "vision.patch_embed.proj",
        "vision.blocks.0.norm1",
        "vision.blocks.0.attn",
        "vision.blocks.0.attn.qkv",
        "vision.blocks.0.attn.proj",
        "vision.blocks.0.norm2",
        "vision.blocks.0.mlp",
        "vision.blocks.1.mlp.down",
        "vision.norm",
        "aligner",
        "aligner.fc1",
        "aligner.fc2",
        "model.embed_tokens",
        "model.layers",
        "model.layers.1.self_attn",
        "model.norm",
        "lm_head",
    ]:
        assert name in names, name
    assert isinstance(names["vision.patch_embed.proj"], nn.Linear)
    assert isinstance(names["vision.blocks"], nn.ModuleList)
    assert isinstance(names["model.layers"], nn.ModuleList)
    for name, module in names.items():
        if isinstance(module, RMSNorm):
            assert name.startswith("vision."), name
    assert isinstance(names["model.norm"], TextRMSNorm)


def test_build_is_deterministic() -> None:
    a = build_deepseek_v41(TINY, seed=7)
    b = build_deepseek_v41(TINY, seed=7)
    _assert_same_params(a, b)
    c = build_deepseek_v41(TINY, seed=8)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    # Eager construction equals the seed-0 build.
    _assert_same_params(DeepseekV41ForCausalLM(TINY), build_deepseek_v41(TINY, seed=0))


def test_build_ignores_ambient_default_device() -> None:
    """Init and batches draw on CPU explicitly, so a torch.device context cannot change them."""
    with torch.device("meta"):
        model = build_deepseek_v41(TINY, seed=2, device="cpu")
        batch = make_batch(TINY, batch_size=1, seq_len=8, num_images_per_sample=1, seed=2)
    _assert_same_params(model, build_deepseek_v41(TINY, seed=2))
    assert batch["input_ids"].device.type == "cpu"
    assert batch["pixel_values"] is not None
    assert batch["pixel_values"].device.type == "cpu"


def test_init_values() -> None:
    model = build_deepseek_v41(TINY, seed=1)
    assert torch.equal(
        model.get_parameter("vision.blocks.0.norm1.weight"), torch.ones(TINY.vision_hidden)
    )
    assert torch.equal(model.model.norm.weight, torch.ones(TINY.text_hidden))
    assert torch.count_nonzero(model.get_parameter("vision.blocks.0.attn.qkv.bias")) == 0
    std = model.model.embed_tokens.weight.std().item()
    assert 0.018 < std < 0.022


def test_meta_build_allocates_nothing_then_materialises_equal() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        meta = build_deepseek_v41(TINY, seed=3, dtype=dtype, device="meta")
        assert all(p.is_meta for p in meta.parameters())
        assert all(b.is_meta for b in meta.buffers())
        with pytest.raises(ValueError, match="is on the meta device"):
            init_parameters_(meta, 3)
        meta.to_empty(device="cpu")
        init_parameters_(meta, 3)
        _assert_same_params(meta, build_deepseek_v41(TINY, seed=3, dtype=dtype))


def test_init_does_not_depend_on_dtype() -> None:
    fp32 = build_deepseek_v41(TINY, seed=4)
    bf16 = build_deepseek_v41(TINY, seed=4, dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters(), strict=True):
        assert torch.equal(a.to(b.dtype), b), name
    full = dict(iter_initial_parameters(bf16, 4))
    assert all(t.dtype == torch.float32 for t in full.values())
    assert torch.equal(full["lm_head.weight"], fp32.lm_head.weight)


# fp32 norm pinning -----------------------------------------------------------------


def test_vision_norms_stay_fp32_under_casts() -> None:
    model = build_deepseek_v41(TINY)
    odd = 1.0 + 2.0**-12  # not representable in bf16/fp16
    with torch.no_grad():
        model.vision.norm.weight.fill_(odd)
    casts: list[Callable[[nn.Module], nn.Module]] = [
        lambda m: m.to(torch.bfloat16),
        lambda m: m.bfloat16(),
        lambda m: m.half(),
        lambda m: m.to("cpu", torch.float16),
    ]
    for cast in casts:
        cast(model)
        for name, p in model.named_parameters():
            is_vision_norm = name.startswith("vision.") and ".norm" in f".{name}"
            if is_vision_norm:
                assert p.dtype == torch.float32, name
            else:
                assert p.dtype in (torch.bfloat16, torch.float16), name
        assert torch.all(model.vision.norm.weight == odd)
    # Checkpoints keep the fp32 norm values too.
    assert model.state_dict()["vision.norm.weight"].dtype == torch.float32


def test_pinned_norm_device_moves_and_meta_roundtrip() -> None:
    norm = RMSNorm(8)
    norm.to(device="meta", dtype=torch.bfloat16)
    assert norm.weight.is_meta
    assert norm.weight.dtype == torch.float32
    norm.to_empty(device="cpu")
    norm.reset_parameters()
    assert norm.weight.device.type == "cpu"
    assert norm.weight.dtype == torch.float32
    assert torch.equal(norm.weight, torch.ones(8))
    # Gradients follow the same rule.
    norm(torch.randn(2, 8)).sum().backward()
    norm.bfloat16()
    assert norm.weight.grad is not None
    assert norm.weight.grad.dtype == torch.float32
    text_norm = TextRMSNorm(8).bfloat16()
    assert text_norm.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("norm_cls", [RMSNorm, TextRMSNorm])
def test_norm_computes_in_fp32_and_returns_input_dtype(
    norm_cls: type[RMSNorm] | type[TextRMSNorm],
) -> None:
    torch.manual_seed(0)
    norm = norm_cls(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
    norm.bfloat16()
    x = torch.randn(3, 16).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    xf = x.float()
    w = norm.weight.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).bfloat16()
    assert torch.equal(out, ref)


# Forward / backward ----------------------------------------------------------------


def test_fp32_forward_logits_and_loss() -> None:
    model = build_deepseek_v41(TINY)
    batch = make_batch(TINY, batch_size=2, seq_len=24, num_images_per_sample=2, seed=0)
    logits = model(batch["input_ids"], batch["pixel_values"])
    assert logits.shape == (2, 24, TINY.vocab_size)
    assert logits.dtype == torch.float32
    loss = model(**batch)
    assert loss.dim() == 0
    assert 5.5 < loss.item() < 7.0  # ~ln(vocab) at init


def test_bf16_forward_backward_end_to_end() -> None:
    model = build_deepseek_v41(TINY, dtype=torch.bfloat16)
    batch = make_batch(TINY, batch_size=2, seq_len=24, num_images_per_sample=1, seed=1)
    logits = model(batch["input_ids"], batch["pixel_values"])
    assert logits.dtype == torch.bfloat16
    loss = model(**batch)
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.dtype == p.dtype, name
        assert torch.isfinite(p.grad).all(), name
    assert model.vision.patch_embed.proj.weight.grad is not None
    assert model.vision.patch_embed.proj.weight.grad.abs().sum() > 0


def test_text_only_batch_skips_vision_tower() -> None:
    model = build_deepseek_v41(TINY)
    calls: list[str] = []
    model.vision.register_forward_pre_hook(lambda *_: calls.append("vision"))
    model.aligner.register_forward_pre_hook(lambda *_: calls.append("aligner"))
    batch = make_batch(TINY, batch_size=2, seq_len=16, num_images_per_sample=0, seed=2)
    assert batch["pixel_values"] is None
    loss = model(**batch)
    assert torch.isfinite(loss)
    assert calls == []
    loss.backward()
    assert model.vision.patch_embed.proj.weight.grad is None
    image_batch = make_batch(TINY, batch_size=1, seq_len=16, num_images_per_sample=1, seed=2)
    model(**image_batch)
    assert calls == ["vision", "aligner"]


def test_image_token_count_mismatch() -> None:
    model = build_deepseek_v41(TINY)
    batch = make_batch(TINY, batch_size=2, seq_len=24, num_images_per_sample=2, seed=3)
    pixels = batch["pixel_values"]
    assert pixels is not None
    with pytest.raises(ValueError, match=r"16 image token positions .* 12 image features"):
        model(batch["input_ids"], pixels[:3])
    with pytest.raises(ValueError, match=r"16 image token positions .* 0 image features"):
        model(batch["input_ids"], None)
    with pytest.raises(ValueError, match=r"pixel_values must have shape"):
        model(batch["input_ids"], pixels[..., :16])


def test_image_features_land_on_image_positions() -> None:
    model = build_deepseek_v41(TINY)
    batch = make_batch(TINY, batch_size=2, seq_len=20, num_images_per_sample=1, seed=4)
    pixels = batch["pixel_values"]
    assert pixels is not None
    base = model(batch["input_ids"], pixels)
    changed = pixels.clone()
    changed[1] += 1.0  # only the second sample's image
    out = model(batch["input_ids"], changed)
    assert torch.equal(out[0], base[0])
    first_image = int((batch["input_ids"][1] == TINY.image_token_id).nonzero()[0])
    assert torch.equal(out[1, :first_image], base[1, :first_image])  # causal
    assert not torch.allclose(out[1, first_image:], base[1, first_image:])


def test_vision_attention_is_bidirectional_and_aligner_pads() -> None:
    config = DeepseekV41Config.tiny(image_size=24)  # 3x3 patch grid -> padded to 4x4
    assert num_image_tokens(config) == 4
    model = build_deepseek_v41(config)
    pixels = torch.randn(1, 3, 24, 24)
    grid = model.vision(pixels)
    assert grid.shape == (1, 3, 3, config.vision_hidden)
    changed = pixels.clone()
    changed[..., 16:, 16:] += 1.0  # last patch only
    assert not torch.allclose(model.vision(changed)[0, 0, 0], grid[0, 0, 0])
    assert model.aligner(grid).shape == (4, config.text_hidden)
    batch = make_batch(config, batch_size=1, seq_len=12, num_images_per_sample=2)
    assert torch.isfinite(model(**batch))


def test_make_batch_is_deterministic_and_well_formed() -> None:
    a = make_batch(TINY, batch_size=3, seq_len=30, num_images_per_sample=2, seed=9)
    b = make_batch(TINY, batch_size=3, seq_len=30, num_images_per_sample=2, seed=9)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["labels"], b["labels"])
    assert a["pixel_values"] is not None
    assert b["pixel_values"] is not None
    assert torch.equal(a["pixel_values"], b["pixel_values"])
    assert a["pixel_values"].shape == (6, 3, 32, 32)
    is_image = a["input_ids"] == TINY.image_token_id
    assert is_image.sum(dim=1).tolist() == [8, 8, 8]
    assert torch.equal(a["labels"] == -100, is_image)
    assert torch.equal(a["labels"][~is_image], a["input_ids"][~is_image])
    with pytest.raises(ValueError, match="cannot hold 3 images"):
        make_batch(TINY, batch_size=1, seq_len=10, num_images_per_sample=3)
    with pytest.raises(ValueError, match="max_seq_len=128"):
        make_batch(TINY, batch_size=1, seq_len=129)


def test_init_parameters_on_fsdp2_sharded_model(tmp_path: Path) -> None:
    """The DTensor path: meta build -> fully_shard -> to_empty -> init equals a CPU build."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs a fresh torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = build_deepseek_v41(TINY, device="meta")
        for block in model.vision.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        init_parameters_(model, 11)
        reference = build_deepseek_v41(TINY, seed=11)
        for (name, p), (_, q) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert torch.equal(p.full_tensor(), q), name  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()
