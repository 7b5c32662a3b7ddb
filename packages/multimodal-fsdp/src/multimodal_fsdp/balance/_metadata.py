"""The metadata of a round of balanced calls: what every rank learns before items move.

One ``all_gather`` of a fixed-size slot per rank (``SLOT_INTS`` int64): a header (the
module called, item count, fields' dtypes and row shapes, gradient and error flags) and,
inline, the item table (cost, rows per field, sizes) and the pickled blob a rank without
a call needs (a balanced call's ``CallSpec``, a joined call's placeholder description).
When some rank's table and blob exceed ``INLINE_INTS`` words, one more ``all_gather``
carries every rank's, padded to the longest (``exchange_traffic`` predicts it). Every
rank reads the same rows, so every check here fails on every rank alike.
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

from multimodal_fsdp.balance.layouts import CallSpec, FieldSpec, MediaCall

__all__ = [
    "HEADER_INTS",
    "INLINE_INTS",
    "SLOT_INTS",
    "ITEM_INTS",
    "STATUS_INTS",
    "Entry",
    "RoundTable",
    "Table",
    "gather",
    "exchange_round",
    "payload_ints",
]

MAX_FIELDS: Final = 8
MAX_ROW_DIMS: Final = 6
MAX_SIZES: Final = 4
_FIELD_INTS: Final = 3 + MAX_ROW_DIMS  # dtype code, requires grad, row dims, dims...
_FIXED: Final = 12
HEADER_INTS: Final = _FIXED + MAX_FIELDS * _FIELD_INTS
ITEM_INTS: Final = 1 + MAX_FIELDS + MAX_SIZES  # cost, rows per field, sizes
#: Words of item table and blob carried inline in the slot (beyond them: a second gather).
INLINE_INTS: Final = 256
SLOT_INTS: Final = HEADER_INTS + INLINE_INTS
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


def payload_ints(items: int, blob_bytes: int) -> int:
    """Words of one rank's item table and blob in a round's metadata.

    Args:
        items: the items of its call.
        blob_bytes: the bytes of its blob (the pickled ``CallSpec``, or a joined call's
            description).

    Returns:
        The words (inline in the slot when at most ``INLINE_INTS``).
    """
    return items * ITEM_INTS + math.ceil(blob_bytes / 8)


class _Header:
    """Indices into the header."""

    MAGIC, MODULE, ERROR, ITEMS, FIELDS, GRAD, TRAINABLE, BLOB, IDENTITY, SIZES, PAYLOAD = range(11)


@dataclass(frozen=True)
class Entry:
    """What a rank brings to a round: the module it calls, its identity (ranks must agree
    on it), whether it is trainable, and the call (a balanced call's items) or the blob a
    rank without the call needs (a joined call)."""

    module: int
    identity: str
    trainable: bool
    call: MediaCall | None
    blob: bytes = b""


@dataclass(frozen=True)
class Table:
    """One module's call in a round, as every rank knows it after the gathers."""

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
    #: The first caller's blob (the pickled spec, or a joined call's placeholder).
    blob: bytes = b""


@dataclass(frozen=True)
class RoundTable:
    """A round's rows: per rank the module it calls (``-1``: none), its header and its
    item table and blob."""

    world: int
    rank: int
    modules: tuple[int, ...]
    headers: tuple[Tensor, ...]
    tables: tuple[Tensor, ...]

    def called(self) -> list[int]:
        """The modules some rank calls in this round, in index order."""
        return sorted({m for m in self.modules if m >= 0})

    def module_table(self, module: int, *, balanced: bool = True) -> Table:
        """The call of ``module``: its callers' items (every other rank has none), whose
        specs must agree for a balanced module (the pass-through arguments)."""
        callers = tuple(r for r, m in enumerate(self.modules) if m == module)
        costs: list[tuple[int, ...]] = []
        item_rows: list[tuple[tuple[int, ...], ...]] = []
        sizes: list[tuple[tuple[int, ...], ...]] = []
        blobs: dict[int, bytes] = {}
        for r, row in enumerate(self.headers):
            n, nf, ns = (int(row[k]) for k in (_Header.ITEMS, _Header.FIELDS, _Header.SIZES))
            table = self.tables[r][: n * ITEM_INTS]
            entries = table.view(n, ITEM_INTS).tolist() if n and r in callers else []
            if r in callers:
                blob = self.tables[r][n * ITEM_INTS :].numpy().tobytes()
                blobs[r] = blob[: int(row[_Header.BLOB])]
            costs.append(tuple(e[0] for e in entries))
            item_rows.append(tuple(tuple(e[1 : 1 + nf]) for e in entries))
            sizes.append(tuple(tuple(e[1 + MAX_FIELDS : 1 + MAX_FIELDS + ns]) for e in entries))
        specs = {r: _field_specs(self.headers[r]) for r in callers if costs[r]}
        reference = next(iter(specs), None)
        fields = specs[reference] if reference is not None else ()
        for r, found in specs.items():
            if found != fields:
                raise ValueError(
                    f"balanced tower call: rank {r}'s items have fields {found} but rank "
                    f"{reference}'s have {fields}; items must share dtype and row shape to be "
                    "encoded together"
                )
        grads = tuple(
            bool(fields[f].dtype.is_floating_point)
            and any(int(self.headers[r][_FIXED + f * _FIELD_INTS + 1]) for r in specs)
            for f in range(len(fields))
        )
        first = blobs[callers[0]] if callers else b""
        spec = None
        if balanced and callers:
            if len(set(blobs.values())) > 1:
                raise ValueError(
                    "balanced tower call: the pass-through arguments differ between ranks "
                    f"{sorted(blobs)}; every rank must call the tower with the same options"
                )
            spec = pickle.loads(first)  # our own group's bytes
        return Table(
            world=self.world,
            rank=self.rank,
            callers=callers,
            costs=tuple(costs),
            rows=tuple(item_rows),
            sizes=tuple(sizes),
            fields=fields,
            input_grads=grads,
            grad_enabled=bool(int(self.headers[0][_Header.GRAD])),
            trainable=any(int(self.headers[r][_Header.TRAINABLE]) for r in callers),
            spec=spec,
            blob=first,
        )


def gather(tensor: Tensor, group: Any) -> list[Tensor]:
    """all_gather; every slot starts as this rank's tensor, so under the fake group
    (which moves no data) every rank looks like this one."""
    slots = [tensor.clone() for _ in range(dist.get_world_size(group))]
    dist.all_gather(slots, tensor, group=group)
    return slots


def _raise_everywhere(rows: Sequence[Tensor], error: BaseException | None) -> None:
    failed = [r for r, row in enumerate(rows) if int(row[_Header.ERROR]) != 0]
    if not failed:
        return
    if error is not None:
        raise error
    raise ValueError(
        f"balanced call: rank(s) {failed} could not split or run their call (see their error)"
    )


def exchange_round(
    entry: Entry | None,
    error: BaseException | None,
    *,
    group: Any,
    device: torch.device,
) -> RoundTable:
    """The round's metadata on every rank (collective): one ``all_gather`` of the slots,
    and one more of the item tables when some rank's does not fit inline. ``error``
    (this rank could not split its call, or its last call failed) is raised on every
    rank: here, re-raised; elsewhere, a ValueError naming the ranks."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    slot = torch.zeros(SLOT_INTS, dtype=torch.int64)
    slot[_Header.MAGIC] = _MAGIC
    slot[_Header.MODULE] = -1 if entry is None else entry.module
    slot[_Header.GRAD] = int(torch.is_grad_enabled())
    payload = b""
    items: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    if entry is not None and error is None:
        slot[_Header.TRAINABLE] = int(entry.trainable)
        slot[_Header.IDENTITY] = zlib.crc32(entry.identity.encode())
        try:
            if entry.call is not None:
                payload = _describe(entry.call, slot)
                items = [
                    (item.cost, tuple(t.shape[0] for t in item.fields), item.sizes)
                    for item in entry.call.items
                ]
            else:
                payload = entry.blob
        except (ValueError, TypeError) as described:
            error = described
    slot[_Header.ERROR] = int(error is not None)
    slot[_Header.BLOB] = len(payload)
    words = payload_ints(len(items), len(payload))
    slot[_Header.PAYLOAD] = words
    table = _table(items, payload, words)
    if words <= INLINE_INTS:
        slot[HEADER_INTS : HEADER_INTS + words] = table
    rows = [row.cpu() for row in gather(slot.to(device), group)]
    _raise_everywhere(rows, error)
    _check_agreement(rows)
    most = max(int(row[_Header.PAYLOAD]) for row in rows)
    if most <= INLINE_INTS:
        tables = [row[HEADER_INTS:] for row in rows]
    else:
        padded = torch.zeros(most, dtype=torch.int64)
        padded[:words] = table
        tables = [t.cpu() for t in gather(padded.to(device), group)]
    return RoundTable(
        world=world,
        rank=rank,
        modules=tuple(int(row[_Header.MODULE]) for row in rows),
        headers=tuple(row[:HEADER_INTS] for row in rows),
        tables=tuple(tables),
    )


def _table(
    items: Sequence[tuple[int, tuple[int, ...], tuple[int, ...]]], blob: bytes, words: int
) -> Tensor:
    table = torch.zeros(words, dtype=torch.int64)
    for i, (cost, rows, sizes) in enumerate(items):  # _describe checked the field/size counts
        entry = [cost, *rows, *[0] * (MAX_FIELDS - len(rows)), *sizes]
        table[i * ITEM_INTS : i * ITEM_INTS + len(entry)] = torch.tensor(entry)
    if blob:
        start = len(items) * ITEM_INTS
        padded = blob + bytes((words - start) * 8 - len(blob))
        table[start:] = torch.frombuffer(bytearray(padded), dtype=torch.int64)
    return table


def _describe(call: MediaCall, header: Tensor) -> bytes:
    """Fill this rank's header from its call; the pickled spec is returned."""
    spec = call.spec
    if len(spec.fields) > MAX_FIELDS:
        raise ValueError(
            f"a balanced call has at most {MAX_FIELDS} per-item fields, got {spec.fields}"
        )
    header[_Header.ITEMS] = len(call.items)
    header[_Header.FIELDS] = len(spec.fields)
    for item in call.items:
        if len(item.sizes) > MAX_SIZES:
            raise ValueError(f"an item has at most {MAX_SIZES} sizes, got {item.sizes}")
        if isinstance(item.cost, bool) or not isinstance(item.cost, int) or item.cost < 1:
            raise ValueError(f"item costs must be positive integers, got {item.cost!r}")
    if call.items:  # the header's field and size entries stay 0 without items
        first = call.items[0]
        header[_Header.SIZES] = len(first.sizes)
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
            grad = any(item.fields[f].requires_grad for item in call.items)
            entry = [_DTYPES.index(tensor.dtype), int(grad), len(row_shape), *row_shape]
            base = _FIXED + f * _FIELD_INTS
            header[base : base + len(entry)] = torch.tensor(entry)
    try:
        return pickle.dumps(spec)
    except Exception as error:  # pickling raises many types
        raise ValueError(
            f"the pass-through arguments {[n for n, _ in spec.constants]} of a balanced call "
            f"must be picklable (ranks without a call receive them): {error}"
        ) from None


def _field_specs(row: Tensor) -> tuple[FieldSpec, ...]:
    specs = []
    for f in range(int(row[_Header.FIELDS])):
        base = _FIXED + f * _FIELD_INTS
        ndim = int(row[base + 2])
        shape = tuple(int(x) for x in row[base + 3 : base + 3 + ndim])
        specs.append(FieldSpec(dtype=_DTYPES[int(row[base])], row_shape=shape, rows=0))
    return tuple(specs)


def _check_agreement(rows: Sequence[Tensor]) -> None:
    """Values every rank must share; the same check on every rank, so all raise together."""
    grad = {int(row[_Header.GRAD]) for row in rows}
    if len(grad) > 1:
        raise ValueError(
            "balanced tower call: grad mode differs between ranks "
            f"({[bool(int(row[_Header.GRAD])) for row in rows]}); call under the same mode"
        )
    identities: dict[int, set[int]] = {}
    for row in rows:
        module = int(row[_Header.MODULE])
        if module >= 0:
            identities.setdefault(module, set()).add(int(row[_Header.IDENTITY]))
    if any(len(seen) > 1 for seen in identities.values()):
        raise ValueError(
            "balanced tower call: ranks use different media layouts or modules for one tower"
        )
