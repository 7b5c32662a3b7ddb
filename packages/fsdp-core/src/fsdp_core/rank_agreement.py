"""The one agreement of the ranks that run a model's forward together: the divergence guard.

Every call of a sharded model, and every point where the ranks' schedules may part, is
collective. The hooks guarding them (forward agreement, schedule check) and each library
collective call ([collective_entry][fsdp_core.collective_entry]) meet here: each rank
says what it is about to do at the next numbered point, and the
[lockstep ranks][fsdp_core.parallel_dims.ParallelDims.lockstep_ranks] (all but PP) go on
only when the hooks accept what every rank said; otherwise every rank raises the same
exception before any collective, and the group stays usable. Meetings use the c10d store
(four to six round trips, no collective, no device sync) and wait as
[rank_wait][fsdp_core.rank_wait] says; under ``fake`` or alone, a rank meets itself.
"""

from __future__ import annotations

import hashlib
import sys
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

import torch.distributed as dist
from torch import nn

from fsdp_core.internals.torch_modules import process_group_timeout
from fsdp_core.rank_wait import WaitLimits, wait_for_ranks, wait_limits

if TYPE_CHECKING:
    from fsdp_core.parallel_dims import ParallelDims

__all__ = ["CollectiveCallError", "Meeting", "RankAgreement", "agreement_of"]


class CollectiveCallError(RuntimeError):
    """A collective function was not entered by every rank of its group, or the
    ranks entered different ones, or a rank failed and the others raise it too."""


_PREFIX: Final = "fsdp_core/agreement"
_GO: Final = "go"


@dataclass(frozen=True)
class Meeting:
    """What the ranks said at one point: ``values`` of the ranks there, ``elsewhere`` the
    others' last point and value (point -1: the rank has not sharded the model yet; 0:
    it met nowhere yet); ``timed_out_s`` is set once the wait for them ended."""

    point: int
    values: Mapping[int, str]
    elsewhere: Mapping[int, tuple[int, str]]
    timed_out_s: float | None = None


#: Builds the error of a meeting (``None``: the ranks agree, or may still).
Explain = Callable[[Meeting], Exception | None]
#: Says what a rank's last value means, for the waiting rank's warning.
Describe = Callable[[str], str]


def ranks_digest(ranks: tuple[int, ...]) -> str:
    """A short name of a group of ranks, for store keys."""
    return hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:12]


def status_key(namespace: str, rank: int) -> str:
    """The store key of ``rank``'s last point and value in ``namespace``."""
    return f"{namespace}/status/{rank}"


def kind_of(value: str) -> str:
    """The kind of a value (its text before the first ``|``)."""
    return value.partition("|")[0]


def payload_of(value: str) -> str:
    """A value without its kind."""
    return value.partition("|")[2]


def encode_error(error: BaseException) -> str:
    """``error`` as text for the store: ``module:qualname:errno|message`` (an OSError's
    message without the ``[Errno n]`` its rebuild adds back)."""
    kind = type(error)
    number, message = "", str(error) or kind.__name__
    if isinstance(error, OSError) and error.errno is not None and error.strerror:
        number = str(error.errno)
        message = error.strerror + (f": {error.filename!r}" if error.filename else "")
    return f"{kind.__module__}:{kind.__qualname__}:{number}|{message}"


def decode_error(text: str) -> Exception:
    """The exception ``text`` (from ``encode_error``) names, of its type where this
    process has it loaded; else a ``CollectiveCallError`` that names the type."""
    name, _, message = text.partition("|")
    module, qualname, number = name.split(":")
    kind: Any = sys.modules.get(module)
    for part in qualname.split("."):
        kind = getattr(kind, part, None)
    try:
        if isinstance(kind, type) and issubclass(kind, Exception):
            return kind(int(number), message) if number else kind(message)
    except Exception:  # a type that needs other arguments: say which it was
        pass
    return CollectiveCallError(f"{message} ({module}.{qualname})")


def meets_others(ranks: tuple[int, ...]) -> bool:
    """Whether ``ranks`` meet through the store (a process group, not ``fake``, not alone)."""
    return dist.is_initialized() and len(ranks) > 1 and dist.get_backend() != "fake"


