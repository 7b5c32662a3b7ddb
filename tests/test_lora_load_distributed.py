"""LoRA in the documented order on 2 gloo ranks: meta build, adapters, shard, load.

The scenario (``mp/scenarios_lora_load.py``) builds tiny LLaVA on ``meta``, adds
peft LoRA (default initialisation) to the decoder and the CLIP tower, shards it under
each frozen-tower policy and loads a base export. Here, in one process:

- the base weights equal ``from_pretrained`` of the export;
- ``lora_B`` is zero and ``lora_A`` equals what peft gives a CPU model right after
  the same seed, and every rank holds the same full adapters;
- one SGD step equals a single-process data-parallel reference;
- the adapter export, loaded after the base export into a fresh meta-built LoRA
  model, gives back the trained model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from hf_vlms import HF_VLMS  # noqa: E402
from launches import MpResults  # noqa: E402
from reference import reference_training, sgd  # noqa: E402
from scenarios_lora_load import LR, POLICIES, SEED, lora_config  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.transformers]


def _result(mp2: MpResults) -> dict[str, Any]:
    result = mp2("lora_load_llava")
    if "skipped" in result:
        pytest.fail(f"the ranks lacked a dependency the test process has: {result['skipped']}")
    return result


def _cpu_lora(source: Path) -> nn.Module:
    """What a user gets without meta: from_pretrained, seed, get_peft_model."""
    base = transformers.LlavaForConditionalGeneration.from_pretrained(source)
    torch.manual_seed(SEED)
    model: nn.Module = peft.get_peft_model(base, lora_config())
    return model


def _persistent(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    keys = model.state_dict()
    return {k: v for k, v in state.items() if k in keys}


@pytest.mark.parametrize("policy", POLICIES)
def test_loaded_model_equals_from_pretrained_then_peft(mp2: MpResults, policy: str) -> None:
    result = _result(mp2)
    case = result["cases"][policy]
    assert case["missing"] == ()
    assert case["ranks_equal"] is True
    expected = _cpu_lora(Path(result["source"])).state_dict()
    loaded = _persistent(_cpu_lora(Path(result["source"])), case["loaded"])
    assert set(loaded) == set(expected)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    lora_b = [n for n in loaded if ".lora_B." in n]
    assert lora_b
    assert all(torch.count_nonzero(loaded[n]) == 0 for n in lora_b)
    assert any(".vision_tower." in n for n in lora_b)


@pytest.mark.parametrize("policy", POLICIES)
def test_one_step_matches_a_single_process_reference(mp2: MpResults, policy: str) -> None:
    result = _result(mp2)
    source = Path(result["source"])
    batches = [HF_VLMS["llava"].batch(seed=rank) for rank in range(2)]

    def step(model: nn.Module, _step: int, rank: int) -> torch.Tensor:
        loss: torch.Tensor = model(**batches[rank]).loss
        return loss

    reference = reference_training(
        lambda: _cpu_lora(source), step, steps=1, world=2, compute_dtype=None, optimizer=sgd(LR)
    )
    trained = result["cases"][policy]["trained"]
    for name, value in reference.params.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    moved = [n for n in reference.params if ".lora_B." in n]
    assert any(torch.count_nonzero(trained[n]) for n in moved)  # the step changed lora_B


@pytest.mark.parametrize("policy", POLICIES)
def test_adapter_export_round_trip_into_a_fresh_meta_model(mp2: MpResults, policy: str) -> None:
    case = _result(mp2)["cases"][policy]
    assert case["adapter_naming"] == "adapter"
    trained, reloaded = case["trained"], case["reloaded"]
    assert set(reloaded) == set(trained)
    for name, value in trained.items():
        assert torch.equal(reloaded[name], value), name
