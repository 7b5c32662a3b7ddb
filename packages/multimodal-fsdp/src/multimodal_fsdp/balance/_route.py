"""The byte all-to-all of a balanced call, differentiable.

Every field (or output tensor) of every item crosses in ONE ``all_to_all_single`` of
raw bytes, whatever the dtypes, so the number of collectives never depends on them and
a rank with nothing to send still takes part with empty buffers. The autograd function
sends the gradients of the floating fields back along the inverse route.

An output tensor the loss never reads has no gradient (``None``), and one process would
leave the parameters that feed only it without one. So a route with ``flags`` sends, in
front of its gradient bytes to every rank, one byte per field saying whether this rank
has a gradient for it; a field that no rank has one for gets ``None`` back on every rank
(the same answer everywhere, so the tower's FSDP units reduce the same parameters).
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
    flags: int = 0  # fields with a has-gradient byte to every rank in backward (agreed)

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
    flags: Tensor | None = None,
) -> tuple[list[Tensor], Tensor | None]:
    """Send rows ``rows_out[f][d]`` of each field to each rank as bytes, after ``flags``
    (uint8, the same to every rank) when given; return each field's received rows,
    concatenated in source-rank order, and the flags received (one row per source)."""
    world = len(rows_in[0]) if rows_in else dist.get_world_size(route.group)
    nflags = 0 if flags is None else flags.numel()
    chunks: list[Tensor] = []
    send_sizes = [nflags] * world
    offsets = [0] * len(fields)
    for dest in range(world):
        if flags is not None:
            chunks.append(flags)
        for k, field in enumerate(fields):
            rows = rows_out[k][dest]
            if rows:
                chunks.append(_bytes_of(tensors[k][offsets[k] : offsets[k] + rows]))
                offsets[k] += rows
            send_sizes[dest] += route.nbytes(field, rows)
    recv_sizes = [
        nflags + sum(route.nbytes(f, rows_in[k][src]) for k, f in enumerate(fields))
        for src in range(world)
    ]
    send = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=route.device)
    recv = torch.zeros(sum(recv_sizes), dtype=torch.uint8, device=route.device)
    if flags is not None:  # every source starts as this rank (the fake group moves nothing)
        starts = [sum(recv_sizes[:src]) for src in range(world)]
        for start in starts:
            recv[start : start + nflags] = flags
    dist.all_to_all_single(
        recv,
        send.to(route.device),
        output_split_sizes=recv_sizes,
        input_split_sizes=send_sizes,
        group=route.group,
    )
    parts: list[list[Tensor]] = [[] for _ in fields]
    received_flags: list[Tensor] = []
    offset = 0
    for src in range(world):
        received_flags.append(recv[offset : offset + nflags])
        offset += nflags
        for k, field in enumerate(fields):
            rows = rows_in[k][src]
            size = route.nbytes(field, rows)
            piece = recv[offset : offset + size].clone().view(route.dtypes[field])
            parts[k].append(piece.view(rows, *route.row_shapes[field]))
            offset += size
    tensors_in = [
        torch.cat(p)
        if p
        else torch.empty((0, *route.row_shapes[f]), dtype=route.dtypes[f], device=route.device)
        for p, f in zip(parts, fields, strict=True)
    ]
    return tensors_in, (torch.stack(received_flags) if flags is not None else None)


class Exchange(torch.autograd.Function):
    """All fields through one byte all_to_all; gradients of the floating fields that
    ``route.grads`` marks return along the inverse route. ``link`` is a scalar that
    orders this exchange after whatever produced it in backward (and keeps the node in
    the graph when no field needs a gradient locally); the last output is a zero scalar
    that callers add to their loss so the backward collective runs on every rank.

    After the fields may come ``route.flags`` scalars, one per field (a rank with no
    field of its own: a placeholder run's outputs, summed times 0): each gets a zero
    gradient when some rank has a gradient for that field, else ``None``."""

    @staticmethod
    def forward(ctx: Any, route: Route, link: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unread output's gradient arrives as None
        ctx.route = route
        ctx.link_shape = link.shape
        everything = list(range(len(route.dtypes)))
        fields, ctx.anchors = tensors[: len(everything)], len(tensors) - len(everything)
        received, _ = _all_to_all(route, fields, route.send_rows, route.recv_rows, everything)
        for tensor, dtype in zip(received, route.dtypes, strict=True):
            if not dtype.is_floating_point:
                ctx.mark_non_differentiable(tensor)
        return (*received, torch.zeros((), device=route.device))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        route: Route = ctx.route
        fields = [f for f, needed in enumerate(route.grads) if needed]
        flags = None
        if route.flags:
            have = [
                int(f < len(route.grads) and route.grads[f] and grads[f] is not None)
                for f in range(route.flags)
            ]
            flags = torch.tensor(have, dtype=torch.uint8, device=route.device)
        outgoing = []
        for f in fields:
            grad = grads[f]
            rows = sum(route.recv_rows[f])
            if grad is None:
                grad = torch.zeros(
                    (rows, *route.row_shapes[f]), dtype=route.dtypes[f], device=route.device
                )
            outgoing.append(grad.to(route.dtypes[f]))
        back, received = _all_to_all(
            route,
            outgoing,
            [route.recv_rows[f] for f in fields],
            [route.send_rows[f] for f in fields],
            fields,
            flags,
        )
        # A field no rank has a gradient for gets None here, the same on every rank.
        anywhere = [True] * max(route.flags, len(route.dtypes))
        if received is not None:
            anywhere = [bool(x) for x in received.amax(dim=0).tolist()]
        result: list[Tensor | None] = [None] * (len(route.dtypes) + ctx.anchors)
        for f, grad in zip(fields, back, strict=True):
            result[f] = grad if anywhere[f] else None
        for k in range(ctx.anchors):
            if anywhere[k]:
                result[len(route.dtypes) + k] = torch.zeros((), device=route.device)
        return (None, torch.zeros(ctx.link_shape, device=route.device), *result)
