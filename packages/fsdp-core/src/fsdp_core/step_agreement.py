"""Every rank agrees on a forward of the model before any collective of it runs.

FSDP2 turns each forward and backward of a sharded model into collectives that every
rank of the mesh must issue alike. Some mistakes make the ranks' collectives differ with
nothing noticing in time:

- gradient accumulation with a different number of micro-batches per rank: one rank
  reduce-scatters while another accumulates (gloo aborts the process with
  ``EnforceNotMet``, NCCL hangs);
- a rank whose batch is empty: the model fails inside (transformers' attention cannot
  reshape zero rows) while the other ranks wait in the next all-gather;
- a forward that some ranks run with gradients and others without, or a forward some
  ranks run and others not, when the ranks meet at the next forward.

Forwards of ``generate()`` (a forward without gradients that carries a key-value cache:
``cache``, ``past_key_values`` or ``cache_position``) agree on nothing: ranks with images
compute image features before them, with collectives of their own (a schedule checkpoint,
a balanced exchange), that an agreement on the other ranks would meet; every rank runs
the generation steps alike. A ``generate()`` call itself is checked by the
``forward_arrival`` hook (an empty prompt on some rank included).

Before each forward of the model (ahead of the other runtime hooks), every rank puts a
few integers in one all-reduce (MAX over the ranks that run the model's forward
together: the data-parallel mesh and any TP, CP or EP dimension, see
[ParallelDims.lockstep_mesh][fsdp_core.parallel_dims.ParallelDims.lockstep_mesh]; ten
int64 per mesh dimension, and a host sync): whether gradients are on, how many units will
reduce their gradients in this micro-batch's backward (``set_requires_gradient_sync``), whether the
batch is empty, how many forwards of the model it ran and which micro-batch of its step
this is. When they differ, a second all-reduce collects each rank's values and every
rank raises the same [StepMismatchError][fsdp_core.step_agreement.StepMismatchError] (or
[EmptyBatchError][fsdp_core.step_agreement.EmptyBatchError]), built from them, before any
collective of the forward: the process group stays usable. A rank that waits in that
all-reduce for ranks that have not made the forward (a training forward on some ranks
only) logs the shared warning of [rank_wait][fsdp_core.rank_wait] after a minute, naming
them and their last calls of the model; the process group's timeout ends the wait.

The gradient sync flag therefore counts at the forward. A flag changed between a
forward and its backward is set back for that backward (so the ranks' backwards match
what they agreed), with a warning, and the next forward raises ``StepMismatchError`` on
every rank. A forward inside a backward (activation-checkpoint recomputation) agrees on
nothing: every rank recomputes alike.

One more mistake is silent: backwards with gradient sync off and no backward with it on
before ``optimizer.step()``. The sharded gradients were never reduced, so the step
changes nothing (or applies the previous step's gradients). A global optimizer step
pre-hook raises [UnreducedGradientsError][fsdp_core.step_agreement.UnreducedGradientsError]
for an optimizer that holds the model's parameters; every rank runs the same steps, so
every rank raises.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from fsdp_core import internals
from fsdp_core.mesh import all_reduce_max_over_mesh, mesh_device
from fsdp_core.rank_wait import in_collective
from fsdp_core.runtime import BackwardWatch, installed_hooks

__all__ = [
    "AGREEMENT_BYTES",
    "EmptyBatchError",
    "RankStep",
    "StepAgreement",
    "StepMismatchError",
    "UnreducedGradientsError",
    "install_step_agreement",
    "is_empty_batch",
]

logger = logging.getLogger(__name__)

_LISTED: Final = 8
#: Keywords of a forward inside transformers' ``generate()`` (5.x passes ``cache``).
_GENERATION_KEYS: Final = ("cache", "past_key_values", "cache_position")
#: Bytes of the all-reduce (per mesh dimension) every forward of the model costs.
AGREEMENT_BYTES: Final = 10 * 8
#: What the ranks should do about uneven micro-batch counts (quoted by the errors).
_EVEN_COUNTS: Final = (
    "Give every rank the same number of micro-batches per optimizer step (for example "
    "the smallest count over the ranks: dist.all_reduce(count, op=dist.ReduceOp.MIN)), "
    "or pad the short ranks with micro-batches of their own, and call "
    "set_requires_gradient_sync(is_last_micro_batch) before each micro-batch's forward"
)


class StepMismatchError(RuntimeError):
    """The ranks are not running the same forward or micro-batch of the model (their
    collectives would differ); raised on every rank, before any collective."""


class EmptyBatchError(ValueError):
    """Some rank called the model with an empty batch; raised on every rank."""


class UnreducedGradientsError(RuntimeError):
    """``optimizer.step()`` after backwards with gradient sync off that no backward with
    sync on followed: the step would change nothing."""


@dataclass(frozen=True)
class RankStep:
    """What one rank says about a forward of the model (all non-negative)."""

    #: 1 when gradients are on for this forward.
    grad: int
    #: Units that will reduce-scatter their gradients in this micro-batch's backward
    #: (0 when gradients are off).
    sync: int
    #: Units with parameters (the same on every rank).
    units: int
    #: 1 when every tensor argument of the forward is empty.
    empty: int
    #: Forwards of the model this rank ran since the hook was installed, this one included.
    forwards: int
    #: Micro-batch of this optimizer step: forwards with gradients since the last backward
    #: that reduced gradients, this one included (0 when gradients are off).
    micro: int
    #: 1 when gradient sync changed between the last forward and its backward.
    changed: int

    def summary(self) -> list[int]:
        """The values whose maxima tell whether every rank agrees (min as -max(-x))."""
        return [
            self.grad,
            1 - self.grad,
            self.sync,
            -self.sync,
            self.empty,
            self.forwards,
            -self.forwards,
            self.micro,
            -self.micro,
            self.changed,
        ]


def _agrees(summary: Sequence[int]) -> bool:
    grad, no_grad, sync, neg_sync, empty, forwards, neg_forwards, micro, neg_micro, changed = (
        summary
    )
    return (
        not (grad and no_grad)
        and sync == -neg_sync
        and not empty
        and forwards == -neg_forwards
        and micro == -neg_micro
        and not changed
    )


def is_empty_batch(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a forward's arguments hold a batch with no rows: every tensor argument of
    two or more dimensions (of one dimension, when there is none) has no elements. Image
    tensors of a text-only batch may be empty; the token ids then are not."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    batched = [t for t in tensors if t.dim() >= 2] or [t for t in tensors if t.dim() == 1]
    return bool(batched) and all(t.numel() == 0 for t in batched)


def _ranks_text(ranks: Sequence[int]) -> str:
    more = f" and {len(ranks) - _LISTED} more" if len(ranks) > _LISTED else ""
    return f"{list(ranks[:_LISTED])}{more}"


def _who(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks [0, 2]``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranks_text(ranks)}"


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
    """The error every rank raises for ``table`` (global rank -> what it said), built
    from the table alone so that every rank raises the same words."""
    ranks = sorted(table)
    head = f"the ranks of the model's mesh ({_ranks_text(ranks)}) "
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
        "collectives in backward (gloo aborts, NCCL hangs). " + _EVEN_COUNTS
    )


class StepAgreement:
    """The installed agreement (see the module docstring), put on the sharded ``model`` by
    its constructor. ``agreements`` counts the forwards it agreed on."""

    name: str = "step_agreement"

    def __init__(self, model: nn.Module, *, mesh: DeviceMesh) -> None:
        self.model = model
        self.mesh = mesh
        self._units: list[FSDPModule] = [
            unit for unit in internals.distinct_units(model) if internals.param_groups(unit)
        ]
        self._ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        self._device = mesh_device(mesh)
        #: The mesh group's timeout, which ends a wait in the agreement's all-reduce
        #: (``None`` where no other process takes part: nothing to wait for).
        self._timeout_s: float | None = None
        if dist.is_initialized() and len(self._ranks) > 1 and dist.get_backend() != "fake":
            group = mesh.get_group(mesh.ndim - 1)
            self._timeout_s = internals.process_group_timeout(group).total_seconds()
        self.forwards = 0
        self.agreements = 0
        self._micro = 0
        #: Per-unit gradient sync as agreed at the last forward with gradients.
        self._agreed: tuple[bool, ...] | None = None
        self._changed = False
        self._in_backward = False
        #: Whether the last backward left gradients unreduced (gradient sync off).
        self.unreduced = False
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._before_forward, prepend=True, with_kwargs=True)
        ]
        self._watch: BackwardWatch | None = BackwardWatch(model, self._on_backward)
        _AGREEMENTS.add(self)
        _install_step_check()

    # ------------------------------------------------------------------ forward
    def _flags(self) -> tuple[bool, ...]:
        return tuple(internals.reduces_gradients(unit) for unit in self._units)

    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if internals.in_backward():
            return  # a recomputation inside backward: every rank runs it alike
        grad = torch.is_grad_enabled()
        if not grad and any(kwargs.get(key) is not None for key in _GENERATION_KEYS):
            # A generation step: ranks with images ran the tower before it (image
            # features), with collectives of its own, and every rank runs the steps alike.
            return
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
        self.agree(mine)

    def agree(self, mine: RankStep) -> None:
        """Raise on every rank unless every rank of the mesh said the same as ``mine``
        (one all-reduce; a second one, to name the ranks, only when they differ)."""
        self.agreements += 1
        summary = torch.tensor(mine.summary(), dtype=torch.int64, device=self._device)
        with self._waiting(mine.forwards):
            all_reduce_max_over_mesh(summary, self.mesh)
            agreed = _agrees(summary.tolist())  # the host waits here on a GPU
        if agreed:
            return
        me = self._ranks.index(torch.distributed.get_rank()) if len(self._ranks) > 1 else 0
        rows = torch.full(
            (len(self._ranks), len(astuple(mine))), -1, dtype=torch.int64, device=self._device
        )
        rows[me] = torch.tensor(astuple(mine), dtype=torch.int64)
        all_reduce_max_over_mesh(rows, self.mesh)
        table = {
            rank: RankStep(*row)
            for rank, row in zip(self._ranks, rows.tolist(), strict=True)
            if min(row) >= 0  # a rank that wrote nothing: only under the fake group
        }
        raise mismatch_error(table)

    @contextlib.contextmanager
    def _waiting(self, forward: int) -> Iterator[None]:
        """The agreement's all-reduce, marked as a wait for the other ranks: a training
        forward on some ranks only waits there, and is warned about (see
        [rank_wait][fsdp_core.rank_wait]) with what the ``forward_arrival`` hook knows
        of the other ranks' calls."""
        if self._timeout_s is None:
            yield
            return
        arrival = installed_hooks(self.model).get("forward_arrival")
        behind = getattr(arrival, "behind", dict)
        with in_collective(
            f"the agreement before forward #{forward} of the model (an all-reduce over its mesh)",
            rank=dist.get_rank(),
            timeout_s=self._timeout_s,
            last=behind,
        ):
            yield

    # ----------------------------------------------------------------- backward
    def _on_backward(self) -> None:
        if self._in_backward:
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

    # ---------------------------------------------------------------- optimizer
    def holds_parameters_of(self, optimizer: torch.optim.Optimizer) -> bool:
        mine = {id(p) for p in self.model.parameters()}
        return any(id(p) in mine for group in optimizer.param_groups for p in group["params"])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._watch is not None:
            self._watch.remove()
            self._watch = None
        _AGREEMENTS.discard(self)


def install_step_agreement(model: nn.Module, *, mesh: DeviceMesh) -> StepAgreement:
    """Install the agreement on a sharded ``model`` (see the module docstring)."""
    return StepAgreement(model, mesh=mesh)


_AGREEMENTS: weakref.WeakSet[StepAgreement] = weakref.WeakSet()
_STEP_HOOK: list[RemovableHandle] = []


def _install_step_check() -> None:
    """Register the global optimizer step pre-hook once per process."""
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(_before_step))


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for agreement in list(_AGREEMENTS):
        if agreement.unreduced and agreement.holds_parameters_of(optimizer):
            sync_now = any(agreement._flags())
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
