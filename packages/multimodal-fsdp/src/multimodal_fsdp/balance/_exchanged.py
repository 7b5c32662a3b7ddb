"""One balanced call that moves items: the inputs' exchange, the encoding of this rank's
share, the status gather and the outputs' way back (the collectives are listed in
``multimodal_fsdp.balance.exchange``, which runs a call here once its round decided
that items change rank)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from multimodal_fsdp.balance._metadata import Table, gather
from multimodal_fsdp.balance._route import Exchange, Route, start_forward
from multimodal_fsdp.balance.assign import CallRoute
from multimodal_fsdp.balance.layouts import FieldSpec, MediaCall, MediaItem, MediaLayout, OutputSpec

if TYPE_CHECKING:
    from multimodal_fsdp.balance.exchange import Member


#: Bits of the first word of a rank's status: its run failed; its outputs need a gradient.
_FAILED, _NEEDS_GRAD = 1, 2


@dataclass
class _Encoded:
    """What this rank encoded in a balanced call (the kept items' pieces apart from the
    received ones), or why it failed: held until the status gather, where every rank
    learns of it."""

    spec: OutputSpec | None = None
    kept: list[tuple[Tensor, ...]] = field(default_factory=list)
    received: list[tuple[Tensor, ...]] = field(default_factory=list)
    placeholder: list[Tensor] = field(default_factory=list)
    failure: BaseException | None = None

    @property
    def produced(self) -> int:
        """Output tensors produced here (-1: none), which the ranks check they agree on."""
        if self.spec:
            return len(self.spec.dtypes)
        return len(self.placeholder) if self.placeholder else -1

    @property
    def needs_grad(self) -> bool:
        """Whether an output encoded here requires grad: even a frozen tower's may, on the
        ranks that run it (transformers' ``enable_input_require_grads`` hook)."""
        pieces = (*self.kept, *self.received, self.placeholder)
        return any(t.requires_grad for piece in pieces for t in piece)


class Exchanged:
    """One balanced call that moves items (see the module docstring)."""

    def __init__(
        self,
        member: Member,
        layout: MediaLayout,
        table: Table,
        route: CallRoute,
        call: MediaCall | None,
        device: torch.device,
        group: Any,
    ) -> None:
        self.member, self.layout, self.t, self.route = member, layout, table, route
        self.call, self.device, self.group = call, device, group
        self.runner = member.run(own=call is not None)
        self.kept = route.kept(table.rank)
        self.away = route.away(table.rank)
        self.assigned = route.assigned(table.rank)

    def _items(self, indices: Sequence[int]) -> list[MediaItem]:
        if self.call is None:
            return []
        return [self.call.items[i] for i in indices]

    def _encode(self, items: Sequence[MediaItem]) -> tuple[OutputSpec, list[tuple[Tensor, ...]]]:
        spec = self.t.spec
        if spec is None:  # pragma: no cover - a balanced table always has one
            raise RuntimeError("balanced tower call: items without a call spec")
        args, kwargs = self.layout.build_call(spec, items)
        weights = [item.fields[0].shape[0] for item in items]
        return self.layout.split_output(self.runner(*args, **kwargs), weights)

    def run(self) -> tuple[Any, Tensor | None]:
        """The call's forward in protocol order (inputs out, encode, status, outputs back),
        so every rank issues the collectives alike."""
        in_route, send_fields, link = self._input_route()
        kept_items = self._items(self.kept)
        # A tower without units runs twice: on the items it keeps while the others'
        # arrive, then on those (no collective inside it, so any number of runs is safe).
        overlap = not self.member.run_when_empty and bool(kept_items) and bool(self.assigned)
        done = _Encoded()
        pending = start_forward(in_route, send_fields, async_op=True) if overlap else None
        if overlap:
            try:
                done.spec, done.kept = self._encode(kept_items)
            except Exception as raised:  # raised by _check_status, once every rank knows
                done.failure = raised
        *received, in_token = Exchange.apply(  # type: ignore[no-untyped-call]
            in_route, pending, link, *send_fields
        )
        recv_items = self._received_items(received)
        if done.failure is None:
            self._encode_share(done, kept_items, recv_items, overlap)
        leaves, needs_grad = self._check_status(done)
        return self._outputs(done, in_token, leaves, needs_grad)

    def _input_route(self) -> tuple[Route, list[Tensor], Tensor]:
        """The route of the moved items' inputs, one send buffer per field, and ``link``,
        which ties the input gradients into the graph."""
        t = self.t
        nfields = len(t.fields)
        send_fields = []
        for f in range(nfields):
            parts = [item.fields[f] for item in self._items(self.away)]
            empty = torch.empty(
                (0, *t.fields[f].row_shape), dtype=t.fields[f].dtype, device=self.device
            )
            send_fields.append(torch.cat(parts) if parts else empty)
        splits = [
            self.route.per_peer(t.rank, [[item[f] for item in rows] for rows in t.rows])
            for f in range(nfields)
        ]
        in_route = Route(
            send_rows=tuple(send for send, _ in splits),
            recv_rows=tuple(recv for _, recv in splits),
            dtypes=tuple(f.dtype for f in t.fields),
            row_shapes=tuple(f.row_shape for f in t.fields),
            grads=t.input_grads,
            group=self.group,
            device=self.device,
        )
        grads = t.grad_enabled and any(t.input_grads)
        return in_route, send_fields, torch.zeros((), device=self.device, requires_grad=grads)

    def _received_items(self, received: Sequence[Tensor]) -> list[MediaItem]:
        """The items other ranks sent here, in the order they were assigned."""
        t = self.t
        nfields = len(t.fields)
        recv_items = []
        offsets = [0] * nfields
        for s, i in self.assigned:
            fields = []
            for f in range(nfields):
                rows = t.rows[s][i][f]
                fields.append(received[f][offsets[f] : offsets[f] + rows])
                offsets[f] += rows
            recv_items.append(
                MediaItem(fields=tuple(fields), cost=t.costs[s][i], sizes=t.sizes[s][i])
            )
        return recv_items

    def _encode_share(
        self,
        done: _Encoded,
        kept_items: list[MediaItem],
        recv_items: list[MediaItem],
        overlap: bool,
    ) -> None:
        """Encode what ``run`` has not of this rank's share, or a placeholder where the
        tower's units must gather on every rank; an error is kept in ``done``."""
        try:
            if overlap:
                _, done.received = self._encode(recv_items)
            elif kept_items or recv_items:
                done.spec, pieces = self._encode([*kept_items, *recv_items])
                done.kept, done.received = pieces[: len(kept_items)], pieces[len(kept_items) :]
            elif self.member.run_when_empty:
                done.placeholder = placeholder_run(self.layout, self.t, self.runner, self.device)
        except Exception as raised:  # raised by _check_status, once every rank knows
            done.failure = raised

    def _check_status(self, done: _Encoded) -> tuple[set[int], bool]:
        """The status gather: an error on one rank raises on every rank (before any waits
        for outputs that will not come); ranks agree on the number of output tensors
        (returned, at most one) and on whether any rank's outputs need a gradient."""
        bits = (_FAILED if done.failure is not None else 0) | (
            _NEEDS_GRAD if done.failure is None and done.needs_grad else 0
        )
        status = torch.tensor([bits, done.produced], dtype=torch.int64, device=self.device)
        statuses = [row.cpu() for row in gather(status, self.group)]
        failed = [r for r, row in enumerate(statuses) if int(row[0]) & _FAILED]
        if failed:
            if done.failure is not None:
                raise done.failure
            raise RuntimeError(
                f"balanced tower call: the tower failed on rank(s) {failed} (see their error)"
            )
        leaves = {int(row[1]) for row in statuses} - {-1}
        if len(leaves) > 1:
            raise ValueError(
                "balanced tower call: the tower's outputs differ between ranks "
                f"({sorted(leaves)} tensors)"
            )
        return leaves, any(int(row[0]) & _NEEDS_GRAD for row in statuses)

    def _outputs(
        self, done: _Encoded, in_token: Tensor, leaves: set[int], needs_grad: bool
    ) -> tuple[Any, Tensor | None]:
        """Outputs of moved items back to their owners; this rank's output in call order.
        Whether gradients come back is agreed (``needs_grad``), never read from this
        rank's tensors alone, or ranks would record different backward collectives."""
        t, out_spec = self.t, done.spec
        if len(t.costs[t.rank]) and out_spec is None:  # the rule prevents it
            raise RuntimeError("balanced tower call: a rank with items encoded none")
        nleaves = len(out_spec.dtypes) if out_spec is not None else 0
        out_send = [  # the outputs encoded here for other ranks, one buffer per tensor
            torch.cat([piece[leaf] for piece in done.received])
            if done.received
            else torch.empty(
                (0, *out_spec.row_shapes[leaf]), dtype=out_spec.dtypes[leaf], device=self.device
            )
            for leaf in range(nleaves)
            if out_spec is not None
        ]
        differentiable = t.grad_enabled and (t.trainable or any(t.input_grads) or needs_grad)
        kept = [
            torch.cat([piece[leaf] for piece in done.kept]) for leaf in range(nleaves) if done.kept
        ]
        through = differentiable and bool(kept)  # kept outputs pass the exchange untouched
        out_route = self._output_route(done, leaves, differentiable, through)
        zero_link = in_token
        if differentiable and not zero_link.requires_grad:
            zero_link = torch.zeros((), device=self.device, requires_grad=True)
        *returned, out_token = Exchange.apply(  # type: ignore[no-untyped-call]
            out_route, None, zero_link, *out_send, *(kept if through else ()), *done.placeholder
        )
        if through:
            returned, kept = returned[:nleaves], returned[nleaves:]
        zero_term = out_token if out_token.requires_grad else None
        if out_spec is None or not t.costs[t.rank]:  # no items of its own (an empty share)
            return None, zero_term
        output = self.layout.join_output(out_spec, self._in_call_order(out_spec, kept, returned))
        return output, zero_term

    def _output_route(
        self, done: _Encoded, leaves: set[int], differentiable: bool, through: bool
    ) -> Route:
        """The route of the outputs: rows to each owner and from each encoder, and which
        tensors carry gradients back."""
        t, spec = self.t, done.spec
        flags = max(leaves, default=0) if differentiable else 0
        if spec is None:  # nothing encoded here (no items of its own either)
            return Route((), (), (), (), (), self.group, self.device, flags=flags)
        nleaves = len(spec.dtypes)
        send = [[0] * t.world for _ in range(nleaves)]
        for (owner, _), piece in zip(self.assigned, done.received, strict=True):
            for leaf in range(nleaves):
                send[leaf][owner] += piece[leaf].shape[0]
        recv = [[0] * t.world for _ in range(nleaves)]
        for i in self.away:
            for leaf in range(nleaves):
                recv[leaf][self.route.owners[t.rank][i]] += spec.rows(leaf, t.rows[t.rank][i][0])
        return Route(
            send_rows=tuple(map(tuple, send)),
            recv_rows=tuple(map(tuple, recv)),
            dtypes=spec.dtypes,
            row_shapes=spec.row_shapes,
            grads=tuple(differentiable and d.is_floating_point for d in spec.dtypes),
            group=self.group,
            device=self.device,
            flags=flags,
            kept=tuple(range(nleaves)) if through else (),
        )

    def _in_call_order(
        self, out_spec: OutputSpec, kept: Sequence[Tensor], returned: Sequence[Tensor]
    ) -> list[tuple[Tensor, ...]]:
        """Each item's output pieces in the order of this rank's call."""
        t, rank = self.t, self.t.rank
        nleaves = len(out_spec.dtypes)
        by_item: dict[int, tuple[Tensor, ...]] = {}
        for indices, rows in ((self.kept, kept), (self.away, returned)):
            cursor = [0] * nleaves
            for i in indices:
                piece = []
                for leaf in range(nleaves):
                    n = out_spec.rows(leaf, t.rows[rank][i][0])
                    piece.append(rows[leaf][cursor[leaf] : cursor[leaf] + n])
                    cursor[leaf] += n
                by_item[i] = tuple(piece)
        return [by_item[i] for i in range(len(t.costs[rank]))]


def placeholder_run(
    layout: MediaLayout,
    table: Table,
    runner: Callable[..., Any],
    device: torch.device,
) -> list[Tensor]:
    """Run the tower on a placeholder shaped like the cheapest item: each output tensor
    summed times 0, linked into the outputs' exchange so that in backward the tower runs
    for the outputs some rank has a gradient for, as on the ranks with items."""
    spec = table.spec
    if spec is None:  # pragma: no cover - a balanced table always has one
        raise RuntimeError("balanced tower call: a placeholder without a call spec")
    cheapest = min(
        ((c, r, i) for r, costs in enumerate(table.costs) for i, c in enumerate(costs)),
    )
    _, r, i = cheapest
    fields = [
        FieldSpec(dtype=f.dtype, row_shape=f.row_shape, rows=table.rows[r][i][k])
        for k, f in enumerate(table.fields)
    ]
    item = layout.placeholder(spec, fields, table.sizes[r][i])
    item = MediaItem(
        fields=tuple(t.to(device) for t in item.fields), cost=item.cost, sizes=item.sizes
    )
    args, kwargs = layout.build_call(spec, [item])
    output = runner(*args, **kwargs)
    _, leaves = layout.split_output(output, [fields[0].rows])
    return [
        leaf.sum().float() * 0 if leaf.dtype.is_floating_point else torch.zeros((), device=device)
        for leaf in leaves[0]
    ]
