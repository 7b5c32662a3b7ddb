"""Unit tests for multimodal_fsdp.uneven: detecting media in a call, and the guard that
makes ranks agree on it before each forward.

The guard's collective runs under the single-process ``fake`` backend, whose
all-reduce leaves the local values in place (every "rank" agrees); disagreement
is emulated by patching ``dist.all_reduce`` to merge in another rank's flag.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fsdp_core import CommCounter
from fsdp_core.testing import fake_process_group
from multimodal_fsdp.uneven import (
    DEFAULT_MEDIA_INPUTS,
    UnevenMediaError,
    batch_has_media,
    install_uneven_media_guard,
)

CPU = torch.device("cpu")
IMAGE = torch.ones(1, 3, 4, 4)


class Vlm(nn.Module):
    """A forward with a media argument (after a text one, HF style)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.calls = 0

    def forward(
        self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.calls += 1
        return self.proj(input_ids.float())


class TextOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> torch.Tensor:
        return self.proj(input_ids.float())


def text() -> torch.Tensor:
    return torch.zeros(2, 4)


@pytest.fixture(autouse=True)
def _no_process_group_leak() -> Iterator[None]:
    """Fail (and clean up) a test that leaves a process group initialised."""
    assert not dist.is_initialized(), "a process group leaked into this test"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a process group initialised")


# --- batch_has_media -------------------------------------------------------------------------


def forward(input_ids: Any = None, pixel_values: Any = None, input_features: Any = None) -> None:
    """A signature with two media arguments (image and audio)."""


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"pixel_values": IMAGE}, True),
        ({"input_features": torch.zeros(1, 80, 10)}, True),
        ({"input_ids": text()}, False),
        ({}, False),
        ({"pixel_values": None}, False),
        ({"pixel_values": torch.empty(0, 3, 4, 4)}, False),
        ({"pixel_values": []}, False),
        ({"pixel_values": ()}, False),
        ({"pixel_values": {}}, False),
        ({"pixel_values": [None, None]}, False),
        ({"pixel_values": [torch.empty(0)]}, False),
        ({"pixel_values": [None, IMAGE]}, True),
        ({"pixel_values": {"a": None, "b": IMAGE}}, True),
        ({"pixel_values": [[], [IMAGE]]}, True),
        ({"pixel_values": "an image path"}, True),  # anything else counts as media
        ({"pixel_values": None, "input_features": torch.ones(1)}, True),
    ],
)
def test_batch_has_media_from_keyword_arguments(kwargs: dict[str, Any], expected: bool) -> None:
    assert batch_has_media(forward, (), kwargs, DEFAULT_MEDIA_INPUTS) is expected


def test_batch_has_media_binds_positional_arguments_to_the_signature() -> None:
    assert batch_has_media(forward, (text(), IMAGE), {}, DEFAULT_MEDIA_INPUTS) is True
    assert batch_has_media(forward, (text(), None), {}, DEFAULT_MEDIA_INPUTS) is False
    assert batch_has_media(forward, (text(), None, IMAGE), {}, DEFAULT_MEDIA_INPUTS) is True
    assert batch_has_media(forward, (text(),), {}, DEFAULT_MEDIA_INPUTS) is False
    # Mixed: positional text, media by keyword.
    assert batch_has_media(forward, (text(),), {"pixel_values": IMAGE}, DEFAULT_MEDIA_INPUTS)


def test_batch_has_media_binds_the_arguments_of_a_bound_module_forward() -> None:
    model = Vlm()
    assert batch_has_media(model.forward, (text(), IMAGE), {}, DEFAULT_MEDIA_INPUTS) is True
    assert batch_has_media(model.forward, (text(),), {}, DEFAULT_MEDIA_INPUTS) is False
    assert batch_has_media(model.forward, (text(), None), {}, DEFAULT_MEDIA_INPUTS) is False


def test_batch_has_media_is_none_when_the_signature_names_no_media() -> None:
    def text_forward(input_ids: Any = None, attention_mask: Any = None) -> None:
        pass

    assert batch_has_media(text_forward, (text(),), {}, DEFAULT_MEDIA_INPUTS) is None
    assert batch_has_media(TextOnly().forward, (text(),), {}, DEFAULT_MEDIA_INPUTS) is None
    # Media arguments outside the given names do not count.
    assert batch_has_media(forward, (), {"pixel_values": IMAGE}, ("images",)) is None


def test_batch_has_media_follows_the_given_names() -> None:
    def custom(tokens: Any = None, scans: Any = None) -> None:
        pass

    assert batch_has_media(custom, (text(), IMAGE), {}, ("scans",)) is True
    assert batch_has_media(custom, (text(),), {}, ("scans",)) is False
    # Only the given names are looked at: input_features is not one of them here.
    assert batch_has_media(forward, (), {"input_features": IMAGE}, ["pixel_values"]) is False


def test_batch_has_media_falls_back_to_keywords_when_binding_fails() -> None:
    # Too many positional arguments: nothing can be bound, only kwargs are read.
    assert batch_has_media(forward, (1, 2, 3, 4), {}, DEFAULT_MEDIA_INPUTS) is False


def test_default_media_inputs_cover_common_signatures() -> None:
    for name in ("pixel_values", "pixel_values_videos", "input_features", "input_values"):
        assert name in DEFAULT_MEDIA_INPUTS
    assert len(set(DEFAULT_MEDIA_INPUTS)) == len(DEFAULT_MEDIA_INPUTS)


# --- install_uneven_media_guard ----------------------------------------------------------------


def test_uneven_media_error_is_a_runtime_error() -> None:
    assert issubclass(UnevenMediaError, RuntimeError)


