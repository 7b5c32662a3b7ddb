"""The HF export and load on a model sharded over part of the world (a pipeline stage).

``save_pretrained`` and ``export_adapter`` write one directory from the first rank of the
model's ranks: on a stage each stage's first rank would prepare and swap the same
directory with its stage's tensors alone (a race; the last swap wins and the export
lacks the other stages). They are refused on every rank before anything is written.
``load_pretrained`` on a stage reads the stage's own tensors from the whole model's
export (collective over the stage's ranks only): the checkpoint's other keys are the
other stages', so ``strict`` checks only the stage's missing tensors.

Under the fake process group (4 ranks, this one rank 0 of a ``('pp', 'dp')`` 2x2 mesh)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp_core.fake_group import fake_process_group
from fsdp_core.hf import load_pretrained, save_pretrained
from fsdp_core.hf._save import export_adapter


def _stage(world_dp: DeviceMesh) -> nn.Sequential:
    """Stage 0 of a two-layer model: its first layer, under the same name."""
    torch.manual_seed(1)
    stage = nn.Sequential(nn.Linear(4, 4))
    fully_shard(stage, mesh=world_dp)
    return stage


@pytest.mark.parametrize("export", [save_pretrained, export_adapter])
def test_exports_are_refused_on_a_pipeline_stage(
    tmp_path: Path, export: Callable[..., Any]
) -> None:
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        stage = _stage(world["dp"])
        with pytest.raises(ValueError, match=r"ranks \[0, 1\] of a world of 4.*per stage"):
            export(stage, tmp_path / "export")
    assert not list(tmp_path.iterdir())  # nothing written


def test_load_pretrained_on_a_stage_reads_its_own_tensors(tmp_path: Path) -> None:
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    save_pretrained(whole, tmp_path / "export")  # no process group: the whole model
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        stage = _stage(world["dp"])
        loaded = load_pretrained(stage, tmp_path / "export")  # strict: the stage's keys
        weight = stage.get_parameter("0.weight")
        assert isinstance(weight, DTensor)
        local = weight.to_local()
    assert loaded.missing == ()
    assert loaded.unexpected == ("1.bias", "1.weight")  # the other stage's
    torch.testing.assert_close(local, whole.get_parameter("0.weight").detach()[: local.shape[0]])


def test_a_stage_missing_its_own_tensors_still_fails_strict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_pretrained(nn.Sequential(nn.Identity(), nn.Linear(4, 4)), tmp_path / "export")
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        stage = _stage(world["dp"])
        with pytest.raises(ValueError, match=r"2 model tensors missing"):
            load_pretrained(stage, tmp_path / "export")


def test_an_adapter_export_loads_into_a_stage(tmp_path: Path) -> None:
    """A peft adapter exported from the whole model loads into a stage's PeftModel: the
    other stage's adapter keys are returned as unexpected, not a strict failure."""
    peft = pytest.importorskip("peft")
    config = {"r": 2, "lora_alpha": 2, "init_lora_weights": False}
    torch.manual_seed(0)
    whole = peft.get_peft_model(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
        peft.LoraConfig(target_modules=["0", "1"], **config),
    )
    whole.save_pretrained(str(tmp_path / "adapter"))
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        torch.manual_seed(1)
        stage = peft.get_peft_model(
            nn.Sequential(nn.Linear(4, 4)), peft.LoraConfig(target_modules=["0"], **config)
        )
        fully_shard(stage, mesh=world["dp"])
        loaded = load_pretrained(stage, tmp_path / "adapter")
        local = stage.get_parameter("base_model.model.0.lora_A.default.weight").to_local()
    assert loaded.missing == ()
    assert loaded.unexpected == (
        "base_model.model.1.lora_A.weight",
        "base_model.model.1.lora_B.weight",
    )
    expected = whole.get_parameter("base_model.model.0.lora_A.default.weight").detach()
    torch.testing.assert_close(local, expected[: local.shape[0]])
