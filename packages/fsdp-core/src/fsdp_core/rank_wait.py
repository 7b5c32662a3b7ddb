"""How a rank waits on the c10d store for the other ranks: the one wait of every guard.

The divergence guards ([rank_agreement][fsdp_core.rank_agreement], where the forward
agreement and the schedule check meet, and [collective_entry][fsdp_core.collective_entry])
make a rank wait, through the process group's store, until the other ranks reach the same
call or step. A rank that never comes (``if rank == 0: model.eval(); model(**batch)``)
would leave the waiting rank silent for the whole wait, so this wait:

- logs a warning after ``warn_after_s`` (default 60 s) naming the ranks that have not
  arrived, what each last did (as the guard knows it from the store), and when this
  rank gives up; again after twice, four times, ... that delay;
- gives up after ``timeout_s`` (default: the process group's timeout) and lets the
  guard raise its error; a rank that arrives before then is merely slow, and the
  ranks go on as if nothing happened.

Both are set once per job through environment variables (read at each wait, so a
launcher's, a script's or a test's setting applies):

- ``FSDP_CORE_RANK_WAIT_TIMEOUT_S``: seconds before a waiting rank gives up;
- ``FSDP_CORE_RANK_WAIT_WARN_S``: seconds before its first warning.

The wait polls ``store.check`` (a ``store.wait`` that times out logs a warning of
its own each time): quickly at first, where ranks in step meet, then every
``POLL_S``. It adds no store operation to a rank that does not wait.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

__all__ = [
    "DEFAULT_WARN_AFTER_S",
    "TIMEOUT_ENV",
    "WARN_ENV",
    "WaitLimits",
    "ranks_text",
    "seconds_setting",
    "wait_for_ranks",
    "wait_limits",
]

logger = logging.getLogger(__name__)

#: Environment variable: seconds a rank waits for the others before it gives up.
TIMEOUT_ENV: Final = "FSDP_CORE_RANK_WAIT_TIMEOUT_S"
#: Environment variable: seconds a rank waits before its first warning.
WARN_ENV: Final = "FSDP_CORE_RANK_WAIT_WARN_S"
#: The first warning's delay when ``WARN_ENV`` is not set.
DEFAULT_WARN_AFTER_S: Final = 60.0
#: How many ranks a message lists before it says how many more.
LISTED: Final = 8
#: How often a waiting rank looks (after a first pause of ``_FIRST_PAUSE_S``, doubled).
POLL_S: Final = 0.5
_FIRST_PAUSE_S: Final = 0.0001


@dataclass(frozen=True)
class WaitLimits:
    """How long a rank waits for the others: ``warn_after_s`` before its first warning,
    ``timeout_s`` before it gives up (both positive seconds)."""

    timeout_s: float
    warn_after_s: float = DEFAULT_WARN_AFTER_S


def seconds_setting(name: str, raw: str) -> float:
    """``raw``, the text of the setting ``name``, as positive finite seconds.

    Args:
        name: the environment variable, for the message.
        raw: its text.

    Returns:
        The seconds.

    Raises:
        ValueError: ``raw`` is not a positive finite number; the message names the
            setting and its value.
    """
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name}={raw!r} is not a number of seconds: set it to a positive number "
            "(e.g. 600 or 0.5), or unset it for the default"
        )
    return value


def wait_limits(default_timeout_s: float) -> WaitLimits:
    """The limits of a wait now: the environment's settings, else ``default_timeout_s``
    (the process group's timeout, as the guard reads it) and ``DEFAULT_WARN_AFTER_S``.

    Args:
        default_timeout_s: the timeout when the environment sets none.

    Returns:
        When to warn and when to give up.

    Raises:
        ValueError: a setting is set to something else than positive seconds.
    """
    settings = {}
    for name in (TIMEOUT_ENV, WARN_ENV):
        raw = os.environ.get(name, "").strip()
        if raw:
            settings[name] = seconds_setting(name, raw)
    return WaitLimits(
        timeout_s=settings.get(TIMEOUT_ENV, default_timeout_s),
        warn_after_s=settings.get(WARN_ENV, DEFAULT_WARN_AFTER_S),
    )


def ranks_text(ranks: Iterable[int]) -> str:
    """``[0, 2]``, or the first ``LISTED`` ranks and how many more: how every guard's
    message lists ranks.

    Args:
        ranks: the ranks to list.

    Returns:
        The text.
    """
    items = sorted(ranks)
    more = f" and {len(items) - LISTED} more" if len(items) > LISTED else ""
    return f"{items[:LISTED]}{more}"


def _clock(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, tz=UTC).strftime("%H:%M:%S UTC")


def _warn(
    what: str,
    rank: int,
    waited_s: float,
    limits: WaitLimits,
    gives_up_at: float,
    last: Any,
) -> None:
    missing: Mapping[int, str] = last()
    if not missing:
        return  # every rank arrived since the last look: the wait ends at once
    ranks: Sequence[int] = sorted(missing)
    listed = "; ".join(f"rank {r}: {missing[r]}" for r in ranks[:LISTED])
    who = (
        f"for ranks {ranks_text(ranks)}, which have not made it yet (what each last did: {listed})"
    )
    end = (
        f"It gives up at {_clock(gives_up_at)} ({limits.timeout_s:g} s after it arrived; "
        f"set {TIMEOUT_ENV} to change that) and then raises an error"
    )
    logger.warning(
        "rank %d has waited %.3g s in %s %s. %s; a rank that is merely slow arrives before "
        "then and the job goes on.",
        rank,
        waited_s,
        what,
        who,
        end,
    )


def wait_for_ranks(
    store: Any,
    key: str,
    *,
    what: str,
    rank: int,
    limits: WaitLimits,
    last: Callable[[], Mapping[int, str]],
    look: Callable[[], None] | None = None,
) -> bool:
    """Wait until ``key`` exists on ``store`` (the guard's decision that the ranks met or
    parted), at most ``limits.timeout_s``.

    Args:
        store: the process group's c10d store.
        key: the key whose existence ends the wait.
        what: where this rank waits, for the warning (``"call #2 of the model (...)"``).
        rank: this rank.
        limits: when to warn and when to give up
            ([wait_limits][fsdp_core.rank_wait.wait_limits]).
        last: the ranks that have not arrived, each with what it last did (read only when
            a warning is due).
        look: called every ``POLL_S``; it may write ``key`` (a divergence it found).

    Returns:
        Whether ``key`` exists; ``False`` when ``limits.timeout_s`` passed without it.
    """
    start = time.monotonic()
    gives_up_at = time.time() + limits.timeout_s
    deadline = start + limits.timeout_s
    warn_in = limits.warn_after_s
    looked = start
    pause = _FIRST_PAUSE_S
    while not store.check([key]):
        now = time.monotonic()
        if now >= deadline:
            return bool(store.check([key]))
        if now - start >= warn_in:
            _warn(what, rank, now - start, limits, gives_up_at, last)
            warn_in *= 2
        if look is not None and now - looked >= POLL_S:
            looked = now
            look()
            continue
        time.sleep(min(pause, max(deadline - now, 0.0)))
        pause = min(2 * pause, POLL_S)
    return True
