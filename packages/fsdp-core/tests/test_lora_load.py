"""A base checkpoint into a LoRA model built on ``meta`` and sharded, without peft.

The modules are shaped like peft's (see ``test_lora_export.py``); the peft model
is recognised by ``peft_config`` and ``get_base_model``. Under the fake process
group each rank must hold its own shard of the one full adapter tensor (never
the same shard on every rank, as ``reset_parameters`` on DTensors would give);
the real-peft and 2-rank cases are in ``tests/``.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

safetensors_torch = pytest.importorskip("safetensors.torch")

from fsdp_core.fake_group import fake_process_group  # noqa: E402
from fsdp_core.hf.pretrained import load_pretrained  # noqa: E402
from fsdp_core.mesh import build_mesh  # noqa: E402
from fsdp_core.parallelizer import ModelParallelizer  # noqa: E402

IN, OUT, RANK = 6, 8, 4


class LoraLayer(nn.Module):
    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(IN, RANK, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(RANK, OUT, bias=False)})
        self.scaling = {"default": 2.0}
        self.r = {"default": RANK}
        self.active_adapters = ["default"]


class SavedCopy(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.original_module = module
        self.modules_to_save = nn.ModuleDict({"default": nn.Linear(OUT, OUT)})
        self.active_adapters = ["default"]


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT)
        self.head = nn.Linear(OUT, OUT)


class Wrapped(nn.Module):
    def __init__(self, base: Base) -> None:
        super().__init__()
        self.model = base
        base.proj = LoraLayer(base.proj)  # type: ignore[assignment]
        base.head = SavedCopy(base.head)  # type: ignore[assignment]


class FakePeft(nn.Module):
    def __init__(self, init: object = True) -> None:
        super().__init__()
        self.base_model = Wrapped(Base())
        self.peft_config = {"default": SimpleNamespace(init_lora_weights=init)}

    def get_base_model(self) -> nn.Module:
        return self.base_model.model


def _checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in Base().state_dict().items()}
    directory.mkdir()
    safetensors_torch.save_file(state, str(directory / "model.safetensors"))
    return state


def _expected_lora_a(seed: int, gaussian: bool) -> torch.Tensor:
    """peft's draws: nn.Linear(IN, RANK), nn.Linear(RANK, OUT), then lora_A again."""
    torch.manual_seed(seed)
    nn.init.kaiming_uniform_(torch.empty(RANK, IN), a=math.sqrt(5))
    nn.init.kaiming_uniform_(torch.empty(OUT, RANK), a=math.sqrt(5))
    value = torch.empty(RANK, IN)
    if gaussian:
        return value.normal_(0.0, 1.0 / RANK)
    nn.init.kaiming_uniform_(value, a=math.sqrt(5))
    return value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@pytest.mark.parametrize("init", [True, "gaussian"])
def test_each_rank_keeps_its_shard_of_the_same_full_adapter(tmp_path: Path, init: object) -> None:
    state = _checkpoint(tmp_path / "base")
    expected_a = _expected_lora_a(9, init == "gaussian")
    shards: list[torch.Tensor] = []
    for rank in range(2):
        with fake_process_group(2, rank=rank), torch.device("meta"):
            model = FakePeft(init)
        with fake_process_group(2, rank=rank):
            ModelParallelizer().parallelize(model, mesh=build_mesh())
            torch.manual_seed(9)
            report = load_pretrained(model, tmp_path / "base")
            inner: Any = model.base_model.model
            a = inner.proj.lora_A["default"].weight
            assert isinstance(a, DTensor)
            shards.append(_local(a).clone())
            assert not _local(inner.proj.lora_B["default"].weight).any()
            chunk = torch.chunk(state["proj.weight"], 2)[rank]
            assert torch.equal(_local(inner.proj.base_layer.weight), chunk)
            head = torch.chunk(state["head.weight"], 2)[rank]
            assert torch.equal(_local(inner.head.modules_to_save["default"].weight), head)
            assert torch.equal(_local(inner.head.original_module.weight), head)
        assert report.missing == ()
        assert report.unexpected == ()
    assert torch.equal(torch.cat(shards), expected_a)


def test_an_initialisation_that_needs_the_base_is_refused_before_reading(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "base")
    with torch.device("meta"):
        model = FakePeft("pissa")
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa'.*adapter export"):
        load_pretrained(model, tmp_path / "base")
    assert model.base_model.model.proj.base_layer.weight.is_meta  # type: ignore[union-attr]


def test_a_nested_adapter_is_refused_with_what_to_do(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "base")
    with torch.device("meta"):
        model = FakePeft()
        outer = model.base_model.model.proj
        outer.base_layer = LoraLayer(outer.base_layer)  # type: ignore[union-attr]
    with pytest.raises(
        ValueError, match=r"nested adapters are not initialised by the load: load the base"
    ):
        load_pretrained(model, tmp_path / "base")
