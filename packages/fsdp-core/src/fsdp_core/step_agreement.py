"""What a rank brings to the agreement before each forward: its step.

Uneven micro-batch counts (gloo aborts, NCCL hangs), an empty batch on one rank or a
forward with gradients on some ranks only make the ranks' collectives differ. The
[forward agreement][fsdp_core.forward_agreement] carries each rank's
[RankStep][fsdp_core.step_agreement.RankStep], and differing steps raise the same
[StepMismatchError][fsdp_core.step_agreement.StepMismatchError] (or
[EmptyBatchError][fsdp_core.step_agreement.EmptyBatchError]) on every rank. Gradient
sync therefore counts at the forward: a flag changed before the backward is set back
(with a warning) and the next forward raises. An optimizer step after backwards that
reduced nothing raises [UnreducedGradientsError][fsdp_core.step_agreement.UnreducedGradientsError].
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any, Final

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from fsdp_core import internals
from fsdp_core.rank_wait import ranks_text
from fsdp_core.runtime import BackwardWatch

__all__ = [
    "EmptyBatchError",
    "RankStep",
    "StepMismatchError",
    "StepState",
    "UnreducedGradientsError",
    "is_empty_batch",
    "mismatch_error",
]

logger = logging.getLogger(__name__)

#: Keywords of a forward inside transformers' ``generate()`` (5.x passes ``cache``).
GENERATION_KEYS: Final = ("cache", "past_key_values", "cache_position")


class StepMismatchError(RuntimeError):
    """The ranks are not running the same forward or micro-batch of the model."""


class EmptyBatchError(ValueError):
    """Some rank called the model with an empty batch; raised on every rank."""


class UnreducedGradientsError(RuntimeError):
    """``optimizer.step()`` after backwards that all had gradient sync off."""


@dataclass(frozen=True)
class RankStep:
    """What one rank says about a forward of the model (all non-negative)."""

    #: 1 when gradients are on for this forward.
    grad: int
    #: Units that will reduce-scatter their gradients in this backward (0 without gradients).
    sync: int
    #: Units with parameters (the same on every rank).
    units: int
    #: 1 when the batch is empty (``is_empty_batch``).
    empty: int
    #: Forwards of the model since the hook was installed, this one included.
    forwards: int
    #: Forwards with gradients since the last reducing backward (0 without gradients).
    micro: int
    #: 1 when gradient sync changed between the last forward and its backward.
    changed: int

    def text(self) -> str:
        """The step as the agreement carries it.

        Returns:
            Its fields, comma-separated.
        """
        return ",".join(map(str, astuple(self)))

    @classmethod
    def parse(cls, text: str) -> RankStep:
        """The step ``text`` carried (the inverse of ``text``).

        Args:
            text: what another rank's ``text`` returned.

        Returns:
            The step.
        """
        return cls(*(int(value) for value in text.split(",")))


def agrees(steps: Sequence[RankStep]) -> bool:
    """Whether ``steps`` are the same forward, none empty or with gradient sync changed."""
    same = len({(s.grad, s.sync, s.forwards, s.micro) for s in steps}) == 1
    return same and not any(s.empty or s.changed for s in steps)


def is_empty_batch(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether the batch has no rows: every tensor argument of two or more dimensions (else
    of one) is empty (a text-only batch's image tensors may be; its token ids are not).

    Args:
        args: the forward's positional arguments.
        kwargs: the forward's keyword arguments.

    Returns:
        Whether the batch is empty.
    """
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    batched = [t for t in tensors if t.dim() >= 2] or [t for t in tensors if t.dim() == 1]
    return bool(batched) and all(t.numel() == 0 for t in batched)


def _who(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks [0, 2]``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks_text(ranks)}"


def _grouped(table: Mapping[int, RankStep], key: Any) -> list[tuple[Any, list[int]]]:
    """The ranks of ``table`` grouped by ``key(step)``, groups in order of first rank."""
    groups: dict[Any, list[int]] = {}
    for rank, step in table.items():
        groups.setdefault(key(step), []).append(rank)
    return list(groups.items())


