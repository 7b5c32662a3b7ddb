"""Memory of a balanced frozen tower on a ``('dp', 'cp')`` 2x2 mesh, predicted and measured.

Under the fake process group the library shards the tiny DeepSeek-V4.1 reference model
over ``dp`` x ``cp``; each rank of a CP group encodes its share of the tower call and
the data group exchanges the outputs after a header carrying each rank's item mask
(``multimodal_fsdp.balance._data_group``). The batch is one CP rank's: the memory
model traces it as one sequence holding every sample's media tokens, so the rank needs
every item (``inspect_model``), as the measured step does without
``context_parallel_media``. The exchange's buffers are held byte for byte to the
runtime in ``tests/test_data_group_memory.py``; here the whole step against FSDP's
memory tracker, within the tolerances data-parallel plans get.
"""

from __future__ import annotations

import pytest
import torch
from memory_check import check_memory
from torch.distributed.device_mesh import init_device_mesh
from vlm import build_vlm, vlm_batches, vlm_loss

from fsdp_core.fake_group import fake_process_group
from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer
from multimodal_fsdp.measure.memory import measure_plan_memory

pytestmark = [pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")]


@pytest.mark.parametrize("images", [1, 4])
@pytest.mark.parametrize("policy", ["root", "per_layer"])
def test_balanced_tower_on_cp_ranks_memory_is_predicted(images: int, policy: str) -> None:
    batch = vlm_batches(1, 1, images=[images])[0][0]
    with fake_process_group(4):
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        model = build_vlm(dtype=torch.float32, frozen_tower=True)
        plan = DeepseekV41ModelParallelizer(
            frozen_multimodal_sharding=policy, balance_media=True
        ).plan(model)
        result = measure_plan_memory(
            plan, model, lambda m: vlm_loss(m, batch), world_size=4, mesh=world, dp_dims="dp"
        )
    assert result.costs.exchange is not None  # the exchange was costed
    check_memory(result)
