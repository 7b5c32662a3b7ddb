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

Two generic layouts are built in (``multimodal_fsdp.balance.generic_layouts``):
``batch-first`` ([BatchFirstLayout][multimodal_fsdp.balance.generic_layouts.BatchFirstLayout])
and ``packed-by-grid``
([PackedByGridLayout][multimodal_fsdp.balance.generic_layouts.PackedByGridLayout]).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

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
