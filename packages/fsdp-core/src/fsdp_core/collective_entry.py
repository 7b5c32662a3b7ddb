"""How every rank enters and leaves a collective library call.

A function that all ranks must call (``save_pretrained``, ``load_pretrained``,
``apply_plan``, the measurements) first checks that every rank of its group
arrived in the same function, with a bounded wait, and then lets the ranks agree
after each step that may fail on some of them. So a misuse (``if rank == 0:
save_pretrained(...)``) or a failure on one rank (an unwritable directory, a full
disk) is raised on every rank, with the same exception type and message, instead
of one rank raising while the others block in the next collective.

Both go through the process group's store (c10d ``Store``), never through
collectives: a rank that never arrives leaves no collective half done, so the
process group stays usable, and the collectives a measurement counts are
unchanged. Under the single-process ``fake`` backend, without a process group or
in a group of one rank, every check is a no-op and a local error is raised as is.

Protocol, per group of ranks and per call (a sequence number each rank counts):
each rank writes its entry point's name, the last to arrive records the decision
``go``; a rank that waited ``timeout`` in vain records ``abort`` (an atomic
compare-and-set, so exactly one decision wins) and every rank that arrived raises
[CollectiveCallError][fsdp_core.collective_entry.CollectiveCallError]. A rank that
comes to an aborted call later skips it, so the ranks' sequence numbers meet
again at the next call.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, Final, TypeVar

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_core.internals import process_group_timeout
from fsdp_core.rank_wait import (
    LISTED,
    TIMEOUT_ENV,
    WaitLimits,
    ranks_text,
    wait_for_ranks,
    wait_limits,
)

__all__ = [
    "CollectiveCallError",
    "CollectiveCall",
    "enter_collective",
    "group_ranks",
    "whole_world_ranks",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PREFIX: Final = "fsdp_core/collective"
_GO: Final = "go"
_ABORT: Final = "abort"
#: Calls entered so far in this process, per group of ranks.
_SEQUENCE: dict[str, int] = {}
#: Set on an exception that every rank already raises (not posted again on exit).
_AGREED: Final = "_fsdp_core_agreed"


class CollectiveCallError(RuntimeError):
    """A collective function was not entered by every rank of its group, or the
    ranks entered different ones, or a rank failed and the others raise it too."""


def group_ranks(
    *, model: nn.Module | None = None, mesh: DeviceMesh | None = None
) -> tuple[int, ...]:
    """The global ranks that take part in a collective call on ``model`` or ``mesh``:
    those of ``mesh``, else of every mesh ``model``'s tensors are sharded over (an
    HSDP mesh counts whole; a mesh that is part of the world counts only its ranks),
    else the world. Empty without a process group."""
    if not dist.is_initialized():
        return ()
    meshes: dict[int, DeviceMesh] = {}
    if mesh is not None:
        meshes[id(mesh)] = mesh
    elif model is not None:
        for tensor in (*model.parameters(), *model.buffers()):
            if isinstance(tensor, DTensor):
                meshes.setdefault(id(tensor.device_mesh), tensor.device_mesh)
    if not meshes:
        return tuple(range(dist.get_world_size()))
    ranks: set[int] = set()
    for each in meshes.values():
        ranks.update(int(r) for r in each.mesh.flatten().tolist())
    return tuple(sorted(ranks))


def whole_world_ranks(model: nn.Module, what: str, instead: str) -> tuple[int, ...]:
    """``group_ranks(model=model)`` for a call whose torch collectives span the whole
    world (DCP, ``broadcast_from_rank0``). A model sharded over part of it (a pipeline
    stage) is refused: each stage's ranks would meet the others' different call. Every
    stage holds a part, so every rank raises, before any collective.

    Args:
        model: the sharded model the call is about.
        what: the call, for the message.
        instead: what to do instead, for the message.

    Returns:
        The global ranks the model is sharded over (the world).

    Raises:
        ValueError: the model's ranks are not the world (``instead`` says what to do).
    """
    ranks = group_ranks(model=model)
    if dist.is_initialized() and len(ranks) < dist.get_world_size():
        raise ValueError(
            f"{what}: the model is sharded over ranks {list(ranks)} of a world of "
            f"{dist.get_world_size()} (a pipeline stage), and {what} runs torch "
            f"collectives over the whole world; {instead}"
        )
    return ranks


def _seconds(timeout: float | timedelta | None, default: timedelta) -> float:
    if timeout is None:
        return default.total_seconds()
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise TypeError(
            f"timeout must be seconds (a number) or a datetime.timedelta, got "
            f"{type(timeout).__name__} ({timeout!r})"
        )
    if not value > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return value


def _active(ranks: Sequence[int]) -> bool:
    """Whether the checks talk to other processes (not fake, not alone)."""
    if not dist.is_initialized() or len(ranks) <= 1:
        return False
    return dist.get_backend() != "fake"


def _group_key(ranks: Sequence[int]) -> str:
    text = ",".join(map(str, ranks))
    return f"{len(ranks)}-{hashlib.sha1(text.encode()).hexdigest()[:16]}"


def _message(error: BaseException) -> str:
    """The error's text (an OSError's without the ``[Errno n]`` its rebuild adds back)."""
    if isinstance(error, OSError) and error.errno is not None and error.strerror:
        return error.strerror + (f": {error.filename!r}" if error.filename else "")
    return str(error) or type(error).__name__


def _failure_payload(error: BaseException, rank: int, step: str) -> str:
    kind = type(error)
    return json.dumps(
        {
            "rank": rank,
            "step": step,
            "module": kind.__module__,
            "qualname": kind.__qualname__,
            "errno": getattr(error, "errno", None) if isinstance(error, OSError) else None,
            "message": _message(error),
        }
    )


def exception_type(module: str, qualname: str) -> type[Exception] | None:
    """The class a failing rank raised, if this process has it loaded already."""
    owner: Any = sys.modules.get(module)
    for part in qualname.split("."):
        owner = getattr(owner, part, None)
    if isinstance(owner, type) and issubclass(owner, Exception):
        return owner
    return None


def _rebuild(payload: dict[str, Any], failed: Sequence[int], name: str) -> Exception:
    """The same exception on every rank: the failing rank's type and message."""
    rank, step = payload["rank"], payload["step"]
    others = [r for r in failed if r != rank]
    text = f"{name} failed on rank {rank} ({step}): {payload['message']}"
    if others:
        text += f"; ranks {ranks_text(others)} failed too"
    kind = exception_type(payload["module"], payload["qualname"])
    number = payload.get("errno")
    try:
        if kind is not None and issubclass(kind, OSError) and isinstance(number, int):
            return kind(number, text)
        if kind is not None:
            return kind(text)
    except Exception:  # a type that needs other arguments: say which it was
        pass
    return CollectiveCallError(f"{text} ({payload['module']}.{payload['qualname']})")


