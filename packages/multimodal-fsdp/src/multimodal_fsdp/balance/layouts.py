"""Layout adapters: how one tower call splits into media items and back.

Balancing moves single images, tiles or clips between ranks, so something must know
which rows of which call argument belong to one item, what an item costs to encode,
and which rows of the tower's output are that item's. A
[MediaLayout][multimodal_fsdp.balance.layouts.MediaLayout] says so for one family of
tower forward signatures:

- ``split_call`` turns the call's ``(args, kwargs)`` into a
  [MediaCall][multimodal_fsdp.balance.layouts.MediaCall]: the per-item tensor arguments
  (*fields*, cut into items by rows of dim 0) and the rest, passed through unchanged;
- ``build_call`` rebuilds call arguments from any list of items, wherever they came from;
- ``split_output`` / ``join_output`` cut the tower's output (a tensor, a tuple or list,
  a mapping or a dataclass such as a transformers ``ModelOutput``, nested) into per-item
  pieces and join pieces back into an output of the same structure and types.

Each output tensor is split along dim 0 in proportion to the rows of the item's first
field (one row per image for batch-first towers, ``t*h*w`` patches for packed ones),
which also covers outputs with fewer rows than patches (a spatial merge).

Two generic layouts are built in: ``batch-first``
([BatchFirstLayout][multimodal_fsdp.balance.layouts.BatchFirstLayout]) and
``packed-by-grid`` ([PackedByGridLayout][multimodal_fsdp.balance.layouts.PackedByGridLayout]).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from multimodal_fsdp.balance._arguments import (
    arguments_by_name,
    check_constants_hold_no_tensor,
    forward_signature,
    indexed_like_items,
    positional_only_names,
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
from multimodal_fsdp.balance._tree import put_tensors_back, take_tensors_out

__all__ = [
    "MediaItem",
    "CallSpec",
    "MediaCall",
    "FieldSpec",
    "OutputSpec",
    "RowRule",
    "ProbeCall",
    "MediaLayout",
    "BatchFirstLayout",
    "PackedByGridLayout",
]


@dataclass(frozen=True)
class MediaItem:
    """One image, tile or clip of a tower call.

    ``fields`` holds this item's rows of each per-item argument (in
    ``CallSpec.fields`` order), ``cost`` what encoding it costs (patches or pixels),
    ``sizes`` small layout-specific integers another rank needs to rebuild the item
    or a placeholder of it (``(t, h, w)`` for packed towers)."""

    fields: tuple[Tensor, ...]
    cost: int
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class CallSpec:
    """What a call passes besides the items: the names of the per-item tensor arguments
    (``fields``), the other arguments by name (``constants``, passed through unchanged
    and sent to ranks that have no call of their own, so they must be picklable), and
    which names are positional-only.

    ``scalars`` names the fields that hold a 0-d tensor argument (transformers'
    ``num_items_in_batch``): it is not cut by item but travels with each item as one
    row (ranks may pass different values), and a call built from items gets it back as
    a 0-d tensor, the value of its first item."""

    fields: tuple[str, ...]
    constants: tuple[tuple[str, Any], ...] = ()
    positional: tuple[str, ...] = ()
    scalars: tuple[str, ...] = ()


@dataclass(frozen=True)
class MediaCall:
    """A tower call split into items: ``spec`` plus the items in call order."""

    spec: CallSpec
    items: tuple[MediaItem, ...]


@dataclass(frozen=True)
class ProbeCall:
    """A tiny call of a tower made by a layout for the plan-time probe."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class FieldSpec:
    """One per-item field as another rank sees it: dtype, the shape of one row, and the
    number of rows the item has (used for placeholders)."""

    dtype: torch.dtype
    row_shape: tuple[int, ...]
    rows: int


@dataclass(frozen=True)
class RowRule:
    """Rows of an output tensor that belong to an item, as a function of the item's
    weight (its first field's rows) when they are not proportional to it: Whisper-style
    audio encoders give ``((frames - 1) // 2 + 1 - 2) // 2 + 1`` tokens for ``frames``
    mel frames. ``name`` says which rule in plans and messages."""

    name: str
    rows: Callable[[int], int]

    def __call__(self, weight: int) -> int:
        return int(self.rows(weight))


