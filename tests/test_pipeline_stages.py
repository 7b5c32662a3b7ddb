"""``multimodal_fsdp.pipeline``: cutting a VLM into pipeline stages and checking the cut
(one process, ``meta`` models; the 4-rank training is ``test_pipeline_distributed.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model_deepseek_v41 import DeepseekV41Config, build_deepseek_v41
from model_deepseek_v41.fsdp import DeepseekV41ModelParallelizer
from multimodal_fsdp.pipeline import check_stages, split_stages, stage_layer_ranges

CONFIG = DeepseekV41Config.tiny(text_layers=3)


def _model(*, frozen: bool = True) -> nn.Module:
    model = build_deepseek_v41(CONFIG, device="meta")
    if frozen:
        model.vision.requires_grad_(False)
    return model


def _names(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_parameters()}


def _layer(name: str) -> str:
    return ".".join(name.split(".")[:3])


def test_stages_keep_the_model_names_and_split_its_parameters() -> None:
    model = _model()
    first, last = split_stages(model, layers="model.layers", num_stages=2)
    firsts, lasts = _names(first), _names(last)
    assert firsts | lasts == _names(model)
    assert not firsts & lasts
    assert {n.split(".")[0] for n in firsts} == {"vision", "aligner", "model"}
    assert {_layer(n) for n in firsts if n.startswith("model.layers.")} == {
        "model.layers.0",
        "model.layers.1",
    }
    assert {_layer(n) for n in lasts if ".layers." in n} == {"model.layers.2"}
    assert {n for n in lasts if ".layers." not in n} == {"model.norm.weight", "lm_head.weight"}
    assert first.lm_head is None  # type: ignore[comparison-overlap]
    assert last.vision is None  # type: ignore[comparison-overlap]
    assert _names(model) == _names(_model())  # the model itself is left whole


def test_boundaries_and_even_ranges() -> None:
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    first, _last = split_stages(_model(), layers="model.layers", num_stages=2, boundaries=(1,))
    assert {n for n in _names(first) if ".layers." in n} == {
        n for n in _names(_model()) if n.startswith("model.layers.0.")
    }


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_stages": 1}, "num_stages must be an int >= 2"),
        ({"num_stages": 4}, "3 decoder layers cannot fill 4 pipeline stages"),
        ({"num_stages": 2, "boundaries": (3,)}, "increasing layer indices"),
        ({"num_stages": 3, "boundaries": (2, 1)}, "increasing layer indices"),
        ({"num_stages": 2, "forwards": (lambda s: s,)}, "1 forwards for 2 stages"),
    ],
)
def test_bad_cuts_are_refused(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        split_stages(_model(), layers="model.layers", **kwargs)  # type: ignore[arg-type]


def test_layers_must_be_a_container() -> None:
    with pytest.raises(TypeError, match="decoder layer container"):
        split_stages(_model(), layers="model.norm", num_stages=2)


def test_a_parameter_tied_across_stages_is_refused() -> None:
    model = _model()
    model.lm_head.weight = model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="cannot live on two pipeline stages"):
        split_stages(model, layers="model.layers", num_stages=2)


def test_forwards_become_the_stages_forward() -> None:
    def first_forward(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def last_forward(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    first, last = split_stages(
        _model(), layers="model.layers", num_stages=2, forwards=(first_forward, last_forward)
    )
    assert last(first(torch.ones(1))).item() == 4.0


def test_check_stages_plans_each_stage() -> None:
    stages = split_stages(_model(), layers="model.layers", num_stages=2)
    plans = check_stages(stages, parallelizer=DeepseekV41ModelParallelizer())
    assert len(plans) == 2
    assert any(path.startswith("vision") for path in plans[0].replicated_param_names)
    # The last stage has no tower: planned as a plain language model, no error.
    assert not any(path.startswith("vision") for path in plans[1].replicated_param_names)
    assert "model.layers.2" in {p for u in plans[1].units for p in u.paths}


@pytest.mark.parametrize(
    "options",
    [{"frozen_multimodal_sharding": "per_layer"}, {"frozen_multimodal_sharding": "root"}],
)
def test_media_regions_are_refused_before_any_stage_runs(options: dict[str, str]) -> None:
    """``per_layer`` frozen towers, and a trainable tower's blocks, are units that only
    media run: under PP the schedule check would stop stage 0 alone."""
    frozen = options["frozen_multimodal_sharding"] == "per_layer"
    stages = split_stages(_model(frozen=frozen), layers="model.layers", num_stages=2)
    with pytest.raises(ValueError, match="media regions") as error:
        check_stages(stages, parallelizer=DeepseekV41ModelParallelizer(**options))
    assert "balance_media=True" in str(error.value)
    balanced = DeepseekV41ModelParallelizer(**options, balance_media=True)
    assert len(check_stages(stages, parallelizer=balanced)) == 2


class _LateTower(nn.Module):
    """A model whose vision tower is registered after its layers (so it lands on the
    last stage by registration order)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(8, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.vision_tower = nn.Linear(4, 4)


def test_a_tower_off_the_first_stage_is_refused_or_moved() -> None:
    parallelizer = DeepseekV41ModelParallelizer()
    stages = split_stages(_LateTower(), layers="layers", num_stages=2)
    with pytest.raises(ValueError, match="stage 1 holds the towers or projectors"):
        check_stages(stages, parallelizer=parallelizer)
    moved = split_stages(_LateTower(), layers="layers", num_stages=2, first_stage=("vision_tower",))
    assert "vision_tower.weight" in _names(moved[0])
    assert len(check_stages(moved, parallelizer=parallelizer)) == 2


def test_a_transformers_llava_splits_with_its_tower_on_stage_0() -> None:
    """A real transformers VLM: the CLIP tower, the projector and the embeddings go to
    stage 0, the final norm and the head to the last; the rotary table (no parameters)
    stays on both; both stages plan with the default parallelizer."""
    pytest.importorskip("transformers")
    from hf_vlms import build_llava

    from multimodal_fsdp import MultimodalParallelizer

    model = build_llava(text_layers=4)
    model.model.vision_tower.requires_grad_(False)
    layers = "model.language_model.layers"
    first, last = split_stages(model, layers=layers, num_stages=2)
    assert _names(first) | _names(last) == _names(model)
    assert not _names(first) & _names(last)
    assert {n.split(".")[1] for n in _names(first)} == {
        "vision_tower",
        "multi_modal_projector",
        "language_model",
    }
    assert {n for n in _names(last) if ".layers." not in n} == {
        "model.language_model.norm.weight",
        "lm_head.weight",
    }
    assert last.model.language_model.rotary_emb is not None
    assert len(check_stages([first, last], parallelizer=MultimodalParallelizer())) == 2
