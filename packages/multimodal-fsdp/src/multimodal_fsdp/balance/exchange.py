"""The balanced tower call: exchange item sizes, send items, encode a share, send back.

Every rank of ``group`` takes part in every balanced call of a tower, with its own
items (``balanced_call``) or with none (``join_without_call``, for a rank whose forward
has no such call). The collectives of one call, in order, are fixed:

Forward (``W`` ranks, ``n_r`` items on rank ``r``, ``N = max_r n_r``, ``B`` the
longest pickled ``CallSpec`` in bytes, ``F`` fields):

1. ``all_gather`` of the header: ``HEADER_INTS`` int64 per rank
   (``W * HEADER_INTS * 8`` bytes received per rank);
2. ``all_gather`` of the item table: ``N * ITEM_INTS + ceil(B / 8)`` int64 per rank
   (``W`` times that, times 8 bytes, received per rank).
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
as 5 for them); then, when some rank's floating input requires grad, one with the
input gradients along the inverse route of 3 (floating fields only).

In all: 2 all_gathers when no rank has an item; else 3 all_gathers and 2
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
import math
import pickle
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import Tensor, nn

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

__all__ = [
    "balanced_call",
    "join_without_call",
    "HEADER_INTS",
    "ITEM_INTS",
    "STATUS_INTS",
    "MAX_FIELDS",
    "MAX_ROW_DIMS",
    "MAX_SIZES",
]

logger = logging.getLogger(__name__)

MAX_FIELDS: Final = 8
MAX_ROW_DIMS: Final = 6
MAX_SIZES: Final = 4
_FIELD_INTS: Final = 3 + MAX_ROW_DIMS  # dtype code, requires grad, row dims, dims...
_FIXED: Final = 12
HEADER_INTS: Final = _FIXED + MAX_FIELDS * _FIELD_INTS
ITEM_INTS: Final = 1 + MAX_FIELDS + MAX_SIZES  # cost, rows per field, sizes
STATUS_INTS: Final = 2
_MAGIC: Final = 0x6D6564
_DTYPES: Final[tuple[torch.dtype, ...]] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)


class _Header:
    """Indices into the header row."""

    MAGIC, HAS_CALL, ERROR, ITEMS, FIELDS, GRAD, TRAINABLE, BLOB, LAYOUT, SIZES = range(10)


@dataclass(frozen=True)
class _Route:
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
    route: _Route,
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


class _Exchange(torch.autograd.Function):
    """All fields through one byte all_to_all; gradients of the floating fields that
    ``route.grads`` marks return along the inverse route. ``link`` is a scalar that
    orders this exchange after whatever produced it in backward (and keeps the node in
    the graph when no field needs a gradient locally); the last output is a zero scalar
    that callers add to their loss so the backward collective runs on every rank."""

    @staticmethod
    def forward(ctx: Any, route: _Route, link: Tensor, *fields: Tensor) -> tuple[Tensor, ...]:
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
        route: _Route = ctx.route
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


# --------------------------------------------------------------------------- metadata
@dataclass(frozen=True)
class _Table:
    """What every rank knows after the two metadata gathers."""

    world: int
    rank: int
    callers: tuple[int, ...]
    costs: tuple[tuple[int, ...], ...]
    rows: tuple[tuple[tuple[int, ...], ...], ...]  # rows[r][i][f]
    sizes: tuple[tuple[tuple[int, ...], ...], ...]
    fields: tuple[FieldSpec, ...]  # dtype and row shape (rows unused)
    input_grads: tuple[bool, ...]
    grad_enabled: bool
    trainable: bool
    spec: CallSpec | None


def _gather(tensor: Tensor, group: Any) -> list[Tensor]:
    """all_gather; every slot starts as this rank's tensor, so under the fake group
    (which moves no data) every rank looks like this one."""
    slots = [tensor.clone() for _ in range(dist.get_world_size(group))]
    dist.all_gather(slots, tensor, group=group)
    return slots


def _raise_everywhere(rows: Sequence[Tensor], error: BaseException | None, rank: int) -> None:
    failed = [r for r, row in enumerate(rows) if int(row[_Header.ERROR]) != 0]
    if not failed:
        return
    if error is not None:
        raise error
    raise ValueError(
        f"balanced tower call: rank(s) {failed} could not split their call (see their error)"
    )


def _exchange_metadata(
    call: MediaCall | None,
    error: BaseException | None,
    *,
    layout: MediaLayout,
    trainable: bool,
    group: Any,
    device: torch.device,
) -> _Table:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    header = torch.zeros(HEADER_INTS, dtype=torch.int64)
    header[_Header.MAGIC] = _MAGIC
    header[_Header.HAS_CALL] = int(call is not None)
    header[_Header.GRAD] = int(torch.is_grad_enabled())
    header[_Header.TRAINABLE] = int(trainable)
    header[_Header.LAYOUT] = zlib.crc32(layout.name.encode())
    blob = b""
    if call is not None and error is None:
        try:
            blob = _describe(call, header)
        except (ValueError, TypeError) as described:
            error = described
    header[_Header.ERROR] = int(error is not None)
    rows = _gather(header.to(device), group)
    rows = [row.cpu() for row in rows]
    _raise_everywhere(rows, error, rank)
    callers = tuple(r for r, row in enumerate(rows) if int(row[_Header.HAS_CALL]))
    _check_agreement(rows, callers, layout)
    most = max(int(row[_Header.ITEMS]) for row in rows)
    blob_words = max(math.ceil(int(row[_Header.BLOB]) / 8) for row in rows)
    table = torch.zeros(most * ITEM_INTS + blob_words, dtype=torch.int64)
    if call is not None:
        for i, item in enumerate(call.items):
            base = i * ITEM_INTS
            table[base] = item.cost
            for f, tensor in enumerate(item.fields):
                table[base + 1 + f] = tensor.shape[0]
            for s, size in enumerate(item.sizes):
                table[base + 1 + MAX_FIELDS + s] = size
        padded = blob + bytes(blob_words * 8 - len(blob))
        if blob_words:
            words = torch.frombuffer(bytearray(padded), dtype=torch.int64)
            table[most * ITEM_INTS :] = words
    tables = [t.cpu() for t in _gather(table.to(device), group)]
    return _read_table(rows, tables, callers, most, world, rank)


def _describe(call: MediaCall, header: Tensor) -> bytes:
    """Fill this rank's header from its call; the pickled spec is returned."""
    spec = call.spec
    if len(spec.fields) > MAX_FIELDS:
        raise ValueError(
            f"a balanced call has at most {MAX_FIELDS} per-item fields, got {spec.fields}"
        )
    header[_Header.ITEMS] = len(call.items)
    header[_Header.FIELDS] = len(spec.fields)
    first = call.items[0] if call.items else None
    for item in call.items:
        if len(item.sizes) > MAX_SIZES:
            raise ValueError(f"an item has at most {MAX_SIZES} sizes, got {item.sizes}")
        if isinstance(item.cost, bool) or not isinstance(item.cost, int) or item.cost < 1:
            raise ValueError(f"item costs must be positive integers, got {item.cost!r}")
    header[_Header.SIZES] = len(first.sizes) if first is not None else 0
    if first is not None:
        for f, (name, tensor) in enumerate(zip(spec.fields, first.fields, strict=True)):
            if tensor.dtype not in _DTYPES:
                raise TypeError(
                    f"field {name!r} has dtype {tensor.dtype}; valid choices: {list(_DTYPES)}"
                )
            row_shape = tuple(tensor.shape[1:])
            if len(row_shape) > MAX_ROW_DIMS:
                raise ValueError(
                    f"field {name!r} rows have {len(row_shape)} dims, at most {MAX_ROW_DIMS}"
                )
            for item in call.items:
                if (
                    tuple(item.fields[f].shape[1:]) != row_shape
                    or item.fields[f].dtype != tensor.dtype
                ):
                    raise ValueError(f"field {name!r} rows differ in shape or dtype between items")
            base = _FIXED + f * _FIELD_INTS
            header[base] = _DTYPES.index(tensor.dtype)
            header[base + 1] = int(any(item.fields[f].requires_grad for item in call.items))
            header[base + 2] = len(row_shape)
            for d, size in enumerate(row_shape):
                header[base + 3 + d] = size
    try:
        blob = pickle.dumps(spec)
    except Exception as error:  # pickling raises many types
        raise ValueError(
            f"the pass-through arguments {[n for n, _ in spec.constants]} of a balanced call "
            f"must be picklable (ranks without a call receive them): {error}"
        ) from None
    header[_Header.BLOB] = len(blob)
    return blob


