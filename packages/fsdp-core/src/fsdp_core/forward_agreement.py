"""Before each call of the model, every rank agrees on it: a call on some ranks only, or a
step that differs, fails on every rank instead of hanging.

``if rank == 0: model.eval(); model(**batch)`` leaves rank 0 in an all-gather nobody
joins; uneven micro-batch counts or an empty batch make reduce-scatters differ. So the
model's *calls* (root forwards, ``generate()``, a tower called outside the forward) are
numbered and each meets the lockstep ranks at the model's
[agreement][fsdp_core.rank_agreement] with the call and this rank's
[step][fsdp_core.step_agreement.RankStep]: different calls or missing ranks raise
[CollectiveCallError][fsdp_core.rank_agreement.CollectiveCallError], different steps
[StepMismatchError][fsdp_core.step_agreement.StepMismatchError], on every rank.
Recomputations and forwards inside an agreed ``generate()`` meet nowhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_core import internals
from fsdp_core.rank_agreement import (
    CollectiveCallError,
    Meeting,
    RankAgreement,
    agreement_of,
    kind_of,
    payload_of,
)
from fsdp_core.rank_wait import LISTED, ranks_text
from fsdp_core.runtime import RuntimeHook, installed_hooks
from fsdp_core.step_agreement import RankStep, StepState, agrees, mismatch_error

if TYPE_CHECKING:
    from fsdp_core.parallel_dims import ParallelDims

__all__ = [
    "EMPTY_BATCH",
    "ForwardAgreement",
    "ForwardAgreementRuntimeHook",
    "TRAINING_FORWARD",
    "agreement_scope",
    "call_kind",
    "record_call",
]

NAME = "forward_agreement"
#: The kind of this hook's values at the agreement.
CALL: Final = "call"
#: Added to a call's kind when its batch has no rows: the ranks then disagree at once.
EMPTY_BATCH: Final = " with an empty batch"
TRAINING_FORWARD: Final = "a training forward"
#: Set while an agreed call (``generate()``) covers the forwards inside it.
_SCOPED: ContextVar[bool] = ContextVar("fsdp_core_agreement_scoped", default=False)


def call_kind(model: nn.Module) -> str:
    """What a root forward of ``model`` is, in words.

    Args:
        model: the model about to run its forward.

    Returns:
        ``TRAINING_FORWARD`` when gradients are on and the model is in training mode.
    """
    if not torch.is_grad_enabled():
        return "a forward under torch.no_grad()"
    if not model.training:
        return "a forward in eval mode (model.eval())"
    return TRAINING_FORWARD


def _call(value: str) -> tuple[int, str, RankStep | None]:
    """(number, kind, step) of a call value."""
    number, kind, step = payload_of(value).split("|")
    return int(number), kind, RankStep.parse(step) if step else None


def describe_call(value: str) -> str:
    number, kind, _ = _call(value)
    return f"call #{number}, {kind}"


def _last(point: int, value: str) -> str:
    """A rank's last call as a timeout names it (``#1, a training forward``)."""
    if point <= 0:
        return "none yet"
    return describe_call(value).removeprefix("call ") if kind_of(value) == CALL else value


