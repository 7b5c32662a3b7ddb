"""Count collectives and their bytes exactly, by watching ``c10d`` ops.

[`CommCounter`][fsdp_core.comm.CommCounter] is a ``TorchDispatchMode``: every collective FSDP2
issues passes through the dispatcher as an op of the ``c10d`` namespace, so counting
there is exact and works the same under the fake process group (one process,
real layouts) and real gloo/NCCL ranks.

Byte convention: the size of the *unsharded* buffer of a collective (the
all-gather output, every slot of it, the reduce-scatter input, the all-reduce/broadcast
tensor). What a rank actually sends on a ring is ``(world - 1) / world`` of that.
An ``all_to_all`` has no such buffer (each rank sends and receives its own amounts):
its bytes are those this rank sends (its whole input buffer, the part for itself
included), and what it receives is recorded beside them
([`CollectiveRecord.received`][fsdp_core.comm.CollectiveRecord]).
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
    or the raw name."""
    return _KINDS.get(op_name, op_name)


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
    """Bytes of every tensor in ``value`` (a tensor or nested lists of them) and the
    dtype of the first."""
    tensors = nested_tensors(value)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return nbytes, (tensors[0].dtype if tensors else None)


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
            if kind in _BUFFER:
                nbytes, dtype = _buffer(args[_BUFFER[kind]])
                received = _buffer(args[_RECEIVED[kind]])[0] if kind in _RECEIVED else None
                self.records.append(
                    CollectiveRecord(
                        kind=kind, phase=self._phase, nbytes=nbytes, dtype=dtype, received=received
                    )
                )
        return func(*args, **(kwargs or {}))

    def counts(self, phase: str | None = None) -> dict[str, int]:
        """Number of collectives per kind (optionally of one phase)."""
        return dict(Counter(r.kind for r in self.records if phase in (None, r.phase)))

    def bytes(self, phase: str | None = None) -> dict[str, int]:
        """Full-buffer bytes per kind (optionally of one phase); ``all_to_all``: sent."""
        totals: Counter[str] = Counter()
        for record in self.records:
            if phase in (None, record.phase):
                totals[record.kind] += record.nbytes
        return dict(totals)

    def received_bytes(self, phase: str | None = None) -> dict[str, int]:
        """Bytes received per kind that records them (``all_to_all``), optionally of one
        phase."""
        totals: Counter[str] = Counter()
        for record in self.records:
            if record.received is not None and phase in (None, record.phase):
                totals[record.kind] += record.received
        return dict(totals)

    def clear(self) -> None:
        self.records.clear()
