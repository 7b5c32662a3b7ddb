"""The balanced tower call: exchange item sizes, send items, encode a share, send back.

Every rank of ``group`` takes part in every balanced call of a tower, with its own
items (``balanced_call``) or with none (``join_without_call``, for a rank whose forward
has no such call). The collectives of one call, in order, are fixed:

Forward (``W`` ranks, ``n_r`` items on rank ``r``, ``N = max_r n_r``, ``B`` the
longest pickled ``CallSpec`` in bytes, ``F`` fields):

1. ``all_gather`` of the header: ``HEADER_INTS`` int64 per rank
   (``W * HEADER_INTS * 8`` bytes received per rank);
2. ``all_gather`` of the item table: ``N * ITEM_INTS + ceil(B / 8)`` int64 per rank
   (``W`` times that, times 8 bytes, received per rank); skipped when no rank calls
   (a round of ``join_remaining_calls`` in which every rank joins: it ends there).
   When no rank has an item, the call ends here.
3. ``all_to_all_single`` (uint8) of the inputs: rank ``r`` sends, to each rank ``d``,
   the bytes of every field row of its items that ``d`` encodes
   (``sum over items of sum_f rows_f * row_numel_f * itemsize_f``); what it receives
   is the same sum over the items it encodes. Bytes to itself included.
4. ``all_gather`` of the status after the tower ran: ``STATUS_INTS`` int64 per rank.
5. ``all_to_all_single`` (uint8) of the outputs: rank ``r`` sends back, for each item
   it encoded, ``sum over output tensors of rows * row_numel * itemsize`` (rows per item
   proportional to the item's first-field rows).

Backward, when gradients are needed (grad mode on and the tower trainable or some
rank's floating input requiring grad): one ``all_to_all_single`` (uint8) with the
output gradients along the inverse route of 5 (floating output tensors, the same bytes
as 5 for them), led by ``L`` flag bytes to every rank, itself included (``L`` output
tensors: whether this rank has a gradient for each; an output no rank has one for gets
``None`` on every rank, so parameters that feed only unread outputs keep no gradient,
as in one process); then, when some rank's floating input requires grad, one with the
input gradients along the inverse route of 3 (floating fields only).

In all: 1 all_gather when no rank calls; 2 when no rank has an item; else 3 and 2
all_to_all_single in forward, and 0, 1 or 2 all_to_all_single in backward.
[exchange_traffic][multimodal_fsdp.balance.traffic.exchange_traffic] computes each
rank's list with its bytes. Under the fake process group every rank looks like the
calling one (the gathers start from its own values), so the same code runs there.

All tensors are sent as raw bytes, so one collective carries every field or output
tensor whatever their dtypes, and a rank that sends and receives nothing still takes
part with empty buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from multimodal_fsdp.balance._metadata import Table, exchange_metadata, gather
from multimodal_fsdp.balance._route import Exchange, Route
from multimodal_fsdp.balance.assign import assign_items
from multimodal_fsdp.balance.layouts import (
    CallSpec,
    FieldSpec,
    MediaCall,
    MediaItem,
    MediaLayout,
    OutputSpec,
)
from multimodal_fsdp.balance.registry import media_layout_for

__all__ = ["balanced_call", "join_without_call", "join_remaining_calls"]

logger = logging.getLogger(__name__)


def _device(tower: nn.Module, call: MediaCall | None, group: Any) -> torch.device:
    if call is not None:
        for item in call.items:
            return item.fields[0].device
    for param in tower.parameters():
        if param.device.type != "meta":
            return param.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _status(code: int, leaves: int, group: Any, device: torch.device) -> list[Tensor]:
    return [
        t.cpu()
        for t in gather(torch.tensor([code, leaves], dtype=torch.int64, device=device), group)
    ]


def _run(
    tower: nn.Module,
    layout: MediaLayout,
    call: MediaCall | None,
    error: BaseException | None,
    *,
    group: Any,
    run_when_empty: bool,
    runner: Callable[..., Any],
    original: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
) -> tuple[Any, Tensor, bool]:
    """The call's output on this rank, the zero anchor, and whether any rank called."""
    device = _device(tower, call, group)
    trainable = any(p.requires_grad for p in tower.parameters())
    table = exchange_metadata(
        call, error, layout=layout, trainable=trainable, group=group, device=device
    )
    world, rank = table.world, table.rank
    anchor = torch.zeros((), device=device)
    if not any(table.costs):
        if original is None:
            return None, anchor, bool(table.callers)
        return runner(*original[0], **original[1]), anchor, True  # no items: as unbalanced
    spec = table.spec
    if spec is None:
        raise RuntimeError("balanced tower call: items without a call spec")  # cannot happen
    owners = assign_items(table.costs)
    if logger.isEnabledFor(logging.DEBUG):
        loads = [0] * world
        for r, costs in enumerate(table.costs):
            for i, cost in enumerate(costs):
                loads[owners[r][i]] += cost
        before = [sum(costs) for costs in table.costs]
        logger.debug(
            "balanced call of %s: cost per rank %s -> %s", type(tower).__name__, before, loads
        )
    nfields = len(table.fields)
    # Inputs: my items to their encoders (grouped by destination), others' to me.
    mine = sorted(range(len(table.costs[rank])), key=lambda i: (owners[rank][i], i))
    send_fields = []
    for f in range(nfields):
        parts = [call.items[i].fields[f] for i in mine] if call is not None else []
        empty = torch.empty(
            (0, *table.fields[f].row_shape), dtype=table.fields[f].dtype, device=device
        )
        send_fields.append(torch.cat(parts) if parts else empty)
    send_rows = tuple(
        tuple(
            sum(table.rows[rank][i][f] for i in mine if owners[rank][i] == d) for d in range(world)
        )
        for f in range(nfields)
    )
    assigned = [
        (s, i) for s in range(world) for i in range(len(table.costs[s])) if owners[s][i] == rank
    ]
    recv_rows = tuple(
        tuple(sum(table.rows[s][i][f] for (s2, i) in assigned if s2 == s) for s in range(world))
        for f in range(nfields)
    )
    differentiable = table.grad_enabled
    in_route = Route(
        send_rows=send_rows,
        recv_rows=recv_rows,
        dtypes=tuple(f.dtype for f in table.fields),
        row_shapes=tuple(f.row_shape for f in table.fields),
        grads=table.input_grads,
        group=group,
        device=device,
    )
    link = torch.zeros((), device=device, requires_grad=differentiable and any(table.input_grads))
    *received, in_token = Exchange.apply(  # type: ignore[no-untyped-call]
        in_route, link, *send_fields
    )
    # Run the tower on my share (or a placeholder).
    items: list[MediaItem] = []
    offsets = [0] * nfields
    for s, i in assigned:
        fields = []
        for f in range(nfields):
            rows = table.rows[s][i][f]
            fields.append(received[f][offsets[f] : offsets[f] + rows])
            offsets[f] += rows
        items.append(
            MediaItem(fields=tuple(fields), cost=table.costs[s][i], sizes=table.sizes[s][i])
        )
    weights = [table.rows[s][i][0] for s, i in assigned]
    out_spec: OutputSpec | None = None
    pieces: list[tuple[Tensor, ...]] = []
    zero_link = in_token
    placeholder: list[Tensor] = []
    failure: BaseException | None = None
    try:
        if items:
            args, kwargs = layout.build_call(spec, items)
            out_spec, pieces = layout.split_output(runner(*args, **kwargs), weights)
        elif run_when_empty:
            placeholder = _placeholder_run(layout, spec, table, runner, device)
    except Exception as raised:  # re-raised below, after every rank knows
        failure = raised
    produced = len(out_spec.dtypes) if out_spec else len(placeholder) if placeholder else -1
    statuses = _status(int(failure is not None), produced, group, device)
    failed = [r for r, row in enumerate(statuses) if int(row[0])]
    if failed:
        if failure is not None:
            raise failure
        raise RuntimeError(
            f"balanced tower call: the tower failed on rank(s) {failed} (see their error)"
        )
    leaves = {int(row[1]) for row in statuses} - {-1}
    if len(leaves) > 1:
        raise ValueError(
            "balanced tower call: the tower's outputs differ between ranks "
            f"({sorted(leaves)} tensors)"
        )
    # Outputs back to their owners.
    local = len(table.costs[rank])
    if local and out_spec is None:
        raise RuntimeError(
            "balanced tower call: a rank with items encoded none"
        )  # the rule prevents it
    nleaves = len(out_spec.dtypes) if out_spec is not None else 0
    out_send = [
        torch.cat([piece[leaf] for piece in pieces]) if pieces else torch.empty(0, device=device)
        for leaf in range(nleaves)
    ]
    out_send_rows = tuple(
        tuple(
            sum(
                piece[leaf].shape[0]
                for (s, _), piece in zip(assigned, pieces, strict=True)
                if s == d
            )
            for d in range(world)
        )
        for leaf in range(nleaves)
    )
    home = sorted(range(local), key=lambda i: (owners[rank][i], i))
    out_recv_rows = tuple(
        tuple(
            sum(out_spec.rows(leaf, table.rows[rank][i][0]) for i in home if owners[rank][i] == s)
            if out_spec is not None
            else 0
            for s in range(world)
        )
        for leaf in range(nleaves)
    )
    out_differentiable = differentiable and (table.trainable or any(table.input_grads))
    out_route = Route(
        send_rows=out_send_rows,
        recv_rows=out_recv_rows,
        dtypes=out_spec.dtypes if out_spec is not None else (),
        row_shapes=out_spec.row_shapes if out_spec is not None else (),
        grads=tuple(out_differentiable and d.is_floating_point for d in out_spec.dtypes)
        if out_spec
        else (),
        group=group,
        device=device,
        flags=max(leaves, default=0) if out_differentiable else 0,
    )
    if out_differentiable and not zero_link.requires_grad:
        zero_link = torch.zeros((), device=device, requires_grad=True)
    *returned, out_token = Exchange.apply(  # type: ignore[no-untyped-call]
        out_route, zero_link, *out_send, *placeholder
    )
    if out_spec is None:
        return None, out_token, True
    # Pieces arrive by source rank; put them back in call order.
    cursor = [0] * nleaves
    by_item: dict[int, tuple[Tensor, ...]] = {}
    for i in home:
        piece = []
        for leaf in range(nleaves):
            n = out_spec.rows(leaf, table.rows[rank][i][0])
            piece.append(returned[leaf][cursor[leaf] : cursor[leaf] + n])
            cursor[leaf] += n
        by_item[i] = tuple(piece)
    output = layout.join_output(out_spec, [by_item[i] for i in range(local)])
    return output, out_token, True


