"""Pretrained checkpoints into sharded models and trained weights back out, on 2 gloo ranks.

The scenarios (``mp/scenarios_pretrained.py``) build each model on ``meta``, shard it
under each frozen-tower policy, load a ``save_pretrained`` directory split into
several files, train, and export. Here, in one process, transformers'
``from_pretrained`` of the source directory must equal what the ranks loaded, and
``from_pretrained`` of the export must equal what they trained, bit for bit.
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
from launches import MpResults  # noqa: E402
from scenarios_pretrained import (  # noqa: E402
    HF_MODELS,
    POLICIES,
    build_source,
    checkpoint_dir,
    export_dir,
)
from torch import nn  # noqa: E402
from vlm import build_vlm, is_vision_norm  # noqa: E402

from fsdp_core.hf import load_pretrained  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.transformers]

CASES = [(name, policy) for name in HF_MODELS for policy in POLICIES]


def _result(mp2: MpResults, name: str) -> dict[str, Any]:
    result = mp2(f"pretrained_{name}")
    if "skipped" in result:
        pytest.fail(f"the ranks lacked a dependency the test process has: {result['skipped']}")
    return result


@functools.cache
def _from_pretrained(name: str, directory: Path) -> nn.Module:
    cls = getattr(transformers, HF_MODELS[name][0])
    model: nn.Module = cls.from_pretrained(directory, dtype=torch.float32)
    return model


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False))


def _file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(str(path)))
    return tensors


def _dtype_sizes(tensors: dict[str, torch.Tensor]) -> dict[torch.dtype, int]:
    sizes: dict[torch.dtype, int] = {}
    for tensor in tensors.values():
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
    return sizes


@pytest.mark.parametrize(("name", "policy"), CASES)
def test_loaded_shards_equal_from_pretrained(name: str, policy: str, mp2: MpResults) -> None:
    result = _result(mp2, f"{name}_{policy}")
    source = checkpoint_dir(mp2.out, f"{name}_{policy}")  # type: ignore[attr-defined]
    assert len(result["source_files"]) > 1, "the checkpoint was meant to span several files"
    assert result["naming"] == "save_pretrained"
    reference = _params(_from_pretrained(name, source))
    loaded = result["loaded"]
    tower = HF_MODELS[name][1]
    for key, want in reference.items():
        got = loaded[key]
        # The replicate policy stores the frozen tower in the compute dtype (bf16).
        cast = policy == "replicate" and key.startswith(tower + ".")
        assert got.dtype == (torch.bfloat16 if cast else torch.float32), key
        assert torch.equal(got, want.detach().to(got.dtype)), key


@pytest.mark.parametrize(("name", "policy"), CASES)
def test_non_persistent_buffers_equal_a_cpu_built_model(
    name: str, policy: str, mp2: MpResults
) -> None:
    result = _result(mp2, f"{name}_{policy}")
    cpu_built = dict(build_source(name).named_buffers())
    assert set(result["recomputed_buffers"]) == {
        n for n in cpu_built if n.endswith(("inv_freq", "position_ids"))
    }
    for key, want in cpu_built.items():
        assert torch.equal(result["loaded"][key], want), key


@pytest.mark.parametrize(("name", "policy"), CASES)
def test_replicated_tower_loaded_whole_on_every_rank(
    name: str, policy: str, mp2: MpResults
) -> None:
    result = _result(mp2, f"{name}_{policy}")
    tower = HF_MODELS[name][1] + "."
    if policy == "replicate":
        assert result["replicated"], "no replicated parameters"
        assert all(n.startswith(tower) for n in result["replicated"])
        assert result["replicated_equal"] is True
    else:
        assert result["replicated"] == []


@pytest.mark.parametrize(("name", "policy"), CASES)
def test_export_reloads_bit_exact(name: str, policy: str, mp2: MpResults) -> None:
    result = _result(mp2, f"{name}_{policy}")
    label = f"{name}_{policy}"
    exported = export_dir(mp2.out, label)  # type: ignore[attr-defined]
    source = checkpoint_dir(mp2.out, label)  # type: ignore[attr-defined]
    reloaded = _from_pretrained(name, exported)
    trained, loaded = result["trained"], result["loaded"]
    for key, param in _params(reloaded).items():
        assert torch.equal(param.detach(), trained[key].to(param.dtype)), key
    tower = HF_MODELS[name][1] + "."
    changed = [k for k in trained if not torch.equal(trained[k], loaded[k])]
    assert changed, "training changed nothing"
    assert not [k for k in changed if k.startswith(tower)], "the frozen tower moved"
    # The same keys transformers itself writes, in the dtypes the model held.
    files = _file_tensors(exported)
    assert set(files) == set(_file_tensors(source))
    assert _dtype_sizes(files) == _dtype_sizes(
        {k: v for k, v in trained.items() if k in dict(reloaded.named_parameters())}
    )
    assert "model.safetensors.index.json" in result["files"]
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == [HF_MODELS[name][0]]


def test_tied_head_stays_tied(mp2: MpResults) -> None:
    for policy in POLICIES:
        result = _result(mp2, f"llava_{policy}")
        assert result["tied"] is True
        trained = result["trained"]
        embed = "model.language_model.embed_tokens.weight"
        assert torch.equal(trained["lm_head.weight"], trained[embed])
        exported = export_dir(mp2.out, f"llava_{policy}")  # type: ignore[attr-defined]
        assert "lm_head.weight" not in _file_tensors(exported)
        reloaded: Any = _from_pretrained("llava", exported)
        assert reloaded.lm_head.weight is reloaded.get_input_embeddings().weight


def test_deepseek_fp32_norms_from_a_bf16_file(mp2: MpResults) -> None:
    result = _result(mp2, "deepseek_fp32_norms")
    source = _file_tensors(checkpoint_dir(mp2.out, "deepseek"))  # type: ignore[attr-defined]
    assert {t.dtype for t in source.values()} == {torch.bfloat16}
    assert result["naming"] == "module"
    norms = sorted(k for k in source if is_vision_norm(k))
    assert norms
    assert sorted(result["cast"]) == norms
    for key, value in source.items():
        got = result["loaded"][key]
        assert got.dtype == (torch.float32 if is_vision_norm(key) else torch.bfloat16), key
        assert torch.equal(got, value.to(got.dtype)), key


def test_deepseek_export_keeps_fp32_norms(mp2: MpResults) -> None:
    result = _result(mp2, "deepseek_fp32_norms")
    exported = export_dir(mp2.out, "deepseek")  # type: ignore[attr-defined]
    files = _file_tensors(exported)
    trained = result["trained"]
    assert set(files) == set(trained)
    for key, value in files.items():
        assert value.dtype == trained[key].dtype, key
        assert torch.equal(value, trained[key]), key
    assert any(value.dtype == torch.float32 for value in files.values())
    # The same directory loads into a plain model in one process.
    plain = build_vlm(dtype=torch.bfloat16, frozen_tower=False)
    report = load_pretrained(plain, exported)
    assert report.cast == ()
    for key, value in plain.state_dict().items():
        assert torch.equal(value, trained[key]), key
