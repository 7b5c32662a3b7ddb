"""Precision: discovery finds nothing in text-only models of every family transformers ships.

Every model type of the causal-LM, sequence-to-sequence LM and masked-LM auto mappings that
is not a vision/audio-language type (see ``test_discovery_every_type.py``) is built from its
default config on the meta device; neither the name rules nor the structural rules may
report anything. Types whose default config does not build are skipped as a group, and a
floor on the count (plus a list of families that must be among them) keeps the test from
passing on an empty set. About 10 s on two CPU cores.
"""

from __future__ import annotations

import warnings

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers.models.auto import modeling_auto  # noqa: E402

from multimodal_fsdp.discovery.walk import resolve_multimodal_modules  # noqa: E402

pytestmark = pytest.mark.transformers

TEXT_MAPPINGS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
)
MULTIMODAL_MAPPINGS = (
    "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_VISUAL_QUESTION_ANSWERING_MAPPING_NAMES",
)
# Multimodal types registered only under text mappings (pinned in test_discovery_every_type).
MULTIMODAL_IN_TEXT_MAPPINGS = frozenset(
    {"audioflamingo3", "musicflamingo", "modernvbert", "ultravbert"}
)
# Families that must be among the models checked: decoder-only dense and MoE, state-space,
# encoder-decoder and encoder-only.
REQUIRED_FAMILIES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3_moe",
    "gemma2",
    "gpt2",
    "gpt_neox",
    "phi3",
    "falcon",
    "opt",
    "mamba",
    "t5",
    "bart",
    "bert",
    "roberta",
)


def _text_only_types() -> dict[str, str]:
    multimodal = set(MULTIMODAL_IN_TEXT_MAPPINGS)
    for name in MULTIMODAL_MAPPINGS:
        multimodal.update(getattr(modeling_auto, name, {}))
    types: dict[str, str] = {}
    for name in TEXT_MAPPINGS:
        for model_type, cls_name in getattr(modeling_auto, name, {}).items():
            if model_type not in multimodal:
                types.setdefault(model_type, cls_name)
    return types


def _build(cls_name: str) -> nn.Module | None:
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                model: nn.Module = cls._from_config(cls.config_class())
    except Exception:  # a default config that does not build says nothing about discovery
        return None
    return model


def test_text_only_models_yield_nothing() -> None:
    checked: list[str] = []
    reported: dict[str, list[str]] = {}
    for model_type, cls_name in sorted(_text_only_types().items()):
        model = _build(cls_name)
        if model is None:
            continue
        checked.append(model_type)
        found = resolve_multimodal_modules(model)
        if found:
            reported[model_type] = [f"{item.path} ({item.rule})" for item in found]
        del model
    assert reported == {}
    assert len(checked) >= 150, checked
    assert set(REQUIRED_FAMILIES) <= set(checked), set(REQUIRED_FAMILIES) - set(checked)