def _placeholder_run(
    layout: MediaLayout,
    spec: CallSpec,
    table: Table,
    runner: Callable[..., Any],
    device: torch.device,
) -> list[Tensor]:
    """Run the tower on a placeholder shaped like the cheapest item; return each output
    tensor summed and times 0 (a zero scalar; integer tensors give a constant zero), to be
    linked into the exchange of the outputs: in backward the tower then runs for the
    outputs that have a gradient on some rank, and only for those, as on the ranks with
    items."""
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


def balanced_call(
    tower: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    layout: MediaLayout | None = None,
    group: Any = None,
    run_when_empty: bool = False,
    runner: Callable[..., Any] | None = None,
    anchors: list[Tensor] | None = None,
) -> Any:
    """``tower(*args, **kwargs)``, with the items of every rank's call spread evenly over
    the ranks of ``group`` (collective: every rank calls this or ``join_without_call``).

    Returns what the tower would have returned for this rank's items, built from pieces
    encoded anywhere (``None`` for a call with no items while other ranks have some:
    use ``join_without_call`` there); gradients flow back to the encoding ranks and,
    where inputs require grad, to the inputs. ``runner`` runs the tower on the local share (default
    ``tower`` itself; a hook that replaces the tower's forward passes the original).
    ``run_when_empty``: run the tower on a placeholder whose output counts 0 when this
    rank gets nothing to encode (for towers that own FSDP units). ``anchors``: a list
    that gets the call's zero anchor when gradients flow back; add it to the loss (as
    ``join_without_call``'s) so this rank runs the exchange's backward collectives even
    when its loss reads none of the outputs, as the ranks that joined do.
    """
    chosen = layout if layout is not None else media_layout_for(tower)
    named = dict(kwargs or {})
    error: BaseException | None = None
    try:
        call = chosen.split_call(tower, tuple(args), named)
    except (ValueError, TypeError) as raised:
        error = raised
        call = MediaCall(spec=CallSpec(fields=()), items=())
    output, anchor, _ = _run(
        tower,
        chosen,
        call,
        error,
        group=group,
        run_when_empty=run_when_empty,
        runner=runner or tower,
        original=(tuple(args), named),
    )
    if anchors is not None and anchor.requires_grad:
        anchors.append(anchor)
    return output