def _ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10)
    return f"{number}{suffix or 'th'}"


def mismatch_error(table: Mapping[int, RankStep]) -> Exception:
    """The error every rank raises for ``table``, built from it alone (the same words).

    Args:
        table: ``{global rank: its step}``.

    Returns:
        The error to raise.
    """
    ranks = sorted(table)
    head = f"the ranks of the model's mesh ({ranks_text(ranks)}) "
    empty = [r for r in ranks if table[r].empty]
    if empty:
        return EmptyBatchError(
            f"{_who(empty)} called the model with an empty batch (every tensor "
            "argument has no elements, e.g. input_ids of shape (0, seq)). A sharded model's "
            "forward is collective: every rank runs every unit, and an empty batch fails "
            "inside the model (transformers' attention cannot reshape zero rows) or gives a "
            "NaN mean loss, while the other ranks wait. Give every rank at least one row "
            "per forward: drop the incomplete last batch (DataLoader(..., drop_last=True), "
            "DistributedSampler(..., drop_last=True)) or pad it"
        )
    forwards = _grouped(table, lambda s: s.forwards)
    if len(forwards) > 1:
        said = "; ".join(
            f"{_who(rs)}: the {_ordinal(n)} forward of the model" for n, rs in forwards
        )
        return StepMismatchError(
            head + f"ran different numbers of forwards ({said}). Every forward of a sharded "
            "model is collective (its units all-gather from every rank): run each forward, "
            "eval and generate() on every rank, the same number of times"
        )
    grads = _grouped(table, lambda s: s.grad)
    if len(grads) > 1:
        said = "; ".join(
            f"{_who(rs)}: "
            + ("with gradients" if g else "without gradients (torch.no_grad / inference_mode)")
            for g, rs in grads
        )
        return StepMismatchError(
            head + f"disagree about this forward ({said}): their backwards would differ; "
            "run training forwards and no-grad forwards alike on every rank"
        )
    changed = [r for r in ranks if table[r].changed]
    if changed:
        return StepMismatchError(
            f"{_who(changed)} changed set_requires_gradient_sync between a "
            "forward of the model and its backward. The ranks agree on gradient sync at the "
            "forward (a backward that reduces on some ranks and not on others aborts on "
            "gloo and hangs on NCCL), so that backward ran with the flag set before its "
            "forward. Call set_requires_gradient_sync(is_last_micro_batch) before each "
            "micro-batch's forward"
        )

    def state(step: RankStep) -> str:
        if step.sync == step.units:
            sync = "gradient sync on (its last micro-batch)"
        elif step.sync == 0:
            sync = "gradient sync off (more micro-batches follow)"
        else:
            sync = f"gradient sync on for {step.sync} of {step.units} units"
        return f"micro-batch {step.micro} of its step, {sync}"

    said = "; ".join(f"{_who(rs)} at {text}" for text, rs in _grouped(table, state))
    return StepMismatchError(
        head + f"are not in the same gradient-accumulation step: at this forward {said}. "
        "Ranks that reduce gradients while others accumulate would run different "
        "collectives in backward (gloo aborts, NCCL hangs). Give every rank the same number "
        "of micro-batches per optimizer step (for example the smallest count over the ranks: "
        "dist.all_reduce(count, op=dist.ReduceOp.MIN)), or pad the short ranks with "
        "micro-batches of their own, and call set_requires_gradient_sync(is_last_micro_batch) "
        "before each micro-batch's forward"
    )


