"""The plan-time probe of balanced towers (``multimodal_fsdp.balance.probe``): a layout
that does not fit its tower is found when the plan is made, a plain custom tower needs
no adapter, and a tower no layout can split is refused by ``plan()`` with a message
naming it and how to register an adapter."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.balance import (
    BatchFirstLayout,
    MediaCall,
    MediaLayout,
    choose_media_layout,
    probe_layout,
    register_media_layout,
)
from multimodal_fsdp.balance import registry as registry_module


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, hidden: Tensor) -> Tensor:
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return hidden


class _Vlm(nn.Module):
    """A VLM around ``tower``: the tower's output rows become tokens before the text."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        self.vision_tower = tower
        self.language_model = _Decoder()

    def forward(self, input_ids: Tensor, images: Tensor | None = None) -> Tensor:
        hidden = self.language_model.embed_tokens(input_ids)
        if images is not None:
            hidden = torch.cat([self.vision_tower(images).reshape(1, -1, 8), hidden], 1)
        return self.language_model(hidden)


class _Plain(nn.Module):
    """A custom tower: patches of 12 values in, 8 features per patch out."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, images: Tensor) -> Tensor:
        hidden = self.proj(images)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return hidden


class _Pooled(_Plain):
    """Pools every item of the call into one vector: no row belongs to one item. Its
    ``pixel_values`` made ``batch-first`` apply by signature: the plan accepted it and
    the first balanced step failed to split its output."""

    def forward(self, pixel_values: Tensor) -> Tensor:
        return super().forward(pixel_values).mean(0, keepdim=True)


class _Mixing(_Plain):
    """Each item's output depends on the other items of the call (the shapes do not)."""

    def forward(self, pixel_values: Tensor) -> Tensor:
        hidden = super().forward(pixel_values)
        return hidden - hidden.mean(0, keepdim=True)


class _BatchNormed(_Plain):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.norm(super().forward(pixel_values))


class _NoWeights(nn.Module):
    """Nothing says what its input looks like."""

    def forward(self, frames: Tensor, lengths: Tensor) -> Tensor:
        return frames


def _balance_line(tower: nn.Module) -> str:
    plan = MultimodalParallelizer(balance_media=True).plan(_Vlm(tower))
    return next(line for line in plan.format().splitlines() if "balance_media on" in line)


def test_a_plain_custom_tower_needs_no_adapter() -> None:
    """Its first argument is not ``pixel_values``; the probe finds its input from its first
    layer, runs it on one and two items and infers one output row per item."""
    tower = _Plain()
    choice = choose_media_layout(tower)
    assert choice.layout.name == "batch-first"
    assert choice.report.fits
    assert choice.report.inputs == (("images", 1),)
    assert choice.report.outputs == ("1 per input row",)
    line = _balance_line(_Plain())
    assert "'vision_tower' (batch-first)" in line
    assert "batch-first, probed on cpu weights: per item images 1 row" in line


@pytest.mark.parametrize(
    ("tower", "found"),
    [
        (_Pooled, "tower output tensor 0 has 1 rows for items of \\[1, 1\\] input rows"),
        (_Mixing, "output tensor 0 of an item differs when another item is in the call"),
        (_BatchNormed, "batch norms \\['norm'\\] normalise over the items of a call"),
    ],
    ids=["pooled", "mixing", "batch-norm"],
)
def test_a_tower_no_layout_fits_is_refused_by_plan(tower: type[nn.Module], found: str) -> None:
    """Refused when the plan is made, not at step 0: the message names the tower, what the
    probe found and how to register an adapter."""
    with pytest.raises(ValueError, match="balance_media=True cannot balance tower") as error:
        MultimodalParallelizer(balance_media=True).plan(_Vlm(tower()))
    message = str(error.value)
    assert "'vision_tower'" in message
    assert f"no media layout fits tower {tower.__name__}" in message
    assert "register_media_layout" in message
    assert re.search(found, message), message


def test_a_tower_the_probe_cannot_run_is_refused_unless_its_signature_tells() -> None:
    with pytest.raises(ValueError, match="no media layout fits tower _NoWeights") as error:
        choose_media_layout(_NoWeights())
    assert "the layout cannot make a probe call for this tower" in str(error.value)
    assert "(frames: 'Tensor', lengths: 'Tensor')" in str(error.value)


