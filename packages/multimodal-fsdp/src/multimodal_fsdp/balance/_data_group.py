"""Balanced calls on ranks that hold the same batch: a *data group* (TP x CP).

Every rank of a data group makes the same tower calls. Rather than each encoding every
image, each rank brings its *share* of a call's items (consecutive, split evenly by
position) to the rounds, which span the balance group times the data groups, and the
data group then gathers the shares' outputs (``gather_outputs``): every image is encoded
once in the world and every rank gets the whole call's output.

Gradients: TP gives every rank of the group the whole gradient of a replicated input,
so a rank's own share keeps its graph and the others arrive detached: each item's
gradient flows back once. A trainable module's parameter gradients then hold the items
each rank encoded, summed over the group by ``replica_grad_reduce``
(``ParallelDims.sharing_mesh``; TP only: a CP rank needs the gradients of the items it
reads). A call of fewer items than ranks is not split: every rank encodes it whole and
only the first one's output carries gradients back.

Collectives per split call on the data group: one ``all_gather`` of a fixed header
(``HEADER_INTS`` int64 per rank: its share's output bytes and a fingerprint of their
structure, which must agree), then one of the outputs' bytes, padded to the longest
share's; both sizes are known before the call (``gathered_bytes``). With CP
(``DataGroup.indexed``) a rank needs only its sequence shard's items
(``multimodal_fsdp.balance.context_parallel``): the header also carries a bad-index flag
and an item mask, and the outputs go by one ``all_to_all`` of the needed items (the
``all_gather`` when every rank needs every item; an unsplit call has the header only).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from multimodal_fsdp.balance._metadata import gather
from multimodal_fsdp.balance._route import bytes_of
from multimodal_fsdp.balance.layouts import MediaCall, MediaLayout, OutputSpec

__all__ = ["HEADER_INTS", "DataGroup", "gather_outputs", "gathered_bytes", "select_items"]

#: int64 words of a rank's header in the gather after a split call: its bytes, the
#: structure's fingerprint.
HEADER_INTS = 2


@dataclass(frozen=True)
class DataGroup:
    """The ranks holding this rank's batch (global ranks, sorted), their process group
    and this rank's position among them."""

    group: Any
    ranks: tuple[int, ...]
    position: int
    #: CP ranks among them: each rank names the items it needs (``gather_outputs``).
    indexed: bool = False

    @property
    def size(self) -> int:
        return len(self.ranks)

    def share(self, items: int) -> tuple[int, int]:
        """This rank's items ``[start, stop)`` of a call of ``items`` items."""
        return share_of_position(items, self.position, self.size)

    def share_of(self, call: MediaCall) -> MediaCall:
        start, stop = self.share(len(call.items))
        return MediaCall(spec=call.spec, items=call.items[start:stop])


def splits(items: int, size: int) -> bool:
    """Whether a call of ``items`` items is split over a data group of ``size`` ranks."""
    return size > 1 and items >= size


def share_of_position(items: int, position: int, size: int) -> tuple[int, int]:
    """The items ``[start, stop)`` the rank at ``position`` of a data group of ``size``
    ranks brings of a call of ``items`` items (sizes differ by at most one; the whole
    call when it is not split)."""
    if not splits(items, size):
        return 0, items
    return position * items // size, (position + 1) * items // size


def gathered_bytes(output_bytes: Sequence[int], size: int, *, indexed: bool = False) -> list[int]:
    """Bytes each rank receives in the gathers after a call whose items' outputs take
    ``output_bytes`` on a data group of ``size`` ranks: the header's, then the padded
    outputs' (none for an unsplit call). ``indexed`` (CP): a rank is assumed to need its
    own share's items, so the all_to_all after the header moves nothing."""
    if indexed and size > 1:
        header = size * (HEADER_INTS + 1 + len(output_bytes)) * 8
        return [header, 0] if splits(len(output_bytes), size) else [header]
    if not splits(len(output_bytes), size):
        return []
    longest = max(
        sum(output_bytes[slice(*share_of_position(len(output_bytes), p, size))])
        for p in range(size)
    )
    return [size * HEADER_INTS * 8, size * longest]


