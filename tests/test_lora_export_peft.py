"""The merged and adapter exports against real peft, in one process (no sharding).

The 2-rank tests (``test_hf_export_distributed.py``) cover sharded VLMs; here the
LoRA flavours the merge must reproduce exactly as peft's ``merge_and_unload`` does:
plain scaling, rsLoRA (``alpha / sqrt(r)``), ``fan_in_fan_out`` layers (GPT-2's
``Conv1D``), ``lora_bias``, and ``modules_to_save``; and the adapter export against
peft's own ``save_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fsdp_core.hf import save_pretrained  # noqa: E402


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(6, 10)
        self.conv1d = transformers.pytorch_utils.Conv1D(8, 10)  # weight stored in x out
        self.head = nn.Linear(8, 4)


def _lora(**options: Any) -> Any:
    config = peft.LoraConfig(r=2, lora_alpha=5, init_lora_weights=False, **options)
    torch.manual_seed(1)
    return peft.get_peft_model(Net(), config)


def _read(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(path)))
    return out


@pytest.mark.parametrize(
    "options",
    [
        {"target_modules": ["up"]},
        {"target_modules": ["up"], "use_rslora": True},
        {"target_modules": ["conv1d"], "fan_in_fan_out": True},
        {"target_modules": ["up"], "lora_bias": True},
        {"target_modules": ["up"], "modules_to_save": ["head"]},
    ],
    ids=["plain", "rslora", "fan_in_fan_out", "lora_bias", "modules_to_save"],
)
def test_merged_export_equals_merge_and_unload(tmp_path: Path, options: dict[str, Any]) -> None:
    model = _lora(**options)
    if "modules_to_save" in options:
        with torch.no_grad():  # the trained copy differs from the original
            model.base_model.model.head.modules_to_save["default"].weight.add_(1.0)
    save_pretrained(model, tmp_path / "merged", merge_adapters=True)
    reference = model.merge_and_unload().state_dict()  # after the export: it changes the model
    saved = _read(tmp_path / "merged")
    assert set(saved) == set(reference)
    for key, value in reference.items():
        assert torch.equal(saved[key], value), key


def test_adapter_export_is_what_peft_writes(tmp_path: Path) -> None:
    model = _lora(target_modules=["up", "conv1d"], fan_in_fan_out=True)
    save_pretrained(model, tmp_path / "lib")
    type(model).save_pretrained(model, str(tmp_path / "peft"))
    ours, theirs = _read(tmp_path / "lib"), _read(tmp_path / "peft")
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    config = "adapter_config.json"
    assert json.loads((tmp_path / "lib" / config).read_text()) == json.loads(
        (tmp_path / "peft" / config).read_text()
    )
    assert not (tmp_path / "lib" / "model.safetensors").exists()


def test_names_probe_prints_no_progress_bar(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Deriving checkpoint names runs transformers' save_pretrained: silently."""
    from hf_vlms import HF_VLMS

    model = HF_VLMS["llava"].build()
    capfd.readouterr()
    save_pretrained(model, tmp_path / "plain", max_shard_size="40KB")
    save_pretrained(_lora(target_modules=["up"]), tmp_path / "adapter")  # peft's save runs too
    captured = capfd.readouterr()
    assert "Writing model shards" not in captured.err + captured.out
    assert transformers.utils.logging.is_progress_bar_enabled()  # switched back on


