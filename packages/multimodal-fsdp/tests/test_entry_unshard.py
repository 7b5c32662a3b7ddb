"""The ``entry_unshard`` hook: towers and projectors called outside the model's forward.

Its plan data (targets, owning units, reason, cost) per frozen-tower policy is
checked without a process group; what it does is checked under the single-process
``fake`` backend (real layouts and collectives, meaningless numbers): no collective
added inside the forward, one all-gather per owning unit outside it, the units
resharded after, inputs cast to the compute dtype, and a clear error for a backward
through such a call. Equality with one process is checked on real ranks in
``tests/test_inference_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch
from _mm_toy_vlm import DIM, PATCH, VOCAB, LanguageModel, ToyVLM
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_core import CommCounter, ShardingPlan, build_mesh, mixed_precision_policy
from fsdp_core.entry_unshard import entry_owners
from fsdp_core.fake_group import fake_process_group
from fsdp_core.runtime import installed_hooks
from multimodal_fsdp import MultimodalParallelizer

pytestmark = pytest.mark.filterwarnings(
    "ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning"
)


class Vlm(ToyVLM):
    """The shared toy as these tests use it: a frozen two-block tower without a final
    norm (``embed=False``: without ``patch_embed``), a two-linear projector, a
    two-layer decoder without a final norm."""

    def __init__(self, *, embed: bool = True) -> None:
        super().__init__(
            tower_depth=2,
            text_depth=2,
            patch_embed=embed,
            tower_norm=False,
            text_norm=False,
            projector_gelu=False,
            frozen_tower=True,
        )


def pixels(width: int = PATCH) -> torch.Tensor:
    return torch.randn(2, 3, width)


def plan_for(policy: str, model: nn.Module, **options: object) -> ShardingPlan:
    return MultimodalParallelizer(frozen_multimodal_sharding=policy, **options).plan(model)  # type: ignore[arg-type]


# --- plan data ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "targets"),
    [
        ("root", ("vision_tower", "multi_modal_projector")),
        ("per_layer", ("vision_tower", "multi_modal_projector")),
        # The tower is replicated (plain tensors, nothing to gather); the trained projector
        # stays in the root unit.
        ("replicate", ("multi_modal_projector",)),
    ],
)
def test_plan_lists_the_entries_and_what_they_cost(policy: str, targets: tuple[str, ...]) -> None:
    plan = plan_for(policy, Vlm())
    hook = plan.hook("entry_unshard")
    assert hook is not None
    assert hook.targets == targets
    assert "<root>" in hook.reason
    assert hook.cost.startswith("no collective inside the model's forward")
    assert "entry_unshard" in plan.format()


def test_plan_with_uneven_media_lists_the_entries() -> None:
    hook = plan_for("root", Vlm(), uneven_media=True).hook("entry_unshard")
    assert hook is not None
    assert hook.targets == ("vision_tower", "multi_modal_projector")


def test_a_replicated_frozen_model_needs_no_entry_hook() -> None:
    model = Vlm()
    model.multi_modal_projector.requires_grad_(False)
    assert plan_for("replicate", model).hook("entry_unshard") is None


def test_disabled_hooks_leaves_it_out() -> None:
    plan = plan_for("root", Vlm(), disabled_hooks=("entry_unshard",))
    assert "entry_unshard" not in plan.hook_names()
    with pytest.raises(ValueError, match=r"valid names: .*entry_unshard"):
        MultimodalParallelizer(disabled_hooks=("entry_unshards",))


def test_owners_are_the_units_that_do_not_run_with_the_entry() -> None:
    model = Vlm()
    plan = plan_for("per_layer", model)
    labels = [unit.label for unit in plan.units]
    owners = entry_owners(model, plan, ["vision_tower", "multi_modal_projector"])
    # The tower's blocks are units of their own; its patch embedding is in the root unit.
    assert {p: [labels[i] for i in owned] for p, owned in owners.items()} == {
        "vision_tower": ["<root>"],
        "multi_modal_projector": ["<root>"],
    }
    # A tower whose blocks own every parameter has no owner outside, but stays an entry
    # (the hook still makes the model FSDP's root before a block runs on its own).
    bare = Vlm(embed=False)
    bare_plan = plan_for("per_layer", bare)
    assert entry_owners(bare, bare_plan, ["vision_tower"]) == {"vision_tower": ()}


# --- behaviour on 2 fake ranks -----------------------------------------------------------


def _shard(policy: str, *, bf16: bool = False, **options: object) -> nn.Module:
    model = Vlm()
    policy_mp = mixed_precision_policy("bf16", "fp32") if bf16 else None
    MultimodalParallelizer(frozen_multimodal_sharding=policy, **options).parallelize(  # type: ignore[arg-type]
        model, mesh=build_mesh(), mp_policy=policy_mp
    )
    return model


def _training_step_records(policy: str, **options: object) -> list[tuple[str, str, int]]:
    with fake_process_group(2):
        model = _shard(policy, **options)
        counter = CommCounter()
        with counter:
            for _ in range(2):
                with counter.phase("forward"):
                    logits = model(pixels(), torch.randint(0, VOCAB, (2, 5)))
                with counter.phase("backward"):
                    logits.float().pow(2).mean().backward()
        return [(r.kind, r.phase, r.nbytes) for r in counter.records]


@pytest.mark.parametrize("policy", ["root", "per_layer", "replicate"])
def test_no_collective_added_inside_the_forward(policy: str) -> None:
    with_hook = _training_step_records(policy)
    without = _training_step_records(policy, disabled_hooks=("entry_unshard",))
    assert with_hook == without


@pytest.mark.parametrize(("policy", "gathers"), [("root", 1), ("per_layer", 3), ("replicate", 0)])
def test_a_tower_called_by_hand_gathers_its_owners_once_and_reshards(
    policy: str, gathers: int
) -> None:
    with fake_process_group(2):
        model = _shard(policy)
        with CommCounter() as counter, torch.no_grad():
            model.vision_tower(pixels())  # type: ignore[operator]
        # root: the root unit; per_layer: the root unit (patch embedding) and each block.
        assert counter.counts().get("all_gather", 0) == gathers
        assert isinstance(model.lm_head.weight, DTensor), "the root unit was left gathered"
        hook = installed_hooks(model)["entry_unshard"]
        assert hook.calls == (1 if policy != "replicate" else 0)  # type: ignore[attr-defined]
        # The model's own forward still runs (a tower block did not become FSDP's root).
        model(pixels(), torch.randint(0, VOCAB, (2, 5))).float().sum().backward()


def test_without_the_hook_a_hand_call_meets_sharded_parameters() -> None:
    with fake_process_group(2):
        model = _shard("root", disabled_hooks=("entry_unshard",))
        with pytest.raises(RuntimeError, match=r"mixed torch\.Tensor and DTensor"), torch.no_grad():
            model.vision_tower(pixels())  # type: ignore[operator]


def test_inputs_are_cast_to_the_compute_dtype() -> None:
    with fake_process_group(2):
        model = _shard("root", bf16=True)
        with torch.no_grad():
            out = model.multi_modal_projector(torch.randn(2, 3, DIM))  # type: ignore[operator]
        assert out.dtype == torch.bfloat16


def test_backward_through_a_call_outside_the_forward_names_the_remedy() -> None:
    with fake_process_group(2):
        model = _shard("root")
        features = model.multi_modal_projector(torch.randn(2, 3, DIM))  # type: ignore[operator]
        assert features.requires_grad
        with pytest.raises(RuntimeError, match=r"torch\.no_grad\(\).*model's forward"):
            features.sum().backward()


@pytest.mark.parametrize("hooked", [True, False])
def test_a_block_called_first_does_not_become_fsdp_root(hooked: bool) -> None:
    """Under per_layer a tower whose blocks own all its parameters has nothing to gather,
    but FSDP2 makes the first unit to run its root: without the hook, the model's own
    forward fails after the tower ran by hand."""
    with fake_process_group(2):
        model = Vlm(embed=False)
        disabled = () if hooked else ("entry_unshard",)
        MultimodalParallelizer(
            frozen_multimodal_sharding="per_layer", disabled_hooks=disabled
        ).parallelize(model, mesh=build_mesh())
        with torch.no_grad():
            model.vision_tower(torch.randn(2, 3, DIM))  # type: ignore[operator]
        run = lambda: model(torch.randn(2, 3, DIM), torch.randint(0, VOCAB, (2, 5)))  # noqa: E731
        if hooked:
            run()
        else:
            with pytest.raises(RuntimeError, match="running forward through the root"):
                run()


class Generating(nn.Module):
    """A transformers-like model inside a wrapper (as a ``PeftModel`` holds one)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Vlm()

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values, input_ids)  # type: ignore[no-any-return]

    def generate(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self(pixel_values, input_ids).argmax(-1)  # type: ignore[no-any-return]


class Wrapper(nn.Module):
    """Its ``generate`` calls the inner model's, never its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Generating()

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(pixel_values, input_ids)  # type: ignore[no-any-return]


class FeatureVlm(Vlm):
    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixel_values))  # type: ignore[no-any-return]


class WithBase(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = FeatureVlm()

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values, input_ids)  # type: ignore[no-any-return]


def test_wrapped_generating_models_and_feature_models_are_entries() -> None:
    from fsdp_core import ModelParallelizer

    # fsdp_core alone: a wrapped model that generates (text-only LoRA models too).
    hook = ModelParallelizer().plan(Wrapper()).hook("entry_unshard")
    assert hook is not None
    assert hook.targets == ("inner",)
    # multimodal: also the model computing image features, then towers and projectors.
    hook = plan_for("root", WithBase()).hook("entry_unshard")
    assert hook is not None
    assert hook.targets == ("model", "model.vision_tower", "model.multi_modal_projector")


def test_a_wrapped_model_generates_outside_the_wrappers_forward() -> None:
    with fake_process_group(2):
        model = Wrapper()
        model.inner.model.vision_tower.requires_grad_(False)
        MultimodalParallelizer().parallelize(model, mesh=build_mesh())
        with CommCounter() as counter:
            model.inner.generate(pixels(), torch.randint(0, VOCAB, (2, 5)))  # type: ignore[operator]
        assert counter.counts().get("all_gather", 0) == 3  # the root unit, 2 decoder layers
        assert isinstance(model.inner.model.lm_head.weight, DTensor)


def test_generate_holds_the_owners_for_the_whole_call_and_comes_off() -> None:
    """A rank without images never calls the tower: the gather is made once per
    ``generate`` call, on every rank, not per tower call."""
    from fsdp_core.runtime import remove_runtime_hooks

    with fake_process_group(2):
        model = Wrapper()
        model.inner.model.vision_tower.requires_grad_(False)
        MultimodalParallelizer().parallelize(model, mesh=build_mesh())
        assert "generate" in vars(model.inner)  # wrapped on the instance
        hook = installed_hooks(model)["entry_unshard"]
        with torch.no_grad():
            model.inner.generate(pixels(), torch.randint(0, VOCAB, (2, 5)))  # type: ignore[operator]
        assert hook.calls == 0  # type: ignore[attr-defined]  # no entry had to gather
        assert isinstance(model.inner.model.lm_head.weight, DTensor)
        remove_runtime_hooks(model, ["entry_unshard"])
        assert "generate" not in vars(model.inner)


class TextModel(nn.Module):
    """transformers-shaped submodel (a ``config`` and ``get_input_embeddings``)."""

    config = object()

    def __init__(self) -> None:
        super().__init__()
        self.inner = LanguageModel(depth=2, norm=False)

    def get_input_embeddings(self) -> nn.Module:
        return self.inner.embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(self.inner.embed_tokens(input_ids))  # type: ignore[no-any-return]


class CausalLm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = TextModel()
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))  # type: ignore[no-any-return]


def test_a_transformers_submodel_called_by_hand_is_an_entry() -> None:
    from fsdp_core import ModelParallelizer

    hook = ModelParallelizer().plan(CausalLm()).hook("entry_unshard")
    assert hook is not None
    assert hook.targets == ("model",)
    with fake_process_group(2):
        model = ModelParallelizer().parallelize(CausalLm(), mesh=build_mesh())
        with CommCounter() as counter, torch.no_grad():
            model.model(torch.randint(0, VOCAB, (2, 5)))  # type: ignore[operator]
        assert counter.counts().get("all_gather", 0) == 3  # the root unit, 2 layers