@dataclass(frozen=True)
class OutputSpec:
    """The structure of a tower output with its tensors taken out (``tree``), and for each
    tensor (*leaf*, in walk order) its dtype, row shape and rows per unit of item weight.

    ``rules`` (per leaf, or empty): a [RowRule][multimodal_fsdp.balance.layouts.RowRule]
    where a leaf's rows per item are not proportional to the weight. ``axes`` (per leaf,
    or empty): the dimension the items' rows run along, 0, or 1 for a packed output of
    shape ``(1, rows, ...)`` (Pixtral's hidden states); the pieces hold rows along
    dim 0 either way and ``row_shapes`` is the shape after that dimension."""

    tree: Any
    dtypes: tuple[torch.dtype, ...]
    row_shapes: tuple[tuple[int, ...], ...]
    rows_per_weight: tuple[Fraction, ...]
    rules: tuple[RowRule | None, ...] = ()
    axes: tuple[int, ...] = ()

    def rows(self, leaf: int, weight: int) -> int:
        """Rows of leaf ``leaf`` that belong to an item of weight ``weight``.

        Args:
            leaf: the output tensor's index.
            weight: the item's weight (its main field's rows).

        Returns:
            The item's rows of that tensor.

        Raises:
            ValueError: the tensor's rows are not a whole multiple of the weight.
        """
        rule = self.rules[leaf] if self.rules else None
        if rule is not None:
            return rule(weight)
        value = self.rows_per_weight[leaf] * weight
        if value.denominator != 1:
            raise ValueError(
                f"output tensor {leaf} has {self.rows_per_weight[leaf]} rows per input row, "
                f"which gives no whole number of rows for an item of {weight} input rows"
            )
        return int(value)

    def axis(self, leaf: int) -> int:
        """The dimension of leaf ``leaf`` its items' rows run along.

        Args:
            leaf: the output tensor's index.

        Returns:
            The dimension.
        """
        return self.axes[leaf] if self.axes else 0

    def describe(self, leaf: int) -> str:
        """How leaf ``leaf`` splits, for plans: ``"16 rows per item row"`` and the like.

        Args:
            leaf: the output tensor's index.

        Returns:
            The description.
        """
        rule = self.rules[leaf] if self.rules else None
        how = rule.name if rule is not None else f"{self.rows_per_weight[leaf]} per input row"
        where = " along dim 1 of (1, rows, ...)" if self.axis(leaf) == 1 else ""
        return how + where


# ----------------------------------------------------------------------- the protocol
def _scalar_value(spec: CallSpec, items: Sequence[MediaItem], name: str) -> Tensor:
    """A scalar field's value for a call on ``items``: its first item's, as a 0-d tensor."""
    return items[0].fields[spec.fields.index(name)].reshape(())


