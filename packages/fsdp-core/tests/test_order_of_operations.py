"""Misuse caught at the boundary: an optimizer built before sharding, and a module tree
changed (adapters added, parameters frozen or unfrozen) after planning or sharding.

Both are deterministic, so every rank raises the same error; the fake process group
is enough here (tests/test_misuse_distributed.py checks it on two gloo ranks).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_core import ModelParallelizer, build_mesh
from fsdp_core.fake_group import fake_process_group

DIM = 8


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.q_proj(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.lm_head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


class Lora(nn.Module):
    """A minimal adapter wrapper, as peft makes one: base layer plus two matrices."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(DIM, 2, bias=False)
        self.lora_B = nn.Linear(2, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def add_lora(model: Model) -> None:
    model.requires_grad_(False)
    for layer in model.layers:
        assert isinstance(layer, Layer)
        layer.q_proj = Lora(layer.q_proj)  # type: ignore[assignment]


@pytest.fixture
def fake2() -> Iterator[None]:
    with fake_process_group(2):
        yield


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(2, DIM)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


# --- item 8: an optimizer built before sharding ----------------------------------------------


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_an_optimizer_built_before_parallelize_fails_at_its_first_step(
    fake2: None, kind: str
) -> None:
    model = Model()
    params = list(model.parameters())
    optimizer = (
        torch.optim.AdamW(params, lr=0.1) if kind == "adamw" else torch.optim.SGD(params, lr=0.1)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    model(torch.randn(2, DIM)).sum().backward()
    optimizer.zero_grad()  # harmless: it only touches the old tensors
    with pytest.raises(RuntimeError, match="built before the model was sharded") as info:
        optimizer.step()
    message = str(info.value)
    assert "'lm_head.weight'" in message
    assert "build the optimizer after parallelize" in message
    assert "apply_plan" in message
    scheduler.step()  # the scheduler itself is not the problem
    from fsdp_core import StaleOptimizerError

    assert isinstance(info.value, StaleOptimizerError)
    with pytest.raises(StaleOptimizerError):  # and again: no step ever runs silently
        optimizer.step()


def test_an_optimizer_built_after_parallelize_trains(fake2: None) -> None:
    model = Model()
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = model.lm_head.weight.detach().clone()
    for _ in range(3):
        step(model, optimizer)
    assert not torch.equal(before, model.lm_head.weight.detach())


def test_the_check_runs_once_per_optimizer(fake2: None) -> None:
    from fsdp_core import stale_optimizer as order_checks

    model = Model()
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step(model, optimizer)
    scans = order_checks._STATE.scans
    for _ in range(3):
        step(model, optimizer)
    assert order_checks._STATE.scans == scans
    # A new param group (or more replaced parameters) checks it again.
    stale = Model()
    optimizer.add_param_group({"params": list(stale.parameters())})
    ModelParallelizer().parallelize(stale, mesh=build_mesh())
    with pytest.raises(RuntimeError, match="built before the model was sharded"):
        step(model, optimizer)
    assert order_checks._STATE.scans == scans + 1


def test_an_optimizer_of_an_unsharded_model_is_left_alone(fake2: None) -> None:
    plain = Model()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    ModelParallelizer().parallelize(Model(), mesh=build_mesh())  # another model
    step(plain, optimizer)


# --- item 9: the module tree changed after planning or sharding ------------------------------


def test_a_plan_records_the_module_tree_it_was_made_for() -> None:
    model = Model()
    plan = ModelParallelizer().plan(model)
    fingerprint = plan.fingerprint  # type: ignore[attr-defined]
    assert fingerprint is not None
    names = [p.name for p in fingerprint.parameters]
    assert names == [name for name, _ in model.named_parameters()]
    assert "layers.0.q_proj" in fingerprint.modules


def test_a_plan_applied_after_adapters_were_added_is_refused(fake2: None) -> None:
    model = Model()
    plan = ModelParallelizer().plan(model)
    add_lora(model)
    with pytest.raises(RuntimeError, match="changed since the plan was made") as info:
        ModelParallelizer().apply_plan(model, plan, mesh=build_mesh())
    message = str(info.value)
    assert "added: 'layers.0.q_proj.lora_A.weight'" in message
    assert "wrapped by adapters (weights moved under 'base_layer'): 'layers.0.q_proj'" in message
    assert "now frozen: 'layers.0.q_proj.base_layer.weight'" in message
    assert "before planning and sharding" in message
    assert not any(hasattr(m, "reshard") for m in model.modules())  # nothing sharded


def test_a_plan_applied_after_freezing_is_refused(fake2: None) -> None:
    model = Model()
    plan = ModelParallelizer().plan(model)
    model.layers[0].requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"now frozen: 'layers\.0\.q_proj\.weight'"):
        ModelParallelizer().apply_plan(model, plan, mesh=build_mesh())


def test_a_plan_applied_to_its_model_or_an_identical_one_works(fake2: None) -> None:
    plan = ModelParallelizer().plan(Model())
    ModelParallelizer().apply_plan(Model(), plan, mesh=build_mesh())


def test_adapters_added_after_sharding_fail_at_the_first_forward(fake2: None) -> None:
    model = Model()
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    add_lora(model)
    with pytest.raises(RuntimeError, match="changed since it was sharded") as info:
        model(torch.randn(2, DIM))
    message = str(info.value)
    assert "added: 'layers.0.q_proj.lora_A.weight'" in message
    assert "before planning and sharding" in message


def test_the_first_forward_check_removes_itself(fake2: None) -> None:
    model = Model()
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    hooks = len(model._forward_pre_hooks)
    model(torch.randn(2, DIM)).sum().backward()
    assert len(model._forward_pre_hooks) == hooks - 1
    # Activation checkpointing wrappers added after sharding are not a change.


class Wrapper(nn.Module):
    """Wraps a model as peft's PeftModel does: ``base_model.model.<names>``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_model.model(x)  # type: ignore[no-any-return]


def test_a_wrapped_model_is_named_as_wrapped(fake2: None) -> None:
    model = Model()
    plan = ModelParallelizer().plan(model)
    add_lora(model)
    with pytest.raises(RuntimeError, match="changed since the plan was made") as info:
        ModelParallelizer().apply_plan(Wrapper(model), plan, mesh=build_mesh())
    message = str(info.value)
    assert "every parameter name now starts with 'base_model.model.'" in message
    assert "wrapped by adapters (weights moved under 'base_layer'): " in message
    assert "added: 'base_model.model.layers.0.q_proj.lora_A.weight'" in message
    assert "removed" not in message


@pytest.mark.parametrize("entry", ["load_pretrained", "save_pretrained"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["model", "wrapper"])
def test_adapters_added_after_sharding_fail_in_load_and_save(
    fake2: None, tmp_path: Path, entry: str, wrapped: bool
) -> None:
    """The same check before the collective entry points read or write anything, also
    when the sharded model is inside a wrapper (a ``PeftModel``)."""
    pytest.importorskip("safetensors")
    from fsdp_core.hf import load_pretrained, save_pretrained

    source = tmp_path / "source"
    save_pretrained(Model(), source)  # an unsharded model: a plain export
    model = Model()
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    add_lora(model)
    target: nn.Module = Wrapper(model) if wrapped else model
    call = (
        (lambda: load_pretrained(target, source))
        if entry == "load_pretrained"
        else (lambda: save_pretrained(target, tmp_path / "out"))
    )
    with pytest.raises(RuntimeError, match=rf"changed since it was sharded \({entry}\)"):
        call()
    assert not (tmp_path / "out").exists()


def test_adapters_merged_away_after_sharding_are_not_a_change(fake2: None) -> None:
    """peft's merge_and_unload on a sharded model puts the sharded base layer back in
    the adapted layer's place: nothing FSDP does not manage is added."""
    model = Model()
    add_lora(model)
    for layer in model.layers:
        layer.q_proj.lora_A.requires_grad_(True)  # type: ignore[union-attr]
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    for layer in model.layers:
        layer.q_proj = layer.q_proj.base_layer  # type: ignore[union-attr]
    model(torch.randn(2, DIM))


@pytest.mark.parametrize("entry", ["save_checkpoint", "load_checkpoint"])
def test_a_stale_optimizer_is_named_by_the_checkpoint_functions(
    fake2: None, tmp_path: Path, entry: str
) -> None:
    from fsdp_core import load_checkpoint, save_checkpoint

    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    ModelParallelizer().parallelize(model, mesh=build_mesh())
    call = save_checkpoint if entry == "save_checkpoint" else load_checkpoint
    with pytest.raises(RuntimeError, match="built before the model was sharded"):
        call(tmp_path / "ckpt", model, optimizer)
