"""torchtitan's ``parallelize_fn`` protocol with the library, on 2 gloo ranks, against
one process (issue 25): ``fsdp_core.integrations.torchtitan.parallelize_fn`` on a model
built on ``meta``, sharded over ``ParallelDims(...).get_mesh("dp_shard")`` (its device
type set to CPU in the scenario only), then ``to_empty`` and ``init_weights`` as
torchtitan's Trainer does; ``root`` with clipping, ``per_layer``, and ``balance_media``
with every image on rank 0. Losses, first-step gradients and final parameters must
equal the single-process reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from compare import TOL, check_against_reference
from framework_cases import TORCHTITAN, reference
from launches import MpResults

pytestmark = pytest.mark.distributed


def _result(mp2: MpResults, name: str) -> dict[str, Any]:
    result = mp2(name)
    if "skipped" in result:
        pytest.skip(result["skipped"])
    return result


@pytest.mark.parametrize("name", list(TORCHTITAN))
def test_torchtitan_parallelize_fn_trains_like_one_process(name: str, mp2: MpResults) -> None:
    result = _result(mp2, name)
    check_against_reference(result, reference(name).as_tuple(), TOL[torch.float32])
    # Sharded on meta, before any value exists, as torchtitan calls it.
    assert result["on_meta_after_parallelize"]
    assert "dp_shard=2" in result["mesh"]
    # compile.enable: each block's forward compiled (the numbers above: eager's).
    if TORCHTITAN[name].compile_backend is None:
        assert result["compiled"] == []
    else:
        blocks = ["vision_tower.blocks.0", "vision_tower.blocks.1"]
        layers = [f"language_model.layers.{i}" for i in range(3)]
        assert result["compiled"] == blocks + layers
