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

Collectives per balanced call, on the data group (``T`` ranks): one
``all_gather_object`` of each rank's output description (the output structure and the
rows of each piece), then one ``all_gather`` of the outputs' bytes, padded to the
longest rank's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from multimodal_fsdp.balance.layouts import MediaCall, MediaLayout, OutputSpec

__all__ = ["DataGroup", "gather_outputs"]


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
        the same split on every rank of the group (sizes differ by at most one)."""
        return (
            self.position * items // self.size,
            (self.position + 1) * items // self.size,
        )

    def share_of(self, call: MediaCall) -> MediaCall:
        start, stop = self.share(len(call.items))
        return MediaCall(spec=call.spec, items=call.items[start:stop])


def _bytes_of(tensor: Tensor) -> Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def gather_outputs(
    layout: MediaLayout,
    data: DataGroup,
    output: Any,
    weights: Sequence[int],
    device: torch.device,
) -> Any:
    """The whole call's output on every rank of ``data`` (collective over the group),
    from each rank's ``output`` for its share (items of the given ``weights``; ``None``
    and no weights for an empty share): this rank's pieces keep their graph, the others'
    are received copies."""
    spec: OutputSpec | None = None
    mine: list[tuple[Tensor, ...]] = []
    if output is not None and weights:
        spec, mine = layout.split_output(output, list(weights))
    rows = [tuple(int(leaf.shape[0]) for leaf in piece) for piece in mine]
    described: list[Any] = [None] * data.size
    dist.all_gather_object(described, (spec, rows), group=data.group)
    specs = [s for s, _ in described if s is not None]
    if not specs:  # the call has no items anywhere: the layouts never split such a call
        raise RuntimeError("balanced tower call: no rank of the data group encoded its share")
    full = specs[0]

    def nbytes(piece_rows: Sequence[int]) -> int:
        return sum(
            n * int(torch.Size(full.row_shapes[leaf]).numel()) * full.dtypes[leaf].itemsize
            for leaf, n in enumerate(piece_rows)
        )

    sizes = [sum(nbytes(r) for r in piece_rows) for _, piece_rows in described]
    longest = max(sizes)
    send = torch.zeros(longest, dtype=torch.uint8, device=device)
    if mine:
        flat = torch.cat([_bytes_of(leaf) for piece in mine for leaf in piece])
        send[: flat.numel()] = flat
    received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in described]
    dist.all_gather(received, send, group=data.group)
    pieces: list[tuple[Tensor, ...]] = []
    for source, ((_, piece_rows), buffer) in enumerate(zip(described, received, strict=True)):
        if source == data.position:
            pieces.extend(mine)
            continue
        offset = 0
        for leaf_rows in piece_rows:
            piece = []
            for leaf, n in enumerate(leaf_rows):
                shape = (n, *full.row_shapes[leaf])
                size = n * int(torch.Size(full.row_shapes[leaf]).numel())
                size *= full.dtypes[leaf].itemsize
                chunk = buffer[offset : offset + size].clone()
                piece.append(chunk.view(full.dtypes[leaf]).view(shape))
                offset += size
            pieces.append(tuple(piece))
    return layout.join_output(full, pieces)