class RankAgreement:
    """The numbered meeting points of one sharded model's ``ranks`` (see the module
    docstring); ``points`` counts this rank's points.

    Args:
        ranks: the global ranks that meet (sorted; this rank among them).
        timeout_s: how long a rank waits for the others unless
            ``FSDP_CORE_RANK_WAIT_TIMEOUT_S`` says otherwise.
        namespace: the store keys' prefix of these points (one library collective call);
            by default one per model of these ranks.

    Raises:
        ValueError: a wait setting of the environment is not positive seconds.
    """

    def __init__(
        self, ranks: tuple[int, ...], *, timeout_s: float, namespace: str | None = None
    ) -> None:
        self.ranks = ranks
        self.timeout_s = timeout_s
        self.points = 0
        self.active = meets_others(ranks)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        #: kind -> (explain, describe); the first registered kind present explains.
        self._kinds: dict[str, tuple[Explain, Describe]] = {}
        self._store: Any = None
        self._base = namespace or ""
        self._passed = ""
        if not self.active:
            return
        wait_limits(timeout_s)  # a bad setting fails here, not at the first point
        self._store = dist.group.WORLD.get_group_store()  # type: ignore[union-attr]
        if namespace is None:
            # One namespace per model: two sharded models of one job count separately.
            digest = ranks_digest(ranks)
            count = self._store.add(f"{_PREFIX}/{digest}/models/{self.rank}", 1)
            self._base = f"{_PREFIX}/{digest}/{count}"
            self._store.set(status_key(self._base, self.rank), "0|")

    def register(
        self, kind: str, explain: Explain, describe: Describe, *, first: bool = False
    ) -> None:
        """Say how values of ``kind`` are explained and described.

        Args:
            kind: the kind of value a hook says (``"call"``, ``"media"``).
            explain: builds the error of a meeting (``None`` while the ranks agree).
            describe: a value in words, for the warning of a waiting rank.
            first: this kind explains a meeting where it is present before any kind
                registered earlier (a position explains a rank at another call).
        """
        entry = (explain, describe)
        self._kinds = {kind: entry, **self._kinds} if first else {**self._kinds, kind: entry}

    def unregister(self, kind: str) -> None:
        """Forget ``kind`` (its hook was removed).

        Args:
            kind: a kind given to ``register``.
        """
        self._kinds.pop(kind, None)

    def meet(self, kind: str, payload: str, *, what: str, limits: WaitLimits | None = None) -> None:
        """Meet the other ranks at the next point.

        Args:
            kind: the kind of what this rank says (its hook's registered kind).
            payload: what this rank says (no ``|`` in a kind; the payload may hold any).
            what: the point in words, for the warning of a long wait.
            limits: how long to wait (default: ``timeout_s`` and the environment's).

        Raises:
            Exception: the error the registered hooks built from what the ranks said (the
                same on every rank), or ``CollectiveCallError`` for ranks that did not come.
        """
        value = f"{kind}|{payload}"
        if not self.active:
            self.points += 1
            error = self._explain(Meeting(self.points, self._local(value), {}))
            if error is not None:
                raise error
            return
        key, last = self._arrive(value)
        if last:  # the last to come decides (2 round trips, no wait)
            decision = self._decide(key, self._meeting(self.points, complete=True))
        else:
            decision = self._await(key, what, limits or wait_limits(self.timeout_s))
        if decision != _GO:
            raise decode_error(decision)
        if self.rank == self.ranks[0]:
            # Every rank added to this point's count after reading the previous point's
            # decision: the previous point's keys are not read again.
            if self._passed:
                self._store.delete_key(f"{self._passed}/count")
                self._store.delete_key(f"{self._passed}/done")
            self._passed = key

    def leave(self, kind: str, payload: str) -> None:
        """Say ``payload`` at the next point and go without waiting (this rank fails: the
        others raise what the hooks build from it there).

        Args:
            kind: the kind of what this rank says.
            payload: what it says.
        """
        if self.active:
            key, last = self._arrive(f"{kind}|{payload}")
            if last:
                self._decide(key, self._meeting(self.points, complete=True))

    def decided(self) -> bool:
        """Whether the next point was decided already, without this rank.

        Returns:
            Whether its decision is on the store.
        """
        return self.active and bool(self._store.check([self._key(self.points + 1) + "/done"]))

    def _key(self, point: int) -> str:
        return f"{self._base}/point/{point}"

    def _arrive(self, value: str) -> tuple[str, bool]:
        """Write this rank's value at the next point: its key, and whether this rank came last."""
        self.points += 1
        self._store.set(status_key(self._base, self.rank), f"{self.points}|{value}")
        key = self._key(self.points)
        return key, self._store.add(f"{key}/count", 1) == len(self.ranks)

    def _await(self, key: str, what: str, limits: WaitLimits) -> str:
        """Wait for the decision of this rank's point, deciding it when a rank parted or
        the others did not come within ``limits``."""
        point = self.points

        def look() -> None:
            meeting = self._meeting(point)
            if len(set(meeting.values.values())) > 1:
                self._decide(key, meeting)

        met = wait_for_ranks(
            self._store,
            f"{key}/done",
            what=what,
            rank=self.rank,
            limits=limits,
            last=lambda: self._behind(point),
            look=look,
        )
        if not met:
            meeting = replace(self._meeting(point), timed_out_s=limits.timeout_s)
            if meeting.elsewhere:
                self._decide(key, meeting)
            self._store.wait([f"{key}/done"])  # every rank came: the last one is deciding
        return str(self._store.get(f"{key}/done").decode())

    def _local(self, value: str) -> dict[int, str]:
        """The values of a meeting with no other process (a test plays other ranks here)."""
        return {self.rank: value}

    def _decide(self, key: str, meeting: Meeting) -> str:
        """Record the decision of ``meeting`` (unless it may still go well: ``""``); the
        first decision recorded wins and is returned."""
        error = self._explain(meeting)
        if error is None and meeting.elsewhere:
            return ""
        decision = _GO if error is None else encode_error(error)
        return str(self._store.compare_set(f"{key}/done", "", decision).decode())

    def _explain(self, meeting: Meeting) -> Exception | None:
        """The error of ``meeting``: built by the first registered kind present; when the
        ranks parted and it builds none, a plain one naming what each rank said."""
        values = meeting.values
        parted = len(set(values.values())) > 1 or (
            meeting.timed_out_s is not None and bool(meeting.elsewhere)
        )
        present = {kind_of(v) for v in values.values()}
        explain = next((e for kind, (e, _) in self._kinds.items() if kind in present), None)
        error = explain(meeting) if explain is not None else None
        if error is not None or not parted:
            return error
        said = "; ".join(f"rank {r}: {self._describe(v)}" for r, v in values.items())
        missing = sorted(meeting.elsewhere)
        return CollectiveCallError(
            f"the ranks {list(self.ranks)} of a sharded model parted at point {meeting.point} "
            f"({said}" + (f"; ranks {missing} did not come" if missing else "") + ")"
        )

    def _describe(self, value: str) -> str:
        entry = self._kinds.get(kind_of(value))
        return entry[1](value) if entry is not None else value

    def _meeting(self, point: int, *, complete: bool = False) -> Meeting:
        """Who said what at ``point``, and the others' last point and value, read from the
        store (one round trip when every rank is known to have come, else two or more)."""
        keys = {rank: status_key(self._base, rank) for rank in self.ranks}
        if complete or self._store.check(list(keys.values())):
            raw = dict(zip(keys, self._store.multi_get(list(keys.values())), strict=True))
        else:
            raw = {r: self._store.get(k) for r, k in keys.items() if self._store.check([k])}
        said = {rank: text.decode().split("|", 1) for rank, text in raw.items()}
        status = {r: (int(said[r][0]), said[r][1]) if r in said else (-1, "") for r in self.ranks}
        values = {r: value for r, (number, value) in status.items() if number == point}
        return Meeting(point, values, {r: s for r, s in status.items() if r not in values})

    def _behind(self, point: int) -> dict[int, str]:
        """What each rank that has not come to ``point`` did last, for the warning."""
        return {r: self._last(r, *status) for r, status in self._meeting(point).elsewhere.items()}

    def _last(self, rank: int, point: int, value: str) -> str:
        if point < 0:
            return "has not sharded this model yet"
        return f"last made {self._describe(value)}" if point else "made no call of the model yet"


_AGREEMENTS: weakref.WeakKeyDictionary[nn.Module, RankAgreement] = weakref.WeakKeyDictionary()


def agreement_of(model: nn.Module, dims: ParallelDims) -> RankAgreement:
    """The agreement of ``model``'s lockstep ranks, made by its first hook; every hook of
    the model meets through it, so their points are numbered in one sequence.

    Args:
        model: the sharded model.
        dims: its mesh dimensions; the agreement spans ``dims.lockstep_ranks()`` and
            waits as long as the data-parallel group's timeout.

    Returns:
        The model's agreement (a new one when its lockstep ranks changed).
    """
    agreement = _AGREEMENTS.get(model)
    ranks = dims.lockstep_ranks()
    if agreement is None or agreement.ranks != ranks:
        mesh = dims.dp_mesh
        group = mesh.get_group(mesh.ndim - 1) if dist.is_initialized() else None
        timeout = process_group_timeout(group) if group is not None else timedelta(minutes=10)
        agreement = RankAgreement(ranks, timeout_s=timeout.total_seconds())
        _AGREEMENTS[model] = agreement
    return agreement