def _field_specs(row: Tensor) -> tuple[FieldSpec, ...]:
    specs = []
    for f in range(int(row[_Header.FIELDS])):
        base = _FIXED + f * _FIELD_INTS
        ndim = int(row[base + 2])
        shape = tuple(int(x) for x in row[base + 3 : base + 3 + ndim])
        specs.append(FieldSpec(dtype=_DTYPES[int(row[base])], row_shape=shape, rows=0))
    return tuple(specs)


def _check_agreement(rows: Sequence[Tensor], callers: Sequence[int], layout: MediaLayout) -> None:
    """Values every rank must share; the same check on every rank, so all raise together."""
    grad = {int(row[_Header.GRAD]) for row in rows}
    if len(grad) > 1:
        raise ValueError(
            "balanced tower call: grad mode differs between ranks "
            f"({[bool(int(row[_Header.GRAD])) for row in rows]}); call under the same mode"
        )
    if {int(row[_Header.LAYOUT]) for row in rows} != {zlib.crc32(layout.name.encode())}:
        raise ValueError("balanced tower call: ranks use different media layouts for one tower")
    with_items = [r for r in callers if int(rows[r][_Header.ITEMS])]
    if with_items:
        reference = _field_specs(rows[with_items[0]])
        for r in with_items[1:]:
            if _field_specs(rows[r]) != reference:
                raise ValueError(
                    f"balanced tower call: rank {r}'s items have fields "
                    f"{_field_specs(rows[r])} but "
                    f"rank {with_items[0]}'s have {reference}; items must share dtype and row "
                    "shape to be encoded together"
                )