class ForwardAgreement:
    """The installed hook; ``calls`` counts this rank's numbered calls of the model.

    Args:
        model: the sharded model.
        agreement: the model's agreement ([agreement_of][fsdp_core.rank_agreement.agreement_of]).
    """

    name: str = NAME

    def __init__(self, model: nn.Module, agreement: RankAgreement) -> None:
        self.model = model
        self.agreement = agreement
        self.ranks = agreement.ranks
        self.step = StepState(model)
        self.calls = 0
        self._depth = 0
        agreement.register(CALL, self.explain, describe_call)
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._before, prepend=True, with_kwargs=True),
            model.register_forward_hook(self._after, always_call=True),
        ]

    def arrive(self, kind: str, step: RankStep | None = None) -> None:
        """Number one call of the model on this rank and meet the others there.

        Args:
            kind: the call in words (``call_kind``, ``"generate()"``, ...).
            step: this rank's step, for a forward that says one.

        Raises:
            CollectiveCallError: the ranks made different calls, or some did not come.
            StepMismatchError: the ranks' steps differ.
            EmptyBatchError: some rank's batch has no rows.
        """
        self.calls += 1
        payload = f"{self.calls}|{kind}|{step.text() if step is not None else ''}"
        self.agreement.meet(CALL, payload, what=f"call #{self.calls} of the model ({kind})")

    def _before(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._depth += 1
        if self._depth > 1 or _SCOPED.get() or internals.in_backward():
            return  # a nested call, a forward inside generate() or a recomputation
        self.arrive(call_kind(module), self.step.before_forward(args, kwargs))

    def _after(self, *_: object) -> None:
        self._depth = max(0, self._depth - 1)

    def explain(self, meeting: Meeting) -> Exception | None:
        """The error of a meeting of calls.

        Args:
            meeting: what the ranks said at one point.

        Returns:
            The error every rank raises, or ``None`` while the ranks agree (or may).
        """
        calls = {r: _call(v) for r, v in meeting.values.items() if kind_of(v) == CALL}
        made = {(number, kind) for number, kind, _ in calls.values()}
        late = meeting.timed_out_s is not None and bool(meeting.elsewhere)
        if len(made) == 1 and not late:
            steps = {r: step for r, (_, _, step) in calls.items() if step is not None}
            if len(steps) < len(calls) or agrees(list(steps.values())):
                return None
            return mismatch_error(steps)
        groups: dict[tuple[int, str], list[int]] = {}
        for rank, (number, kind, _) in calls.items():
            groups.setdefault((number, kind), []).append(rank)
        lines = [
            f"{'rank' if len(rs) == 1 else 'ranks'} {rs[0] if len(rs) == 1 else rs} made "
            f"{kind} as call #{number}"
            for (number, kind), rs in groups.items()
        ]
        number = min(number for number, _ in made)
        if late:
            behind = sorted(meeting.elsewhere)
            last = "; ".join(f"rank {r}: {_last(*meeting.elsewhere[r])}" for r in behind[:LISTED])
            lines.append(
                f"ranks {ranks_text(behind)} did not make call #{number} within "
                f"{meeting.timed_out_s:g} s (their last calls: {last})"
            )
        if any(EMPTY_BATCH in kind for _, kind in made):
            lines.append(
                "give every rank at least one row per call: drop the incomplete last batch "
                "(DataLoader(..., drop_last=True)) or pad it"
            )
        return CollectiveCallError(
            f"the model's calls are collective under FSDP: every rank of the mesh (ranks "
            f"{ranks_text(self.ranks)}) must make the same calls in the same order, "
            "but " + "; ".join(lines) + ". A forward, eval or generate() on some ranks only "
            "(e.g. `if rank == 0: model.eval(); model(**batch)`) cannot run on a sharded "
            "model: run it on every rank, each on its share of the data, or export the full "
            "weights (fsdp_core.export_full_state_dict) and evaluate a plain copy on one rank."
        )

    def remove(self) -> None:
        """Remove the hooks and the step state; the agreement forgets calls."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.step.remove()
        self.agreement.unregister(CALL)


def _hook_of(model: nn.Module) -> ForwardAgreement | None:
    hook = installed_hooks(model).get(NAME)
    return hook if isinstance(hook, ForwardAgreement) else None


def record_call(model: nn.Module, kind: str) -> None:
    """One numbered call of ``model`` made outside its forward (a tower called by hand);
    a no-op inside an agreed call or without the hook.

    Args:
        model: the sharded model.
        kind: the call in words.
    """
    hook = _hook_of(model)
    if hook is not None and not _SCOPED.get():
        hook.arrive(kind)


@contextlib.contextmanager
def agreement_scope(model: nn.Module, kind: str) -> Iterator[None]:
    """One numbered call of ``model`` (e.g. ``"generate()"``) that covers the forwards
    inside it (transformers keeps ranks generating in step for FSDP models); a no-op
    without the hook or inside a scope already.

    Args:
        model: the sharded model.
        kind: the call in words.
    """
    hook = _hook_of(model)
    if hook is None or _SCOPED.get():
        yield
        return
    hook.arrive(kind)
    token = _SCOPED.set(True)
    try:
        yield
    finally:
        _SCOPED.reset(token)


@dataclass(frozen=True)
class ForwardAgreementRuntimeHook(RuntimeHook):
    """The ``forward_agreement`` runtime hook; no plan data."""

    name: ClassVar[str] = NAME
    reads: ClassVar[tuple[internals.Probe, ...]] = (
        internals.STATE_GROUPS,
        internals.GROUP_PARAMS,
        internals.GROUP_REDUCE,
        internals.GRAPH_TASK,
        internals.QUEUE_CALLBACK,
    )

    def install(self, model: nn.Module, *, dims: ParallelDims) -> ForwardAgreement:
        """Agreed over ``dims.lockstep_ranks()``: every rank whose collectives run inside
        the model's forward (not other PP stages)."""
        return ForwardAgreement(model, agreement_of(model, dims))
