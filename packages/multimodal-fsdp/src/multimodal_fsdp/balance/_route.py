"""The byte all-to-all of a balanced call, differentiable.

Every field (or output tensor) of every item crosses in ONE ``all_to_all_single`` of
raw bytes, whatever the dtypes, and the gradients of the floating fields come back
along the inverse route. An output the loss never reads has no gradient, and one process
would leave the parameters feeding only it without one: so a route with ``flags`` sends,
before its gradient bytes to every rank, one has-gradient byte per field, and a field no
rank has a gradient for gets ``None`` on every rank (so FSDP units reduce the same
parameters everywhere). Rows a rank keeps pass through untouched (``kept``), only so
their gradients count in the flags. The forward collective can start early
(``Pending``, ``async_op``) so a rank encodes its kept items while the others' arrive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Route", "Exchange", "Pending"]


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
    #: For each tensor passed through untouched (rows this rank keeps), its field.
    kept: tuple[int, ...] = ()

    def nbytes(self, field: int, rows: int) -> int:
        return rows * math.prod(self.row_shapes[field]) * self.dtypes[field].itemsize


def bytes_of(tensor: Tensor) -> Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class Pending:
    """One byte ``all_to_all_single`` of a route, started: ``wait`` returns each field's
    received rows (in source-rank order) and the flags received (a row per source)."""

    def __init__(
        self,
        route: Route,
        tensors: Sequence[Tensor],
        rows_out: Sequence[Sequence[int]],
        rows_in: Sequence[Sequence[int]],
        fields: Sequence[int],
        flags: Tensor | None = None,
        *,
        async_op: bool = False,
    ) -> None:
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
                    chunks.append(bytes_of(tensors[k][offsets[k] : offsets[k] + rows]))
                    offsets[k] += rows
                send_sizes[dest] += route.nbytes(field, rows)
        recv_sizes = [
            nflags + sum(route.nbytes(f, rows_in[k][src]) for k, f in enumerate(fields))
            for src in range(world)
        ]
        send = (
            torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=route.device)
        )
        recv = torch.zeros(sum(recv_sizes), dtype=torch.uint8, device=route.device)
        if flags is not None:  # every source starts as this rank (the fake group moves nothing)
            starts = [sum(recv_sizes[:src]) for src in range(world)]
            for start in starts:
                recv[start : start + nflags] = flags
        self._route, self._fields, self._rows_in = route, list(fields), rows_in
        self._world, self._nflags, self._recv = world, nflags, recv
        self._send = send.to(route.device)  # alive until the collective is done
        self._work = dist.all_to_all_single(
            recv,
            self._send,
            output_split_sizes=recv_sizes,
            input_split_sizes=send_sizes,
            group=route.group,
            async_op=async_op,
        )

    def wait(self) -> tuple[list[Tensor], Tensor | None]:
        if self._work is not None:
            self._work.wait()
            self._work = None
        route, recv = self._route, self._recv
        parts: list[list[Tensor]] = [[] for _ in self._fields]
        received_flags: list[Tensor] = []
        offset = 0
        for src in range(self._world):
            received_flags.append(recv[offset : offset + self._nflags])
            offset += self._nflags
            for k, field in enumerate(self._fields):
                rows = self._rows_in[k][src]
                size = route.nbytes(field, rows)
                if rows:
                    piece = recv[offset : offset + size].clone().view(route.dtypes[field])
                    parts[k].append(piece.view(rows, *route.row_shapes[field]))
                offset += size
        tensors_in = [
            torch.cat(p)
            if p
            else torch.empty((0, *route.row_shapes[f]), dtype=route.dtypes[f], device=route.device)
            for p, f in zip(parts, self._fields, strict=True)
        ]
        flags = torch.stack(received_flags) if self._nflags else None
        return tensors_in, flags


def start_forward(route: Route, tensors: Sequence[Tensor], *, async_op: bool) -> Pending:
    """Start the forward collective of ``route`` for its fields' send rows."""
    everything = list(range(len(route.dtypes)))
    return Pending(route, tensors, route.send_rows, route.recv_rows, everything, async_op=async_op)


class Exchange(torch.autograd.Function):
    """All fields through one byte all_to_all; the gradients ``route.grads`` marks return
    along the inverse route. ``link`` orders this exchange after what produced it in
    backward (and keeps the node in the graph); the last output is a zero scalar for the
    loss, so the backward collective runs on every rank. ``pending``: the forward
    collective already started, or ``None``. After the fields come ``len(route.kept)``
    tensors passed through, then ``route.flags`` scalars (a placeholder run's outputs,
    summed times 0), each given a zero gradient when some rank has one for its field."""

    @staticmethod
    def forward(
        ctx: Any, route: Route, pending: Pending | None, link: Tensor, *tensors: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unread output's gradient arrives as None
        ctx.route = route
        ctx.link_shape = link.shape
        nfields, nkept = len(route.dtypes), len(route.kept)
        fields = tensors[:nfields]
        kept = tensors[nfields : nfields + nkept]
        ctx.nflag_scalars = len(tensors) - nfields - nkept
        if pending is None:
            pending = start_forward(route, fields, async_op=False)
        received, _ = pending.wait()
        for tensor, dtype in zip(received, route.dtypes, strict=True):
            if not dtype.is_floating_point:
                ctx.mark_non_differentiable(tensor)
        passed = [tensor.view_as(tensor) for tensor in kept]
        return (*received, *passed, torch.zeros((), device=route.device))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        route: Route = ctx.route
        nfields, nkept = len(route.dtypes), len(route.kept)
        kept_grads = grads[nfields : nfields + nkept]
        fields = [f for f, needed in enumerate(route.grads) if needed]
        flags = None
        if route.flags:
            kept_have = {k for g, k in zip(kept_grads, route.kept, strict=True) if g is not None}
            have = [
                int(f < nfields and route.grads[f] and (grads[f] is not None or f in kept_have))
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
        back, received = Pending(
            route,
            outgoing,
            [route.recv_rows[f] for f in fields],
            [route.send_rows[f] for f in fields],
            fields,
            flags,
        ).wait()
        # A field no rank has a gradient for gets None here, the same on every rank.
        anywhere = [True] * max(route.flags, nfields)
        if received is not None:
            anywhere = [bool(x) for x in received.amax(dim=0).tolist()]
        result: list[Tensor | None] = [None] * (nfields + nkept + ctx.nflag_scalars)
        for f, grad in zip(fields, back, strict=True):
            result[f] = grad if anywhere[f] else None
        for k, grad in enumerate(kept_grads):
            result[nfields + k] = grad
        for k in range(ctx.nflag_scalars):
            if anywhere[k]:
                result[nfields + nkept + k] = torch.zeros((), device=route.device)
        return (None, None, torch.zeros(ctx.link_shape, device=route.device), *result)
