"""torchtitan's ``parallelize_fn`` protocol with the library, on 2 gloo ranks against
one process (issue 25): ``fsdp_core.integrations.torchtitan.parallelize_fn`` on a model
built on ``meta``, sharded over ``ParallelDims(...).get_mesh("dp_shard")`` (its device
type set to CPU in the scenario only), then ``to_empty`` and ``init_weights`` as
torchtitan's Trainer does; ``root`` with clipping, ``per_layer``, and ``balance_media``
with every image on rank 0. Losses, first-step gradients and final parameters must
equal the single-process reference. On 4 ranks (issue 34): ``dp_shard=2 x tp=2``, the
caller's TP plan applied by the adapter, compared with one process the same way."""

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


@pytest.fixture(scope="module")
def nd_reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process on the two data-parallel batches of each step (scenarios_nd's)."""
    from scenarios_nd import IMAGES, STEPS
    from toy import reference_run
    from vlm import LR, build_vlm, vlm_batches, vlm_loss

    return reference_run(
        lambda: build_vlm(dtype=torch.float32, frozen_tower=True),
        vlm_batches(STEPS, 2, images=IMAGES),
        vlm_loss,
        compute_dtype=None,
        lr=LR,
    )


def test_torchtitan_tensor_parallel_beside_the_library_trains_like_one_process(
    mp4: MpResults,
    nd_reference: tuple,  # type: ignore[type-arg]
) -> None:
    """ParallelDims(dp_shard=2, tp=2): the adapter applies the caller's TP plan on
    torchtitan's tp mesh, then the library shards over dp_shard of torchtitan's dense
    mesh and sees the tp dimension (issue 34)."""
    result = mp4("torchtitan_dp_tp")
    if "skipped" in result:
        pytest.skip(result["skipped"])
    check_against_reference(result, nd_reference, TOL[torch.float32])
    assert result["on_meta_after_parallelize"]
    assert result["tp_mesh_dims"] == 2  # TP's placement kept, FSDP's dp dimension added
    # The forward's checks span the TP peers; the unused flags the data-parallel ranks.
    assert result["arrival_ranks"] == [0, 1, 2, 3]
    assert result["unused_ranks"] in ([0, 2], [1, 3])
