"""Calls whose torch collectives span the whole world, on a model sharded over part of it
(a pipeline stage): ``load_full_state_dict``'s ``broadcast_from_rank0`` (from global
rank 0: each stage would receive stage 0's tensors) and the DCP checkpoints; refused on
every rank before anything moves.
Under the fake process group (4 ranks, this one rank 0 of a ``('pp', 'dp')`` 2x2 mesh)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_core.checkpoint import load_checkpoint, save_checkpoint
from fsdp_core.fake_group import fake_process_group
from fsdp_core.materialize import load_full_state_dict


def test_broadcast_from_rank0_is_refused_on_a_pipeline_stage() -> None:
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        model = fully_shard(nn.Linear(4, 4), mesh=world["dp"])
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=r"ranks \[0, 1\] of a world of 4.*=False"):
            load_full_state_dict(model, full)


def test_checkpoints_are_refused_on_a_pipeline_stage(tmp_path: Path) -> None:
    """save_checkpoint and load_checkpoint write and read with DCP over the whole world
    and prepare the directory on one rank: on a stage each stage's first rank would
    prepare the same directory while DCP waits for the other stage's call."""
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        model = fully_shard(nn.Linear(4, 4), mesh=world["dp"])
        with pytest.raises(ValueError, match=r"save_checkpoint: .*ranks \[0, 1\].*DCP"):
            save_checkpoint(tmp_path / "ckpt", model)
        with pytest.raises(ValueError, match=r"load_checkpoint: .*pipeline stage"):
            load_checkpoint(tmp_path / "ckpt", model)
    assert not list(tmp_path.iterdir())  # nothing written
