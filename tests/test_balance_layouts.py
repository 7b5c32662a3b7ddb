"""Layout adapters on real transformers 5.24 towers (tiny configs, CPU, fp32): splitting a
call into items, encoding each item alone, and joining the pieces gives the full-batch
output, for calls made exactly as the VLMs make them."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import CLIPVisionConfig, CLIPVisionModel, SiglipVisionConfig, SiglipVisionModel
from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from multimodal_fsdp.balance import (
    BatchFirstLayout,
    FieldSpec,
    MediaCall,
    MediaItem,
    MediaLayout,
    PackedByGridLayout,
    media_layout_for,
    register_media_layout,
)
from multimodal_fsdp.balance import _arguments as arguments_module
from multimodal_fsdp.balance import registry as registry_module

VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
VISION_HEADS = {"num_attention_heads": 4, "image_size": 32, "patch_size": 8}


def _clip() -> nn.Module:
    return CLIPVisionModel(CLIPVisionConfig(**VISION, **VISION_HEADS)).eval()


def _siglip() -> nn.Module:
    return SiglipVisionModel(SiglipVisionConfig(**VISION, **VISION_HEADS)).eval()


def _idefics3() -> nn.Module:
    return Idefics3VisionTransformer(Idefics3VisionConfig(**VISION, **VISION_HEADS)).eval()


def _qwen2() -> nn.Module:
    config = Qwen2VLVisionConfig(
        depth=2, embed_dim=32, hidden_size=48, num_heads=4, patch_size=4, temporal_patch_size=2
    )
    return Qwen2VisionTransformerPretrainedModel(config).eval()


def _qwen25() -> nn.Module:
    config = Qwen2_5_VLVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        out_hidden_size=48,
        num_heads=4,
        patch_size=4,
        temporal_patch_size=2,
        window_size=16,
        fullatt_block_indexes=[1],
    )
    return Qwen2_5_VisionTransformerPretrainedModel(config).eval()


def _tensors(value: Any) -> list[Tensor]:
    """Every tensor of a nested output, in walk order (None fields skipped)."""
    if isinstance(value, Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _roundtrip(tower: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The full-batch output, and the output joined from items encoded one by one."""
    layout = media_layout_for(tower)
    with torch.no_grad():
        full = tower(*args, **kwargs)
        call = layout.split_call(tower, args, kwargs)
        pieces = []
        spec = None
        for item in call.items:
            item_args, item_kwargs = layout.build_call(call.spec, [item])
            spec, parts = layout.split_output(
                tower(*item_args, **item_kwargs), [item.fields[0].shape[0]]
            )
            pieces.extend(parts)
        assert spec is not None
        joined = layout.join_output(spec, pieces)
    return full, joined


def _assert_same(full: Any, joined: Any) -> None:
    assert type(joined) is type(full)
    expected, got = _tensors(full), _tensors(joined)
    assert len(got) == len(expected) > 0
    for a, b in zip(expected, got, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("build", [_clip, _siglip], ids=["clip", "siglip"])
def test_batch_first_llava_call_with_hidden_states(build: Callable[[], nn.Module]) -> None:
    """LLaVA: ``vision_tower(pixel_values, return_dict=True, output_hidden_states=True)``."""
    tower = build()
    pixels = torch.randn(3, 3, 32, 32)
    full, joined = _roundtrip(tower, (pixels,), {"return_dict": True, "output_hidden_states": True})
    assert full.hidden_states is not None
    assert len(full.hidden_states) == 3
    _assert_same(full, joined)
    assert media_layout_for(tower).name == "batch-first"


def test_batch_first_gemma3_and_paligemma_calls() -> None:
    """Gemma 3: ``vision_tower(pixel_values=..., return_dict=True)``; PaliGemma:
    ``vision_tower(pixel_values)``."""
    tower = _siglip()
    pixels = torch.randn(2, 3, 32, 32)
    _assert_same(*_roundtrip(tower, (), {"pixel_values": pixels, "return_dict": True}))
    _assert_same(*_roundtrip(tower, (pixels,), {}))


def test_batch_first_idefics3_splits_the_patch_mask_with_the_rows() -> None:
    """Idefics3/SmolVLM: ``vision_model(pixel_values=..., patch_attention_mask=...)``; a
    padded image's mask must travel with it."""
    tower = _idefics3()
    pixels = torch.randn(3, 3, 32, 32)
    mask = torch.ones(3, 4, 4, dtype=torch.bool)
    mask[1, 2:, :] = False
    call = BatchFirstLayout().split_call(
        tower, (), {"pixel_values": pixels, "patch_attention_mask": mask, "return_dict": True}
    )
    assert call.spec.fields == ("pixel_values", "patch_attention_mask")
    assert torch.equal(call.items[1].fields[1], mask[1:2])
    _assert_same(
        *_roundtrip(
            tower, (), {"pixel_values": pixels, "patch_attention_mask": mask, "return_dict": True}
        )
    )


@pytest.mark.parametrize("build", [_qwen2, _qwen25], ids=["qwen2-vl", "qwen2.5-vl"])
def test_packed_by_grid_images_and_videos(build: Callable[[], nn.Module]) -> None:
    """Qwen2-VL / Qwen2.5-VL: ``visual(pixel_values, grid_thw=...)``, an image and a video
    of different sizes; merged outputs have a quarter of the rows."""
    tower = build()
    grid = torch.tensor([[1, 4, 4], [2, 4, 8], [1, 8, 4]])
    patch_dim = 3 * 2 * 4 * 4
    pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim)
    layout = media_layout_for(tower)
    assert isinstance(layout, PackedByGridLayout)
    call = layout.split_call(tower, (pixels,), {"grid_thw": grid})
    assert [item.cost for item in call.items] == [16, 64, 32]
    assert [item.sizes for item in call.items] == [(1, 4, 4), (2, 4, 8), (1, 8, 4)]
    full, joined = _roundtrip(tower, (pixels,), {"grid_thw": grid})
    assert full.pooler_output.shape[0] == 112 // 4
    _assert_same(full, joined)


