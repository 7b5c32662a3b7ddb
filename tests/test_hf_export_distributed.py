"""LoRA and model exports out of sharded transformers/peft models, on 2 gloo ranks.

The scenarios (``mp/scenarios_hf_export.py``) shard tiny LLaVA and Qwen2-VL models
with LoRA on the decoder, and on the tower and the decoder, under every frozen-tower
policy, train one step and export them. Here, in one process:

- the adapter export (library and peft's own method on the sharded model) loads with
  ``PeftModel.from_pretrained`` and holds the trained adapters bit for bit;
- the merged export (``merge_adapters=True``, of the ``PeftModel`` and of
  ``get_base_model()``) loads with the base class's ``from_pretrained`` and equals
  ``merge_and_unload()`` of a one-process copy with the trained weights;
- a plain export of ``get_base_model()`` fails on every rank, names the option, and
  writes nothing;
- transformers' ``model.save_pretrained`` on a sharded model writes what the library does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

import torch  # noqa: E402
from hf_lora import with_lora  # noqa: E402
from hf_vlms import HF_VLMS  # noqa: E402
from launches import MpResults  # noqa: E402
from scenarios_hf_export import FAMILIES, POLICIES, WHERE, case_dir  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.transformers]

LORA_CASES = [(n, p, w) for n in FAMILIES for p in POLICIES for w in WHERE]
PLAIN_CASES = [(n, p) for n in FAMILIES for p in POLICIES]


def _case(mp2: MpResults, name: str, policy: str, where: str) -> dict[str, Any]:
    result = mp2(f"hf_export_{name}")
    if "skipped" in result:
        pytest.fail(f"the ranks lacked a dependency the test process has: {result['skipped']}")
    case: dict[str, Any] = result["cases"][f"{policy}/{where}"]
    return case


def _dir(mp2: MpResults, name: str, policy: str, where: str) -> Path:
    return case_dir(mp2.out, name, policy, where)  # type: ignore[attr-defined]


def _no_errors(case: dict[str, Any], *exports: str) -> None:
    for export in exports:
        errors = case["errors"][export]
        assert errors == [None] * len(errors), f"{export} failed: {errors}"


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def _class(name: str) -> Any:
    """The transformers class of a family (its ``from_pretrained`` loads the exports)."""
    return type(HF_VLMS[name].build())


def _one_process_copy(name: str, where: str, state: dict[str, torch.Tensor]) -> nn.Module:
    """A one-process peft model holding the state the ranks trained."""
    model = with_lora(HF_VLMS[name].build(), name, where)
    persistent = model.state_dict()  # the results also hold non-persistent buffers
    model.load_state_dict({k: v for k, v in state.items() if k in persistent})
    return model


@pytest.mark.parametrize(("name", "policy", "where"), LORA_CASES)
def test_adapter_export_loads_trained_adapters(
    name: str, policy: str, where: str, mp2: MpResults
) -> None:
    case = _case(mp2, name, policy, where)
    _no_errors(case, "adapter_lib", "adapter_own")
    root = _dir(mp2, name, policy, where)
    lib = _files(root / "adapter_lib")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(lib)
    assert not any(n.startswith("model") for n in lib), "base weights were written"
    assert _files(root / "adapter_own") == lib  # peft's method on the sharded model: same files

    saved = safetensors_torch.load_file(str(root / "adapter_lib" / "adapter_model.safetensors"))
    assert saved
    assert all(".lora_" in key and ".default." not in key for key in saved)

    loaded = peft.PeftModel.from_pretrained(HF_VLMS[name].build(), root / "adapter_lib")
    trained = {n: t for n, t in case["state"].items() if ".lora_" in n}
    got = {n: p for n, p in loaded.named_parameters() if ".lora_" in n}
    assert set(got) == set(trained)
    for key, value in trained.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize(("name", "policy", "where"), LORA_CASES)
def test_merged_export_equals_merge_and_unload(
    name: str, policy: str, where: str, mp2: MpResults
) -> None:
    case = _case(mp2, name, policy, where)
    _no_errors(case, "merged_lib", "merged_base")
    root = _dir(mp2, name, policy, where)
    assert _files(root / "merged_base") == _files(root / "merged_lib")
    assert len(list((root / "merged_lib").glob("model-*.safetensors"))) > 1

    reference = _one_process_copy(name, where, case["state"]).merge_and_unload()
    loaded = _class(name).from_pretrained(root / "merged_lib", dtype=torch.float32)
    want = dict(reference.named_parameters())
    got = dict(loaded.named_parameters())
    assert set(got) == set(want)
    merged = [n for n in want if n.endswith(("q_proj.weight", "v_proj.weight", "qkv.weight"))]
    assert merged
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.parametrize(("name", "policy", "where"), LORA_CASES)
def test_plain_export_of_wrapped_base_fails_on_every_rank(
    name: str, policy: str, where: str, mp2: MpResults
) -> None:
    case = _case(mp2, name, policy, where)
    root = _dir(mp2, name, policy, where)
    for export in ("wrapped_lib", "wrapped_own"):
        errors = case["errors"][export]
        assert all(e is not None and e.startswith("ValueError") for e in errors), errors
        assert len(set(errors)) == 1, errors  # the same error on every rank
        assert "merge_adapters=True" in errors[0]
        assert "/tmp/" not in errors[0]
        assert not (root / export).exists(), f"{export} wrote files"


@pytest.mark.parametrize(("name", "policy"), PLAIN_CASES)
def test_models_own_save_pretrained_writes_the_library_export(
    name: str, policy: str, mp2: MpResults
) -> None:
    case = _case(mp2, name, policy, "none")
    _no_errors(case, "plain_lib", "plain_own")
    root = _dir(mp2, name, policy, "none")
    lib = _files(root / "plain_lib")
    assert "model.safetensors.index.json" in lib
    assert _files(root / "plain_own") == lib
    loaded = _class(name).from_pretrained(root / "plain_own", dtype=torch.float32)
    for key, value in loaded.named_parameters():
        assert torch.equal(value, case["state"][key]), key
