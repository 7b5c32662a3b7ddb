"""How every rank enters and leaves a collective library call.

A function all ranks must call (``save_pretrained``, ``apply_plan``, measurements) first
checks that every rank arrived in it, then agrees after each step that may fail on some,
so ``if rank == 0: save_pretrained(...)`` or a full disk on one rank raises the same
exception everywhere instead of a hang. Arrival and steps are points of a
[RankAgreement][fsdp_core.rank_agreement.RankAgreement] (the c10d store, no collective),
one namespace per call, numbered per group of ranks; a rank late to a call the others
gave up on skips it. No-ops without a process group, under ``fake`` or alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Any, Final, TypeVar

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_core.internals.torch_modules import process_group_timeout
from fsdp_core.rank_agreement import (
    CollectiveCallError,
    Meeting,
    RankAgreement,
    decode_error,
    encode_error,
    kind_of,
    meets_others,
    payload_of,
    ranks_digest,
    status_key,
)
from fsdp_core.rank_wait import LISTED, TIMEOUT_ENV, WaitLimits, ranks_text, wait_limits

__all__ = [
    "CollectiveCall",
    "enter_collective",
    "group_ranks",
    "whole_world_ranks",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PREFIX: Final = "fsdp_core/collective"
#: Calls entered so far in this process, per group of ranks.
_SEQUENCE: dict[str, int] = {}
#: Set on an exception that every rank already raises (not posted again on exit).
_AGREED: Final = "_fsdp_core_agreed"


def group_ranks(
    *, model: nn.Module | None = None, mesh: DeviceMesh | None = None
) -> tuple[int, ...]:
    """The global ranks that take part in a collective call on ``model`` or ``mesh``.

    Args:
        model: a model whose tensors' meshes count (an HSDP mesh counts whole).
        mesh: the mesh of the call (``model`` then does not count).

    Returns:
        Those ranks, sorted; the world when neither gives any; empty without a process
        group.
    """
    if not dist.is_initialized():
        return ()
    tensors = (*model.parameters(), *model.buffers()) if model is not None and mesh is None else ()
    meshes = {id(t.device_mesh): t.device_mesh for t in tensors if isinstance(t, DTensor)}
    chosen = [mesh] if mesh is not None else meshes.values()
    ranks = {int(r) for each in chosen for r in each.mesh.flatten().tolist()}
    return tuple(sorted(ranks)) if ranks else tuple(range(dist.get_world_size()))


def whole_world_ranks(model: nn.Module, what: str, instead: str) -> tuple[int, ...]:
    """``group_ranks(model=model)`` for a call whose torch collectives span the whole
    world (DCP, ``broadcast_from_rank0``); a pipeline stage is refused on every rank.

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


def _seconds(timeout: float | timedelta | None, default: float) -> float:
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(
            f"timeout must be seconds (a number) or a datetime.timedelta, got "
            f"{type(timeout).__name__} ({timeout!r})"
        )
    value = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not value > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return value


def _failure_payload(error: BaseException, call: str, rank: int, step: str) -> dict[str, Any]:
    return {"call": call, "rank": rank, "step": step, "error": encode_error(error)}


def _rebuild(payload: dict[str, Any], failed: Sequence[int], name: str) -> Exception:
    """The same exception on every rank: the failing rank's type and message."""
    kind, _, message = payload["error"].partition("|")
    rank, step = payload["rank"], payload["step"]
    text = f"{name} failed on rank {rank} ({step}): {message}"
    if others := [r for r in failed if r != rank]:
        text += f"; ranks {ranks_text(others)} failed too"
    return decode_error(f"{kind}|{text}")