def test_a_registered_adapter_without_probe_calls_runs_unprobed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The user's adapter for a tower the probe cannot run: used, and the plan says it was
    not probed."""
    monkeypatch.setattr(registry_module, "_REGISTERED", [])

    class Frames(MediaLayout):
        name = "frames"

        def applies_to(self, tower: nn.Module) -> bool:
            return isinstance(tower, _NoWeights)

        def split_call(self, tower: nn.Module, args: Any, kwargs: Any) -> MediaCall:
            return BatchFirstLayout().split_call(tower, args, kwargs)

    register_media_layout(Frames())
    choice = choose_media_layout(_NoWeights())
    assert choice.layout.name == "frames"
    assert choice.describe().startswith("frames, not probed (the layout cannot make a probe")


class _ReadsData(nn.Module):
    """A tower that reads its input's values (``.item()``): it cannot run on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 8)

    def forward(self, pixel_values: Tensor) -> Tensor:
        scale = float(pixel_values.abs().amax().item())
        out: Tensor = self.proj(pixel_values) * scale
        return out


def test_a_meta_tower_the_probe_cannot_run_is_noted_without_its_raw_error() -> None:
    """The plan's note of a trusted layout (batch-first on a ``pixel_values`` forward) the
    probe could not run on the meta device says its calls are checked at the first step,
    not the tower's raw error; the report's summary, which a refusal shows, keeps it."""
    with torch.device("meta"):
        tower = _ReadsData()
    choice = choose_media_layout(tower)
    assert choice.describe() == (
        "batch-first, not probed (the tower ran on none of the 2 probe inputs on the meta "
        "device); its calls are checked at the first step"
    )
    assert choice.report.error == "RuntimeError: Tensor.item() cannot be called on meta tensors"
    assert choice.report.summary() == (
        "batch-first: unprobed (the tower ran on none of the 2 probe inputs on the meta "
        "device: RuntimeError: Tensor.item() cannot be called on meta tensors)"
    )


def test_a_layout_that_does_not_fit_is_found_at_plan_time() -> None:
    """The probe of ``batch-first`` on a tower that pools the call: a misfit with the
    reason, and the next layout is tried (none here)."""
    report = probe_layout(_Pooled(), BatchFirstLayout())
    assert report.status == "misfit"
    assert "whole number of rows per item" in report.reason


class _Random(_Plain):
    """Draws from torch's and numpy's random state in its forward (dropout, Phi-4's
    audio encoder)."""

    def forward(self, images: Tensor) -> Tensor:
        import numpy

        numpy.random.rand()
        return torch.nn.functional.dropout(super().forward(images), 0.5, training=True)


def test_probe_leaves_modes_and_random_state_alone() -> None:
    numpy = pytest.importorskip("numpy")
    tower = _Random().train()
    state, numpy_state = torch.get_rng_state(), numpy.random.get_state()
    assert probe_layout(tower, BatchFirstLayout()).ran_on == "cpu"
    assert all(m.training for m in tower.modules())
    assert torch.equal(torch.get_rng_state(), state)
    assert numpy.random.get_state()[1].tolist() == numpy_state[1].tolist()


