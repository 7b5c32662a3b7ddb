"""``load_full_state_dict`` on a model sharded over part of the world (a pipeline
stage): torch's ``broadcast_from_rank0`` sends from global rank 0 over the whole world,
so each stage would receive rank 0's stage; refused on every rank before anything moves.
Under the fake process group (4 ranks, this one rank 0 of a ``('pp', 'dp')`` 2x2 mesh)."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fsdp_core.fake_group import fake_process_group
from fsdp_core.materialize import load_full_state_dict


def test_broadcast_from_rank0_is_refused_on_a_pipeline_stage() -> None:
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        model = fully_shard(nn.Linear(4, 4), mesh=world["dp"])
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=r"ranks \[0, 1\] of a world of 4.*=False"):
            load_full_state_dict(model, full)