def join_without_call(
    tower: nn.Module,
    *,
    layout: MediaLayout | None = None,
    group: Any = None,
    run_when_empty: bool = False,
    runner: Callable[..., Any] | None = None,
) -> Tensor:
    """Take part in a balanced call of ``tower`` on a rank whose forward has no call of
    it (a text-only batch): this rank may still encode others' items. Returns a zero
    scalar; add it to the loss so this rank joins the exchange's backward collectives."""
    chosen = layout if layout is not None else media_layout_for(tower)
    _, anchor, _ = _run(
        tower,
        chosen,
        None,
        None,
        group=group,
        run_when_empty=run_when_empty,
        runner=runner or tower,
    )
    return anchor


def join_remaining_calls(
    tower: nn.Module,
    *,
    layout: MediaLayout | None = None,
    group: Any = None,
    run_when_empty: bool = False,
    runner: Callable[..., Any] | None = None,
) -> tuple[Tensor, int]:
    """Join, as a rank without a call, every balanced call of ``tower`` that other ranks
    still make, until a round in which no rank calls (collective: every rank calls this
    once it has made all of its own calls of this forward, e.g. just before the decoder).

    Ranks need not know each other's number of calls (text-only batches, an image call
    here and an image and a video call there, one call per image). Returns the sum of the
    zero anchors (add it to a tensor the loss depends on, before the decoder, so the
    backward collectives keep their order) and the number of calls joined. The last
    round costs one ``all_gather`` of the header.
    """
    chosen = layout if layout is not None else media_layout_for(tower)
    total = torch.zeros(())
    joined = 0
    while True:
        _, anchor, called = _run(
            tower,
            chosen,
            None,
            None,
            group=group,
            run_when_empty=run_when_empty,
            runner=runner or tower,
        )
        if not called:
            return total, joined
        total = total + anchor.to(total.device) if joined else anchor
        joined += 1
