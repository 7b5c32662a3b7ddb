"""Loading into a LoRA model built on ``meta`` (adapters added before any weight exists).

The documented order is: build on meta, ``get_peft_model``, parallelize,
``load_pretrained``. The base checkpoint has no adapter tensors: the load gives
them peft's own initial values (from the default generator, in peft's order) and
reads the base weights under their unwrapped names. One process here, with real
peft; the sharded LLaVA case is ``test_lora_load_distributed.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fsdp_core.hf import load_pretrained, save_pretrained  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.mid = nn.Linear(10, 8)
        self.head = nn.Linear(8, 4)


def _base_export(directory: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in Net().state_dict().items()}
    directory.mkdir()
    safetensors_torch.save_file(state, str(directory / "model.safetensors"))
    return state


def _config(**options: Any) -> Any:
    options.setdefault("target_modules", ["up", "mid"])
    return peft.LoraConfig(r=2, lora_alpha=4, **options)


def _meta_lora(**options: Any) -> Any:
    with torch.device("meta"):
        net = Net()
    return peft.get_peft_model(net, _config(**options))


def _reference(state: dict[str, torch.Tensor], seed: int, **options: Any) -> Any:
    """What a user gets on the CPU: load the base, seed, add adapters."""
    net = Net()
    net.load_state_dict(state)
    torch.manual_seed(seed)
    return peft.get_peft_model(net, _config(**options))


@pytest.mark.parametrize("init", [True, "gaussian"])
def test_base_checkpoint_into_meta_lora_model_gives_peft_initial_adapters(
    tmp_path: Path, init: object
) -> None:
    state = _base_export(tmp_path / "base")
    model = _meta_lora(init_lora_weights=init, modules_to_save=["head"])
    torch.manual_seed(7)
    result = load_pretrained(model, tmp_path / "base")
    reference = _reference(state, 7, init_lora_weights=init, modules_to_save=["head"])
    ours, theirs = model.state_dict(), reference.state_dict()
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    assert not any(t.is_meta for t in model.state_dict().values())
    b = model.base_model.model.up.lora_B["default"].weight
    assert torch.count_nonzero(b) == 0
    assert torch.equal(model.base_model.model.up.base_layer.weight, state["up.weight"])
    assert torch.equal(
        model.base_model.model.head.modules_to_save["default"].weight, state["head.weight"]
    )
    assert result.missing == ()
    assert result.unexpected == ()


@pytest.mark.parametrize("init", ["pissa", "olora", "eva", "loftq", False])
def test_other_adapter_initialisations_are_refused_before_reading(
    tmp_path: Path, init: object
) -> None:
    _base_export(tmp_path / "base")
    model = _meta_lora()  # peft itself cannot run these on meta: set them afterwards
    model.peft_config["default"].init_lora_weights = init
    with pytest.raises(ValueError, match="init_lora_weights") as raised:
        load_pretrained(model, tmp_path / "base")
    assert "adapter export" in str(raised.value)
    assert model.base_model.model.up.base_layer.weight.is_meta  # nothing was read


def test_adapter_export_round_trip_into_a_fresh_meta_model(tmp_path: Path) -> None:
    state = _base_export(tmp_path / "base")
    trained = _reference(state, 3, init_lora_weights=False, modules_to_save=["head"])
    with torch.no_grad():
        trained.base_model.model.head.modules_to_save["default"].weight.add_(1.0)
    save_pretrained(trained, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    fresh = _meta_lora(modules_to_save=["head"])
    load_pretrained(fresh, tmp_path / "base")
    result = load_pretrained(fresh, tmp_path / "adapter")
    assert result.naming == "adapter"
    ours, theirs = fresh.state_dict(), trained.state_dict()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_adapter_export_before_the_base_is_refused(tmp_path: Path) -> None:
    state = _base_export(tmp_path / "base")
    save_pretrained(_reference(state, 3, init_lora_weights=False), tmp_path / "adapter")
    with pytest.raises(ValueError, match="base checkpoint first"):
        load_pretrained(_meta_lora(), tmp_path / "adapter")