class StepState:
    """This rank's step at each forward of ``model``; ``forwards`` counts them.

    Args:
        model: the sharded model whose forwards are agreed on.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._units: list[FSDPModule] = [
            unit for unit in internals.distinct_units(model) if internals.param_groups(unit)
        ]
        self.forwards = 0
        self._micro = 0
        #: Per-unit gradient sync as agreed at the last forward with gradients.
        self._agreed: tuple[bool, ...] | None = None
        self._changed = False
        self._in_backward = False
        #: Whether the last backward left gradients unreduced (gradient sync off).
        self.unreduced = False
        self._watch: BackwardWatch | None = BackwardWatch(model, self._on_backward)
        _STATES.add(self)
        if not _STEP_HOOK:  # one global optimizer step pre-hook per process
            _STEP_HOOK.append(register_optimizer_step_pre_hook(_before_step))

    def _flags(self) -> tuple[bool, ...]:
        return tuple(internals.reduces_gradients(unit) for unit in self._units)

    def before_forward(self, args: Any, kwargs: Mapping[str, Any]) -> RankStep | None:
        """The step of the forward about to run; ``None`` for a generation step (no
        gradients, a key-value cache), which says nothing.

        Args:
            args: the forward's positional arguments.
            kwargs: the forward's keyword arguments.

        Returns:
            This rank's step, or None.
        """
        grad = torch.is_grad_enabled()
        if not grad and any(kwargs.get(key) is not None for key in GENERATION_KEYS):
            return None
        self.forwards += 1
        flags = self._flags() if grad else ()
        if grad:
            self._micro += 1
            self._agreed = flags
        mine = RankStep(
            grad=int(grad),
            sync=sum(flags),
            units=len(self._units),
            empty=int(is_empty_batch(args, kwargs)),
            forwards=self.forwards,
            micro=self._micro if grad else 0,
            changed=int(self._changed),
        )
        self._changed = False
        return mine

    def _on_backward(self) -> None:
        if self._in_backward or not internals.finishes_backward(self.model):  # type: ignore[arg-type]
            # A caller that ends the backwards by hand (torch's pipeline schedules) owns
            # the flag: the same on every rank of the stage, nothing unreduced.
            return
        self._in_backward = True
        flags = self._flags()
        if self._agreed is not None and flags != self._agreed:
            for unit, flag, now in zip(self._units, self._agreed, flags, strict=True):
                if flag != now:
                    unit.set_requires_gradient_sync(flag, recurse=False)
            self._changed = True
            logger.warning(
                "set_requires_gradient_sync changed between a forward and its backward; "
                "this backward uses the flag set before the forward (the ranks agreed on "
                "it there), and the next forward raises StepMismatchError on every rank"
            )
            flags = self._agreed
        reduces = any(flags)
        internals.queue_end_of_backward(lambda: self._backward_done(reduces))

    def _backward_done(self, reduced: bool) -> None:
        self._in_backward = False
        self.unreduced = not reduced
        if reduced:
            self._micro = 0

    def holds_parameters_of(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` steps parameters of this model.

        Args:
            optimizer: an optimizer about to step.

        Returns:
            Whether it holds one of the model's parameters.
        """
        mine = {id(p) for p in self.model.parameters()}
        return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])

    def remove(self) -> None:
        """Stop watching the model's backwards and forget this state."""
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        _STATES.discard(self)


_STATES: weakref.WeakSet[StepState] = weakref.WeakSet()
_STEP_HOOK: list[RemovableHandle] = []


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for state in list(_STATES):
        if state.unreduced and state.holds_parameters_of(optimizer):
            sync_now = any(state._flags())
            when = (
                "gradient sync is on again, but it was off during the last backward"
                if sync_now
                else "gradient sync is still off"
            )
            raise UnreducedGradientsError(
                f"{type(optimizer).__name__}.step() follows backwards with gradient sync "
                f"off (set_requires_gradient_sync(False)) and no backward since reduced "
                f"the gradients ({when}): the sharded gradients the step reads were never "
                "reduced, so it would silently change nothing (or apply the previous "
                "step's gradients). Turn gradient sync on before the last micro-batch's "
                "forward of each step: model.set_requires_gradient_sync(is_last_micro_batch)"
            )