class _MaskedAudio(nn.Module):
    """An audio encoder that reads each clip's length from its mask, which it requires
    though the signature makes it optional (as AudioFlamingo3's does): ``(mel, frames)``
    per clip, a stride-2 convolution, the padded frames zeroed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, stride=2, padding=1)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, input_features: Tensor, input_features_mask: Tensor | None = None) -> Tensor:
        lengths = (input_features_mask.sum(-1) - 1) // 2 + 1  # type: ignore[union-attr]
        hidden = self.conv(input_features).transpose(1, 2)
        keep = torch.arange(hidden.shape[1]) < lengths[:, None]
        for block in self.blocks:
            hidden = block(hidden) * keep[..., None]
        return hidden


class _Waveform(nn.Module):
    """A raw-waveform encoder: ``(samples,)`` per clip, a one-channel stride-160 front end."""

    def __init__(self) -> None:
        super().__init__()
        self.front = nn.Conv1d(1, 8, 400, stride=160)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, input_values: Tensor) -> Tensor:
        hidden = self.front(input_values[:, None]).transpose(1, 2)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return hidden


@pytest.mark.parametrize(
    ("tower", "inputs"),
    [
        (_MaskedAudio, (("input_features", 1), ("input_features_mask", 1))),
        (_Waveform, (("input_values", 1),)),
    ],
    ids=["mask-read-as-data", "raw-waveform"],
)
def test_audio_encoders_get_the_inputs_they_need(
    tower: type[nn.Module], inputs: tuple[tuple[str, int], ...]
) -> None:
    """The probe gives an encoder its masks all ones and a raw waveform of many samples:
    both were refused ("the tower ran on none of the probe inputs") and now balance with
    ``batch-first``, values checked on their real weights."""
    choice = choose_media_layout(tower())
    assert choice.layout.name == "batch-first"
    assert choice.report.fits, choice.report.reason
    assert choice.report.ran_on == "cpu"
    assert choice.report.inputs == inputs
    assert choice.report.outputs == ("1 per input row",)


class _PackedAudio(_MaskedAudio):
    """Packs the valid frames of all clips into one sequence (as Qwen3-ASR's encoder
    does): a clip's output rows depend on the lengths of the others beside it."""

    def forward(self, input_features: Tensor, input_features_mask: Tensor | None = None) -> Tensor:
        lengths = (input_features_mask.sum(-1) - 1) // 2 + 1  # type: ignore[union-attr]
        hidden = self.conv(input_features).transpose(1, 2)
        keep = torch.arange(hidden.shape[1]) < lengths[:, None]
        return hidden[keep]


def test_an_encoder_that_packs_the_valid_frames_of_all_clips_is_refused() -> None:
    """The probe's second clip is padded after its first half, so packing shows: refused
    when the plan is made, not split wrongly at the first step with padded clips."""
    report = probe_layout(_PackedAudio(), BatchFirstLayout())
    assert report.status == "misfit", report.summary()
    assert "an item's output rows depend on the other items of the call" in report.reason


class _PackedWhenMasked(_MaskedAudio):
    """Runs without a mask (every frame valid, one row per clip) and packs the valid
    frames of all clips when given one, as its real calls are."""

    def forward(self, input_features: Tensor, input_features_mask: Tensor | None = None) -> Tensor:
        hidden = self.conv(input_features).transpose(1, 2)
        if input_features_mask is None:
            return hidden
        lengths = (input_features_mask.sum(-1) - 1) // 2 + 1
        return hidden[torch.arange(hidden.shape[1]) < lengths[:, None]]


def test_a_tower_that_takes_a_mask_is_probed_with_one_first() -> None:
    """Its calls pass masks, so the probe tries masks before leaving them out: the
    packing shows and the tower is refused, though it fits when called without one."""
    report = probe_layout(_PackedWhenMasked(), BatchFirstLayout())
    assert report.status == "misfit", report.summary()
    assert "an item's output rows depend on the other items of the call" in report.reason


class _MisconfiguredAudio(nn.Module):
    """An encoder whose config gives frames of 16 features but whose projection after
    its convolution was built for another width (a config whose widths disagree, as
    Phi-4-multimodal's default ``ext_pw_out_channel`` beside a shrunk ``hidden_size``):
    it runs on no input, and the likeliest input's error is the one that says why."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"input_size": 16})()
        self.conv = nn.Conv1d(16, 8, 3, padding=1)
        self.proj = nn.Linear(12, 8)

    def forward(self, input_features: Tensor) -> Tensor:
        if input_features.dim() != 3 or input_features.shape[-1] != 16:
            raise ValueError(f"frames of 16 features wanted, got {tuple(input_features.shape)}")
        hidden = self.conv(input_features.transpose(1, 2)).transpose(1, 2)
        out: Tensor = self.proj(hidden)
        return out


def test_a_tower_that_runs_on_no_input_is_refused_with_its_likeliest_inputs_error() -> None:
    """The refusal shows the error of the first probe input (from the config, the
    likeliest), not the last guess's. Before, it showed the last guess's ("frames of 16
    features wanted, got (1, 16, 64)"), which hid the tower's real fault."""
    with pytest.raises(ValueError, match="no media layout fits") as raised:
        choose_media_layout(_MisconfiguredAudio())
    message = str(raised.value)
    assert "mat1 and mat2 shapes cannot be multiplied" in message, message
    assert "wanted" not in message, message