def select_items(
    layout: MediaLayout, output: Any, weights: Sequence[int], needs: Sequence[int]
) -> Any:
    """The output of items ``needs`` from ``output``, the whole call's; a ValueError when
    ``needs`` are not increasing item indices of the call."""
    if list(needs) != sorted(set(needs)) or any(not 0 <= i < len(weights) for i in needs):
        raise ValueError(
            f"context_parallel_media: items {list(needs)} are not increasing indices of this "
            f"call of {len(weights)} items"
        )
    spec, pieces = layout.split_output(output, list(weights))
    return layout.join_output(spec, [pieces[i] for i in needs])


def _fingerprint(spec: OutputSpec) -> int:
    """What a share's bytes are read with: dtypes, row shapes, axes and how each leaf's
    rows follow an item's weight (crc32: the same in every process)."""
    rules = spec.rules or (None,) * len(spec.dtypes)
    rows = tuple(
        rule.name if rule is not None else str(ratio)
        for rule, ratio in zip(rules, spec.rows_per_weight, strict=True)
    )
    described = repr((spec.dtypes, spec.row_shapes, spec.axes, rows))
    return zlib.crc32(described.encode())


def _share_bytes(spec: OutputSpec, weights: Sequence[int]) -> list[list[int]]:
    """Per item of ``weights``, the bytes of each of its output tensors."""
    return [
        [
            spec.rows(leaf, weight)
            * int(torch.Size(spec.row_shapes[leaf]).numel())
            * spec.dtypes[leaf].itemsize
            for leaf in range(len(spec.dtypes))
        ]
        for weight in weights
    ]


def gather_outputs(
    layout: MediaLayout,
    data: DataGroup,
    output: Any,
    weights: Sequence[int],
    device: torch.device,
    needs: Sequence[int] | None = None,
) -> Any:
    """The call's output on every rank of ``data`` (collective), from each rank's
    ``output`` for its share of a call of items of ``weights`` (the whole call's): this
    rank's pieces keep their graph, the others' are received copies. On an indexed group
    (CP) a rank gets the items of its ``needs`` only (``None``: all). Raises on every
    rank a RuntimeError when the output structures differ, a ValueError when a rank's
    ``needs`` are not increasing item indices."""
    items = len(weights)
    split = splits(items, data.size)
    if not split and not data.indexed:
        return output if data.position == 0 else _without_gradient(layout, output, weights)
    start, stop = data.share(items)
    spec, mine = layout.split_output(output, list(weights[start:stop]))
    shares = [share_of_position(items, p, data.size) for p in range(data.size)]
    item_bytes = [sum(piece) for piece in _share_bytes(spec, weights)]
    totals = [sum(item_bytes[slice(*share)]) for share in shares] if split else [0] * data.size
    wanted = range(items) if needs is None else needs
    bad = list(wanted) != sorted(set(wanted)) or any(not 0 <= i < items for i in wanted)
    mask = [0] * items if bad else [int(i in set(wanted)) for i in range(items)]
    words = [totals[data.position], _fingerprint(spec)]
    if data.indexed:
        words += [int(bad), *mask]
    rows = [h.cpu().tolist() for h in gather(torch.tensor(words).to(device), data.group)]
    if len({row[1] for row in rows}) > 1:
        raise RuntimeError(
            "balanced tower call: the ranks of a data group encoded outputs of different "
            f"structures (bytes and structure fingerprint per rank: {[r[:2] for r in rows]}); "
            "the tower's output must depend on its inputs alone"
        )
    if data.indexed and any(row[2] for row in rows):
        failed = [p for p, row in enumerate(rows) if row[2]]
        raise ValueError(
            f"context_parallel_media: the ranks at positions {failed} of the data group "
            f"{data.ranks} named items that are not increasing indices of this call of "
            f"{items} items (this rank asked for {list(wanted)})"
        )
    masks = [row[3:] for row in rows] if data.indexed else [[1] * items] * data.size
    if not split:  # every rank holds the whole call
        return layout.join_output(spec, [mine[i] for i in range(items) if masks[data.position][i]])
    owner = [p for p, share in enumerate(shares) for _ in range(*share)]
    if all(all(m) for m in masks):
        received = _all_gathered(mine, max(totals), data, device)
    else:
        received = _exchanged(mine, masks, item_bytes, shares, data, device)
    pieces: list[tuple[Tensor, ...]] = []
    offsets = [0] * data.size
    for item, weight in enumerate(weights):
        source = owner[item]
        if not masks[data.position][item]:
            continue
        if source == data.position:
            pieces.append(mine[item - start])
            continue
        piece = []
        for leaf, size in enumerate(_share_bytes(spec, [weight])[0]):
            chunk = received[source][offsets[source] : offsets[source] + size].clone()
            piece.append(
                chunk.view(spec.dtypes[leaf]).view(spec.rows(leaf, weight), *spec.row_shapes[leaf])
            )
            offsets[source] += size
        pieces.append(tuple(piece))
    return layout.join_output(spec, pieces)


