"""Exact-set discovery on every vision- and audio-language model type of transformers 5.24.

The universe is every model type in transformers' auto mappings for multimodal LMs
(``MODEL_FOR_MULTIMODAL_LM``), image-text-to-text, speech sequence-to-sequence and visual
question answering, plus the four multimodal types registered only under text mappings
(AudioFlamingo3 and MusicFlamingo as sequence-to-sequence LMs, ModernVBert and UltraVBert as
masked LMs): 134 model types. Each is built from its *default* config on the meta device.

* 120 build, and each pins the exact set of maximal towers and projectors found, with role
  and modality (``EXPECTED`` in ``mp/hf_model_types.py``, labelled by hand from the model
  trees).
* 14 do not build from their default config (``UNBUILDABLE`` there, with the reason). Seven
  of them are covered with a repaired config in ``test_discovery_transformers.py``
  (Aya Vision, Chameleon, Emu3, Granite 4 Vision, HunYuan-VL, Moonshine-Streaming, and
  Qwen3-Omni-MoE's thinker); the other seven need packages that are not installed or fail
  deeper in their defaults.

The whole module builds 134 models and runs in about 20 s on two CPU cores. The
completeness checks (every type listed, every unbuildable type still failing) only run on
transformers 5.24; on other versions the pinned sets are still checked where they build.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf_model_types import (
    EXPECTED,
    MAPPINGS,
    PINNED_VERSION,
    UNBUILDABLE,
    build,
    build_or_skip,
    pinned,
    universe,
)
from transformers.models.auto import modeling_auto

from multimodal_fsdp.discovery.walk import (
    iter_multimodal_modules,
    resolve_multimodal_modules,
)

pytestmark = pytest.mark.transformers

STRUCTURAL_RULES = frozenset({"config", "main_input", "forward", "features", "bundle"})


def test_every_multimodal_type_is_pinned_or_listed_as_unbuildable() -> None:
    if not pinned():
        pytest.skip(f"the type list is pinned for transformers {PINNED_VERSION}x")
    assert not set(EXPECTED) & set(UNBUILDABLE)
    assert universe() == set(EXPECTED) | set(UNBUILDABLE)
    assert (len(EXPECTED), len(UNBUILDABLE)) == (120, 14)


@pytest.mark.parametrize("model_type", sorted(UNBUILDABLE))
def test_unbuildable_types_still_fail_from_their_default_config(model_type: str) -> None:
    """When one starts to build, its exact set must be pinned instead."""
    if not pinned():
        pytest.skip(f"the unbuildable list is pinned for transformers {PINNED_VERSION}x")
    mappings = [getattr(modeling_auto, name) for name in MAPPINGS]
    cls_name = next(m[model_type] for m in mappings if model_type in m)
    with pytest.raises(Exception):  # noqa: B017, PT011 -- any failure to build counts
        build(cls_name)


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_exact_set_of_towers_and_projectors(model_type: str) -> None:
    model = build_or_skip(model_type)
    found = resolve_multimodal_modules(model)
    got = {item.path: f"{item.role}/{item.modality}" for item in found}
    assert got == EXPECTED[model_type][1]
    assert [(item.path, item.module) for item in found] == list(iter_multimodal_modules(model))
    for item in found:
        assert model.get_submodule(item.path) is item.module
        # Never the inside of a numbered layer, never a module and its own ancestor.
        assert not any(part.isdecimal() for part in item.path.split("."))
        kind = item.rule.partition(":")[0]
        assert kind in STRUCTURAL_RULES or item.rule == "name:" + item.path.rpartition(".")[2]
    paths = [item.path for item in found]
    assert not [(a, b) for a in paths for b in paths if b.startswith(a + ".")]
