"""Layouts of tower families whose items have sizes of their own: ``packed-by-size``
(Pixtral), ``packed-by-length`` (Qwen2.5-Omni's audio encoder) and ``tiled`` (Mllama).

Items travel as rows of fixed shape (a patch, a mel frame, an image's tiles), so items
of different sizes from different ranks meet in one call; ``build_call`` pads them
again as the tower expects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from multimodal_fsdp.balance._arguments import (
    arguments_by_name,
    call_spec,
    forward_signature,
    scalar_arguments,
    scalar_rows,
)
from multimodal_fsdp.balance._probe_inputs import config_value, floating_dtype
from multimodal_fsdp.balance._tree import put_tensors_back, take_tensors_out
from multimodal_fsdp.balance.layouts import (
    CallSpec,
    FieldSpec,
    MediaCall,
    MediaItem,
    MediaLayout,
    OutputSpec,
    ProbeCall,
    RowRule,
)

__all__ = ["PackedBySizeLayout", "PackedByLengthLayout", "TiledLayout"]


def _refuse_others(
    layout: str, tower: nn.Module, named: Mapping[str, Any], known: Sequence[str]
) -> list[str]:
    """The call's scalar arguments; other tensor arguments the layout does not know are
    an error naming them (they may hold per-item data it cannot cut)."""
    scalars = [n for n in scalar_arguments(named) if n not in known]
    others = sorted(
        n for n, v in named.items() if isinstance(v, Tensor) and n not in known and n not in scalars
    )
    if others:
        raise ValueError(
            f"the {layout!r} layout cannot split the tensor arguments {others} of "
            f"{type(tower).__name__}.forward; register a layout adapter that knows them "
            "(register_media_layout)"
        )
    return scalars


# --------------------------------------------------------------------------- Pixtral
class PackedBySizeLayout(MediaLayout):
    """Pixtral (Mistral 3, LLaVA with a Pixtral tower): ``vision_tower(pixel_values,
    image_sizes=...)``, images padded to the largest, every image's patch tokens packed
    into one ``(1, tokens, D)`` output. An item is one image as rows of whole patches
    (``(patches, C, p, p)``: cropped pixels never travel), its sizes the patch grid, its
    cost the patches; its output is one token per patch along dim 1.

    Args:
        patch: the tower's patch size (``bind`` reads it from the tower when None).
    """

    name: ClassVar[str] = "packed-by-size"
    pixel_argument: ClassVar[str] = "pixel_values"
    sizes_argument: ClassVar[str] = "image_sizes"

    def __init__(self, patch: int | None = None) -> None:
        self.patch = patch

    def applies_to(self, tower: nn.Module) -> bool:
        params = forward_signature(tower).parameters
        return (
            self.pixel_argument in params
            and self.sizes_argument in params
            and isinstance(config_value(tower, "patch_size"), int)
        )

    def bind(self, tower: nn.Module) -> MediaLayout:
        patch = config_value(tower, "patch_size")
        return PackedBySizeLayout(patch if isinstance(patch, int) else None)

    def _patch(self) -> int:
        if self.patch is None:
            raise ValueError(
                f"the {self.name!r} layout needs the tower's patch size: get it with "
                "media_layout_for(tower) (which binds it to the tower)"
            )
        return self.patch

    def item_axis(self, leaf: Tensor, items: int) -> int:
        return 1 if leaf.dim() >= 2 and leaf.shape[0] == 1 else 0

    def probe_calls(self, tower: nn.Module) -> Sequence[tuple[ProbeCall, ProbeCall]]:
        """An image of 2 x 2 patches and one of 2 x 3, padded to 2 x 3."""
        patch = config_value(tower, "patch_size")
        if not isinstance(patch, int):
            return ()
        channels = int(config_value(tower, "num_channels", "in_channels") or 3)
        generator = torch.Generator().manual_seed(0)
        pixels = torch.randn((2, channels, 2 * patch, 3 * patch), generator=generator)
        pixels = pixels.to(floating_dtype(tower))
        sizes = torch.tensor([[2 * patch, 2 * patch], [2 * patch, 3 * patch]])
        first = pixels[:1, :, :, : 2 * patch]
        return [
            (
                ProbeCall((), {self.pixel_argument: first, self.sizes_argument: sizes[:1]}),
                ProbeCall((), {self.pixel_argument: pixels, self.sizes_argument: sizes}),
            )
        ]

    def split_call(
        self, tower: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> MediaCall:
        named = arguments_by_name(tower, args, kwargs)
        patch = self.patch or config_value(tower, "patch_size")
        if not isinstance(patch, int):
            raise ValueError(f"the {self.name!r} layout needs the patch size of the tower")
        pixels = named.get(self.pixel_argument)
        if not isinstance(pixels, Tensor) or pixels.dim() != 4:
            shape = tuple(pixels.shape) if isinstance(pixels, Tensor) else type(pixels).__name__
            raise TypeError(
                f"the {self.name!r} layout needs {self.pixel_argument} of shape "
                f"(images, channels, height, width), got {shape}"
            )
        count, channels, height, width = pixels.shape
        given = named.get(self.sizes_argument)
        given = given.tolist() if isinstance(given, Tensor) else given
        sizes = (
            [(int(h), int(w)) for h, w in given] if given is not None else [(height, width)] * count
        )
        if len(sizes) != count:
            raise ValueError(
                f"{self.sizes_argument} gives {len(sizes)} sizes for {count} images of "
                f"{self.pixel_argument}"
            )
        cut = (self.pixel_argument, self.sizes_argument)
        scalars = _refuse_others(self.name, tower, named, cut)
        extra = scalar_rows(named, scalars)
        items = []
        for index, (h, w) in enumerate(sizes):
            hp, wp = h // patch, w // patch
            if hp < 1 or wp < 1 or hp * patch > height or wp * patch > width:
                raise ValueError(
                    f"image {index} of size {(h, w)} has no whole patch of {patch} pixels "
                    f"inside the padded {(height, width)}"
                )
            crop = pixels[index, :, : hp * patch, : wp * patch]
            rows = (
                crop.reshape(channels, hp, patch, wp, patch)
                .permute(1, 3, 0, 2, 4)
                .reshape(hp * wp, channels, patch, patch)
            )
            items.append(MediaItem(fields=(rows, *extra), cost=hp * wp, sizes=(hp, wp)))
        spec = call_spec(tower, self.name, named, cut[:1], scalars, rebuilt=cut[1:])
        return MediaCall(spec=spec, items=tuple(items))

    def build_call(
        self, spec: CallSpec, items: Sequence[MediaItem]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not items:
            raise ValueError("build_call needs at least one item")
        patch = self._patch()
        tall = max(item.sizes[0] for item in items) * patch
        wide = max(item.sizes[1] for item in items) * patch
        images = []
        for item in items:
            hp, wp = item.sizes[0], item.sizes[1]
            rows = item.fields[0]
            channels = rows.shape[1]
            image = (
                rows.reshape(hp, wp, channels, patch, patch)
                .permute(2, 0, 3, 1, 4)
                .reshape(channels, hp * patch, wp * patch)
            )
            images.append(
                torch.nn.functional.pad(image, (0, wide - wp * patch, 0, tall - hp * patch))
            )
        sizes = torch.tensor(
            [[item.sizes[0] * patch, item.sizes[1] * patch] for item in items],
            device=items[0].fields[0].device,
        )
        fields = {self.pixel_argument: torch.stack(images), self.sizes_argument: sizes}
        return self._arguments(spec, items, fields)


# ---------------------------------------------------------------- Qwen2.5-Omni audio
LengthsFn = Callable[[Tensor], tuple[Tensor, Tensor]]


class PackedByLengthLayout(MediaLayout):
    """Qwen2.5-Omni's audio encoder: ``audio_tower(input_features, feature_lens=...,
    aftercnn_lens=...)``, every clip's mel frames concatenated (``(mel, frames)``). An
    item is one clip as rows of frames (``(frames, mel)``) with its lengths, its cost the
    frames; its output rows follow the tower's ``_get_feat_extract_output_lengths`` (its
    convolutions and pooling) when it has one, else are proportional.

    Args:
        lengths: a clip's output tokens from its frames (``bind`` takes the tower's own
            rule when None).
    """

    name: ClassVar[str] = "packed-by-length"
    lengths_argument: ClassVar[str] = "feature_lens"
    after_argument: ClassVar[str] = "aftercnn_lens"

    def __init__(self, lengths: LengthsFn | None = None) -> None:
        self.lengths = lengths

    def applies_to(self, tower: nn.Module) -> bool:
        params = list(forward_signature(tower).parameters)
        return bool(params) and self.lengths_argument in params[1:]

    def bind(self, tower: nn.Module) -> MediaLayout:
        lengths = getattr(tower, "_get_feat_extract_output_lengths", None)
        return PackedByLengthLayout(lengths if callable(lengths) else None)

    def _lengths(self, frames: int) -> tuple[int, int]:
        if self.lengths is None:
            raise ValueError(f"the {self.name!r} layout is not bound to a tower's lengths")
        after, tokens = self.lengths(torch.tensor([frames]))
        return int(after.reshape(-1)[0]), int(tokens.reshape(-1)[0])

    def row_rules(self) -> Sequence[RowRule]:
        if self.lengths is None:
            return ()
        return (
            RowRule("the encoder's tokens per clip", lambda frames: self._lengths(frames)[1]),
            RowRule(
                "the encoder's frames after its convolutions",
                lambda frames: self._lengths(frames)[0],
            ),
        )

    def probe_calls(self, tower: nn.Module) -> Sequence[tuple[ProbeCall, ProbeCall]]:
        """Clips of 8 and 12 mel frames."""
        mel = config_value(tower, "num_mel_bins")
        if not isinstance(mel, int):
            return ()
        generator = torch.Generator().manual_seed(0)
        features = torch.randn((mel, 20), generator=generator).to(floating_dtype(tower))
        lens = torch.tensor([8, 12])
        first = next(iter(forward_signature(tower).parameters))
        calls = []
        for count in (1, 2):
            kwargs: dict[str, Any] = {self.lengths_argument: lens[:count]}
            if self.lengths is not None:
                kwargs[self.after_argument] = self.lengths(lens[:count])[0]
            kwargs[first] = features[:, : int(lens[:count].sum())]
            calls.append(ProbeCall((), kwargs))
        return [(calls[0], calls[1])]

    def split_call(
        self, tower: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> MediaCall:
        named = arguments_by_name(tower, args, kwargs)
        first = next(iter(forward_signature(tower).parameters))
        features, lens = named.get(first), named.get(self.lengths_argument)
        if not isinstance(features, Tensor) or features.dim() != 2:
            shape = (
                tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
            )
            raise TypeError(
                f"the {self.name!r} layout needs {first} of shape (mel bins, frames), got {shape}"
            )
        if not isinstance(lens, Tensor) or lens.dim() != 1:
            raise ValueError(
                f"the {self.name!r} layout needs {self.lengths_argument} as a 1-d tensor of "
                "frames per clip"
            )
        frames = [int(n) for n in lens.tolist()]
        if sum(frames) != features.shape[1] or any(n < 1 for n in frames):
            raise ValueError(
                f"{self.lengths_argument} gives {frames} frames but {first} has {features.shape[1]}"
            )
        after = named.get(self.after_argument)
        cut = [first, self.lengths_argument]
        if isinstance(after, Tensor):
            if after.shape[:1] != lens.shape:
                raise ValueError(
                    f"{self.after_argument} has shape {tuple(after.shape)}, not one value per "
                    f"clip of {self.lengths_argument}"
                )
            cut.append(self.after_argument)
        scalars = _refuse_others(self.name, tower, named, cut)
        extra = scalar_rows(named, scalars)
        items = []
        offset = 0
        for index, length in enumerate(frames):
            rows = features[:, offset : offset + length].transpose(0, 1)
            offset += length
            side = [named[n][index : index + 1] for n in cut[1:]]
            items.append(MediaItem(fields=(rows, *side, *extra), cost=length, sizes=(length,)))
        return MediaCall(call_spec(tower, self.name, named, cut, scalars), tuple(items))

    def build_call(
        self, spec: CallSpec, items: Sequence[MediaItem]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not items:
            raise ValueError("build_call needs at least one item")
        fields: dict[str, Any] = {}
        for index, name in enumerate(spec.fields):
            if name in spec.scalars:
                continue
            joined = torch.cat([item.fields[index] for item in items], dim=0)
            fields[name] = joined.transpose(0, 1).contiguous() if index == 0 else joined
        return self._arguments(spec, items, fields)

    def placeholder(
        self, spec: CallSpec, fields: Sequence[FieldSpec], sizes: tuple[int, ...]
    ) -> MediaItem:
        """Zero frames, with the lengths of a real clip of as many frames."""
        item = super().placeholder(spec, fields, sizes)
        frames = fields[0].rows
        values = list(item.fields)
        for index, name in enumerate(spec.fields[1:], start=1):
            if name == self.lengths_argument:
                values[index] = torch.full((1,), frames, dtype=fields[index].dtype)
            elif name == self.after_argument and self.lengths is not None:
                after = self._lengths(frames)[0]
                values[index] = torch.full((1,), after, dtype=fields[index].dtype)
        return MediaItem(fields=tuple(values), cost=item.cost, sizes=item.sizes)


# ---------------------------------------------------------------------------- Mllama
class TiledLayout(MediaLayout):
    """Mllama: ``vision_model(pixel_values, aspect_ratio_ids, aspect_ratio_mask)`` with
    ``pixel_values`` of shape ``(batch, images, tiles, C, H, W)`` and an output of
    ``(batch, images, tiles, patches, D)``. An item is one sample (its images as rows,
    with their ids and masks; its cost its pixels); a call pads its samples again to the
    most images there, as the processor does (zeros)."""

    name: ClassVar[str] = "tiled"
    pixel_argument: ClassVar[str] = "pixel_values"
    ids_argument: ClassVar[str] = "aspect_ratio_ids"
    mask_argument: ClassVar[str] = "aspect_ratio_mask"

    def applies_to(self, tower: nn.Module) -> bool:
        params = forward_signature(tower).parameters
        return all(n in params for n in (self.pixel_argument, self.ids_argument))

    def probe_calls(self, tower: nn.Module) -> Sequence[tuple[ProbeCall, ProbeCall]]:
        """Two samples of one image with every tile."""
        size = config_value(tower, "image_size")
        if not isinstance(size, int):
            return ()
        channels = int(config_value(tower, "num_channels") or 3)
        tiles = int(config_value(tower, "max_num_tiles") or 1)
        generator = torch.Generator().manual_seed(0)
        pixels = torch.randn((2, 1, tiles, channels, size, size), generator=generator)
        named = {
            self.pixel_argument: pixels.to(floating_dtype(tower)),
            self.ids_argument: torch.ones((2, 1), dtype=torch.long),
            self.mask_argument: torch.ones((2, 1, tiles), dtype=torch.long),
        }
        return [
            (
                ProbeCall((), {k: v[:1] for k, v in named.items()}),
                ProbeCall((), named),
            )
        ]

    def split_call(
        self, tower: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> MediaCall:
        named = arguments_by_name(tower, args, kwargs)
        pixels = named.get(self.pixel_argument)
        if not isinstance(pixels, Tensor) or pixels.dim() < 3:
            raise TypeError(
                f"the {self.name!r} layout needs {self.pixel_argument} of shape "
                f"(batch, images, tiles, ...), got {type(pixels).__name__}"
            )
        batch, images = pixels.shape[0], pixels.shape[1]
        cut = [self.pixel_argument]
        for name in (self.ids_argument, self.mask_argument):
            value = named.get(name)
            if value is None:
                continue
            if not isinstance(value, Tensor) or tuple(value.shape[:2]) != (batch, images):
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"the {self.name!r} layout needs {name} of shape ({batch}, {images}, ...), "
                    f"got {shape}"
                )
            cut.append(name)
        scalars = _refuse_others(self.name, tower, named, cut)
        extra = scalar_rows(named, scalars)
        items = tuple(
            MediaItem(
                fields=(*(named[n][b] for n in cut), *extra),
                cost=max(1, pixels[b].numel()),
            )
            for b in range(batch)
        )
        return MediaCall(call_spec(tower, self.name, named, cut, scalars), items)

    def build_call(
        self, spec: CallSpec, items: Sequence[MediaItem]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not items:
            raise ValueError("build_call needs at least one item")
        most = max(item.fields[0].shape[0] for item in items)
        fields: dict[str, Any] = {}
        for index, name in enumerate(spec.fields):
            if name in spec.scalars:
                continue
            padded = []
            for item in items:
                rows = item.fields[index]
                pad = rows.new_zeros((most - rows.shape[0], *rows.shape[1:]))
                padded.append(torch.cat([rows, pad]) if pad.shape[0] else rows)
            fields[name] = torch.stack(padded)
        return self._arguments(spec, items, fields)

    def split_output(
        self, output: Any, weights: Sequence[int]
    ) -> tuple[OutputSpec, list[tuple[Tensor, ...]]]:
        """Sample ``s`` of the call's output is its first ``weights[s]`` images."""
        if not weights:
            raise ValueError("split_output needs the weights of at least one item")
        leaves: list[Tensor] = []
        tree = take_tensors_out(output, leaves)
        for index, leaf in enumerate(leaves):
            if leaf.dim() < 2 or leaf.shape[0] != len(weights) or leaf.shape[1] < max(weights):
                raise ValueError(
                    f"tower output tensor {index} has shape {tuple(leaf.shape)}; the "
                    f"{self.name!r} layout needs (samples={len(weights)}, images>="
                    f"{max(weights)}, ...)"
                )
        spec = OutputSpec(
            tree=tree,
            dtypes=tuple(leaf.dtype for leaf in leaves),
            row_shapes=tuple(tuple(leaf.shape[2:]) for leaf in leaves),
            rows_per_weight=tuple(Fraction(1) for _ in leaves),
        )
        pieces = [tuple(leaf[s, :w] for leaf in leaves) for s, w in enumerate(weights)]
        return spec, pieces

    def join_output(self, spec: OutputSpec, pieces: Sequence[Sequence[Tensor]]) -> Any:
        """The samples' pieces stacked again: ``(samples, images, ...)``."""
        leaves = [
            torch.stack([piece[i] for piece in pieces])
            if pieces
            else torch.empty((0, 0, *spec.row_shapes[i]), dtype=spec.dtypes[i])
            for i in range(len(spec.dtypes))
        ]
        return put_tensors_back(spec.tree, leaves)