class _ZeroGradient(torch.autograd.Function):
    """The tensor itself, whose backward sends zeros (the graph, and the collectives in
    its backward, still run)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return torch.zeros_like(grad)


def _zero_gradient(tensor: Tensor) -> Tensor:
    return _ZeroGradient.apply(tensor)  # type: ignore[no-untyped-call,no-any-return]


def _without_gradient(layout: MediaLayout, output: Any, weights: Sequence[int]) -> Any:
    """``output`` of an unsplit call on a rank other than the group's first, which alone
    carries the items' gradients back."""
    spec, pieces = layout.split_output(output, list(weights))
    if not any(leaf.requires_grad for piece in pieces for leaf in piece):
        return output
    return layout.join_output(
        spec,
        [
            tuple(_zero_gradient(leaf) if leaf.requires_grad else leaf for leaf in piece)
            for piece in pieces
        ],
    )


def _flat(pieces: Sequence[Sequence[Tensor]]) -> Tensor:
    leaves = [bytes_of(leaf) for piece in pieces for leaf in piece]
    return torch.cat(leaves) if leaves else torch.empty(0, dtype=torch.uint8)


def _all_gathered(
    mine: Sequence[Sequence[Tensor]], longest: int, data: DataGroup, device: torch.device
) -> list[Tensor]:
    """Every rank's share's output bytes (all_gather, padded to ``longest``)."""
    send = torch.zeros(longest, dtype=torch.uint8, device=device)
    flat = _flat(mine).to(device)
    send[: flat.numel()] = flat
    received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(data.size)]
    dist.all_gather(received, send, group=data.group)
    return received


def _exchanged(
    mine: Sequence[Sequence[Tensor]],
    masks: Sequence[Sequence[int]],
    item_bytes: Sequence[int],
    shares: Sequence[tuple[int, int]],
    data: DataGroup,
    device: torch.device,
) -> list[Tensor]:
    """Per source rank, the bytes of the items of its share this rank needs (one
    all_to_all: each rank sends every other the items of its share that one needs)."""
    start, stop = shares[data.position]
    send = [
        _flat([mine[i - start] for i in range(start, stop) if masks[q][i]])
        if q != data.position
        else torch.empty(0, dtype=torch.uint8)
        for q in range(data.size)
    ]
    into = [
        0
        if p == data.position
        else sum(item_bytes[i] for i in range(*shares[p]) if masks[data.position][i])
        for p in range(data.size)
    ]
    output = torch.empty(sum(into), dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        output,
        torch.cat(send).to(device),
        output_split_sizes=into,
        input_split_sizes=[t.numel() for t in send],
        group=data.group,
    )
    return list(torch.split(output, into))
