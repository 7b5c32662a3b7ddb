"""A step's collectives, counted and tallied: what the estimates predict and a real step
measures, in one type.

[`CommCounter`][fsdp_core.collective_count.CommCounter] is a ``TorchDispatchMode``: every
collective FSDP2 issues is a ``c10d`` op in the dispatcher, so counting there is exact, in
one process under the fake process group as on real ranks.
[`CommTally`][fsdp_core.collective_count.CommTally] adds them up per phase and kind: the
estimates predict one, hooks' cost models
([`RuntimeHook.collectives`][fsdp_core.runtime.RuntimeHook.collectives]) return one and a
counter gives one, so all three compare key by key. It lives below every package so that a
hook's cost model can speak it without importing the estimates.

Bytes are those of the *unsharded* buffer (the all-gather output, the reduce-scatter input,
the all-reduce/broadcast tensor; a ring sends ``(world - 1) / world`` of it). An
``all_to_all`` has no such buffer: its bytes are what this rank sends (its whole input),
and what it receives is recorded beside them (``received``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_core.internals import TorchDispatchMode

__all__ = ["KINDS", "PHASES", "CollectiveRecord", "CommCounter", "CommTally", "collective_kind"]

PHASES: tuple[str, ...] = ("forward", "backward")
KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")

_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
}

#: Per counted kind, the argument of the ``c10d`` op that holds the buffer counted as
#: the collective's bytes (the unsharded one; for ``all_to_all`` the one sent), and for
#: ``all_to_all`` the one received.
_BUFFER = {"all_gather": 0, "reduce_scatter": 1, "all_reduce": 0, "broadcast": 0, "all_to_all": 1}
_RECEIVED = {"all_to_all": 0}


def collective_kind(op_name: str) -> str:
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast``, ``all_to_all``
    or the raw name.

    Args:
        op_name: a ``c10d`` op's name.

    Returns:
        The kind.
    """
    return _KINDS.get(op_name, op_name)


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
        """Count ``count`` collectives of ``kind`` in ``phase``, ``nbytes`` in all.

        Args:
            phase: ``"forward"``, ``"backward"``, ...
            kind: ``"all_gather"``, ``"reduce_scatter"``, ...
            nbytes: their bytes together (unsharded buffers).
            count: how many (nothing is recorded for ``count <= 0``).
            received: the bytes they receive, for kinds that record it.
        """
        if count <= 0:
            return
        key = (phase, kind)
        self.counts[key] = self.counts.get(key, 0) + count
        self.nbytes[key] = self.nbytes.get(key, 0) + nbytes
        if received is not None:
            self.received[key] = self.received.get(key, 0) + received

    def merge(self, other: CommTally, times: int = 1) -> None:
        """Add ``other`` ``times`` times (a unit that runs that often in the step).

        Args:
            other: the tally to add.
            times: how often.
        """
        for _ in range(times):
            for key, count in other.counts.items():
                self.add(*key, other.nbytes.get(key, 0), count, received=other.received.get(key))

    def _sum(self, table: dict[tuple[str, str], int], kind: str | None, phase: str | None) -> int:
        return sum(n for (p, k), n in table.items() if kind in (None, k) and phase in (None, p))

    def count(self, kind: str | None = None, phase: str | None = None) -> int:
        """Number of collectives, of every kind and phase or of the ones given.

        Args:
            kind: ``"all_gather"``, ... (every kind if None).
            phase: ``"forward"``, ``"backward"``, ... (every phase if None).

        Returns:
            The count.
        """
        return self._sum(self.counts, kind, phase)

    def bytes(self, kind: str | None = None, phase: str | None = None) -> int:
        """Bytes (unsharded buffers), of every kind and phase or of the ones given.

        Args:
            kind: ``"all_gather"``, ... (every kind if None).
            phase: ``"forward"``, ``"backward"``, ... (every phase if None).

        Returns:
            The bytes.
        """
        return self._sum(self.nbytes, kind, phase)

    def received_bytes(self, kind: str | None = None, phase: str | None = None) -> int:
        """Bytes received (``all_to_all`` records them), of every kind and phase or those given.

        Args:
            kind: ``"all_gather"``, ... (every kind if None).
            phase: ``"forward"``, ``"backward"``, ... (every phase if None).

        Returns:
            The bytes received.
        """
        return self._sum(self.received, kind, phase)

    def pairs(self) -> list[tuple[str, str]]:
        """(phase, kind) pairs present, phases and kinds in their natural order.

        Returns:
            The pairs.
        """
        order = {name: i for i, name in enumerate((*PHASES, *KINDS))}
        return sorted(self.counts, key=lambda k: (order.get(k[0], 99), order.get(k[1], 99), k))

    def as_dict(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{phase: {kind: {"count": n, "bytes": b}}}`` (JSON-ready).

        Returns:
            The nested dict.
        """
        result: dict[str, dict[str, dict[str, int]]] = {}
        for phase, kind in self.pairs():
            key = (phase, kind)
            entry = {"count": self.counts[key], "bytes": self.nbytes.get(key, 0)}
            if key in self.received:
                entry["received_bytes"] = self.received[key]
            result.setdefault(phase, {})[kind] = entry
        return result

    def differences(self, other: CommTally) -> list[str]:
        """Readable lines where ``self`` (expected) and ``other`` (actual) differ.

        Args:
            other: the measured tally.

        Returns:
            One line per difference (empty when equal).
        """
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


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: its kind, the phase it ran in, bytes and dtype of its full buffer
    (of an ``all_to_all``: of what this rank sends, with ``received`` the bytes it
    receives; ``None`` for the other kinds)."""

    kind: str
    phase: str
    nbytes: int
    dtype: torch.dtype | None
    received: int | None = None


def _buffer(value: Any) -> tuple[int, torch.dtype | None]:
    """Bytes of every tensor in a ``c10d`` op argument (a tensor or nested lists of them)
    and the dtype of the first."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size(), value.dtype
    parts = [_buffer(item) for item in value] if isinstance(value, (list, tuple)) else []
    return sum(n for n, _ in parts), next((d for _, d in parts if d is not None), None)


class CommCounter(TorchDispatchMode):
    """Record every ``c10d`` collective run inside the ``with`` block.

    Use [`phase`][fsdp_core.collective_count.CommCounter.phase] to tag records
    (``"forward"``, ``"backward"``, ...).
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.records: list[CollectiveRecord] = []
        self._phase = "unspecified"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record the collectives issued inside the block under ``name``.

        Args:
            name: the phase (``"forward"``, ``"backward"``, ``"optimizer"``, ...).
        """
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func.namespace == "c10d":
            kind = collective_kind(func._schema.name.split("::")[-1])
            if kind in _BUFFER:
                nbytes, dtype = _buffer(args[_BUFFER[kind]])
                received = _buffer(args[_RECEIVED[kind]])[0] if kind in _RECEIVED else None
                self.records.append(CollectiveRecord(kind, self._phase, nbytes, dtype, received))
        return func(*args, **(kwargs or {}))

    def tally(self) -> CommTally:
        """Everything recorded, as a [`CommTally`][fsdp_core.collective_count.CommTally].

        Returns:
            The tally.
        """
        tally = CommTally()
        for record in self.records:
            tally.add(record.phase, record.kind, record.nbytes, received=record.received)
        return tally

    def _per_kind(self, table: str, phase: str | None) -> dict[str, int]:
        totals: Counter[str] = Counter()
        for (p, kind), n in getattr(self.tally(), table).items():
            if phase in (None, p):
                totals[kind] += n
        return dict(totals)

    def counts(self, phase: str | None = None) -> dict[str, int]:
        """Number of collectives per kind (optionally of one phase).

        Args:
            phase: ``"forward"``, ``"backward"``, ... (every phase if None).

        Returns:
            ``{kind: count}``.
        """
        return self._per_kind("counts", phase)

    def bytes(self, phase: str | None = None) -> dict[str, int]:
        """Full-buffer bytes per kind (optionally of one phase); ``all_to_all``: sent.

        Args:
            phase: ``"forward"``, ``"backward"``, ... (every phase if None).

        Returns:
            ``{kind: bytes}``.
        """
        return self._per_kind("nbytes", phase)

    def received_bytes(self, phase: str | None = None) -> dict[str, int]:
        """Bytes received per kind that records them (``all_to_all``), optionally of one phase.

        Args:
            phase: ``"forward"``, ``"backward"``, ... (every phase if None).

        Returns:
            ``{kind: bytes}``.
        """
        return self._per_kind("received", phase)

    def clear(self) -> None:
        """Forget everything recorded so far (the counter keeps counting)."""
        self.records.clear()
