"""The TP plans of ``multimodal_fsdp.tensor_parallel`` and ``model_deepseek_v41.tensor_parallel``.

Under the fake process group (one process, 4 ranks) on a ``('dp', 'tp')`` 2x2 mesh: each
plan holds exactly the projections it should (and no frozen tower's), applying it makes
those parameters DTensors on ``tp`` with the column-/row-wise placements, and the library
then adds ``dp`` to them; sizes that TP cannot divide and malformed plans are refused
with messages naming the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from vlm import build_vlm

from fsdp_core.fake_group import fake_process_group
from model_deepseek_v41 import PARALLELIZER
from model_deepseek_v41.tensor_parallel import deepseek_v41_tp_plan
from multimodal_fsdp.tensor_parallel import apply_tensor_parallel, llama_style_plan

pytestmark = [pytest.mark.filterwarnings("ignore:.*returned a view tensor")]


def _world() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _llava() -> nn.Module:
    pytest.importorskip("transformers")
    from hf_vlms import build_llava

    model = build_llava()
    model.model.vision_tower.requires_grad_(False)  # type: ignore[union-attr]
    return model


def _placement(model: nn.Module, name: str) -> tuple[tuple[str, ...], tuple[object, ...]]:
    param = model.get_parameter(name)
    assert isinstance(param, DTensor), name
    return tuple(param.device_mesh.mesh_dim_names or ()), tuple(param.placements)


def test_deepseek_plan_holds_the_language_mlps_exactly() -> None:
    model = build_vlm(dtype=torch.float32, frozen_tower=True)
    plan = deepseek_v41_tp_plan(model, tp_size=2)
    layers = len(model.model.layers)  # type: ignore[arg-type]
    expected = {f"model.layers.{i}.mlp.{p}" for i in range(layers) for p in ("gate_up", "down")}
    assert set(plan) == expected
    assert all(
        isinstance(plan[p], ColwiseParallel if p.endswith("gate_up") else RowwiseParallel)
        for p in plan
    )
    # A frozen tower is not planned, even when asked for the vision MLPs ...
    assert set(deepseek_v41_tp_plan(model, tp_size=2, include_vision=True)) == expected
    # ... unless frozen modules are asked for too.
    both = deepseek_v41_tp_plan(model, tp_size=2, include_vision=True, include_frozen=True)
    assert {p for p in both if p.startswith("vision.blocks.")} == {
        f"vision.blocks.{i}.mlp.{p}"
        for i in range(len(model.vision.blocks))  # type: ignore[arg-type]
        for p in ("gate_up", "down")
    }


def test_deepseek_plan_applied_then_the_library_shards_over_dp() -> None:
    with fake_process_group(4):
        world = _world()
        model = build_vlm(dtype=torch.float32, frozen_tower=True)
        plan = deepseek_v41_tp_plan(model, tp_size=world["tp"].size())
        assert apply_tensor_parallel(model, world["tp"], plan) == sorted(plan)
        assert _placement(model, "model.layers.0.mlp.gate_up.weight") == (("tp",), (Shard(0),))
        assert _placement(model, "model.layers.0.mlp.down.weight") == (("tp",), (Shard(1),))
        assert not isinstance(model.get_parameter("model.layers.0.self_attn.qkv.weight"), DTensor)
        assert not isinstance(model.get_parameter("vision.blocks.0.mlp.down.weight"), DTensor)
        PARALLELIZER.parallelize(model, mesh=world["dp"])
        # FSDP adds dp in front of TP's placement.
        assert _placement(model, "model.layers.0.mlp.down.weight") == (
            ("dp", "tp"),
            (Shard(0), Shard(1)),
        )


def test_llama_plan_holds_the_language_projections_exactly() -> None:
    model = _llava()
    plan = llama_style_plan(model, tp_size=2)
    prefix = "model.language_model.layers"
    columns = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
    columns |= {"mlp.gate_proj", "mlp.up_proj"}
    rows = {"self_attn.o_proj", "mlp.down_proj"}
    expected = {f"{prefix}.{i}.{p}": c for i in range(2) for p in columns for c in [True]}
    expected |= {f"{prefix}.{i}.{p}": False for i in range(2) for p in rows}
    assert {p: isinstance(s, ColwiseParallel) for p, s in plan.items()} == expected
    assert all(isinstance(plan[p], RowwiseParallel) for p, col in expected.items() if not col)


def test_llama_plan_applied_then_the_library_shards_over_dp() -> None:
    model = _llava()
    with fake_process_group(4):
        world = _world()
        apply_tensor_parallel(model, world["tp"], llama_style_plan(model, tp_size=2))
        layer = "model.language_model.layers.1"
        for name, dim in (
            ("self_attn.q_proj", 0),
            ("self_attn.k_proj", 0),
            ("self_attn.v_proj", 0),
            ("self_attn.o_proj", 1),
            ("mlp.gate_proj", 0),
            ("mlp.up_proj", 0),
            ("mlp.down_proj", 1),
        ):
            assert _placement(model, f"{layer}.{name}.weight") == (("tp",), (Shard(dim),)), name
        # The frozen CLIP tower (whose layers are not Llama-style anyway) stays whole.
        assert not any(
            isinstance(p, DTensor)
            for p in model.model.vision_tower.parameters()  # type: ignore[union-attr]
        )
        from multimodal_fsdp import MultimodalParallelizer

        MultimodalParallelizer().parallelize(model, mesh=world, dp_dims="dp")
        assert _placement(model, f"{layer}.mlp.down_proj.weight") == (
            ("dp", "tp"),
            (Shard(0), Shard(1)),
        )


def test_tp_sizes_that_do_not_divide_are_refused_with_the_sizes_that_do() -> None:
    with pytest.raises(ValueError, match=r"tp size 3 does not divide the 2 query heads.*\[1, 2\]"):
        llama_style_plan(_llava(), tp_size=3)
    model = build_vlm(dtype=torch.float32, frozen_tower=True)
    features = model.model.layers[0].mlp.down.in_features  # type: ignore[index,union-attr]
    bad = next(n for n in range(2, features + 1) if features % n)
    with pytest.raises(ValueError, match=f"tp size {bad} does not divide the {features} inter"):
        deepseek_v41_tp_plan(model, tp_size=bad)
    for wrong in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="tp_size must be a positive int"):
            deepseek_v41_tp_plan(model, tp_size=wrong)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="tp_size must be a positive int"):
            llama_style_plan(model, tp_size=wrong)  # type: ignore[arg-type]


def test_a_model_without_planned_modules_is_refused() -> None:
    model = build_vlm(dtype=torch.float32, frozen_tower=True)
    with pytest.raises(ValueError, match="no trainable Llama/Qwen2-style attention"):
        llama_style_plan(model, tp_size=2)
    with pytest.raises(ValueError, match="no trainable Llama/Qwen2-style decoder layer"):
        llama_style_plan(model, tp_size=2, sequence_parallel=True)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="include_frozen=True"):
        deepseek_v41_tp_plan(model, tp_size=2)


def test_apply_checks_the_mesh_and_the_plan() -> None:
    model = build_vlm(dtype=torch.float32, frozen_tower=True)
    with fake_process_group(4):
        world = _world()
        plan = deepseek_v41_tp_plan(model, tp_size=2)
        with pytest.raises(ValueError, match=r"pass the 1-D tensor-parallel sub-mesh"):
            apply_tensor_parallel(model, world, plan)
        with pytest.raises(TypeError, match="tp_mesh must be a DeviceMesh"):
            apply_tensor_parallel(model, "tp", plan)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"does not have: \['model.nope'\]"):
            apply_tensor_parallel(model, world["tp"], {"model.nope": RowwiseParallel()})
        with pytest.raises(TypeError, match="not a ParallelStyle"):
            apply_tensor_parallel(model, world["tp"], {"lm_head": "colwise"})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="empty"):
            apply_tensor_parallel(model, world["tp"], {})
        assert not any(isinstance(p, DTensor) for p in model.parameters())  # nothing applied


def test_sequence_parallel_plans_each_decoder_layer_around_its_projections() -> None:
    model = _llava()
    plan = llama_style_plan(model, tp_size=2, sequence_parallel=True)
    plain = llama_style_plan(model, tp_size=2)
    layers = {f"model.language_model.layers.{i}" for i in range(2)}
    around = {
        f"{layer}.{part}"
        for layer in layers
        for part in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    }
    assert set(plan) == set(plain) | layers | around
    assert all(isinstance(plan[f"{layer}.input_layernorm"], SequenceParallel) for layer in layers)
    assert all(isinstance(plan[f"{layer}.mlp"], PrepareModuleInput) for layer in layers)
    # The row-wise projections reduce-scatter along the sequence instead of all-reducing.
    for layer in layers:
        for row in ("self_attn.o_proj", "mlp.down_proj"):
            assert plan[f"{layer}.{row}"].output_layouts == (Shard(1),)
            assert plain[f"{layer}.{row}"].output_layouts == (Replicate(),)
    with fake_process_group(4):
        world = _world()
        apply_tensor_parallel(model, world["tp"], plan)
        norm = model.get_parameter("model.language_model.layers.0.input_layernorm.weight")
        assert _placement(model, "model.language_model.layers.0.input_layernorm.weight") == (
            ("tp",),
            (Replicate(),),
        )
        assert isinstance(norm, DTensor)
