"""fsdp_core.hf.pretrained on real transformers models, in one process (no ranks launched).

Checkpoints are written by transformers' own ``save_pretrained`` (the original key
layout of transformers 5, e.g. LLaVA's ``language_model.model.*``); the multi-process
round trip lives in ``test_pretrained_distributed.py``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import torch  # noqa: E402
from hf_vlms import HF_VLMS  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from fsdp_core import build_mesh, mixed_precision_policy  # noqa: E402
from fsdp_core.fake_group import fake_process_group  # noqa: E402
from fsdp_core.hf import load_pretrained  # noqa: E402
from fsdp_core.hf import save_pretrained as export  # noqa: E402
from multimodal_fsdp import MultimodalParallelizer  # noqa: E402

pytestmark = pytest.mark.transformers

NAMES = ["llava", "qwen2_vl"]


@functools.cache
def _source(name: str) -> nn.Module:
    return HF_VLMS[name].build()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    for name in NAMES:
        _source(name).save_pretrained(root / name, max_shard_size="40KB")  # type: ignore[operator]
    return {name: root / name for name in NAMES}


def _meta(name: str, *, dtype: torch.dtype = torch.float32) -> Any:
    model: Any = _source(name)
    with torch.device("meta"):
        return type(model)._from_config(model.config, dtype=dtype)


def _keys(directory: Path) -> set[str]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return set(index["weight_map"])


@pytest.mark.parametrize("name", NAMES)
def test_bf16_meta_model_from_fp32_checkpoint(name: str, checkpoints: dict[str, Path]) -> None:
    model = _meta(name, dtype=torch.bfloat16)
    report = load_pretrained(model, checkpoints[name])
    assert report.naming == "save_pretrained"
    assert report.cast  # every floating tensor of the fp32 file was cast to bf16
    cls = type(_source(name))
    reference = cls.from_pretrained(checkpoints[name], dtype=torch.bfloat16)
    for key, param in reference.named_parameters():
        assert torch.equal(model.get_parameter(key), param), key
    # Non-persistent buffers equal those of a model built on the CPU in the same dtype.
    cpu_built = cls._from_config(_source(name).config, dtype=torch.bfloat16)
    for key, buffer in cpu_built.named_buffers():
        assert torch.equal(model.get_buffer(key), buffer), key


def test_rank_one_shards_under_per_layer(checkpoints: dict[str, Path]) -> None:
    reference = dict(
        type(_source("llava")).from_pretrained(checkpoints["llava"]).named_parameters()
    )
    with fake_process_group(2, rank=1):
        model = _meta("llava")
        model.model.vision_tower.requires_grad_(False)
        MultimodalParallelizer(frozen_multimodal_sharding="per_layer").parallelize(
            model, mesh=build_mesh(), mp_policy=mixed_precision_policy("bf16")
        )
        load_pretrained(model, checkpoints["llava"])
        for key, param in model.named_parameters():
            assert isinstance(param, DTensor), key
            chunks = torch.chunk(reference[key].detach(), 2)
            want = chunks[1] if len(chunks) > 1 else reference[key][:0]
            assert torch.equal(param.to_local(), want), key


def test_mismatched_checkpoint_names_the_keys(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="does not match") as info:
        load_pretrained(_meta("llava"), checkpoints["qwen2_vl"])
    message = str(info.value)
    assert "names matched as: save_pretrained" in message
    assert "'model.language_model.embed_tokens.weight'" in message  # a missing module name
    assert "'language_model.model.embed_tokens.weight'" in message  # ... as a checkpoint key
    assert "'model.embed_tokens.weight'" in message  # an unexpected checkpoint key


@pytest.mark.parametrize("name", NAMES)
def test_export_writes_what_transformers_writes(
    name: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model = _source(name)
    files = export(model, tmp_path / "out", max_shard_size="40KB")
    assert set(files) >= {"model.safetensors.index.json", "config.json", "generation_config.json"}
    assert _keys(tmp_path / "out") == _keys(checkpoints[name])
    reloaded = type(model).from_pretrained(tmp_path / "out")
    for key, param in model.named_parameters():
        assert torch.equal(reloaded.get_parameter(key), param), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    assert config["dtype"] == "float32"