def test_build_call_from_items_of_several_calls() -> None:
    """Items from different calls (other ranks) rebuild one call whose output is theirs."""
    tower = _clip()
    layout = BatchFirstLayout()
    a, b = torch.randn(2, 3, 32, 32), torch.randn(1, 3, 32, 32)
    items = [
        *layout.split_call(tower, (a,), {}).items[1:],
        *layout.split_call(tower, (b,), {}).items,
    ]
    spec = layout.split_call(tower, (a,), {}).spec
    args, kwargs = layout.build_call(spec, items)
    with torch.no_grad():
        together = tower(*args, **kwargs).last_hidden_state
        alone = tower(torch.cat([a[1:], b])).last_hidden_state
    torch.testing.assert_close(together, alone)


def test_tuple_and_plain_tensor_outputs_round_trip() -> None:
    layout = BatchFirstLayout()
    x = torch.randn(4, 3)
    for output in (x, (x, x * 2), [x], {"a": x, "b": None}):
        spec, pieces = layout.split_output(output, [1, 1, 1, 1])
        assert len(pieces) == 4
        joined = layout.join_output(spec, pieces)
        assert type(joined) is type(output)
        assert all(
            torch.equal(t, u) for t, u in zip(_tensors(joined), _tensors(output), strict=True)
        )


def test_unsplittable_arguments_and_outputs_are_named() -> None:
    with pytest.raises(ValueError, match="'patch_attention_mask' has shape \\(3, 4, 4\\)"):
        BatchFirstLayout().split_call(
            _idefics3(),
            (),
            {
                "pixel_values": torch.randn(2, 3, 32, 32),
                "patch_attention_mask": torch.ones(3, 4, 4),
            },
        )
    with pytest.raises(ValueError, match="whole number of rows"):
        BatchFirstLayout().split_output(torch.randn(3, 2), [1, 1])
    qwen = _qwen2()
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match="gives 16 patches"):
        PackedByGridLayout().split_call(qwen, (torch.randn(15, 96),), {"grid_thw": grid})
    with pytest.raises(ValueError, match="tensor arguments \\['offsets'\\]"):
        PackedByGridLayout().split_call(
            _NamedPacked(), (torch.randn(16, 4),), {"grid_thw": grid, "offsets": torch.zeros(3)}
        )


