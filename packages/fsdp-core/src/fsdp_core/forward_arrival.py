"""A forward run on some ranks only fails on every rank, within the collective timeout.

Under FSDP the model's forward is collective: every unit all-gathers its parameters
from all ranks of the mesh. The most common mistake, ``if rank == 0: model.eval();
model(**batch)``, leaves rank 0 waiting in an all-gather that the other ranks never
join, and the job hangs without a word. This hook numbers the *calls* of the model
(root forwards, and ``generate()`` calls, which run their forwards in step on every
rank) and tells the ranks what each made, through the process group's c10d store,
never a collective:

- A training forward (gradients on, ``model.train()``) only records its number and
  kind on the store (one write, no wait): no extra collective and no synchronisation
  where the ranks are normally in step.
- Any other call (a forward without gradients or in eval mode, ``generate()``, a
  tower called outside the forward) waits until every rank of the mesh made the same
  call, looking every half second at what the others recorded, in the shared wait of
  [rank_wait][fsdp_core.rank_wait]: after a minute it logs a warning naming the ranks
  that have not made the call, their last calls and when it gives up (the process
  group's timeout unless ``FSDP_CORE_RANK_WAIT_TIMEOUT_S`` says otherwise). A rank that
  made another call under the same number (a training forward, say), or already went
  past it, or did not arrive in time, ends the wait on every waiting rank with
  [CollectiveCallError][fsdp_core.collective_entry.CollectiveCallError] naming the
  ranks and what they called; a rank that makes that call after the others gave up
  raises the same error instead of running the forward alone. Cost: a few store round
  trips per such call.
- A rank left inside a collective (a training forward that the others did not join)
  fails when the process group times out; its exception gets a note (``add_note``)
  with what the other ranks did, read from the store.

Under the ``fake`` backend, without a process group or on one rank, nothing is
recorded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Final

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_core.collective_entry import CollectiveCallError
from fsdp_core.internals import process_group_timeout
from fsdp_core.rank_wait import wait_for_ranks, wait_limits
from fsdp_core.runtime import RuntimeHook, installed_hooks

if TYPE_CHECKING:
    from fsdp_core.parallel_dims import ParallelDims

__all__ = [
    "EMPTY_BATCH",
    "ForwardArrivalHook",
    "ForwardArrivalRuntimeHook",
    "TRAINING_FORWARD",
    "arrival_scope",
    "call_kind",
    "record_call",
]

logger = logging.getLogger(__name__)

NAME = "forward_arrival"
_PREFIX: Final = "fsdp_core/arrival"
_LISTED: Final = 8
#: How the note this hook adds to an exception starts.
_NOTE: Final = "fsdp_core: "
#: Added to a call's kind when its batch has no rows: the ranks then disagree at once.
EMPTY_BATCH: Final = " with an empty batch"
#: The kind of call that records without waiting.
TRAINING_FORWARD: Final = "a training forward"
#: Set while an arrival scope (``generate()``) covers the forwards inside it.
_SCOPED: ContextVar[bool] = ContextVar("fsdp_core_arrival_scoped", default=False)


def call_kind(model: nn.Module) -> str:
    """What a root forward of ``model`` is, in words (``TRAINING_FORWARD`` when gradients
    are on and the model is in training mode)."""
    if not torch.is_grad_enabled():
        return "a forward under torch.no_grad()"
    if not model.training:
        return "a forward in eval mode (model.eval())"
    return TRAINING_FORWARD


def _ranks_text(ranks: list[int]) -> str:
    more = f" and {len(ranks) - _LISTED} more" if len(ranks) > _LISTED else ""
    return f"{ranks[:_LISTED]}{more}"


@dataclass
class ForwardArrivalHook:
    """The installed hook (see the module docstring). ``calls`` counts this rank's
    numbered calls of the model; ``waits`` those that waited for the other ranks;
    ``timeout_s`` is how long a wait lasts unless ``FSDP_CORE_RANK_WAIT_TIMEOUT_S`` is
    set (the mesh group's timeout)."""

    model: nn.Module
    ranks: tuple[int, ...]
    timeout_s: float
    name: str = NAME
    calls: int = 0
    waits: int = 0
    _store: Any = field(default=None, repr=False)
    _rank: int = field(default=0, repr=False)
    _base: str = field(default="", repr=False)
    _depth: int = field(default=0, repr=False)
    #: The store key of the last call every rank passed (lowest rank only).
    _passed: str = field(default="", repr=False)
    _handles: list[RemovableHandle] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        active = dist.is_initialized() and len(self.ranks) > 1 and dist.get_backend() != "fake"
        if active:
            self._rank = dist.get_rank()
            self._store = dist.group.WORLD.get_group_store()  # type: ignore[union-attr]
            digest = hashlib.sha1(",".join(map(str, self.ranks)).encode()).hexdigest()[:12]
            # One namespace per model: two sharded models of one job count separately.
            count = self._store.add(f"{_PREFIX}/{digest}/models/{self._rank}", 1)
            self._base = f"{_PREFIX}/{digest}/{count}"
            self._store.set(f"{self._base}/status/{self._rank}", "0|no call yet")
            wait_limits(self.timeout_s)  # a bad setting fails here, not at the first wait
        self._handles.append(self.model.register_forward_pre_hook(self._before, prepend=True))
        self._handles.append(self.model.register_forward_hook(self._after, always_call=True))

    # ----------------------------------------------------------------- the calls
    def arrive(self, kind: str) -> None:
        """Number one call of the model on this rank; wait for the others unless it is
        a training forward (see the module docstring)."""
        self.calls += 1
        if self._store is None:
            return
        number = self.calls
        self._store.set(f"{self._base}/status/{self._rank}", f"{number}|{kind}")
        if kind == TRAINING_FORWARD:
            return
        self.waits += 1
        self._wait(number, kind)

    def _wait(self, number: int, kind: str) -> None:
        store = self._store
        tag = hashlib.sha1(kind.encode()).hexdigest()[:8]
        key = f"{self._base}/call/{number}/{tag}"
        limits = wait_limits(self.timeout_s)  # a bad setting raises before the count
        if store.add(f"{key}/count", 1) == len(self.ranks):
            # Compare-and-set: a call the others gave up on stays given up.
            store.compare_set(f"{key}/done", "", "go")

        def look() -> None:
            problem = self._divergence(number, kind, timed_out=False, timeout_s=0.0)
            if problem is not None:
                self._decide(key, problem)

        met = wait_for_ranks(
            store,
            f"{key}/done",
            what=f"call #{number} of the model ({kind})",
            rank=self._rank,
            limits=limits,
            last=lambda: self._last_calls(number),
            look=look,
        )
        if not met:
            problem = self._divergence(number, kind, timed_out=True, timeout_s=limits.timeout_s)
            if problem is None:  # every rank made the call; the last is deciding "go"
                store.wait([f"{key}/done"])
            else:
                self._decide(key, problem)
        if store.get(f"{key}/done").decode() != "go":
            raise CollectiveCallError(store.get(f"{self._base}/diagnosis").decode())
        if self._rank == self.ranks[0]:
            # Every rank added to this call's count after reading the previous call's
            # decision: the previous call's keys are not read again.
            if self._passed:
                store.delete_key(f"{self._passed}/count")
                store.delete_key(f"{self._passed}/done")
            self._passed = key

    def _decide(self, key: str, problem: str) -> None:
        """End call ``key`` on every rank waiting in it, and on any rank that comes to it
        later, with ``problem`` (unless the ranks met first)."""
        self._store.compare_set(f"{self._base}/diagnosis", "", problem)
        self._store.compare_set(f"{key}/done", "", "abort")

    def behind(self) -> dict[int, str]:
        """The ranks that have made fewer calls of the model than this rank, each with
        its last call (read from the store; empty without one)."""
        return {} if self._store is None else self._last_calls(self.calls)

    def _last_calls(self, number: int) -> dict[int, str]:
        """The ranks that have not made call ``number`` yet, each with its last call."""
        statuses = self._statuses()
        last = {}
        for rank in self.ranks:
            made, what = statuses.get(rank, (-1, ""))
            if made < 0:
                last[rank] = "has not sharded this model yet"
            elif made == 0:
                last[rank] = "made no call of the model yet"
            elif made < number:
                last[rank] = f"last made call #{made}, {what}"
        return last

    def _statuses(self) -> dict[int, tuple[int, str]]:
        """Each rank's last call (number, kind); ranks that installed no hook yet are
        missing. One round trip once every rank has installed the hook."""
        keys = [f"{self._base}/status/{rank}" for rank in self.ranks]
        if self._store.check(keys):
            values = list(zip(self.ranks, self._store.multi_get(keys), strict=True))
        else:
            values = [
                (r, self._store.get(k))
                for r, k in zip(self.ranks, keys, strict=True)
                if self._store.check([k])
            ]
        found = {}
        for rank, raw in values:
            number, _, kind = raw.decode().partition("|")
            found[rank] = (int(number), kind)
        return found

    def _divergence(
        self, number: int, kind: str, *, timed_out: bool, timeout_s: float
    ) -> str | None:
        """What stops call ``number`` (``kind``) from being made on every rank, or
        ``None`` while it still may be."""
        statuses = self._statuses()
        other, behind = [], []
        for rank in self.ranks:
            made, what = statuses.get(rank, (0, "no call yet"))
            if made > number or (made == number and what != kind):
                other.append(rank)
            elif made < number:
                behind.append(rank)
        if not other and not (timed_out and behind):
            return None
        lines = []
        for rank in other:
            made, what = statuses[rank]
            lines.append(
                f"rank {rank} made {what} as call #{number}"
                if made == number
                else f"rank {rank} went on to call #{made} ({what}) without making this one"
            )
        if timed_out and behind:
            last = "; ".join(
                f"rank {r}: #{statuses[r][0]}, {statuses[r][1]}"
                if r in statuses
                else f"rank {r}: none yet"
                for r in behind[:_LISTED]
            )
            lines.append(
                f"ranks {_ranks_text(behind)} did not make call #{number} within "
                f"{timeout_s:g} s (their last calls: {last})"
            )
        if any(EMPTY_BATCH in text for text in (kind, *(statuses[r][1] for r in other))):
            lines.append(
                "give every rank at least one row per call: drop the incomplete last batch "
                "(DataLoader(..., drop_last=True)) or pad it"
            )
        return (
            f"the model's calls are collective under FSDP: every rank of the mesh (ranks "
            f"{_ranks_text(list(self.ranks))}) must make the same calls in the same order, "
            f"but rank {self._rank} made {kind} as call #{number} and "
            + "; ".join(lines)
            + ". A forward, eval or generate() on some ranks only (e.g. `if rank == 0: "
            "model.eval(); model(**batch)`) cannot run on a sharded model: run it on every "
            "rank, each on its share of the data, or export the full weights "
            "(fsdp_core.export_full_state_dict) and evaluate a plain copy on one rank."
        )

    # ----------------------------------------------------------------- the hooks
    def _before(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth > 1 or _SCOPED.get():
            return  # a nested call, or a forward inside generate(): counted there
        self.arrive(call_kind(module))

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        error = sys.exc_info()[1]  # set when the forward raised (always-called hook)
        if output is None and error is not None and not isinstance(error, CollectiveCallError):
            self.annotate(error)

    def annotate(self, error: BaseException) -> None:
        """Add what the other ranks did to an exception that left a call of the model
        (a collective that timed out because some rank never joined it)."""
        notes = getattr(error, "__notes__", [])
        if self._store is None or any(str(n).startswith(_NOTE) for n in notes):
            return  # no store, or noted already (by an inner call of the model)
        try:
            diagnosis = ""
            if self._store.check([f"{self._base}/diagnosis"]):
                diagnosis = self._store.get(f"{self._base}/diagnosis").decode()
            if not diagnosis:
                statuses = self._statuses()
                behind = [r for r in self.ranks if statuses.get(r, (0, ""))[0] < self.calls]
                if not behind:
                    return
                diagnosis = (
                    f"rank {self._rank} was in call #{self.calls} of the model; ranks "
                    f"{_ranks_text(behind)} had not made it (their last calls: "
                    + "; ".join(
                        f"rank {r}: #{statuses[r][0]}, {statuses[r][1]}"
                        if r in statuses
                        else f"rank {r}: none"
                        for r in behind[:_LISTED]
                    )
                    + "): a call of the model on some ranks only"
                )
            error.add_note(f"{_NOTE}{diagnosis}")
        except Exception:  # the store itself is gone: the original error matters more
            logger.debug("could not read the other ranks' calls", exc_info=True)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _hook_of(model: nn.Module) -> ForwardArrivalHook | None:
    hook = installed_hooks(model).get(NAME)
    return hook if isinstance(hook, ForwardArrivalHook) else None


def record_call(model: nn.Module, kind: str) -> None:
    """One numbered call of ``model`` made outside its forward (a tower called by hand):
    every rank must make it. A no-op inside an arrival scope or without the hook."""
    hook = _hook_of(model)
    if hook is not None and not _SCOPED.get():
        hook.arrive(kind)


@contextlib.contextmanager
def arrival_scope(model: nn.Module, kind: str) -> Iterator[None]:
    """One numbered call of ``model`` (``kind`` says what, e.g. ``"generate()"``) that
    covers the forwards run inside it: they are in step on every rank when the scope's
    call is (transformers keeps ranks generating in step for FSDP models). A no-op when
    ``model`` has no ``forward_arrival`` hook or a scope is open already."""
    hook = _hook_of(model)
    if hook is None or _SCOPED.get():
        yield
        return
    hook.arrive(kind)
    token = _SCOPED.set(True)
    try:
        yield
    except Exception as error:
        hook.annotate(error)
        raise
    finally:
        _SCOPED.reset(token)


@dataclass(frozen=True)
class ForwardArrivalRuntimeHook(RuntimeHook):
    """The ``forward_arrival`` runtime hook (see the module docstring); no plan data."""

    name: ClassVar[str] = NAME

    def install(self, model: nn.Module, *, dims: ParallelDims) -> ForwardArrivalHook:
        """The calls are numbered over ``dims.lockstep_ranks()``: every rank that runs
        the model's forward (data-parallel, TP, CP and EP ranks, whose collectives inside
        the forward hang when some of them skip a call); not over other PP stages."""
        mesh = dims.dp_mesh
        group = mesh.get_group(mesh.ndim - 1) if dist.is_initialized() else None
        timeout = process_group_timeout(group) if group is not None else timedelta(minutes=10)
        return ForwardArrivalHook(model, dims.lockstep_ranks(), timeout_s=timeout.total_seconds())
