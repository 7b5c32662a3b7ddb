"""How a rank waits on the c10d store for the other ranks: the one wait of every guard.

The guards ([rank_agreement][fsdp_core.rank_agreement],
[collective_entry][fsdp_core.collective_entry]) wait until the others reach the same
call or step. The wait warns after ``FSDP_CORE_RANK_WAIT_WARN_S`` (default 60 s; then
after twice, four times, ... that) naming the missing ranks and what each last did, and
gives up after ``FSDP_CORE_RANK_WAIT_TIMEOUT_S`` (default: the process group's timeout)
so the guard raises; both are read at each wait. It polls ``store.check`` (a timed-out
``store.wait`` logs warnings of its own); a rank that does not wait pays nothing.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

__all__ = [
    "DEFAULT_WARN_AFTER_S",
    "TIMEOUT_ENV",
    "WARN_ENV",
    "WaitLimits",
    "names_text",
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
    and ``DEFAULT_WARN_AFTER_S``.

    Args:
        default_timeout_s: the timeout when the environment sets none.

    Returns:
        When to warn and when to give up.

    Raises:
        ValueError: a setting is set to something else than positive seconds.
    """
    raw = {name: os.environ.get(name, "").strip() for name in (TIMEOUT_ENV, WARN_ENV)}
    found = {name: seconds_setting(name, text) for name, text in raw.items() if text}
    timeout_s = found.get(TIMEOUT_ENV, default_timeout_s)
    return WaitLimits(timeout_s, found.get(WARN_ENV, DEFAULT_WARN_AFTER_S))


def ranks_text(ranks: Iterable[int]) -> str:
    """``[0, 2]``, or the first ``LISTED`` ranks and how many more (every guard's lists).

    Args:
        ranks: the ranks to list.

    Returns:
        The text.
    """
    return names_text(sorted(ranks), LISTED, as_list=True)


def names_text(
    names: Iterable[Any], limit: int = 3, *, show: Callable[..., str] = repr, as_list: bool = False
) -> str:
    """The first ``limit`` names and how many more (``'a', 'b', 'c' and 4 more``), so a
    message stays short.

    Args:
        names: what to list, in order.
        limit: how many to name.
        show: how one is written.
        as_list: name them as a list, ``['a', 'b'] and 4 more``.

    Returns:
        The text; ``""`` (``"[]"`` as a list) for none.
    """
    items = list(names)
    shown = ", ".join(show(name) for name in items[:limit])
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return (f"[{shown}]" if as_list else shown) + more


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
    gives_up_at = datetime.fromtimestamp(time.time() + limits.timeout_s, tz=UTC)
    deadline = start + limits.timeout_s
    warn_in = limits.warn_after_s
    looked = start
    pause = _FIRST_PAUSE_S
    while not store.check([key]):
        now = time.monotonic()
        if now >= deadline:
            return bool(store.check([key]))
        if now - start >= warn_in:
            warn_in *= 2
            if missing := last():  # none: every rank arrived since, the wait ends at once
                listed = "; ".join(f"rank {r}: {missing[r]}" for r in sorted(missing)[:LISTED])
                logger.warning(
                    f"rank {rank} has waited {now - start:.3g} s in {what} for ranks "
                    f"{ranks_text(missing)}, which have not made it yet (what each last did: "
                    f"{listed}). It gives up at {gives_up_at:%H:%M:%S} UTC "
                    f"({limits.timeout_s:g} s after it arrived; set {TIMEOUT_ENV} to change "
                    "that) and then raises an error; a rank that is merely slow arrives before "
                    "then and the job goes on."
                )
        if look is not None and now - looked >= POLL_S:
            looked = now
            look()
            continue
        time.sleep(min(pause, max(deadline - now, 0.0)))
        pause = min(2 * pause, POLL_S)
    return True