class CollectiveCall:
    """One collective call that every rank of ``ranks`` entered (see
    [enter_collective][fsdp_core.collective_entry.enter_collective]).

    [agree][fsdp_core.collective_entry.CollectiveCall.agree] after a step that may fail
    on some ranks; [run][fsdp_core.collective_entry.CollectiveCall.run] runs the step
    and agrees; [agree_on][fsdp_core.collective_entry.CollectiveCall.agree_on] checks
    that every rank holds the same value. Used as a context manager, an exception that
    leaves the block on one rank is posted so that the others raise it at their next
    agreement instead of waiting out the timeout.
    """

    def __init__(
        self, name: str, ranks: tuple[int, ...], *, timeout_s: float, step_timeout_s: float
    ) -> None:
        self.name = name
        self.ranks = ranks
        self.active = _active(ranks)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        self._store: Any = None
        self._base = ""
        self._step = 0
        if self.active:
            if self.rank not in ranks:
                raise ValueError(f"rank {self.rank} is not one of the ranks {list(ranks)}")
            self._store = dist.group.WORLD.get_group_store()  # type: ignore[union-attr]

    # ------------------------------------------------------------------ arrival
    def _enter(self) -> None:
        store = self._store
        group = _group_key(self.ranks)
        number = _SEQUENCE.get(group, 0)
        while store.check([f"{_PREFIX}/{group}/{number}/decision"]):
            logger.warning(
                "skipping collective call %d of ranks %s: decided without this rank",
                number,
                ranks_text(self.ranks),
            )
            number += 1  # the others gave up on this rank there: the call is over
        _SEQUENCE[group] = number + 1
        self._base = base = f"{_PREFIX}/{group}/{number}"
        store.set(f"{base}/name/{self.rank}", self.name)
        first = store.compare_set(f"{base}/name", "", self.name).decode()
        if first != self.name:
            self._decide(_ABORT)
        elif store.add(f"{base}/count", 1) == len(self.ranks):
            self._decide(_GO)
        met = wait_for_ranks(
            store,
            f"{base}/done",
            what=f"{self.name} (collective call #{number} of ranks {ranks_text(self.ranks)})",
            rank=self.rank,
            limits=WaitLimits(self.timeout_s, wait_limits(self.timeout_s).warn_after_s),
            last=lambda: self._last_entries(number),
        )
        if not met:
            self._decide(_ABORT)
        if store.get(f"{base}/decision").decode() != _GO:
            raise self._arrival_error()

    def _last_entries(self, number: int) -> dict[int, str]:
        """The ranks that have not entered call ``number``, each with the last collective
        call of these ranks it entered (looked up among the few calls before)."""
        group = _group_key(self.ranks)
        last = {}
        for rank in self.ranks:
            if self._store.check([f"{_PREFIX}/{group}/{number}/name/{rank}"]):
                continue
            last[rank] = "entered none of the last collective calls of these ranks"
            for earlier in range(number - 1, max(number - 1 - LISTED, -1), -1):
                key = f"{_PREFIX}/{group}/{earlier}/name/{rank}"
                if self._store.check([key]):
                    name = self._store.get(key).decode()
                    last[rank] = f"last entered {name} (collective call #{earlier})"
                    break
        return last

    def _decide(self, decision: str) -> None:
        self._store.compare_set(f"{self._base}/decision", "", decision)
        self._store.set(f"{self._base}/done", "1")

    def _arrival_error(self) -> CollectiveCallError:
        store = self._store
        entered: dict[int, str] = {}
        for rank in self.ranks:
            key = f"{self._base}/name/{rank}"
            if store.check([key]):
                entered[rank] = store.get(key).decode()
        missing = [r for r in self.ranks if r not in entered]
        elsewhere = {r: n for r, n in entered.items() if n != self.name}
        problems = []
        if missing:
            problems.append(
                f"ranks {ranks_text(missing)} did not arrive within {self.timeout_s:g} s"
            )
        problems += [f"rank {r} entered {n} instead" for r, n in sorted(elsewhere.items())[:LISTED]]
        if not problems:
            problems.append("the other ranks gave up waiting before this rank arrived")
        return CollectiveCallError(
            f"{self.name} is collective: call it on every rank of the model's mesh "
            f"(ranks {ranks_text(self.ranks)}), not on some of them; "
            + "; ".join(problems)
            + f" (rank {self.rank} raises this)"
        )

    # ---------------------------------------------------------------- agreement
    def agree(self, error: BaseException | None = None, *, step: str) -> None:
        """Exchange whether ``step`` went well on each rank; if it failed on any, raise
        on every rank the failure of the lowest failing rank (its type where this
        process can build it, else [CollectiveCallError][fsdp_core.collective_entry.
        CollectiveCallError]), naming that rank."""
        if not self.active:
            if error is not None:
                raise error
            return
        store = self._store
        base = f"{self._base}/step/{self._step}"
        self._step += 1
        if error is not None:
            store.set(f"{base}/error/{self.rank}", _failure_payload(error, self.rank, step))
            store.add(f"{base}/failures", 1)
        store.set(f"{base}/at/{self.rank}", step)
        if store.add(f"{base}/count", 1) == len(self.ranks):
            store.set(f"{base}/done", "1")
        if not self._wait_step(f"{base}/done", step, self._last_steps):
            late = [r for r in self.ranks if not store.check([f"{base}/at/{r}"])]
            raise self._mark(
                CollectiveCallError(
                    f"{self.name}: ranks {ranks_text(late)} did not reach the step "
                    f"{step!r} within {self._step_limits().timeout_s:g} s; a rank stopped "
                    f"or is stuck (the limit: the process group's timeout, or {TIMEOUT_ENV})"
                )
            ) from error
        if store.add(f"{base}/failures", 0) == 0:
            return
        failed = [r for r in self.ranks if store.check([f"{base}/error/{r}"])]
        payload = json.loads(store.get(f"{base}/error/{failed[0]}").decode())
        raise self._mark(_rebuild(payload, failed, self.name)) from error

    def _step_limits(self) -> WaitLimits:
        return wait_limits(self.step_timeout_s)

    def _wait_step(self, key: str, step: str, last: Callable[[], dict[int, str]]) -> bool:
        """Wait for ``key`` within the step's limits (see [rank_wait][fsdp_core.rank_wait])."""
        return wait_for_ranks(
            self._store,
            key,
            what=f"{self.name} (the step {step!r})",
            rank=self.rank,
            limits=self._step_limits(),
            last=last,
        )

    def _last_steps(self) -> dict[int, str]:
        """The ranks that have not reached the current step, each with the last step of
        this call it reached."""
        last = {}
        for rank in self.ranks:
            if self._store.check([f"{self._base}/step/{self._step - 1}/at/{rank}"]):
                continue
            last[rank] = f"has not reached a step of {self.name} after its entry"
            for earlier in range(self._step - 2, -1, -1):
                key = f"{self._base}/step/{earlier}/at/{rank}"
                if self._store.check([key]):
                    last[rank] = f"last reached the step {self._store.get(key).decode()!r}"
                    break
        return last

    def run(self, fn: Callable[[], T], *, step: str) -> T:
        """``fn()`` on this rank, then [agree][fsdp_core.collective_entry.CollectiveCall.agree]."""
        try:
            value = fn()
        except Exception as exc:
            self.agree(exc, step=step)
            raise
        self.agree(None, step=step)
        return value

    def agree_on(
        self, value: str, *, what: str, error: Callable[[str], Exception] = CollectiveCallError
    ) -> None:
        """Raise on every rank unless every rank holds the same ``value`` (e.g. a hash)
        as the lowest rank; the message names the ranks whose ``what`` differs."""
        if not self.active:
            return
        store = self._store
        key = f"{self._base}/value/{self._step}"
        lowest = self.ranks[0]
        if self.rank == lowest:
            store.set(key, value)
            reference = value
        else:
            if not self._wait_step(
                key, f"agreeing on {what}", lambda: self._lowest_missing(key, what)
            ):
                raise self._mark(
                    CollectiveCallError(
                        f"{self.name}: rank {lowest} did not share its {what} within "
                        f"{self._step_limits().timeout_s:g} s; it stopped or is stuck"
                    )
                )
            reference = store.get(key).decode()
        problem = None
        if reference != value:
            problem = error(
                f"rank {self.rank}'s {what} differs from rank {lowest}'s ({value[:16]} vs "
                f"{reference[:16]}); every rank must pass the same"
            )
        self.agree(problem, step=f"agreeing on {what}")

    def _lowest_missing(self, key: str, what: str) -> dict[int, str]:
        if self._store.check([key]):
            return {}
        return {self.ranks[0]: f"has not shared its {what} yet"}

    # ------------------------------------------------------------ context manager
    def _mark(self, error: Exception) -> Exception:
        with contextlib.suppress(AttributeError):
            setattr(error, _AGREED, True)
        return error

    def __enter__(self) -> CollectiveCall:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Post an error no agreement has shared yet, for the ranks waiting at the next."""
        if error is None or not self.active or getattr(error, _AGREED, False):
            return
        base = f"{self._base}/step/{self._step}"
        try:
            self._store.set(
                f"{base}/error/{self.rank}", _failure_payload(error, self.rank, "on the way")
            )
            self._store.add(f"{base}/failures", 1)
            self._store.set(f"{base}/at/{self.rank}", "on the way")
            if self._store.add(f"{base}/count", 1) == len(self.ranks):
                self._store.set(f"{base}/done", "1")
        except Exception:  # the store itself failed: the original error matters more
            logger.debug("could not post %r to the other ranks", error, exc_info=True)


def enter_collective(
    name: str,
    *,
    ranks: Iterable[int] | None = None,
    timeout: float | timedelta | None = None,
) -> CollectiveCall:
    """Wait until every rank of ``ranks`` (default: the world) entered ``name``.

    Waits at most ``timeout`` (seconds or a timedelta; default:
    ``FSDP_CORE_RANK_WAIT_TIMEOUT_S`` when set, else the process group's own timeout),
    warning after a minute (see [rank_wait][fsdp_core.rank_wait]), then raises
    [CollectiveCallError][fsdp_core.collective_entry.CollectiveCallError] on every rank
    that arrived, naming the ranks that did not and those that entered another
    collective call. Agreement steps of the returned call wait as long as
    ``FSDP_CORE_RANK_WAIT_TIMEOUT_S`` or the process group's timeout (a step may write
    a large file).

    Raises:
        CollectiveCallError: the ranks did not all enter ``name``.
        TypeError: ``name`` or ``timeout`` has the wrong type.
        ValueError: ``timeout``, or ``FSDP_CORE_RANK_WAIT_TIMEOUT_S`` or
            ``FSDP_CORE_RANK_WAIT_WARN_S``, is not positive seconds.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    members = tuple(sorted(set(ranks))) if ranks is not None else group_ranks()
    group_timeout = process_group_timeout() if _active(members) else timedelta(minutes=30)
    limits = wait_limits(group_timeout.total_seconds())  # the settings, checked
    call = CollectiveCall(
        name,
        members,
        timeout_s=_seconds(timeout, timedelta(seconds=limits.timeout_s)),
        step_timeout_s=group_timeout.total_seconds(),
    )
    if call.active:
        call._enter()
    return call
