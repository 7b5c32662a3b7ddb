"""Unit tests for fsdp_core.accumulation (unshard warm-up and aligned accumulated
gradients) and fsdp_core.unused_params (equal reduce-scatters when ranks skip parameters).

Collectives are counted under the single-process ``fake`` backend (its numbers
are meaningless, its collectives exact); the gradients of an accumulated step
are checked numerically on a one-process gloo group.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_core import (
    CommCounter,
    ModelParallelizer,
    build_mesh,
    compat,
    destroy_distributed,
    init_distributed,
    internals,
    mixed_precision_policy,
)
from fsdp_core.accumulation import install_unshard_warmup
from fsdp_core.runtime import installed_hooks
from fsdp_core.unused_params import install_unused_params_hook

DIM = 8
#: bf16 compute, fp32 gradient reduction: the setting that needs aligned gradients.
MP = mixed_precision_policy("bf16", "fp32")


class Net(nn.Module):
    """Two layers (units), a projector and a head in the root, an optional vision unit.

    ``image`` goes through ``vision`` and ``proj``; a text-only call skips both.
    """

    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(DIM, DIM, bias=False))
        self.layers = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(2)])
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        if image is not None:
            x = x + self.proj(self.vision(image))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def shard(model: Net, mesh: DeviceMesh, *, vision_unit: bool = False) -> Net:
    """The layers (and optionally ``vision``) as units, then the root; nothing else."""
    if vision_unit:
        fully_shard(model.vision, mesh=mesh, mp_policy=MP)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=MP)
    fully_shard(model, mesh=mesh, mp_policy=MP)
    return model


def units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def make_accumulation_safe(model: nn.Module, mesh: DeviceMesh) -> None:
    """What the parallelizers install for accumulation: the warm-up and unused params."""
    install_unshard_warmup(model)
    install_unused_params_hook(model, mesh=mesh)


def micro_batch(
    model: nn.Module, counter: CommCounter, phase: str, *, sync: bool, image: bool
) -> None:
    """Forward and backward of one micro-batch, its collectives tagged ``phase``."""
    assert isinstance(model, FSDPModule)
    model.set_requires_gradient_sync(sync)
    with counter.phase(phase):
        x = torch.randn(2, DIM)
        model(x, torch.randn(2, DIM) if image else None).float().sum().backward()


def kinds(counter: CommCounter, phase: str) -> list[tuple[str, int]]:
    return [(r.kind, r.nbytes) for r in counter.records if r.phase == phase]


# bf16 all-gather bytes of the parts of Net (fp32 gradients are twice as large).
LAYER = 2 * (DIM * DIM + DIM)  # a layer, proj or head: weight and bias
VISION = 2 * DIM * DIM  # no bias
ROOT_WITH_VISION = VISION + 2 * LAYER  # vision, proj, head
ROOT = 2 * LAYER  # proj, head


# --- reduce-scatter of unused parameters ----------------------------------------------------------


def _flags(model: nn.Module) -> list[bool]:
    return [
        group.reduce_scatter_unused_params
        for unit in units(model)
        for group in internals.param_groups(unit)
    ]


def test_unused_params_hook_sets_every_unit_and_removes_cleanly(mesh2: DeviceMesh) -> None:
    model = shard(Net(), mesh2, vision_unit=True)
    assert _flags(model) == [False] * 4  # FSDP's default
    hook = install_unused_params_hook(model, mesh=mesh2)
    assert hook is not None
    assert _flags(model) == [True] * 4
    hook.remove()
    assert _flags(model) == [False] * 4


def test_unused_params_hook_without_torch_support(
    mesh2: DeviceMesh, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat, "REDUCE_SCATTER_UNUSED_PARAMS", False)
    model = shard(Net(), mesh2)
    with caplog.at_level(logging.WARNING, logger="fsdp_core.unused_params"):
        assert install_unused_params_hook(model, mesh=mesh2) is None
    assert _flags(model) == [False] * 3
    (record,) = caplog.records
    assert record.getMessage().startswith("this torch cannot reduce-scatter unused parameters")


def test_reduce_scatter_unused_params_sends_zeros_for_a_skipped_projector(
    mesh2: DeviceMesh,
) -> None:
    """A text-only step reduce-scatters the whole root unit, projector included."""
    counted = {}
    for enabled in (False, True):
        model = shard(Net(), mesh2)
        if enabled:
            install_unused_params_hook(model, mesh=mesh2)
        counter = CommCounter()
        with counter:
            micro_batch(model, counter, "text", sync=True, image=False)
        counted[enabled] = sorted(
            n for kind, n in kinds(counter, "text") if kind == "reduce_scatter"
        )
    # The root holds vision, proj and head.
    assert counted[True] == [2 * LAYER, 2 * LAYER, 2 * ROOT_WITH_VISION]
    # Without it the root reduce-scatters only the head, which got a gradient.
    assert counted[False] == [2 * LAYER, 2 * LAYER, 2 * LAYER]


class _FirstOnly(torch.autograd.Function):
    """``a``, with ``b`` in the graph but given no gradient (``None``), as the balanced
    media exchange does for a tower output that no loss reads."""

    @staticmethod
    def forward(ctx: object, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.view_as(a)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SkipNet(Net):
    """The second layer runs, but its output reaches the loss with no gradient."""

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        used, skipped = self.layers[0](x), self.layers[1](x)
        return self.head(_FirstOnly.apply(used, skipped))  # type: ignore[no-any-return]


def test_a_unit_reached_only_by_a_missing_gradient_keeps_none(mesh2: DeviceMesh) -> None:
    """Autograd runs the second layer's backward with no gradient and still calls its
    parameters' post-accumulate hooks (with ``grad`` None): that is no use, so their
    gradients stay ``None`` as without sharding, not the zeros of the reduce-scatter."""
    model = shard(_SkipNet(), mesh2)  # type: ignore[arg-type]
    hook = install_unused_params_hook(model, mesh=mesh2)
    assert hook is not None
    model(torch.randn(2, DIM)).float().sum().backward()
    assert model.layers[1].weight.grad is None
    assert model.layers[1].bias.grad is None
    assert model.layers[0].weight.grad is not None
    assert sorted(hook.last_unused) == [
        "layers.1.bias",
        "layers.1.weight",
        "proj.bias",
        "proj.weight",
        "vision.0.weight",
    ]


def _reduce_scatter_order(mesh: DeviceMesh, *, image: bool) -> list[int]:
    model = shard(Net(), mesh)
    install_unused_params_hook(model, mesh=mesh)
    counter = CommCounter()
    with counter:
        micro_batch(model, counter, "step", sync=True, image=image)
    return [n for kind, n in kinds(counter, "step") if kind == "reduce_scatter"]


def test_ranks_with_and_without_media_reduce_scatter_in_the_same_order(
    mesh2: DeviceMesh,
) -> None:
    """With an image the trainable projector makes the first layer's input require a
    gradient; on a text-only rank it does not. FSDP2 reduces a unit whose inputs need
    no gradient only at the end of backward, after the root: without the hook's input
    anchors the text-only rank sends [layer, root, layer] while the other sends [layer,
    layer, root], and the reduce-scatters of different units meet."""
    with_media = _reduce_scatter_order(mesh2, image=True)
    text_only = _reduce_scatter_order(mesh2, image=False)
    assert with_media == text_only == [2 * LAYER, 2 * LAYER, 2 * ROOT_WITH_VISION]


# --- install_unshard_warmup ----------------------------------------------------------------------


def test_install_unshard_warmup_adds_one_hook_and_removes_it(mesh2: DeviceMesh) -> None:
    model = shard(Net(), mesh2, vision_unit=True)
    hooks = len(model._forward_pre_hooks)
    warmup = install_unshard_warmup(model)
    assert len(model._forward_pre_hooks) == hooks + 1
    warmup.remove()
    assert len(model._forward_pre_hooks) == hooks


@pytest.mark.parametrize("vision_unit", [False, True])
def test_warmup_issues_no_collective_in_syncing_steps(mesh2: DeviceMesh, vision_unit: bool) -> None:
    """Syncing steps, the vision unit never run: the same collectives with and without."""
    recorded = []
    for safe in (False, True):
        torch.manual_seed(0)
        model = shard(Net(), mesh2, vision_unit=vision_unit)
        if safe:
            install_unshard_warmup(model)
        counter = CommCounter()
        with counter:
            for index in range(2):
                micro_batch(model, counter, f"step{index}", sync=True, image=False)
        recorded.append([(r.kind, r.phase, r.nbytes) for r in counter.records])
        if vision_unit:
            assert kinds(counter, "step0").count(("all_gather", VISION)) == 0
    plain, safe_run = recorded
    assert plain == safe_run


def test_warmup_gathers_a_never_unsharded_unit_once_in_a_non_syncing_step(
    mesh2: DeviceMesh,
) -> None:
    model = shard(Net(), mesh2, vision_unit=True)
    install_unshard_warmup(model)
    counter = CommCounter()
    with counter:
        micro_batch(model, counter, "sync", sync=True, image=False)
        micro_batch(model, counter, "accumulate1", sync=False, image=False)
        micro_batch(model, counter, "accumulate2", sync=False, image=False)
        micro_batch(model, counter, "last", sync=True, image=True)
    # A text-only step: the root, then each layer in forward and again in backward.
    text_step = [("all_gather", ROOT)] + [("all_gather", LAYER)] * 4
    # Then a reduce-scatter per unit that got gradients: the layers and the root (its
    # head only: reduce_scatter_unused_params is not set here).
    assert kinds(counter, "sync") == [*text_step, *[("reduce_scatter", 2 * LAYER)] * 3]
    # The first non-syncing step warms the vision unit up: one all-gather of it, first.
    assert kinds(counter, "accumulate1") == [("all_gather", VISION), *text_step]
    # Never again: it now has unsharded parameters.
    assert kinds(counter, "accumulate2") == text_step
    assert len([r for r in kinds(counter, "last") if r[0] == "reduce_scatter"]) == 4


def test_warmup_in_a_first_non_syncing_step_gathers_every_unit_once(mesh2: DeviceMesh) -> None:
    model = shard(Net(), mesh2, vision_unit=True)
    install_unshard_warmup(model)
    counter = CommCounter()
    with counter:
        micro_batch(model, counter, "accumulate", sync=False, image=False)
        micro_batch(model, counter, "last", sync=True, image=True)
    gathers = [n for kind, n in kinds(counter, "accumulate") if kind == "all_gather"]
    # Four warm-ups (root, vision, two layers), then the text-only step's five gathers.
    assert sorted(gathers[:4]) == sorted([ROOT, VISION, LAYER, LAYER])
    assert gathers[4:] == [ROOT, *[LAYER] * 4]
    assert "reduce_scatter" not in {kind for kind, _ in kinds(counter, "accumulate")}


# --- accumulated-gradient alignment --------------------------------------------------------------


@pytest.mark.parametrize(
    ("vision_unit", "error", "match"),
    [
        (False, AssertionError, "reduce-scatter expects uniform gradient dtype"),
        (True, AttributeError, "'FSDPParam' object has no attribute '_unsharded_param'"),
    ],
    ids=["projector-in-root", "vision-unit"],
)
def test_accumulation_fails_without_the_accumulation_hooks(
    mesh2: DeviceMesh, vision_unit: bool, error: type[Exception], match: str
) -> None:
    """A text-only non-syncing micro-batch, then an image one that syncs: FSDP stops."""
    model = shard(Net(), mesh2, vision_unit=vision_unit)
    counter = CommCounter()
    with pytest.raises(error, match=match):  # noqa: PT012
        micro_batch(model, counter, "accumulate", sync=False, image=False)
        micro_batch(model, counter, "last", sync=True, image=True)


@pytest.mark.parametrize("vision_unit", [False, True], ids=["projector-in-root", "vision-unit"])
def test_accumulation_completes_with_the_accumulation_hooks(
    mesh2: DeviceMesh, vision_unit: bool
) -> None:
    model = shard(Net(), mesh2, vision_unit=vision_unit)
    make_accumulation_safe(model, mesh2)
    counter = CommCounter()
    with counter:
        micro_batch(model, counter, "accumulate", sync=False, image=False)
        micro_batch(model, counter, "last", sync=True, image=True)
    reduce_scatters = [r for r in counter.records if r.kind == "reduce_scatter"]
    assert [r.phase for r in reduce_scatters] == ["last"] * (4 if vision_unit else 3)
    assert {r.dtype for r in reduce_scatters} == {torch.float32}
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor), name
        assert param.grad.dtype == torch.float32, name
    # A second accumulation round runs the same way.
    model.zero_grad(set_to_none=True)
    micro_batch(model, counter, "accumulate", sync=False, image=False)
    micro_batch(model, counter, "last", sync=True, image=True)
    assert all(p.grad is not None for p in model.parameters())


def test_model_parallelizer_makes_accumulation_safe(mesh2: DeviceMesh) -> None:
    model = Net()
    ModelParallelizer().parallelize(model, mesh=mesh2, mp_policy=MP)
    assert _flags(model) == [True] * 3
    assert set(installed_hooks(model)) == {
        "accumulation_warmup",
        "unused_params",
        "forward_agreement",
    }
    counter = CommCounter()
    with counter:
        micro_batch(model, counter, "accumulate", sync=False, image=False)
        micro_batch(model, counter, "last", sync=True, image=True)
    assert all(p.grad is not None for p in model.parameters())


def test_aligned_gradients_equal_the_accumulated_reference(
    clean_env: pytest.MonkeyPatch,
) -> None:
    """On one gloo rank: the projector's gradient is the image micro-batch's alone, the
    others the sum over both micro-batches (bf16 reference, fp32 accumulation)."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    text, image_text, image = (torch.randn(2, DIM) for _ in range(3))
    init_distributed(backend="gloo")
    try:
        mesh = build_mesh()
        shard(model, mesh)
        make_accumulation_safe(model, mesh)
        model.set_requires_gradient_sync(False)
        model(text).float().sum().backward()
        model.set_requires_gradient_sync(True)
        model(image_text, image).float().sum().backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    finally:
        destroy_distributed()
    loss = reference(text.bfloat16()).float().sum()
    loss = loss + reference(image_text.bfloat16(), image.bfloat16()).float().sum()
    loss.backward()
    for name, param in reference.named_parameters():
        assert param.grad is not None, name
        assert grads[name].dtype == torch.float32, name
        torch.testing.assert_close(grads[name], param.grad.float(), atol=2e-2, rtol=2e-2)
