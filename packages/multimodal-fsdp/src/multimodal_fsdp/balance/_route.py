"""The byte all-to-all of a balanced call, differentiable.

Every field (or output tensor) of every item crosses in ONE ``all_to_all_single`` of
raw bytes, whatever the dtypes, so the number of collectives never depends on them and
a rank with nothing to send still takes part with empty buffers. The autograd function
sends the gradients of the floating fields back along the inverse route.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Route", "Exchange"]


@dataclass(frozen=True)
class Route:
    """One exchange's rows: ``send_rows[f][d]`` rows of field ``f`` go to rank ``d``,
    ``recv_rows[f][s]`` come from rank ``s``; the fields' dtypes and row shapes; which
    fields carry gradients back."""

    send_rows: tuple[tuple[int, ...], ...]
    recv_rows: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    row_shapes: tuple[tuple[int, ...], ...]
    grads: tuple[bool, ...]
    group: Any
    device: torch.device

    def nbytes(self, field: int, rows: int) -> int:
        return rows * math.prod(self.row_shapes[field]) * self.dtypes[field].itemsize


def _bytes_of(tensor: Tensor) -> Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _all_to_all(
    route: Route,
    tensors: Sequence[Tensor],
    rows_out: Sequence[Sequence[int]],
    rows_in: Sequence[Sequence[int]],
    fields: Sequence[int],
) -> list[Tensor]:
    """Send rows ``rows_out[f][d]`` of each field to each rank as bytes; return each
    field's received rows, concatenated in source-rank order."""
    world = len(rows_in[0]) if rows_in else dist.get_world_size(route.group)
    chunks: list[Tensor] = []
    send_sizes = [0] * world
    offsets = [0] * len(fields)
    for dest in range(world):
        for k, field in enumerate(fields):
            rows = rows_out[k][dest]
            if rows:
                chunks.append(_bytes_of(tensors[k][offsets[k] : offsets[k] + rows]))
                offsets[k] += rows
            send_sizes[dest] += route.nbytes(field, rows)
    recv_sizes = [
        sum(route.nbytes(f, rows_in[k][src]) for k, f in enumerate(fields)) for src in range(world)
    ]
    send = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=route.device)
    recv = torch.zeros(sum(recv_sizes), dtype=torch.uint8, device=route.device)
    dist.all_to_all_single(
        recv,
        send.to(route.device),
        output_split_sizes=recv_sizes,
        input_split_sizes=send_sizes,
        group=route.group,
    )
    parts: list[list[Tensor]] = [[] for _ in fields]
    offset = 0
    for src in range(world):
        for k, field in enumerate(fields):
            rows = rows_in[k][src]
            size = route.nbytes(field, rows)
            piece = recv[offset : offset + size].clone().view(route.dtypes[field])
            parts[k].append(piece.view(rows, *route.row_shapes[field]))
            offset += size
    return [
        torch.cat(p)
        if p
        else torch.empty((0, *route.row_shapes[f]), dtype=route.dtypes[f], device=route.device)
        for p, f in zip(parts, fields, strict=True)
    ]


class Exchange(torch.autograd.Function):
    """All fields through one byte all_to_all; gradients of the floating fields that
    ``route.grads`` marks return along the inverse route. ``link`` is a scalar that
    orders this exchange after whatever produced it in backward (and keeps the node in
    the graph when no field needs a gradient locally); the last output is a zero scalar
    that callers add to their loss so the backward collective runs on every rank."""

    @staticmethod
    def forward(ctx: Any, route: Route, link: Tensor, *fields: Tensor) -> tuple[Tensor, ...]:
        ctx.route = route
        ctx.link_shape = link.shape
        everything = list(range(len(route.dtypes)))
        received = _all_to_all(route, fields, route.send_rows, route.recv_rows, everything)
        for tensor, dtype in zip(received, route.dtypes, strict=True):
            if not dtype.is_floating_point:
                ctx.mark_non_differentiable(tensor)
        return (*received, torch.zeros((), device=route.device))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        route: Route = ctx.route
        fields = [f for f, needed in enumerate(route.grads) if needed]
        outgoing = []
        for f in fields:
            grad = grads[f]
            rows = sum(route.recv_rows[f])
            if grad is None:
                grad = torch.zeros(
                    (rows, *route.row_shapes[f]), dtype=route.dtypes[f], device=route.device
                )
            outgoing.append(grad.to(route.dtypes[f]))
        back = _all_to_all(
            route,
            outgoing,
            [route.recv_rows[f] for f in fields],
            [route.send_rows[f] for f in fields],
            fields,
        )
        result: list[Tensor | None] = [None] * len(route.dtypes)
        for f, grad in zip(fields, back, strict=True):
            result[f] = grad
        return (None, torch.zeros(ctx.link_shape, device=route.device), *result)
