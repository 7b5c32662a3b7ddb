"""Per-block ``torch.compile`` of a sharded transformers VLM (a tiny LLaVA, issue 34 item 5).

The Llama decoder layers of LLaVA's language model compile with ``fullgraph=True`` and
the library's units and hooks around them. What decides the graph count is the key/value
cache: without it (``use_cache=False``, a training step) every layer runs the one graph;
with it each layer guards on its own cache slot, so a model with more layers than
``torch._dynamo.config.recompile_limit`` (8) fails under ``fullgraph=True`` (and runs the
layers past the limit eagerly without it) unless the limit is raised.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn
from torch._dynamo.utils import counters

from fsdp_core import build_mesh
from fsdp_core.regional_compile import compile_blocks
from multimodal_fsdp import MultimodalParallelizer

transformers = pytest.importorskip("transformers")
from hf_vlms import build_llava, hf_loss, llava_batch  # noqa: E402

BACKEND = "aot_eager"
LAYERS = 10  # more than dynamo's recompile_limit (8)


@pytest.fixture(autouse=True)
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    torch._dynamo.reset()
    counters.clear()
    try:
        yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def _llava() -> nn.Module:
    """tests/mp/hf_vlms.py's LLaVA with ``LAYERS`` Llama layers, tower frozen, sharded."""
    model = build_llava(text_layers=LAYERS)
    model.get_submodule("model.vision_tower").requires_grad_(False)
    MultimodalParallelizer().parallelize(model, mesh=build_mesh())
    return model


def _losses(model: nn.Module, *, use_cache: bool) -> torch.Tensor:
    batch = {**llava_batch(), "use_cache": use_cache}
    losses = []
    for _ in range(2):
        loss: torch.Tensor = hf_loss(model, batch)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def _compiled_llava() -> nn.Module:
    model = _llava()
    names = compile_blocks(model.get_submodule("model.language_model"), backend=BACKEND)
    assert names == tuple(f"layers.{i}" for i in range(LAYERS))
    return model


def test_llama_layers_share_one_graph_without_the_cache() -> None:
    eager = _losses(_llava(), use_cache=False)
    losses = _losses(_compiled_llava(), use_cache=False)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(losses, eager)


def test_with_the_cache_each_layer_compiles_its_own_graph() -> None:
    model = _compiled_llava()
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        _losses(model, use_cache=True)
    torch._dynamo.reset()
    counters.clear()
    eager = _losses(_llava(), use_cache=True)
    with torch._dynamo.config.patch(recompile_limit=LAYERS):
        losses = _losses(_compiled_llava(), use_cache=True)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == LAYERS
    torch.testing.assert_close(losses, eager)