def test_adapter_export_replaces_only_adapter_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written beside the old adapter and swapped in, like the model export."""
    from fsdp_core.hf import _save

    directory = tmp_path / "parent" / "adapter"
    model = _lora(target_modules=["up"])
    save_pretrained(model, directory)
    save_pretrained(model, directory, merge_adapters=True)  # a merged model beside it
    (directory / "README.md").write_text("my notes")
    old = {p.name: p.read_bytes() for p in directory.iterdir()}

    with torch.no_grad():
        model.base_model.model.up.lora_B["default"].weight.add_(1.0)

    def full_disk(path: Path, tensors: dict[str, torch.Tensor]) -> None:
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(_save, "write_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(model, directory)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == old
    assert sorted(p.name for p in directory.parent.iterdir()) == ["adapter"]  # no leftovers

    monkeypatch.undo()
    save_pretrained(model, directory)
    new = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert new["adapter_model.safetensors"] != old["adapter_model.safetensors"]
    for kept in ("README.md", "model.safetensors", "config.json"):
        assert new.get(kept) == old.get(kept), kept


def test_peft_method_saves_each_adapter_where_peft_does(tmp_path: Path) -> None:
    """The bound collective method: "default" in the directory, others in sub-directories."""
    from fsdp_core.hf._hf_methods import install_collective_save

    model = _lora(target_modules=["up"])
    torch.manual_seed(2)
    model.add_adapter(
        "second", peft.LoraConfig(r=3, target_modules=["up"], init_lora_weights=False)
    )
    assert install_collective_save(model) == ("",)
    model.save_pretrained(str(tmp_path / "ours"))
    type(model).save_pretrained(model, str(tmp_path / "peft"))
    for sub in ("", "second"):
        ours, theirs = _read(tmp_path / "ours" / sub), _read(tmp_path / "peft" / sub)
        assert set(ours) == set(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), sub
    called: list[object] = []  # accelerate's examples pass save_function=accelerator.save
    model.save_pretrained(str(tmp_path / "accelerate"), save_function=called.append)
    assert called == []
    with_function, ours = _read(tmp_path / "accelerate"), _read(tmp_path / "ours")
    assert set(with_function) == set(ours)
    assert all(torch.equal(with_function[k], ours[k]) for k in ours)
    with pytest.raises(ValueError, match="cannot honour safe_serialization=False"):
        model.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    with pytest.raises(ValueError, match=r"unknown ones \['third'\]"):
        model.save_pretrained(str(tmp_path / "x"), selected_adapters=["third"])


def test_loading_a_base_checkpoint_into_a_built_wrapped_model_keeps_its_adapters(
    tmp_path: Path,
) -> None:
    """Base checkpoints have no adapter keys: the base weights are read under their
    unwrapped names and adapters that already hold values keep them (the meta build,
    whose adapters get peft's first values, is ``test_lora_load_peft.py``)."""
    from hf_lora import with_lora
    from hf_vlms import HF_VLMS

    from fsdp_core.hf import load_pretrained

    base = HF_VLMS["llava"].build()
    base.save_pretrained(tmp_path / "base")
    expected = {k: v.clone() for k, v in base.state_dict().items()}
    model = with_lora(HF_VLMS["llava"].build(), "llava", "decoder")
    for target in (model, model.get_base_model()):
        adapters = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
        with torch.no_grad():
            for param in model.parameters():
                if not param.requires_grad:
                    param.zero_()
        load_pretrained(target, tmp_path / "base")
        state = model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in adapters.items())
        for name, value in model.get_base_model().state_dict().items():
            if "lora_" not in name:
                assert torch.equal(value, expected[name.replace(".base_layer", "")]), name


def test_merged_export_of_a_transformers_model_loads_with_from_pretrained(
    tmp_path: Path,
) -> None:
    """Names as transformers writes them (LLaVA's original layout), unsharded."""
    from hf_lora import with_lora
    from hf_vlms import HF_VLMS

    model = with_lora(HF_VLMS["llava"].build(), "llava", "tower")
    save_pretrained(model, tmp_path / "merged", merge_adapters=True)
    reference = dict(model.merge_and_unload().named_parameters())
    loaded = type(HF_VLMS["llava"].build()).from_pretrained(tmp_path / "merged")
    got = dict(loaded.named_parameters())
    assert set(got) == set(reference)
    for key, value in reference.items():
        assert torch.equal(got[key], value), key