class _NamedPacked(nn.Module):
    """A packed tower whose forward names a per-patch and a per-item tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(
        self,
        patches: Tensor,
        grid_thw: Tensor,
        weights: Tensor | None = None,
        scales: Tensor | None = None,
        offsets: Tensor | None = None,
    ) -> Tensor:
        out = self.proj(patches)
        if weights is not None:
            out = out * weights[:, None]
        if scales is not None:
            out = out * torch.repeat_interleave(scales, grid_thw.prod(-1))[:, None]
        return out


def test_packed_by_grid_splits_named_arguments_indexed_like_the_patches_or_items() -> None:
    """A named argument with one row per patch travels with its item's patches, one with
    one row per item with its grid row; items of two calls rebuild one call."""
    tower = _NamedPacked()
    layout = PackedByGridLayout()
    grids = torch.tensor([[1, 2, 2], [1, 2, 4]]), torch.tensor([[1, 4, 2]])
    calls = [
        {"grid_thw": g, "weights": torch.rand(int(g.prod(-1).sum())), "scales": torch.rand(len(g))}
        for g in grids
    ]
    pixels = [torch.randn(int(g.prod(-1).sum()), 4) for g in grids]
    split = [layout.split_call(tower, (p,), c) for p, c in zip(pixels, calls, strict=True)]
    assert split[0].spec.fields == ("patches", "grid_thw", "weights", "scales")
    assert [item.fields[2].shape[0] for item in split[0].items] == [4, 8]
    items = [*split[0].items[1:], *split[1].items]
    args, kwargs = layout.build_call(split[0].spec, items)
    with torch.no_grad():
        together = tower(*args, **kwargs)
        alone = torch.cat([tower(p, **c) for p, c in zip(pixels, calls, strict=True)])[4:]
    torch.testing.assert_close(together, alone)
    item = split[0].items[1]  # a placeholder of it (a rank that encodes none) runs too
    fields = [FieldSpec(t.dtype, tuple(t.shape[1:]), t.shape[0]) for t in item.fields]
    stand_in = layout.placeholder(split[0].spec, fields, item.sizes)
    assert [t.shape for t in stand_in.fields] == [t.shape for t in item.fields]
    args, kwargs = layout.build_call(split[0].spec, [stand_in])
    assert tower(*args, **kwargs).shape == (8, 4)


def test_tensors_forwarded_through_kwargs_are_left_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers models forward their own keyword arguments to every submodule:
    Qwen2-VL's tower gets a precomputed ``cu_seqlens`` (computed again from the balanced
    call's grid) and Gemma 3's SigLIP tower the text's ``mm_token_type_ids`` (never read),
    here with one image per call and texts of different lengths. Before, the first was
    refused at the call ("cannot split the precomputed tensor arguments") and the second
    was cut as one row per image, which two calls' rows cannot rebuild."""
    qwen = _qwen2()
    grid = torch.tensor([[1, 4, 4], [1, 4, 8]])
    pixels = torch.randn(48, 96)
    precomputed = {"grid_thw": grid, "cu_seqlens": torch.tensor([0, 16, 48], dtype=torch.int32)}
    call = PackedByGridLayout().split_call(qwen, (pixels,), precomputed)
    assert call.spec.fields == ("hidden_states", "grid_thw")
    _assert_same(*_roundtrip(qwen, (pixels,), precomputed))
    monkeypatch.setattr(arguments_module, "_LOGGED", set())
    caplog.set_level(logging.INFO, logger=arguments_module.__name__)
    siglip = _siglip()
    layout = BatchFirstLayout()
    images = torch.randn(1, 3, 32, 32), torch.randn(1, 3, 32, 32)
    texts = torch.zeros(1, 7, dtype=torch.int), torch.ones(1, 9, dtype=torch.int)
    split = [
        layout.split_call(siglip, (), {"pixel_values": p, "mm_token_type_ids": t})
        for p, t in zip(images, texts, strict=True)
    ]
    assert split[0].spec.fields == ("pixel_values",)
    left_out = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(left_out) == 1  # once per tower class, not per call
    assert "['mm_token_type_ids'] reach SiglipVisionModel.forward" in left_out[0]
    args, kwargs = layout.build_call(split[0].spec, [*split[0].items, *split[1].items])
    with torch.no_grad():
        together = siglip(*args, **kwargs).last_hidden_state
        alone = siglip(torch.cat(images)).last_hidden_state
    torch.testing.assert_close(together, alone)


class _Odd(nn.Module):
    def forward(self, frames: Tensor, lengths: Tensor) -> Tensor:
        return frames


def test_unknown_tower_names_class_signature_and_the_remedy() -> None:
    """``batch-first`` applies to any forward, but its probe cannot make an input for a
    tower without weights or config, and its first argument is not ``pixel_values``."""
    with pytest.raises(ValueError, match="no media layout fits") as error:
        media_layout_for(_Odd())
    message = str(error.value)
    assert "_Odd" in message
    assert "(frames: 'Tensor', lengths: 'Tensor')" in message
    assert "register_media_layout" in message
    choices = "'batch-first', 'packed-by-grid', 'packed-by-length', 'packed-by-size', 'tiled'"
    with pytest.raises(ValueError, match=f"valid choices: \\[{choices}\\]"):
        media_layout_for(_clip(), name="nope")


def test_a_registered_layout_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "_REGISTERED", [])

    class FramesLayout(MediaLayout):
        name = "frames"

        def applies_to(self, tower: nn.Module) -> bool:
            return isinstance(tower, _Odd)

        def split_call(self, tower: nn.Module, args: Any, kwargs: Any) -> MediaCall:
            frames = args[0]
            return MediaCall(
                spec=BatchFirstLayout().split_call(_clip(), (frames,), {}).spec,
                items=tuple(
                    MediaItem(fields=(frames[i : i + 1],), cost=1) for i in range(len(frames))
                ),
            )

    register_media_layout(FramesLayout())
    assert media_layout_for(_Odd()).name == "frames"
    with pytest.raises(TypeError, match="MediaLayout instance"):
        register_media_layout("frames")  # type: ignore[arg-type]
