"""The metadata of a balanced call: what every rank learns before items move.

Two ``all_gather`` of int64 rows: a fixed-size header per rank (item count, the
fields' dtypes and row shapes, whether inputs need gradients, an error flag), then the
item table (cost, rows per field and sizes per item, and the pickled ``CallSpec`` that
a rank without a call needs), padded to the longest. When no rank calls (every rank
joins: the last round of ``join_remaining_calls``), the headers say so and the table
gather is skipped on every rank. Every rank reads the same rows, so
every check here fails on every rank alike.
"""

from __future__ import annotations

import math
import pickle
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import Tensor

from multimodal_fsdp.balance.layouts import CallSpec, FieldSpec, MediaCall, MediaLayout

__all__ = [
    "HEADER_INTS",
    "ITEM_INTS",
    "STATUS_INTS",
    "MAX_FIELDS",
    "MAX_ROW_DIMS",
    "MAX_SIZES",
    "Table",
    "gather",
    "exchange_metadata",
]

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
class Table:
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


def gather(tensor: Tensor, group: Any) -> list[Tensor]:
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


def exchange_metadata(
    call: MediaCall | None,
    error: BaseException | None,
    *,
    layout: MediaLayout,
    trainable: bool,
    group: Any,
    device: torch.device,
) -> Table:
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
    rows = gather(header.to(device), group)
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
    if not callers:  # every rank knows from the headers: no table to exchange
        return _read_table(rows, [table] * world, callers, most, world, rank)
    tables = [t.cpu() for t in gather(table.to(device), group)]
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
) -> Table:
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
    return Table(
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
