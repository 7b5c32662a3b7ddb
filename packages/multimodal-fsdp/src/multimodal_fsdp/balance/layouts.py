"""Layout adapters: how one tower call splits into media items and back.

Balancing moves single images, tiles or clips between ranks, so something must know
which rows of which argument belong to an item, what it costs to encode, and which rows
of the output are its. A [MediaLayout][multimodal_fsdp.balance.layouts.MediaLayout]
says so for one family of tower signatures: ``split_call`` cuts a call into a
[MediaCall][multimodal_fsdp.balance.layouts.MediaCall] (per-item *fields*, cut by rows
of dim 0, and pass-through arguments), ``build_call`` rebuilds a call from any items,
and ``split_output`` / ``join_output`` cut an output (nested tensors, tuples, mappings,
dataclasses such as ``ModelOutput``) into per-item pieces and back, each tensor in
proportion to the rows of the item's first field (which also covers a spatial merge).
The built-in layouts are in ``multimodal_fsdp.balance.generic_layouts``
([BatchFirstLayout][multimodal_fsdp.balance.generic_layouts.BatchFirstLayout],
[PackedByGridLayout][multimodal_fsdp.balance.generic_layouts.PackedByGridLayout]) and
``multimodal_fsdp.balance.family_layouts``.
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
    """One image, tile or clip of a tower call: its rows of each per-item argument
    (``CallSpec.fields`` order), what encoding it costs (patches or pixels), and small
    integers another rank needs to rebuild it or a placeholder (``(t, h, w)``)."""

    fields: tuple[Tensor, ...]
    cost: int
    sizes: tuple[int, ...] = ()


@dataclass(frozen=True)
class CallSpec:
    """What a call passes besides the items: the per-item tensor arguments' names
    (``fields``), the other arguments (``constants``: passed through, and pickled to
    ranks without a call), the positional-only names, and the fields that hold a 0-d
    tensor (``scalars``, e.g. ``num_items_in_batch``: one row per item, given back to a
    rebuilt call as its first item's value)."""

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
    """One per-item field as another rank sees it: dtype, row shape, the item's rows."""

    dtype: torch.dtype
    row_shape: tuple[int, ...]
    rows: int


@dataclass(frozen=True)
class RowRule:
    """An item's rows of an output tensor from its weight (its first field's rows), where
    they are not proportional to it (an audio encoder's tokens per clip); ``name`` says
    which rule in plans and messages."""

    name: str
    rows: Callable[[int], int]

    def __call__(self, weight: int) -> int:
        return int(self.rows(weight))


@dataclass(frozen=True)
class OutputSpec:
    """A tower output's structure without its tensors (``tree``) and, per tensor (*leaf*,
    in walk order), its dtype, row shape and rows per unit of item weight; ``rules``
    (per leaf, or empty): a [RowRule][multimodal_fsdp.balance.layouts.RowRule] where
    rows are not proportional; ``axes`` (per leaf, or empty): 1 for a packed
    ``(1, rows, ...)`` leaf (its pieces still hold rows along dim 0), else 0."""

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
        """How leaf ``leaf`` splits, for plans.

        Args:
            leaf: the output tensor's index.

        Returns:
            The description.
        """
        rule = self.rules[leaf] if self.rules else None
        how = rule.name if rule is not None else f"{self.rows_per_weight[leaf]} per input row"
        where = " along dim 1 of (1, rows, ...)" if self.axis(leaf) == 1 else ""
        return how + where


class MediaLayout(ABC):
    """How calls of one family of towers split into items (see the module docstring).
    For a tower no built-in layout covers, subclass it (``applies_to``, ``split_call``;
    the other methods where their defaults do not fit) and register an instance with
    ``register_media_layout``."""

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
        """Split one call of ``tower`` into items.

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
        """Call arguments for ``items`` (from any rank): each field's rows concatenated.

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
        """Call arguments from the rebuilt per-item ``fields``, the scalars (the first
        item's) and constants."""
        scalars = {n: items[0].fields[spec.fields.index(n)].reshape(()) for n in spec.scalars}
        named: dict[str, Any] = {**fields, **scalars, **dict(spec.constants)}
        args = tuple(named.pop(name) for name in spec.positional if name in named)
        return args, named

    def placeholder(
        self, spec: CallSpec, fields: Sequence[FieldSpec], sizes: tuple[int, ...]
    ) -> MediaItem:
        """An item whose values keep the tower finite (zeros; ones for integer fields: an
        all-valid mask); its output is multiplied by 0.

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

    def split_output(
        self, output: Any, weights: Sequence[int]
    ) -> tuple[OutputSpec, list[tuple[Tensor, ...]]]:
        """Cut ``output`` into one piece per item: its rows of every output tensor.

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
            rows = [Fraction(rule(w)) if rule is not None else ratio * w for w in weights]
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
        """The output a call on the pieces' items would give.

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

    def item_axis(self, leaf: Tensor, items: int) -> int:
        """The dimension of an output tensor the items' rows run along (1 for a packed
        ``(1, rows, ...)`` output).

        Args:
            leaf: one output tensor.
            items: how many items the call had.

        Returns:
            The dimension.
        """
        return 0

    def row_rules(self) -> Sequence[RowRule]:
        """Rules for output rows not proportional to an item's weight.

        Returns:
            The rules, tried in order before the proportional split.
        """
        return ()

    def bind(self, tower: nn.Module) -> MediaLayout:
        """This layout for calls of ``tower``: a copy holding facts about the tower beyond
        its call (a patch size, an output-length rule), or itself.

        Args:
            tower: the tower (or encoder) whose calls are balanced.

        Returns:
            The layout to use for its calls.
        """
        return self

    def probe_calls(self, tower: nn.Module) -> Sequence[tuple[ProbeCall, ProbeCall]]:
        """Tiny calls of ``tower`` for the plan-time probe
        ([`probe_layout`][multimodal_fsdp.balance.probe.probe_layout]): one item, then
        two items with the same first; several pairs when the input shape is a guess,
        none when this layout cannot make them (then it is used unprobed if ``trusted``).

        Args:
            tower: the tower (or encoder) whose calls are balanced.

        Returns:
            ``(one-item call, two-item call)`` pairs.
        """
        return ()

    def trusted(self, tower: nn.Module) -> bool:
        """Whether calls of ``tower`` use this layout when the probe cannot run (a family
        layout does, a generic one only on a telling signature).

        Args:
            tower: the tower (or encoder) whose calls are balanced.

        Returns:
            Whether the layout is used unprobed.
        """
        return True
