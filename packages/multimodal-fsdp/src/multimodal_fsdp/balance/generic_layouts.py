"""The two generic layout adapters built in: ``batch-first``
([BatchFirstLayout][multimodal_fsdp.balance.generic_layouts.BatchFirstLayout], one row of
the main input per item) and ``packed-by-grid``
([PackedByGridLayout][multimodal_fsdp.balance.generic_layouts.PackedByGridLayout],
patches packed along dim 0 with a ``grid_thw`` row per item). The interface they
implement is [MediaLayout][multimodal_fsdp.balance.layouts.MediaLayout]; layouts for
single model families are in ``multimodal_fsdp.balance.family_layouts``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from multimodal_fsdp.balance._arguments import (
    arguments_by_name,
    call_spec,
    forward_signature,
    indexed_like_items,
    named_parameters,
    scalar_arguments,
    scalar_rows,
)
from multimodal_fsdp.balance._probe_inputs import (
    candidate_rows,
    config_value,
    floating_dtype,
    mask_arguments,
    mask_lengths,
)
from multimodal_fsdp.balance.layouts import (
    CallSpec,
    FieldSpec,
    MediaCall,
    MediaItem,
    MediaLayout,
    ProbeCall,
)

__all__ = ["BatchFirstLayout", "PackedByGridLayout"]


def _probe_mask(length: int) -> Tensor:
    """Masks of two probe items over ``length`` positions: the first whole, the second
    padded after its first half, so that an encoder which packs only the valid positions
    of all items (its output rows then depend on the other item's length) is found."""
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, max(1, length // 2) :] = 0
    return mask


class BatchFirstLayout(MediaLayout):
    """One row of the tower's main input per image, tile or clip: ``pixel_values`` when
    the forward takes it (CLIP, SigLIP, Idefics3/SmolVLM, Phi-4's image encoder, the
    DeepSeek-V4.1 reference tower), else its first argument (Qwen2-Audio's
    ``input_features``, Phi-4's audio encoder, a plain custom tower's ``images``). Every
    tensor argument is cut by rows with it (``pixel_attention_mask``,
    ``patch_attention_mask``, an audio ``attention_mask``); 0-d tensors, flags and
    ``None`` pass through. Cost: the elements of one row of the main input.

    Its signature test is wide, so the plan-time probe decides whether it fits a tower
    whose main input is not ``pixel_values``."""

    name: ClassVar[str] = "batch-first"
    pixel_argument: ClassVar[str] = "pixel_values"

    def main_argument(self, tower: nn.Module) -> str | None:
        """``pixel_values`` if the forward takes it, else its first named argument.

        Args:
            tower: the tower (or encoder) whose calls are balanced.

        Returns:
            The argument whose rows are the items, or None without named arguments.
        """
        names = list(named_parameters(tower))
        if self.pixel_argument in names:
            return self.pixel_argument
        return names[0] if names else None

    def applies_to(self, tower: nn.Module) -> bool:
        params = forward_signature(tower).parameters
        return self.main_argument(tower) is not None and "grid_thw" not in params

    def trusted(self, tower: nn.Module) -> bool:
        return self.pixel_argument in forward_signature(tower).parameters

    def probe_calls(self, tower: nn.Module) -> Sequence[tuple[ProbeCall, ProbeCall]]:
        """One pair per input shape the tower may take (from its config, else its first
        layer): rows of 1 and 2 items of the main input, other required arguments
        ``None``. A tower with mask arguments (an audio encoder reading each clip's
        length from one) gets each row with masks first, as its calls do (the first item
        whole, the second padded after its first half), then without."""
        main = self.main_argument(tower)
        if main is None:
            return []
        others: dict[str, Any] = {
            name: None
            for name, p in named_parameters(tower).items()
            if name != main and p.default is inspect.Parameter.empty
        }
        rows = candidate_rows(tower, main)
        masks = mask_arguments(tower, main)
        shapes = [(row, length) for row in rows if masks for length in mask_lengths(row)]
        shapes += [(row, 0) for row in rows]
        pairs = []
        for row, length in shapes:
            generator = torch.Generator().manual_seed(0)
            both = {main: torch.randn((2, *row), generator=generator).to(floating_dtype(tower))}
            if length:
                both |= {name: _probe_mask(length) for name in masks}
            one = {name: value[:1] for name, value in both.items()}
            pairs.append((ProbeCall((), {**others, **one}), ProbeCall((), {**others, **both})))
        return pairs

    def split_call(
        self, tower: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> MediaCall:
        named = arguments_by_name(tower, args, kwargs)
        main = self.main_argument(tower) or self.pixel_argument
        pixels = named.get(main)
        if not isinstance(pixels, Tensor) or pixels.dim() < 1:
            raise TypeError(
                f"the {self.name!r} layout needs {main} as a tensor of one row "
                f"per item, got {type(pixels).__name__}"
            )
        count = pixels.shape[0]
        scalars = [n for n in scalar_arguments(named) if n != main]
        names = [main] + [
            n for n, v in named.items() if isinstance(v, Tensor) and n != main and n not in scalars
        ]
        for name in names:
            value = named[name]
            if value.dim() < 1 or value.shape[0] != count:
                raise ValueError(
                    f"the {self.name!r} layout cuts every tensor argument with the "
                    f"{count} rows of {main}, but {name!r} has shape "
                    f"{tuple(value.shape)}; register a layout adapter for "
                    f"{type(tower).__name__}"
                )
        spec = call_spec(tower, self.name, named, names, scalars)
        cost = max(1, pixels[0].numel()) if count else 1
        items = tuple(
            MediaItem(
                fields=(*(named[n][i : i + 1] for n in names), *scalar_rows(named, scalars)),
                cost=cost,
            )
            for i in range(count)
        )
        return MediaCall(spec=spec, items=items)


class PackedByGridLayout(MediaLayout):
    """Patches of all items concatenated along dim 0, ``grid_thw`` giving each item's
    ``(t, h, w)`` (Qwen2-VL, Qwen2.5-VL: ``visual(pixel_values, grid_thw=...)``). Item
    ``i`` owns ``t*h*w`` patch rows and one ``grid_thw`` row; its cost is ``t*h*w``. The
    outputs are packed too, with rows per item proportional to its patches (the spatial
    merge gives fewer). Another tensor argument the forward names is split by the same
    rule when it is indexed like the patches (one row per patch) or like the items (one
    row per ``grid_thw`` row), and refused otherwise; tensors that reach the tower only
    through its ``**kwargs`` are left out (see ``_arguments``)."""

    name: ClassVar[str] = "packed-by-grid"
    grid_argument: ClassVar[str] = "grid_thw"

    def applies_to(self, tower: nn.Module) -> bool:
        params = list(forward_signature(tower).parameters)
        return self.grid_argument in params and params[0] != self.grid_argument

    def probe_calls(self, tower: nn.Module) -> Sequence[tuple[ProbeCall, ProbeCall]]:
        """An image of ``(1, m, m)`` patches and one of ``(1, m, 2m)`` (``m`` the spatial
        merge), patch rows of ``channels * temporal_patch * patch**2`` values."""
        patch = config_value(tower, "patch_size")
        if not isinstance(patch, int):
            return ()
        merge = int(config_value(tower, "spatial_merge_size") or 2)
        temporal = int(config_value(tower, "temporal_patch_size") or 2)
        channels = int(config_value(tower, "in_channels", "in_chans", "num_channels") or 3)
        grid = torch.tensor([[1, merge, merge], [1, merge, 2 * merge]])
        rows = int(grid.prod(-1).sum())
        generator = torch.Generator().manual_seed(0)
        patches = torch.randn((rows, channels * temporal * patch * patch), generator=generator)
        patches = patches.to(floating_dtype(tower))
        first = merge * merge
        first_param = next(iter(forward_signature(tower).parameters))
        return [
            (
                ProbeCall((), {first_param: patches[:first], self.grid_argument: grid[:1]}),
                ProbeCall((), {first_param: patches, self.grid_argument: grid}),
            )
        ]

    def split_call(
        self, tower: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> MediaCall:
        named = arguments_by_name(tower, args, kwargs)
        first = next(iter(forward_signature(tower).parameters))
        patches, grid = named.get(first), named.get(self.grid_argument)
        if not isinstance(patches, Tensor) or patches.dim() < 1:
            raise TypeError(
                f"the {self.name!r} layout needs {first} as a tensor of patch rows, got "
                f"{type(patches).__name__}"
            )
        if not isinstance(grid, Tensor) or grid.dim() != 2 or grid.shape[1] != 3:
            shape = tuple(grid.shape) if isinstance(grid, Tensor) else type(grid).__name__
            raise ValueError(
                f"the {self.name!r} layout needs {self.grid_argument} as an integer tensor of "
                f"shape (items, 3), got {shape}"
            )
        scalars = [n for n in scalar_arguments(named) if n not in (first, self.grid_argument)]
        sizes = [tuple(int(x) for x in row) for row in grid.tolist()]
        rows = [t * h * w for t, h, w in sizes]
        if sum(rows) != patches.shape[0]:
            raise ValueError(
                f"{self.grid_argument} gives {sum(rows)} patches ({sizes}) but {first} has "
                f"{patches.shape[0]} rows"
            )
        if any(r <= 0 for r in rows):
            raise ValueError(f"every {self.grid_argument} row must be positive, got {sizes}")
        per_row, per_item = indexed_like_items(
            tower, named, (first, *scalars, self.grid_argument), rows, self.name, self.grid_argument
        )
        chunks = {name: torch.split(named[name], rows, dim=0) for name in (first, *per_row)}
        extra = scalar_rows(named, scalars)
        items = tuple(
            MediaItem(
                fields=(
                    chunks[first][i],
                    grid[i : i + 1],
                    *(chunks[n][i] for n in per_row),
                    *(named[n][i : i + 1] for n in per_item),
                    *extra,
                ),
                cost=r,
                sizes=size,
            )
            for i, (r, size) in enumerate(zip(rows, sizes, strict=True))
        )
        fields = (first, self.grid_argument, *per_row, *per_item)
        return MediaCall(call_spec(tower, self.name, named, fields, scalars), items)

    def placeholder(
        self, spec: CallSpec, fields: Sequence[FieldSpec], sizes: tuple[int, ...]
    ) -> MediaItem:
        """Zero patches on the grid ``sizes`` (a real item's ``(t, h, w)``)."""
        if len(sizes) != 3 or len(fields) < 2:
            raise ValueError(
                f"a {self.name!r} placeholder needs (t, h, w) and two fields, got {sizes}"
            )
        patches, grid, *extra = fields
        t, h, w = sizes
        rest = super().placeholder(spec, extra, ()).fields if extra else ()
        return MediaItem(
            fields=(
                torch.zeros((t * h * w, *patches.row_shape), dtype=patches.dtype),
                torch.tensor([[t, h, w]], dtype=grid.dtype),
                *rest,
            ),
            cost=t * h * w,
            sizes=sizes,
        )
