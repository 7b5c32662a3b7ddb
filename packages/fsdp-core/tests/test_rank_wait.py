"""fsdp_core.rank_wait: the settings, and the shared wait on a store without a process
group (a HashStore; another thread plays the late rank)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch.distributed as dist

from fsdp_core.rank_wait import (
    DEFAULT_WARN_AFTER_S,
    TIMEOUT_ENV,
    WARN_ENV,
    WaitLimits,
    seconds_setting,
    wait_for_ranks,
    wait_limits,
)

WAIT_LOGGER = "fsdp_core.rank_wait"


def test_defaults_without_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(WARN_ENV, raising=False)
    assert wait_limits(1800.0) == WaitLimits(timeout_s=1800.0, warn_after_s=60.0)
    assert DEFAULT_WARN_AFTER_S == 60.0


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, " 120 ")
    monkeypatch.setenv(WARN_ENV, "0.5")
    assert wait_limits(1800.0) == WaitLimits(timeout_s=120.0, warn_after_s=0.5)
    monkeypatch.setenv(TIMEOUT_ENV, "")  # empty: the default
    assert wait_limits(600.0).timeout_s == 600.0


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "nan", "inf", "1e999"])
@pytest.mark.parametrize("name", [TIMEOUT_ENV, WARN_ENV])
def test_bad_settings_name_the_variable_and_value(
    monkeypatch: pytest.MonkeyPatch, name: str, raw: str
) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"{name}='{raw}' is not a number of seconds"):
        wait_limits(1800.0)


def test_seconds_setting_accepts_fractions() -> None:
    assert seconds_setting("X", "2.5") == 2.5


def _missing(store: Any, key: str) -> dict[int, str]:
    return {} if store.check([key]) else {1: "last made call #1, a training forward"}


def test_a_rank_that_never_comes_is_warned_about_then_given_up_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    caplog.set_level(logging.WARNING, logger=WAIT_LOGGER)
    met = wait_for_ranks(
        store,
        "done",
        what="call #2 of the model (a forward in eval mode)",
        rank=0,
        limits=WaitLimits(timeout_s=0.5, warn_after_s=0.1),
        last=lambda: _missing(store, "done"),
    )
    assert met is False
    warnings = [r.getMessage() for r in caplog.records if r.name == WAIT_LOGGER]
    assert 1 <= len(warnings) <= 3  # after 0.1 s, 0.2 s, 0.4 s
    assert "s in call #2 of the model (a forward in eval mode)" in warnings[0]
    assert "for ranks [1]" in warnings[0]
    assert "rank 1: last made call #1, a training forward" in warnings[0]
    assert "It gives up at " in warnings[0]
    assert f"(0.5 s after it arrived; set {TIMEOUT_ENV}" in warnings[0]


def test_a_late_rank_before_the_deadline_ends_the_wait() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    warned = threading.Event()

    class Late(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.set()

    handler = Late()
    logging.getLogger(WAIT_LOGGER).addHandler(handler)

    def late_rank() -> None:
        warned.wait(30)  # comes only after the waiting rank warned about it
        store.set("done", "go")

    thread = threading.Thread(target=late_rank)
    thread.start()
    try:
        met = wait_for_ranks(
            store,
            "done",
            what="a step",
            rank=0,
            limits=WaitLimits(timeout_s=60.0, warn_after_s=0.1),
            last=lambda: _missing(store, "done"),
        )
    finally:
        thread.join()
        logging.getLogger(WAIT_LOGGER).removeHandler(handler)
    assert met is True
    assert warned.is_set()


def test_ranks_in_step_neither_warn_nor_look(caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    store.set("done", "go")
    looks: list[int] = []
    caplog.set_level(logging.WARNING, logger=WAIT_LOGGER)
    met = wait_for_ranks(
        store,
        "done",
        what="a step",
        rank=0,
        limits=WaitLimits(timeout_s=1.0, warn_after_s=0.1),
        last=lambda: {1: "never read"},
        look=lambda: looks.append(1),
    )
    assert met is True
    assert looks == []
    assert [r for r in caplog.records if r.name == WAIT_LOGGER] == []


def test_a_look_that_decides_ends_the_wait() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    met = wait_for_ranks(
        store,
        "done",
        what="a step",
        rank=0,
        limits=WaitLimits(timeout_s=60.0, warn_after_s=30.0),
        last=lambda: {},
        look=lambda: store.set("done", "abort"),
    )
    assert met is True
    assert store.get("done") == b"abort"