def _read_table(
    rows: Sequence[Tensor],
    tables: Sequence[Tensor],
    callers: Sequence[int],
    most: int,
    world: int,
    rank: int,
) -> _Table:
    costs, item_rows, sizes = [], [], []
    for r in range(world):
        n, nf, ns = (int(rows[r][k]) for k in (_Header.ITEMS, _Header.FIELDS, _Header.SIZES))
        entries = tables[r][: n * ITEM_INTS].view(n, ITEM_INTS).tolist() if n else []
        costs.append(tuple(int(e[0]) for e in entries))
        item_rows.append(tuple(tuple(int(x) for x in e[1 : 1 + nf]) for e in entries))
        sizes.append(
            tuple(tuple(int(x) for x in e[1 + MAX_FIELDS : 1 + MAX_FIELDS + ns]) for e in entries)
        )
    with_items = [r for r in callers if costs[r]]
    fields = _field_specs(rows[with_items[0]]) if with_items else ()
    grads = tuple(
        bool(fields[f].dtype.is_floating_point)
        and any(int(rows[r][_FIXED + f * _FIELD_INTS + 1]) for r in with_items)
        for f in range(len(fields))
    )
    blobs = {}
    for r in callers:
        length = int(rows[r][_Header.BLOB])
        blobs[r] = tables[r][most * ITEM_INTS :].numpy().tobytes()[:length]
    if len(set(blobs.values())) > 1:
        raise ValueError(
            "balanced tower call: the pass-through arguments differ between ranks "
            f"{sorted(blobs)}; every rank must call the tower with the same options"
        )
    spec = pickle.loads(blobs[callers[0]]) if callers else None  # our own group's bytes
    return _Table(
        world=world,
        rank=rank,
        callers=tuple(callers),
        costs=tuple(costs),
        rows=tuple(item_rows),
        sizes=tuple(sizes),
        fields=fields,
        input_grads=grads,
        grad_enabled=bool(int(rows[0][_Header.GRAD])),
        trainable=any(int(row[_Header.TRAINABLE]) for row in rows),
        spec=spec,
    )


