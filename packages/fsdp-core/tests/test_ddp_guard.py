"""A sharded unit refuses DistributedDataParallel with an error naming the integrations.

Before: ``DistributedDataParallel(sharded_model)`` (what accelerate's ``prepare`` and
transformers' Trainer do on CPU) failed deep in DTensor while broadcasting the shards:
``RuntimeError: Cannot flatten unevenly sharded tensor: dimension 0 (size 17) is not
evenly divisible by mesh dimension 0 (size 2)``.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core.ddp_guard import REFUSE_DDP, refuse_ddp
from fsdp_core.integrations import IntegrationRequiredError
from fsdp_core.sharding import apply_fully_shard


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 17), nn.ReLU(), nn.Linear(17, 4))


def test_ddp_of_a_sharded_unit_names_the_integrations(mesh2: DeviceMesh) -> None:
    model = _model()
    apply_fully_shard(model, mesh=mesh2, mp_policy=MixedPrecisionPolicy())
    with pytest.raises(IntegrationRequiredError) as caught:
        nn.parallel.DistributedDataParallel(model)
    text = str(caught.value)
    assert "fsdp_core.integrations.transformers.ShardedTrainer" in text
    assert "fsdp_core.integrations.accelerate.prepare" in text


def test_every_module_of_a_grouped_unit_refuses(mesh2: DeviceMesh) -> None:
    model = _model()
    apply_fully_shard([model[0], model[2]], mesh=mesh2, mp_policy=MixedPrecisionPolicy())
    for module in (model[0], model[2]):
        with pytest.raises(IntegrationRequiredError):
            set(module._ddp_params_and_buffers_to_ignore)


def test_the_guard_survives_copies() -> None:
    model = _model()
    refuse_ddp(model)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert copied._ddp_params_and_buffers_to_ignore is REFUSE_DDP
    assert "DistributedDataParallel" in repr(REFUSE_DDP)


def test_an_unsharded_model_is_left_alone() -> None:
    model = _model()
    assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")
    assert torch.equal(model(torch.ones(1, 8)), model(torch.ones(1, 8)))
