"""Text rendering of plan costs: the unit tree, the totals, sizes and counts.

What the ``plan`` command prints and
[`PlanCosts.format`][multimodal_fsdp.estimate.costs.PlanCosts.format] returns, apart from
the accounting so that the layout can change without touching it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_core.collective_count import CommTally
    from multimodal_fsdp.estimate.costs import PlanCosts, UnitCost

__all__ = ["format_bytes", "format_costs", "format_count"]


def format_bytes(value: float) -> str:
    """A size in binary units.

    Args:
        value: Bytes.

    Returns:
        ``1.5 MiB``-style text.
    """
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


_SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def _dt(name: str) -> str:
    return ",".join(_SHORT_DTYPES.get(part, part) for part in name.split(","))


def format_count(value: int) -> str:
    """A parameter count at a glance.

    Args:
        value: The count.

    Returns:
        ``1.2M``-style text.
    """
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return str(value)


def _reshard_text(value: bool | int) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "no"
    return f"to {value}"


def _comm_text(tally: CommTally, phase: str, kind: str) -> str:
    count = tally.count(kind, phase)
    return "-" if not count else f"{count}x {format_bytes(tally.bytes(kind, phase))}"


def _unit_columns(unit: UnitCost) -> list[str]:
    storage = ",".join(_dt(d) for d in unit.storage_dtypes) or "-"
    return [
        unit.role,
        format_count(unit.numel),
        unit.trainable + ("" if unit.runs_backward or not unit.numel else " (no bwd)"),
        f"{storage}>{_dt(unit.compute_dtype)}",
        _reshard_text(unit.reshard_after_forward),
        format_bytes(unit.sharded_bytes),
        _comm_text(unit.comm, "forward", "all_gather"),
        _comm_text(unit.comm, "backward", "all_gather"),
        _comm_text(unit.comm, "backward", "reduce_scatter"),
    ]


_HEADER = [
    "unit",
    "role",
    "params",
    "state",
    "dtype",
    "reshard",
    "shard/rank",
    "AG fwd",
    "AG bwd",
    "RS",
]


def _signature(unit: UnitCost) -> tuple[Any, ...]:
    return (*_unit_columns(unit), repr(unit.comm.as_dict()))


class _Node:
    def __init__(self, name: str) -> None:
        self.name = name
        self.children: dict[str, _Node] = {}
        self.units: list[UnitCost] = []


def _anchor(unit: UnitCost) -> tuple[list[str], str | None]:
    """Tree position of a unit: its path, or the common prefix of a group's members."""
    if len(unit.paths) == 1:
        return ([p for p in unit.paths[0].split(".") if p], None)
    split = [p.split(".") for p in unit.paths]
    prefix: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    return prefix, f"[{len(unit.paths)} modules]"


def _tree_rows(costs: PlanCosts, collapse: bool) -> list[tuple[str, UnitCost | None]]:
    root = _Node("")
    for unit in costs.units:
        parts, group = _anchor(unit)
        node = root
        for part in parts:
            node = node.children.setdefault(part, _Node(part))
        if group is None:
            node.units.append(unit)
        else:
            node.children.setdefault(group + f"#{unit.index}", _Node(group)).units.append(unit)
    rows: list[tuple[str, UnitCost | None]] = []
    for unit in root.units:
        rows.append(("<root>", unit))
    if not root.units:
        rows.append((costs.model, None))

    def visit(node: _Node, indent: str) -> None:
        entries = (
            _collapsed(list(node.children.values()))
            if collapse
            else [(child.name, child) for child in node.children.values()]
        )
        for i, (name, child) in enumerate(entries):
            last = i == len(entries) - 1
            branch = "`- " if last else "|- "
            if child.units:
                for unit in child.units:
                    rows.append((indent + branch + name, unit))
            else:
                rows.append((indent + branch + name, None))
            visit(child, indent + ("   " if last else "|  "))

    visit(root, "")
    return rows


