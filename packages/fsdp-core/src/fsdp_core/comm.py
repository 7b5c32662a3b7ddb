"""Count collectives and their bytes exactly, by watching ``c10d`` ops.

[`CommCounter`][fsdp_core.comm.CommCounter] is a ``TorchDispatchMode``: every collective FSDP2
issues passes through the dispatcher as an op of the ``c10d`` namespace, so counting
there is exact and works the same under the fake process group (one process,
real layouts) and real gloo/NCCL ranks.

Byte convention: the size of the *unsharded* buffer of a collective (the
all-gather output, the reduce-scatter input, the all-reduce/broadcast tensor).
What a rank actually sends on a ring is ``(world - 1) / world`` of that.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_core.internals import TorchDispatchMode
from fsdp_core.runtime import nested_tensors

__all__ = ["CollectiveRecord", "CommCounter", "collective_kind"]

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
}


def collective_kind(op_name: str) -> str:
    """``all_gather``, ``reduce_scatter``, ``all_reduce``, ``broadcast`` or the raw name."""
    return _KINDS.get(op_name, op_name)


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: its kind, the phase it ran in, bytes and dtype of its full buffer."""

    kind: str
    phase: str
    nbytes: int
    dtype: torch.dtype | None


class CommCounter(TorchDispatchMode):
    """Record every ``c10d`` collective run inside the ``with`` block.

    Use [`phase`][fsdp_core.comm.CommCounter.phase] to tag records (``"forward"``, ``"backward"``,
    ...).
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.records: list[CollectiveRecord] = []
        self._phase = "unspecified"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
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
            op = func._schema.name.split("::")[-1]
            kind = collective_kind(op)
            if kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
                tensors = nested_tensors(args[:2])
                largest = max(tensors, key=lambda t: t.numel() * t.element_size(), default=None)
                self.records.append(
                    CollectiveRecord(
                        kind=kind,
                        phase=self._phase,
                        nbytes=0 if largest is None else largest.numel() * largest.element_size(),
                        dtype=None if largest is None else largest.dtype,
                    )
                )
        return func(*args, **(kwargs or {}))

    def counts(self, phase: str | None = None) -> dict[str, int]:
        """Number of collectives per kind (optionally of one phase)."""
        return dict(Counter(r.kind for r in self.records if phase in (None, r.phase)))

    def bytes(self, phase: str | None = None) -> dict[str, int]:
        """Full-buffer bytes per kind (optionally of one phase)."""
        totals: Counter[str] = Counter()
        for record in self.records:
            if phase in (None, record.phase):
                totals[record.kind] += record.nbytes
        return dict(totals)

    def clear(self) -> None:
        self.records.clear()