class _CallPoints(RankAgreement):
    """The points of one collective call: the arrival (point 1), then one per step."""

    def __init__(self, call: CollectiveCall, group: str, number: int) -> None:
        super().__init__(
            call.ranks, timeout_s=call.step_timeout_s, namespace=f"{_PREFIX}/{group}/{number}"
        )
        self.call, self.group, self.number = call, group, number
        #: Builds the error of a rank whose value differs (``agree_on``'s ``error``).
        self.value_error: Callable[[str], Exception] = CollectiveCallError

    def _explain(self, meeting: Meeting) -> Exception | None:
        said = {r: (kind_of(v), json.loads(payload_of(v))) for r, v in meeting.values.items()}
        waited_s = meeting.timed_out_s or 0.0
        missing = sorted(meeting.elsewhere) if meeting.timed_out_s is not None else []
        if any(kind == "enter" for kind, _ in said.values()):
            return self._arrival_error(said, missing, waited_s)
        if meeting.elsewhere and not missing:
            return None  # a step waits for every rank
        step = said[self.rank][1]["step"]
        if missing:
            return CollectiveCallError(
                f"{self.call.name}: ranks {ranks_text(missing)} did not reach the step "
                f"{step!r} within {waited_s:g} s; a rank stopped or is stuck "
                f"(the limit: the process group's timeout, or {TIMEOUT_ENV})"
            )
        failures = {r: p for r, (kind, p) in said.items() if kind == "fail"}
        lowest = self.ranks[0]
        reference = said[lowest][1].get("value") if said[lowest][0] == "value" else None
        for rank, (kind, p) in said.items():
            if kind == "value" and reference is not None and p["value"] != reference:
                problem = self.value_error(
                    f"rank {rank}'s {p['what']} differs from rank {lowest}'s ({p['value'][:16]} "
                    f"vs {reference[:16]}); every rank must pass the same"
                )
                failures[rank] = _failure_payload(problem, self.call.name, rank, step)
        if not failures:
            return None
        failed = sorted(failures)
        return _rebuild(failures[failed[0]], failed, self.call.name)

    def _arrival_error(
        self, said: dict[int, tuple[str, Any]], missing: list[int], waited_s: float
    ) -> Exception | None:
        names = {r: payload["call"] for r, (_, payload) in said.items()}
        name = names[min(names)]
        problems = []
        if missing:
            problems.append(f"ranks {ranks_text(missing)} did not arrive within {waited_s:g} s")
        if len(set(names.values())) > 1:  # every rank reads the same: name each one's call
            problems += [f"rank {r} entered {n}" for r, n in sorted(names.items())][:LISTED]
        if not problems:
            return None
        return CollectiveCallError(
            f"{name} is collective: call it on every rank of the model's mesh (ranks "
            f"{ranks_text(self.ranks)}), not on some of them; " + "; ".join(problems)
        )

    def _last(self, rank: int, point: int, value: str) -> str:
        """A rank's last step of this call, or before its arrival its last of the few
        collective calls of these ranks before."""
        if point == 1:
            return f"has not reached a step of {self.call.name} after its entry"
        if point > 1:
            return f"last reached the step {json.loads(payload_of(value))['step']!r}"
        for earlier in range(self.number - 1, max(self.number - 1 - LISTED, -1), -1):
            key = status_key(f"{_PREFIX}/{self.group}/{earlier}", rank)
            if self._store.check([key]):
                status = self._store.get(key).decode()  # point|kind|payload
                entered = json.loads(status.split("|", 2)[2])["call"]
                return f"last entered {entered} (collective call #{earlier})"
        return "entered none of the last collective calls of these ranks"


