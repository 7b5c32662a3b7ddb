"""Balanced calls on ranks that hold the same batch: a *data group* (TP x CP).

Every rank of a data group makes the same tower calls. Balanced as they are, each rank
would encode every image of its data group (once per TP rank). Instead each rank brings
only its *share* of a call's items (``share``: consecutive items, split evenly by
position in the group) to the rounds, which run over the data-parallel balance group
times the data groups, and after the call's round the ranks of the data group gather
each other's outputs (``gather_outputs``): every image is encoded once in the world and
every rank of the data group gets the whole call's output, as it would have encoded it.

Gradients: the ranks of a data group run the same forward on the same batch, and
torch's tensor parallelism gives every TP rank the whole gradient of a replicated
input (the backward all-reduces the partial sums), the same on every rank. So the
output of a rank's own share keeps its graph and the other shares arrive detached:
each item's gradient flows back once, from the rank whose share it is. Only frozen
towers are balanced this way (``BalanceMediaRuntimeHook.install``): a trainable one
would also need its parameter gradients summed over the data group.

A call of fewer items than the group has ranks is not split: every rank of the group
brings the whole call and nothing is gathered (a share would be empty, and a rank without
an output has no output structure to rebuild the others' bytes with).

Collectives per split call, on the data group (``T`` ranks): one ``all_gather`` of a
fixed header (``HEADER_INTS`` int64 per rank: the bytes of its share's outputs and a
fingerprint of their structure, which must agree on every rank, else every rank raises),
then one ``all_gather`` of the outputs' bytes, padded to the longest share's. Every rank
derives each share's rows from the output structure and the whole call's item weights,
so both sizes are known before the call (``gathered_bytes``).
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
from multimodal_fsdp.balance.layouts import MediaCall, MediaLayout, OutputSpec

__all__ = ["HEADER_INTS", "DataGroup", "gather_outputs", "gathered_bytes"]

#: int64 words of a rank's header in the gather after a split call: its bytes, the
#: structure's fingerprint.
HEADER_INTS = 2


@dataclass(frozen=True)
class DataGroup:
    """The ranks holding this rank's batch (global ranks, sorted), their process group
    (whose group ranks follow that order) and this rank's position among them."""

    group: Any
    ranks: tuple[int, ...]
    position: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def share(self, items: int) -> tuple[int, int]:
        """This rank's items of a call of ``items`` items: ``[start, stop)``, consecutive,
        the same split on every rank of the group (sizes differ by at most one); the whole
        call when it has fewer items than the group has ranks (see the module docstring)."""
        return share_of_position(items, self.position, self.size)

    def share_of(self, call: MediaCall) -> MediaCall:
        start, stop = self.share(len(call.items))
        return MediaCall(spec=call.spec, items=call.items[start:stop])


def splits(items: int, size: int) -> bool:
    """Whether a call of ``items`` items is split over a data group of ``size`` ranks."""
    return size > 1 and items >= size


def share_of_position(items: int, position: int, size: int) -> tuple[int, int]:
    """The items ``[start, stop)`` the rank at ``position`` of a data group of ``size``
    ranks brings of a call of ``items`` items (``DataGroup.share``)."""
    if not splits(items, size):
        return 0, items
    return position * items // size, (position + 1) * items // size


def gathered_bytes(output_bytes: Sequence[int], size: int) -> list[int]:
    """Bytes each rank receives in the gathers after a call whose items' outputs take
    ``output_bytes`` (every output tensor, in call order) on a data group of ``size``
    ranks: the header's, then the padded outputs'; none when the call is not split."""
    if not splits(len(output_bytes), size):
        return []
    longest = max(
        sum(output_bytes[slice(*share_of_position(len(output_bytes), p, size))])
        for p in range(size)
    )
    return [size * HEADER_INTS * 8, size * longest]


def _bytes_of(tensor: Tensor) -> Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


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
) -> Any:
    """The whole call's output on every rank of ``data`` (collective over the group),
    from each rank's ``output`` for its share of a split call whose items have the given
    ``weights`` (the whole call's, in call order): this rank's pieces keep their graph,
    the others' are received copies.

    Raises:
        RuntimeError: on every rank, when the ranks' output structures differ."""
    start, stop = data.share(len(weights))
    spec, mine = layout.split_output(output, list(weights[start:stop]))
    sizes = [
        [sum(piece) for piece in _share_bytes(spec, weights[slice(*data_share)])]
        for data_share in (share_of_position(len(weights), p, data.size) for p in range(data.size))
    ]
    totals = [sum(piece_sizes) for piece_sizes in sizes]
    header = torch.tensor([totals[data.position], _fingerprint(spec)], dtype=torch.int64)
    told = [tuple(int(v) for v in h.cpu().tolist()) for h in gather(header.to(device), data.group)]
    if len({fingerprint for _, fingerprint in told}) > 1:
        raise RuntimeError(
            "balanced tower call: the ranks of a data group encoded outputs of different "
            f"structures (bytes and structure fingerprint per rank: {told}); the tower's "
            "output must depend on its inputs alone"
        )
    longest = max(totals)
    send = torch.zeros(longest, dtype=torch.uint8, device=device)
    if mine:
        flat = torch.cat([_bytes_of(leaf) for piece in mine for leaf in piece])
        send[: flat.numel()] = flat
    received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(data.size)]
    dist.all_gather(received, send, group=data.group)
    pieces: list[tuple[Tensor, ...]] = []
    for source, buffer in enumerate(received):
        if source == data.position:
            pieces.extend(mine)
            continue
        first, last = share_of_position(len(weights), source, data.size)
        offset = 0
        for weight in weights[first:last]:
            piece = []
            for leaf, size in enumerate(_share_bytes(spec, [weight])[0]):
                shape = (spec.rows(leaf, weight), *spec.row_shapes[leaf])
                chunk = buffer[offset : offset + size].clone()
                piece.append(chunk.view(spec.dtypes[leaf]).view(shape))
                offset += size
            pieces.append(tuple(piece))
    return layout.join_output(spec, pieces)