def _collapsed(children: list[_Node]) -> list[tuple[str, _Node]]:
    """Merge runs of numbered leaf siblings with identical figures into ``{a..b} xN``."""
    out: list[tuple[str, _Node]] = []
    i = 0
    while i < len(children):
        child = children[i]
        j = i + 1
        if child.name.isdigit() and not child.children and len(child.units) == 1:
            sig = _signature(child.units[0])
            while (
                j < len(children)
                and children[j].name.isdigit()
                and not children[j].children
                and len(children[j].units) == 1
                and _signature(children[j].units[0]) == sig
            ):
                j += 1
        if j - i > 1:
            out.append((f"{{{child.name}..{children[j - 1].name}}} x{j - i}", child))
        else:
            out.append((child.name, child))
        i = j
    return out


def format_costs(costs: PlanCosts, *, collapse: bool = True) -> str:
    """A readable tree of the units with their per-rank costs, then the totals.

    Args:
        costs: The plan's costs.
        collapse: Merge runs of identical numbered layers into one row.

    Returns:
        The text.
    """
    mesh = costs.mesh
    head = f"{costs.model}: {len(costs.units)} FSDP units, world size {costs.world_size}"
    head += (
        f" (dp_replicate {mesh.dp_replicate} x dp_shard {mesh.dp_shard})"
        if mesh.is_hsdp
        else f" (dp_shard {mesh.dp_shard})"
    )
    if costs.policy:
        head += f", frozen-tower policy {costs.policy}"
    if costs.precision:
        head += f", {costs.precision}"
    table = [_HEADER]
    for name, unit in _tree_rows(costs, collapse):
        table.append([name, *([""] * (len(_HEADER) - 1) if unit is None else _unit_columns(unit))])
    widths = [max(len(row[c]) for row in table) for c in range(len(_HEADER))]
    roles = ", ".join(f"{k} {v}" for k, v in sorted(costs.role_counts().items()))
    lines = [
        head,
        "",
        *("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip() for row in table),
        "",
        "totals per rank and step (one forward + backward, every module runs):",
        f"  units                     {len(costs.units)} ({roles})",
        f"  parameters                {format_count(costs.numel)} "
        f"(trainable {format_count(costs.trainable_numel)}, "
        f"kept whole on every rank {format_count(costs.replicated_numel)})",
        f"  sharded parameter bytes   {format_bytes(costs.sharded_param_bytes)}",
        f"  replicated param bytes    {format_bytes(costs.replicated_param_bytes)}",
        f"  peak gathered params      forward {format_bytes(costs.peak_gathered_forward_bytes)},"
        f" backward {format_bytes(costs.peak_gathered_backward_bytes)}",
    ]
    if costs.memory is not None:
        lines.extend(costs.memory.format_lines())
    for phase, kind in costs.comm.pairs():
        label = f"{phase} {kind}"
        received = (
            f" sent, {format_bytes(costs.comm.received[(phase, kind)])} received"
            if (phase, kind) in costs.comm.received
            else ""
        )
        lines.append(
            f"  {label:<25} {costs.comm.count(kind, phase):>5}  "
            f"{format_bytes(costs.comm.bytes(kind, phase))}{received}"
        )
    if not costs.comm.pairs():
        lines.append("  collectives               none")
    wasted = costs.wasted
    if wasted.pairs():
        state = "avoided by the prefetch guard" if costs.prefetch_guard else "included above"
        lines.append(
            f"  implicit-prefetch waste   {wasted.count()} all-gathers, "
            f"{format_bytes(wasted.bytes())} ({state})"
        )
    if costs.extra.pairs():
        kinds = sorted({kind for _, kind in costs.extra.pairs()})
        what = (
            "all-reduce"
            if kinds == ["all_reduce"]
            else "collectives (" + ", ".join(f"{costs.extra.count(k)} {k}" for k in kinds) + ")"
        )
        lines.append(
            f"  outside FSDP units        {costs.extra.count()} {what} "
            "(runtime hooks, included above)"
        )
    if costs.exchange is not None:
        lines.append(
            f"  balanced-media exchange   {costs.exchange.count()} collectives, "
            f"{format_bytes(costs.exchange.bytes())} sent or gathered, "
            f"{format_bytes(costs.exchange.received_bytes())} received by all_to_all "
            f"(towers {', '.join(repr(t) for t in costs.balanced_towers)}, included above)"
        )
    lines.extend(f"  hook: {hook.format()}" for hook in costs.hooks)
    lines.extend(f"  note: {note}" for note in costs.notes)
    return "\n".join(lines)
