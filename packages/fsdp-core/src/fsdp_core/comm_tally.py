"""The tally of one step's collectives: per phase and kind, how many and how many bytes.

Estimates predict it ([`multimodal_fsdp.estimate.costs`][multimodal_fsdp.estimate.costs]),
runtime hooks say theirs ([`RuntimeHook.collectives`][fsdp_core.runtime.RuntimeHook.collectives])
and measurements count it ([`CommCounter`][fsdp_core.comm.CommCounter] records), so all
three compare key by key. It lives here, below every package, so that a hook's cost model
can speak it without importing the estimates. Byte convention as
[`fsdp_core.comm`][fsdp_core.comm]: the unsharded buffer; an ``all_to_all`` counts the bytes a
rank sends, with what it receives beside them (``received``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["KINDS", "PHASES", "CommTally"]

PHASES: tuple[str, ...] = ("forward", "backward")
KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")


@dataclass
class CommTally:
    """Collectives of one step: per (phase, kind), how many and how many bytes (of an
    ``all_to_all``: sent, with the bytes received in ``received``)."""

    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    nbytes: dict[tuple[str, str], int] = field(default_factory=dict)
    received: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(
        self, phase: str, kind: str, nbytes: int, count: int = 1, *, received: int | None = None
    ) -> None:
        if count <= 0:
            return
        key = (phase, kind)
        self.counts[key] = self.counts.get(key, 0) + count
        self.nbytes[key] = self.nbytes.get(key, 0) + nbytes
        if received is not None:
            self.received[key] = self.received.get(key, 0) + received

    def merge(self, other: CommTally) -> None:
        for key, count in other.counts.items():
            self.add(
                key[0], key[1], other.nbytes.get(key, 0), count, received=other.received.get(key)
            )

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        """Number of collectives, optionally of one kind and/or phase."""
        return sum(
            n for (p, k), n in self.counts.items() if kind in (None, k) and phase in (None, p)
        )

    def bytes(self, kind: str | None = None, phase: str | None = None) -> int:
        """Bytes (unsharded buffers), optionally of one kind and/or phase."""
        return sum(
            n for (p, k), n in self.nbytes.items() if kind in (None, k) and phase in (None, p)
        )

    def received_bytes(self, kind: str | None = None, phase: str | None = None) -> int:
        """Bytes received by the collectives that record them (``all_to_all``),
        optionally of one kind and/or phase."""
        return sum(
            n for (p, k), n in self.received.items() if kind in (None, k) and phase in (None, p)
        )

    def pairs(self) -> list[tuple[str, str]]:
        """(phase, kind) pairs present, phases and kinds in their natural order."""
        order = {name: i for i, name in enumerate((*PHASES, *KINDS))}
        return sorted(self.counts, key=lambda k: (order.get(k[0], 99), order.get(k[1], 99), k))

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{phase: {kind: {"count": n, "bytes": b}}}`` (JSON-ready)."""
        result: dict[str, dict[str, dict[str, int]]] = {}
        for phase, kind in self.pairs():
            entry = {
                "count": self.counts[(phase, kind)],
                "bytes": self.nbytes.get((phase, kind), 0),
            }
            if (phase, kind) in self.received:
                entry["received_bytes"] = self.received[(phase, kind)]
            result.setdefault(phase, {})[kind] = entry
        return result

    def differences(self, other: CommTally) -> list[str]:
        """Readable lines where ``self`` (expected) and ``other`` (actual) differ."""
        lines = []
        for key in sorted(set(self.counts) | set(other.counts)):
            mine = (self.counts.get(key, 0), self.nbytes.get(key, 0))
            theirs = (other.counts.get(key, 0), other.nbytes.get(key, 0))
            if mine != theirs:
                lines.append(
                    f"{key[0]} {key[1]}: expected {mine[0]} ({mine[1]} B), "
                    f"got {theirs[0]} ({theirs[1]} B)"
                )
            elif self.received.get(key) != other.received.get(key):
                lines.append(
                    f"{key[0]} {key[1]}: expected {self.received.get(key)} B received, "
                    f"got {other.received.get(key)} B"
                )
        return lines

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CommTally):
            return NotImplemented
        return not self.differences(other)

    __hash__ = None  # type: ignore[assignment]