class CollectiveCall:
    """One collective call that every rank of ``ranks`` entered (made by
    [enter_collective][fsdp_core.collective_entry.enter_collective]). Used as a context
    manager, an exception that leaves the block on one rank is posted so that the others
    raise it at their next agreement instead of waiting out the timeout.

    Args:
        name: the call, for the messages.
        ranks: the global ranks that make it (sorted).
        timeout_s: how long a rank waits for the others' arrival.
        step_timeout_s: how long a rank waits for the others at a step.

    Raises:
        ValueError: this rank is not one of ``ranks``.
    """

    def __init__(
        self, name: str, ranks: tuple[int, ...], *, timeout_s: float, step_timeout_s: float
    ) -> None:
        self.name = name
        self.ranks = ranks
        self.active = meets_others(ranks)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.timeout_s = timeout_s
        self.step_timeout_s = step_timeout_s
        if self.active and self.rank not in ranks:
            raise ValueError(f"rank {self.rank} is not one of the ranks {list(ranks)}")

    @property
    def is_main(self) -> bool:
        """Whether this rank writes, logs or broadcasts for the call.

        Returns:
            True on the lowest of ``ranks``, and on every rank of a call that meets no
            other rank.
        """
        return not self.active or self.rank == self.ranks[0]

    def _enter(self) -> None:
        """Meet at this call's arrival, skipping the calls the others gave up on without
        this rank (so the ranks' call numbers meet again)."""
        group = ranks_digest(self.ranks)
        number = _SEQUENCE.get(group, 0)
        while (points := _CallPoints(self, group, number)).decided():
            logger.warning(
                "skipping collective call %d of ranks %s: decided without this rank",
                number,
                ranks_text(self.ranks),
            )
            number += 1
        _SEQUENCE[group] = number + 1
        self._points = points
        points.meet(
            "enter",
            json.dumps({"call": self.name}),
            what=f"{self.name} (collective call #{number} of ranks {ranks_text(self.ranks)})",
            limits=WaitLimits(self.timeout_s, wait_limits(self.timeout_s).warn_after_s),
        )

    def agree(self, error: BaseException | None = None, *, step: str) -> None:
        """Exchange whether ``step`` went well on each rank.

        Args:
            error: what this rank's step raised, if anything.
            step: the step, for the messages.

        Raises:
            Exception: on every rank, the failure of the lowest failing rank, naming it (of
                its type where this process can build it, else ``CollectiveCallError``).
        """
        if not self.active:
            if error is not None:
                raise error
            return
        said = {"call": self.name, "step": step}
        if error is not None:
            said = _failure_payload(error, self.name, self.rank, step)
        self._meet("step" if error is None else "fail", said, error)

    def _meet(self, kind: str, payload: dict[str, Any], error: BaseException | None) -> None:
        try:
            self._points.meet(
                kind, json.dumps(payload), what=f"{self.name} (the step {payload['step']!r})"
            )
        except Exception as shared:
            with contextlib.suppress(AttributeError):
                setattr(shared, _AGREED, True)
            raise shared from error

    def run(self, fn: Callable[[], T], *, step: str) -> T:
        """``fn()`` on this rank, then [agree][fsdp_core.collective_entry.CollectiveCall.agree].

        Args:
            fn: the step.
            step: the step, for the messages.

        Returns:
            What ``fn`` returned.
        """
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
        """Raise on every rank unless every rank holds the lowest rank's ``value``.

        Args:
            value: this rank's value (e.g. a hash).
            what: the value in words; the message names the ranks whose ``what`` differs.
            error: the type of the error raised.
        """
        if self.active:
            self._points.value_error = error
            step = f"agreeing on {what}"
            self._meet(
                "value", {"call": self.name, "step": step, "what": what, "value": value}, None
            )

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
        try:
            self._points.leave(
                "fail", json.dumps(_failure_payload(error, self.name, self.rank, "on the way"))
            )
        except Exception:  # the store itself failed: the original error matters more
            logger.debug("could not post %r to the other ranks", error, exc_info=True)


def enter_collective(
    name: str,
    *,
    ranks: Iterable[int] | None = None,
    timeout: float | timedelta | None = None,
) -> CollectiveCall:
    """Wait until every rank of ``ranks`` entered ``name``, warning after a minute (see
    [rank_wait][fsdp_core.rank_wait]).

    Args:
        name: the call.
        ranks: the ranks that make it (default: the world).
        timeout: the longest wait for the others' arrival, seconds or a timedelta
            (default: ``FSDP_CORE_RANK_WAIT_TIMEOUT_S``, else the process group's
            timeout, which also bounds each step: a step may write a large file).

    Returns:
        The call, to agree after its steps.

    Raises:
        CollectiveCallError: the ranks did not all enter ``name`` (on every rank that
            arrived, naming those that did not and those that entered another call).
        TypeError: ``name`` or ``timeout`` has the wrong type.
        ValueError: ``timeout``, or ``FSDP_CORE_RANK_WAIT_TIMEOUT_S`` or
            ``FSDP_CORE_RANK_WAIT_WARN_S``, is not positive seconds.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    members = tuple(sorted(set(ranks))) if ranks is not None else group_ranks()
    group_timeout = process_group_timeout() if meets_others(members) else timedelta(minutes=30)
    limits = wait_limits(group_timeout.total_seconds())  # the settings, checked
    call = CollectiveCall(
        name,
        members,
        timeout_s=_seconds(timeout, limits.timeout_s),
        step_timeout_s=group_timeout.total_seconds(),
    )
    if call.active:
        call._enter()
    return call
