"""Per-block ``torch.compile`` of the sharded DeepSeek-V4.1 reference model (issue 34 item 5).

One gloo rank in this process (the numbers of a compiled step must equal eager's, so not
the fake group). ``aot_eager`` traces forward and backward as inductor does, without
building C++ kernels; the page docs/deepseek-v41.md runs the inductor example on 2 ranks.
Graph breaks are read from dynamo's counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

from fsdp_core import build_mesh
from fsdp_core.regional_compile import compile_blocks
from model_deepseek_v41 import (
    DeepseekV41Config,
    DeepseekV41ModelParallelizer,
    build_deepseek_v41,
    make_batch,
)

CONFIG = DeepseekV41Config.tiny()
BACKEND = "aot_eager"

#: (id, frozen tower, parallelizer options)
CASES: list[tuple[str, bool, dict[str, Any]]] = [
    ("trainable", False, {"frozen_multimodal_sharding": "per_layer"}),
    (
        "trainable-balance-media",
        False,
        {"frozen_multimodal_sharding": "per_layer", "balance_media": True},
    ),
    ("frozen-per_layer", True, {"frozen_multimodal_sharding": "per_layer"}),
    ("frozen-root", True, {"frozen_multimodal_sharding": "root"}),
    ("frozen-replicate", True, {"frozen_multimodal_sharding": "replicate"}),
]


@pytest.fixture(autouse=True)
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _sharded(frozen: bool, options: dict[str, Any]) -> nn.Module:
    model = build_deepseek_v41(CONFIG)
    if frozen:
        model.vision.requires_grad_(False)
    DeepseekV41ModelParallelizer(**options).parallelize(model, mesh=build_mesh())
    return model


def _train(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Two steps without an optimizer (gradients accumulate): the second forward runs
    the cached graphs after a backward."""
    batch = make_batch(CONFIG, batch_size=2, seq_len=16, num_images_per_sample=1)
    losses = []
    for _ in range(2):
        loss = model(**batch)
        loss.backward()
        losses.append(loss.detach())
    grads = {
        name: p.grad.full_tensor()  # type: ignore[attr-defined]
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return torch.stack(losses), grads


def _breaks() -> dict[str, int]:
    return dict(counters["graph_break"])


@pytest.mark.parametrize(("frozen", "options"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_compile_blocks_has_no_graph_break_and_eager_numbers(
    frozen: bool, options: dict[str, Any]
) -> None:
    eager_losses, eager_grads = _train(_sharded(frozen, options))
    model = _sharded(frozen, options)
    compiled = compile_blocks(model, backend=BACKEND)  # fullgraph=True: a break raises
    losses, grads = _train(model)
    assert _breaks() == {}
    assert counters["stats"]["unique_graphs"] > 0
    torch.testing.assert_close(losses, eager_losses)
    assert grads
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], msg=name)
    layers = ("model.layers.0", "model.layers.1")
    if frozen:  # no unit inside a vision block: each block compiles whole
        assert compiled == ("vision.blocks.0", "vision.blocks.1", *layers)
    else:  # the fp32 norm units inside each block: compiled around them
        pieces = ("norm1", "attn", "norm2", "mlp")
        expected = tuple(f"vision.blocks.{i}.{piece}" for i in (0, 1) for piece in pieces)
        assert compiled == (*expected, *layers)


def _blocks(model: nn.Module) -> list[nn.Module]:
    stacks = [model.get_submodule("vision.blocks"), model.get_submodule("model.layers")]
    return [block for stack in stacks for block in stack.children()]


def _compile_whole_blocks(model: nn.Module) -> None:
    for block in _blocks(model):
        block.forward = torch.compile(block.forward, backend=BACKEND)


def test_whole_trainable_block_breaks_only_at_fsdp_hooks() -> None:
    """Compiling a trainable vision block whole traces the nested fp32 norm unit's hooks:
    FSDP2 marks its own ``torch._dynamo.disable`` (a break torch causes); none of the
    library's hooks may break there (the schedule check's backward probe did, 4 times)."""
    eager_losses, _ = _train(_sharded(False, CASES[0][2]))
    model = _sharded(False, CASES[0][2])
    _compile_whole_blocks(model)
    losses, _ = _train(model)
    breaks = _breaks()
    assert breaks, "a nested FSDP unit's hooks no longer break the graph: update the docs"
    for reason in breaks:
        assert "function `disable`" in reason, reason
    torch.testing.assert_close(losses, eager_losses)


def test_whole_frozen_block_compiles_without_break() -> None:
    model = _sharded(True, {"frozen_multimodal_sharding": "per_layer"})
    for block in _blocks(model):
        block.forward = torch.compile(block.forward, backend=BACKEND, fullgraph=True)
    _train(model)
    assert _breaks() == {}


def test_compile_blocks_twice_compiles_nothing_more() -> None:
    model = _sharded(True, {"frozen_multimodal_sharding": "per_layer"})
    assert compile_blocks(model, backend=BACKEND)
    assert compile_blocks(model, backend=BACKEND) == ()


def test_compile_blocks_refuses_what_it_cannot_compile() -> None:
    with pytest.raises(TypeError, match=r"nn\.Module, got int"):
        compile_blocks(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Linear has no layer stack"):
        compile_blocks(nn.Linear(2, 2))


def _text_model() -> nn.Module:
    """The reference model's text decoder: a model with ``layers`` at its top, the layout
    torchtitan's activation checkpointing expects."""
    text: nn.Module = build_deepseek_v41(CONFIG).model
    return text


def _text_losses(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = make_batch(CONFIG, batch_size=2, seq_len=16, num_images_per_sample=0)["input_ids"]
    losses = []
    for _ in range(2):
        loss = model(ids).float().pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
    grads = {
        name.replace("_checkpoint_wrapped_module.", ""): p.grad.full_tensor()  # type: ignore[attr-defined]
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return torch.stack(losses), grads


def test_torchtitan_activation_checkpointing_then_compile_matches_eager() -> None:
    """torchtitan's own ``FullAC`` and ``compile`` through the adapter, in torchtitan's
    order (checkpointing first): the checkpointed layers compile inside their wrappers
    (the recomputation reruns the compiled code) without a break, with eager's numbers."""
    pytest.importorskip("torchtitan")
    from torchtitan.config.configs import CompileConfig  # type: ignore[import-untyped]
    from torchtitan.distributed.activation_checkpoint import FullAC  # type: ignore[import-untyped]

    from fsdp_core import ModelParallelizer
    from fsdp_core.integrations.torchtitan import parallelize_fn

    dims = _OneRankDims(build_mesh())
    eager_losses, eager_grads = _text_losses(
        parallelize_fn(ModelParallelizer())(_text_model(), parallel_dims=dims)
    )
    model = parallelize_fn(ModelParallelizer())(
        _text_model(),
        parallel_dims=dims,
        compile_config=CompileConfig(enable=True, components=["model"], backend=BACKEND),
        ac_config=FullAC.Config(),
    )
    layers = list(model.get_submodule("layers").children())
    assert all(type(layer).__name__ == "FSDPCheckpointWrapper" for layer in layers)
    losses, grads = _text_losses(model)
    assert _breaks() == {}
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(losses, eager_losses)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], msg=name)


class _OneRankDims:
    """What the adapter reads of torchtitan's ``ParallelDims`` on one rank."""

    tp_enabled = cp_enabled = pp_enabled = ep_enabled = dp_replicate_enabled = False

    def __init__(self, mesh: Any) -> None:
        self._mesh = mesh

    def get_optional_mesh(self, dims: str) -> Any:
        return self._mesh if dims == "dp_shard" else None

    def get_mesh(self, dims: str) -> Any:
        return self._mesh


def _checkpointed(*, frozen: bool) -> nn.Module:
    """torch's ``checkpoint_wrapper`` around every vision block and decoder layer, before
    sharding (the units are then the wrappers)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build_deepseek_v41(CONFIG)
    if frozen:
        model.vision.requires_grad_(False)
    for stack in (model.vision.blocks, model.model.layers):
        for index, block in enumerate(list(stack)):
            stack[index] = checkpoint_wrapper(block)
    DeepseekV41ModelParallelizer(frozen_multimodal_sharding="per_layer").parallelize(
        model, mesh=build_mesh()
    )
    return model


def test_compile_blocks_looks_through_activation_checkpointing() -> None:
    """A trainable block's pieces are compiled inside the checkpoint wrapper; the
    recomputation in backward runs the compiled code again, with eager's numbers."""
    eager_losses, eager_grads = _train(_checkpointed(frozen=False))
    model = _checkpointed(frozen=False)
    compiled = compile_blocks(model, backend=BACKEND)
    assert "vision.blocks.0._checkpoint_wrapped_module.attn" in compiled
    assert "model.layers.1._checkpoint_wrapped_module" in compiled
    losses, grads = _train(model)
    assert _breaks() == {}
    torch.testing.assert_close(losses, eager_losses)
    assert grads.keys() == eager_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], msg=name)