def test_guard_is_not_installed_without_media_arguments(caplog: pytest.LogCaptureFixture) -> None:
    model = TextOnly()
    with caplog.at_level(logging.WARNING, logger="multimodal_fsdp.uneven"):
        assert install_uneven_media_guard(model, modules=["vision_tower"], device=CPU) is False
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"TextOnly.forward takes none of {DEFAULT_MEDIA_INPUTS}; uneven media across ranks "
        "cannot be detected and would hang the units of ['vision_tower']"
    )
    assert not model._forward_pre_hooks
    with fake_process_group(2), CommCounter() as counter:
        model(text())
    assert counter.records == []


def test_guard_is_not_installed_without_modules(caplog: pytest.LogCaptureFixture) -> None:
    model = Vlm()
    with caplog.at_level(logging.WARNING, logger="multimodal_fsdp.uneven"):
        assert install_uneven_media_guard(model, modules=[], device=CPU) is False
    assert caplog.records == []
    assert not model._forward_pre_hooks


def test_guard_is_not_installed_twice() -> None:
    model = Vlm()
    assert install_uneven_media_guard(model, modules=["vision_tower"], device=CPU) is True
    assert len(model._forward_pre_hooks) == 1
    assert install_uneven_media_guard(model, modules=["vision_tower"], device=CPU) is False
    assert install_uneven_media_guard(model, modules=["audio_tower"], device=CPU) is False
    assert len(model._forward_pre_hooks) == 1
    with fake_process_group(2), CommCounter() as counter:
        model(text(), IMAGE)
    assert counter.counts() == {"all_reduce": 1}


def test_guard_follows_custom_media_names() -> None:
    model = TextOnly()
    assert install_uneven_media_guard(
        model, modules=["tower"], device=CPU, media_inputs=("attention_mask",)
    )
    with fake_process_group(2), CommCounter() as counter:
        model(text())
    assert counter.counts() == {"all_reduce": 1}


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m(text(), IMAGE),
        lambda m: m(text(), pixel_values=IMAGE),
        lambda m: m(text()),
        lambda m: m(text(), None),
        lambda m: m(input_ids=text(), pixel_values=torch.empty(0, 3, 4, 4)),
    ],
    ids=["positional", "keyword", "missing", "none", "empty"],
)
def test_guard_runs_one_all_reduce_per_forward(call: Callable[[nn.Module], Any]) -> None:
    model = Vlm()
    assert install_uneven_media_guard(model, modules=["vision_tower"], device=CPU)
    with fake_process_group(2):
        counter = CommCounter()
        with counter:
            for _ in range(3):
                call(model)  # the fake group agrees with itself: no error
    assert model.calls == 3
    assert [(r.kind, r.nbytes, r.dtype) for r in counter.records] == [
        ("all_reduce", 8, torch.float32)
    ] * 3


def test_guard_issues_no_collective_on_a_single_rank() -> None:
    model = Vlm()
    assert install_uneven_media_guard(model, modules=["vision_tower"], device=CPU)
    with CommCounter() as counter:
        model(text(), IMAGE)  # no process group at all
    with fake_process_group(1), counter:
        model(text())  # a group of one
    assert counter.records == []
    assert model.calls == 2


def emulate_other_rank(monkeypatch: pytest.MonkeyPatch, *, other_has_media: bool) -> list[Any]:
    """Make ``dist.all_reduce`` (MAX) merge in the flags of a second rank; returns the calls."""
    calls: list[Any] = []
    flag = 1.0 if other_has_media else 0.0

    def all_reduce(tensor: torch.Tensor, op: Any = None, **_: Any) -> None:
        calls.append(op)
        tensor.copy_(torch.maximum(tensor, torch.tensor([flag, -flag])))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


@pytest.mark.parametrize(("local", "other"), [(True, False), (False, True)])
def test_guard_raises_the_same_error_when_ranks_disagree(
    monkeypatch: pytest.MonkeyPatch, local: bool, other: bool
) -> None:
    model = Vlm()
    assert install_uneven_media_guard(model, modules=["vision_tower", "audio_tower"], device=CPU)
    with fake_process_group(2):
        calls = emulate_other_rank(monkeypatch, other_has_media=other)
        with pytest.raises(UnevenMediaError) as info:
            model(text(), IMAGE if local else None)
    assert calls == [dist.ReduceOp.MAX]
    assert model.calls == 0  # raised before the forward ran
    message = str(info.value)
    assert message.startswith("rank 0: some ranks have media in this batch and others do not")
    assert "'vision_tower', 'audio_tower' own FSDP units" in message
    assert "frozen_multimodal_sharding='root' or 'replicate'" in message


@pytest.mark.parametrize("media", [True, False])
def test_guard_passes_when_ranks_agree(monkeypatch: pytest.MonkeyPatch, media: bool) -> None:
    model = Vlm()
    assert install_uneven_media_guard(model, modules=["vision_tower"], device=CPU)
    with fake_process_group(2):
        calls = emulate_other_rank(monkeypatch, other_has_media=media)
        model(text(), IMAGE if media else None)
    assert calls == [dist.ReduceOp.MAX]
    assert model.calls == 1


def test_guard_runs_before_other_forward_pre_hooks() -> None:
    """Prepended, so its all-reduce comes before FSDP's pre-forward all-gathers."""
    model = Vlm()
    counter = CommCounter()
    seen: list[tuple[str, int]] = []
    model.register_forward_pre_hook(lambda *_: seen.append(("earlier", len(counter.records))))
    assert install_uneven_media_guard(model, modules=["vision_tower"], device=CPU)
    model.register_forward_pre_hook(lambda *_: seen.append(("later", len(counter.records))))
    with fake_process_group(2), counter:
        model(text(), IMAGE)
    assert seen == [("earlier", 1), ("later", 1)]