class MediaLayout(ABC):
    """How calls of one family of towers split into items (see the module docstring).

    Subclass it for a tower whose call neither built-in layout covers, and register an
    instance with ``register_media_layout``. ``split_output``/``join_output`` are
    generic; a subclass implements ``applies_to``, ``split_call`` and ``build_call`` and
    may override ``placeholder``.
    """

    #: The name plans and messages use.
    name: ClassVar[str] = ""

    @abstractmethod
    def applies_to(self, tower: nn.Module) -> bool:
        """Whether this layout understands calls of ``tower`` (from its forward signature).

        Args:
            tower: the tower (or encoder) whose calls are balanced.

        Returns:
            Whether the layout may be tried (the probe decides).
        """

    @abstractmethod
    def split_call(
        self, tower: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> MediaCall:
        """Split one call of ``tower`` into items; raise ValueError/TypeError if it cannot.

        Args:
            tower: the tower (or encoder) whose calls are balanced.
            args: the call's positional arguments.
            kwargs: the call's keyword arguments.

        Returns:
            The call's items and what rebuilds a call of them.

        Raises:
            ValueError: the call cannot be split (a subclass says why).
            TypeError: an argument has a type the layout cannot cut.
        """

    def build_call(
        self, spec: CallSpec, items: Sequence[MediaItem]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Call arguments for ``items`` (any number, from any rank): each field's rows are
        concatenated along dim 0, the constants passed through.

        Args:
            spec: what the split call recorded (fields, constants, positional names).
            items: the items to call the tower on.

        Returns:
            ``(args, kwargs)`` of the call.

        Raises:
            ValueError: the items' fields do not match ``spec``.
        """
        if not items:
            raise ValueError("build_call needs at least one item")
        fields = {
            name: torch.cat([item.fields[i] for item in items], dim=0)
            for i, name in enumerate(spec.fields)
            if name not in spec.scalars
        }
        return self._arguments(spec, items, fields)

    def _arguments(
        self, spec: CallSpec, items: Sequence[MediaItem], fields: Mapping[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Call arguments from the rebuilt per-item ``fields``, the call's scalars (its first
        item's values) and constants, positional-only names first."""
        scalars = {name: _scalar_value(spec, items, name) for name in spec.scalars}
        named: dict[str, Any] = {**fields, **scalars, **dict(spec.constants)}
        args = tuple(named.pop(name) for name in spec.positional if name in named)
        return args, named

    def placeholder(
        self, spec: CallSpec, fields: Sequence[FieldSpec], sizes: tuple[int, ...]
    ) -> MediaItem:
        """An item of the given shape whose values keep the tower finite: zeros for floating
        fields, ones for the others (an all-valid mask). Its output is multiplied by 0.

        Args:
            spec: the call's spec.
            fields: the fields' dtypes and row shapes.
            sizes: the rows of each field.

        Returns:
            The placeholder item.
        """
        tensors = tuple(
            (torch.zeros if f.dtype.is_floating_point else torch.ones)(
                (f.rows, *f.row_shape), dtype=f.dtype
            )
            for f in fields
        )
        return MediaItem(fields=tensors, cost=1, sizes=sizes)

    # ---------------------------------------------------------------- outputs (generic)
    def split_output(
        self, output: Any, weights: Sequence[int]
    ) -> tuple[OutputSpec, list[tuple[Tensor, ...]]]:
        """Cut ``output`` (of a call on items of the given weights, in call order) into one
        piece per item: each piece holds that item's rows of every output tensor, along
        dim 0 (see ``OutputSpec.axes`` for packed ``(1, rows, ...)`` outputs).

        Args:
            output: the tower's output for a call.
            weights: the call's items' weights, in call order.

        Returns:
            How to rejoin pieces, and one piece per item.

        Raises:
            ValueError: an output tensor's rows do not split by the weights.
        """
        if not weights:
            raise ValueError("split_output needs the weights of at least one item")
        leaves: list[Tensor] = []
        tree = take_tensors_out(output, leaves)
        total = sum(weights)
        ratios: list[Fraction] = []
        rules: list[RowRule | None] = []
        axes: list[int] = []
        per_leaf: list[tuple[Tensor, ...]] = []
        for index, leaf in enumerate(leaves):
            if leaf.dim() == 0:
                raise ValueError(
                    f"tower output tensor {index} is a scalar; the {self.name!r} layout "
                    "splits outputs along dim 0 per item"
                )
            axis = self.item_axis(leaf, len(weights))
            if axis not in (0, 1) or (axis == 1 and (leaf.dim() < 2 or leaf.shape[0] != 1)):
                raise ValueError(
                    f"tower output tensor {index} of shape {tuple(leaf.shape)} has its items "
                    f"along dim {axis}; the {self.name!r} layout splits dim 0, or dim 1 of a "
                    "(1, rows, ...) tensor"
                )
            rows_total = leaf.shape[axis]
            rule = next(
                (r for r in self.row_rules() if sum(r(w) for w in weights) == rows_total), None
            )
            ratio = Fraction(rows_total, total)
            if rule is not None:
                rows = [Fraction(rule(w)) for w in weights]
            else:
                rows = [ratio * w for w in weights]
            if any(r.denominator != 1 or r < 0 for r in rows):
                raise ValueError(
                    f"tower output tensor {index} has {rows_total} rows for items of "
                    f"{list(weights)} input rows; the {self.name!r} layout needs a whole "
                    "number of rows per item (register an adapter for this tower)"
                )
            ratios.append(ratio)
            rules.append(rule)
            axes.append(axis)
            rows_of = leaf if axis == 0 else leaf[0]
            per_leaf.append(tuple(torch.split(rows_of, [int(r) for r in rows], dim=0)))
        spec = OutputSpec(
            tree=tree,
            dtypes=tuple(leaf.dtype for leaf in leaves),
            row_shapes=tuple(
                tuple(leaf.shape[axis + 1 :]) for leaf, axis in zip(leaves, axes, strict=True)
            ),
            rows_per_weight=tuple(ratios),
            rules=tuple(rules) if any(r is not None for r in rules) else (),
            axes=tuple(axes) if any(axes) else (),
        )
        pieces = [tuple(parts[i] for parts in per_leaf) for i in range(len(weights))]
        return spec, pieces

    def join_output(self, spec: OutputSpec, pieces: Sequence[Sequence[Tensor]]) -> Any:
        """The output a call on the pieces' items would give: each tensor's pieces are
        concatenated along dim 0 (a packed leaf gets its leading 1 back) and the structure
        rebuilt with its own types.

        Args:
            spec: what ``split_output`` recorded.
            pieces: one piece per item, in the order of the call to rebuild.

        Returns:
            The output, with the tower's own structure and types.
        """
        leaves = []
        for i in range(len(spec.dtypes)):
            leaf = (
                torch.cat([piece[i] for piece in pieces], dim=0)
                if pieces
                else torch.empty((0, *spec.row_shapes[i]), dtype=spec.dtypes[i])
            )
            leaves.append(leaf.unsqueeze(0) if spec.axis(i) == 1 else leaf)
        return put_tensors_back(spec.tree, leaves)

    # ---------------------------------------------------------------- layout hooks
    def item_axis(self, leaf: Tensor, items: int) -> int:
        """The dimension of an output tensor the items' rows run along (0 here; a layout
        of packed ``(1, rows, ...)`` outputs answers 1).

        Args:
            leaf: one output tensor.
            items: how many items the call had.

        Returns:
            The dimension.
        """
        return 0

    def row_rules(self) -> Sequence[RowRule]:
        """Rules for output rows that are not proportional to an item's weight, tried in
        order before the proportional split (none here).

        Returns:
            The rules, first match wins.
        """
        return ()

    def bind(self, tower: nn.Module) -> MediaLayout:
        """This layout for calls of ``tower``: a layout that needs facts about the tower
        beyond its call (a patch size, its output-length rule) returns a copy that holds
        them; the others return themselves.

        Args:
            tower: the tower (or encoder) whose calls are balanced.

        Returns:
            The layout to use for its calls.
        """
        return self

    def probe_calls(self, tower: nn.Module) -> Sequence[tuple[ProbeCall, ProbeCall]]:
        """Pairs of tiny calls of ``tower`` for the plan-time probe
        ([`probe_layout`][multimodal_fsdp.balance.probe.probe_layout]), with one and two
        items, the one-item call's item being the two-item call's first; several pairs
        when the input shape is a guess (the probe keeps the first the tower runs on),
        none when this layout cannot make them (it is then used unprobed if ``trusted``).

        Args:
            tower: the tower (or encoder) whose calls are balanced.

        Returns:
            ``(one-item call, two-item call)`` pairs.
        """
        return ()

    def trusted(self, tower: nn.Module) -> bool:
        """Whether calls of ``tower`` use this layout when the probe cannot run (no probe
        calls, the tower cannot run on the meta device and its weights are not real): a
        layout written for a tower family is, a generic one only on a telling signature.

        Args:
            tower: the tower (or encoder) whose calls are balanced.

        Returns:
            Whether the layout is used unprobed.
        """
        return True


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
        names = [
            name
            for name, p in forward_signature(tower).parameters.items()
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
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
            for name, p in forward_signature(tower).parameters.items()
            if name != main
            and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
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
        constants = {n: v for n, v in named.items() if n not in names and n not in scalars}
        check_constants_hold_no_tensor(tower, constants, self.name)
        cost = max(1, pixels[0].numel()) if count else 1
        items = tuple(
            MediaItem(
                fields=(*(named[n][i : i + 1] for n in names), *scalar_rows(named, scalars)),
                cost=cost,
            )
            for i in range(count)
        )
        spec = CallSpec(
            fields=(*names, *scalars),
            constants=tuple(constants.items()),
            positional=positional_only_names(tower),
            scalars=tuple(scalars),
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
        cut = (first, self.grid_argument, *per_row, *per_item, *scalars)
        constants = {n: v for n, v in named.items() if n not in cut}
        check_constants_hold_no_tensor(tower, constants, self.name)
        spec = CallSpec(
            fields=cut,
            constants=tuple(constants.items()),
            positional=positional_only_names(tower),
            scalars=tuple(scalars),
        )
        return MediaCall(spec=spec, items=items)

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