# ------------------------------------------------------------------------- the call
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
        for t in _gather(torch.tensor([code, leaves], dtype=torch.int64, device=device), group)
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
) -> tuple[Any, Tensor]:
    device = _device(tower, call, group)
    trainable = any(p.requires_grad for p in tower.parameters())
    table = _exchange_metadata(
        call, error, layout=layout, trainable=trainable, group=group, device=device
    )
    world, rank = table.world, table.rank
    anchor = torch.zeros((), device=device)
    if not any(table.costs):
        if original is None:
            return None, anchor
        return runner(*original[0], **original[1]), anchor  # no rank has an item: as unbalanced
    spec = table.spec
    if spec is None:
        raise RuntimeError("balanced tower call: items without a call spec")  # cannot happen
    owners = assign_items(table.costs)
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
    in_route = _Route(
        send_rows=send_rows,
        recv_rows=recv_rows,
        dtypes=tuple(f.dtype for f in table.fields),
        row_shapes=tuple(f.row_shape for f in table.fields),
        grads=table.input_grads,
        group=group,
        device=device,
    )
    link = torch.zeros((), device=device, requires_grad=differentiable and any(table.input_grads))
    *received, in_token = _Exchange.apply(  # type: ignore[no-untyped-call]
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
    failure: BaseException | None = None
    try:
        if items:
            args, kwargs = layout.build_call(spec, items)
            out_spec, pieces = layout.split_output(runner(*args, **kwargs), weights)
        elif run_when_empty:
            zero_link = zero_link + _placeholder_run(layout, spec, table, runner, device)
    except Exception as raised:  # re-raised below, after every rank knows
        failure = raised
    statuses = _status(
        int(failure is not None), len(out_spec.dtypes) if out_spec else -1, group, device
    )
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
    out_route = _Route(
        send_rows=out_send_rows,
        recv_rows=out_recv_rows,
        dtypes=out_spec.dtypes if out_spec is not None else (),
        row_shapes=out_spec.row_shapes if out_spec is not None else (),
        grads=tuple(out_differentiable and d.is_floating_point for d in out_spec.dtypes)
        if out_spec
        else (),
        group=group,
        device=device,
    )
    if out_differentiable and not zero_link.requires_grad:
        zero_link = torch.zeros((), device=device, requires_grad=True)
    *returned, out_token = _Exchange.apply(  # type: ignore[no-untyped-call]
        out_route, zero_link, *out_send
    )
    if out_spec is None:
        return None, out_token
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
    return output, out_token


def _placeholder_run(
    layout: MediaLayout,
    spec: CallSpec,
    table: _Table,
    runner: Callable[..., Any],
    device: torch.device,
) -> Tensor:
    """Run the tower on a placeholder shaped like the cheapest item; return its output
    summed and times 0, to be linked into the graph (a backward then runs the tower)."""
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
    total = torch.zeros((), device=device)
    for leaf in leaves[0]:
        if leaf.dtype.is_floating_point:
            total = total + leaf.sum().float()
    return total * 0


def balanced_call(
    tower: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    layout: MediaLayout | None = None,
    group: Any = None,
    run_when_empty: bool = False,
    runner: Callable[..., Any] | None = None,
) -> Any:
    """``tower(*args, **kwargs)``, with the items of every rank's call spread evenly over
    the ranks of ``group`` (collective: every rank calls this or ``join_without_call``).

    Returns what the tower would have returned for this rank's items, built from pieces
    encoded anywhere (``None`` for a call with no items while other ranks have some:
    use ``join_without_call`` there); gradients flow back to the encoding ranks and,
    where inputs require grad, to the inputs. ``runner`` runs the tower on the local share (default
    ``tower`` itself; a hook that replaces the tower's forward passes the original).
    ``run_when_empty``: run the tower on a placeholder whose output counts 0 when this
    rank gets nothing to encode (for towers that own FSDP units).
    """
    chosen = layout if layout is not None else media_layout_for(tower)
    named = dict(kwargs or {})
    error: BaseException | None = None
    try:
        call = chosen.split_call(tower, tuple(args), named)
    except (ValueError, TypeError) as raised:
        error = raised
        call = MediaCall(spec=CallSpec(fields=()), items=())
    output, _ = _run(
        tower,
        chosen,
        call,
        error,
        group=group,
        run_when_empty=run_when_empty,
        runner=runner or tower,
        original=(tuple(args), named),
    )
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
    _, anchor = _run(
        tower,
        chosen,
        None,
        None,
        group=group,
        run_when_empty=run_when_empty,
        runner=runner or tower,
    )
    return anchor
