"""Unit tests for fsdp_core.weights_check: a model sharded on ``meta`` must have its weights
by its first forward (one process, the fake group; every rank decides alike)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import ModelParallelizer, load_full_state_dict, materialize_from_full
from fsdp_core.weights_check import (
    UninitializedWeightsError,
    mark_weights_loaded,
    unset_buffers,
)

DIM = 8


class Net(nn.Module):
    """Two layers, a head and a non-persistent buffer (as a rotary ``inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.head = nn.Linear(DIM, 2)
        self.register_buffer("scale", torch.ones(DIM), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.scale
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _full() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in Net().named_parameters()}


def _meta_sharded(mesh: DeviceMesh) -> Net:
    with torch.device("meta"):
        model = Net()
    ModelParallelizer().parallelize(model, mesh=mesh)
    return model


def test_to_empty_without_a_load_stops_the_first_forward(mesh2: DeviceMesh) -> None:
    model = _meta_sharded(mesh2)
    model.to_empty(device="cpu")
    with pytest.raises(UninitializedWeightsError) as caught:
        model(torch.randn(2, DIM))
    message = str(caught.value)
    assert message.startswith("Net was sharded on the meta device and none of its 6 parameters")
    assert "materialize_from_full(model, named_full_tensors" in message
    assert "fsdp_core.weights_check.mark_weights_loaded(model)" in message
    # Still stopped at the next forward; the declaration lets it through.
    with pytest.raises(UninitializedWeightsError):
        model(torch.randn(2, DIM))
    mark_weights_loaded(model)
    model(torch.randn(2, DIM))


def test_a_model_left_on_meta_is_named(mesh2: DeviceMesh) -> None:
    model = _meta_sharded(mesh2)
    with pytest.raises(UninitializedWeightsError, match=r"are still there \('layers\.0\.weight'"):
        model(torch.randn(2, DIM))


def test_materialized_weights_pass_and_unset_buffers_are_named(mesh2: DeviceMesh) -> None:
    model = _meta_sharded(mesh2)
    materialize_from_full(model, _full().items(), device="cpu")
    # Not a transformers model: nothing recomputes the buffer; the first forward names it.
    assert unset_buffers(model) == ["scale"]
    with pytest.raises(UninitializedWeightsError, match="non-persistent buffers 'scale'"):
        model(torch.randn(2, DIM))
    with torch.no_grad():
        model.get_buffer("scale").fill_(1.0)
    assert unset_buffers(model) == []
    model(torch.randn(2, DIM)).sum().backward()


def test_buffers_given_to_materialize_pass(mesh2: DeviceMesh) -> None:
    model = _meta_sharded(mesh2)
    materialize_from_full(model, _full().items(), device="cpu", buffers={"scale": torch.ones(DIM)})
    model(torch.randn(2, DIM))


def test_a_state_dict_load_after_to_empty_passes(mesh2: DeviceMesh) -> None:
    model = _meta_sharded(mesh2)
    model.to_empty(device="cpu")
    load_full_state_dict(model, _full())
    with torch.no_grad():
        model.get_buffer("scale").copy_(torch.ones(DIM))
    model(torch.randn(2, DIM))


def test_values_written_through_the_parameters_pass(mesh2: DeviceMesh) -> None:
    model = _meta_sharded(mesh2)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # an in-place write through the DTensor moves its version
        model.get_buffer("scale").fill_(1.0)
    model(torch.randn(2, DIM))


def test_a_model_built_with_values_is_not_checked(mesh2: DeviceMesh) -> None:
    model = Net()
    ModelParallelizer().parallelize(model, mesh=mesh2)
    model(torch.randn(2, DIM))
