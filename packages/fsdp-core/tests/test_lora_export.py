"""LoRA-wrapped models out: merged export, refusals, the collective ``save_pretrained``.

peft is not needed: the modules here are shaped like peft's (a tuner layer with
``base_layer``, ``lora_A``/``lora_B`` module dicts and a ``scaling`` dict; a
saved-module wrapper with ``original_module`` and ``modules_to_save``), which is
all the library looks at. Exports run unsharded in one process (they gather with
collectives); the sharded exports with real peft are tested in ``tests/``.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

safetensors_torch = pytest.importorskip("safetensors.torch")

from fsdp_core.fake_group import fake_process_group  # noqa: E402
from fsdp_core.hf import _lora  # noqa: E402
from fsdp_core.hf._hf_methods import install_collective_save  # noqa: E402
from fsdp_core.hf.pretrained import save_pretrained  # noqa: E402
from fsdp_core.mesh import build_mesh  # noqa: E402
from fsdp_core.parallelizer import ModelParallelizer  # noqa: E402

IN, OUT, RANK = 5, 3, 2


class LoraLayer(nn.Module):
    """Shaped like peft's LoRA ``Linear``: the library reads only these attributes."""

    def __init__(
        self,
        base: nn.Module,
        *,
        fan_in_fan_out: bool = False,
        lora_bias: bool = False,
        dora: bool = False,
        variant: bool = False,
        alpha: float = 4.0,
    ) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(IN, RANK, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(RANK, OUT, bias=lora_bias)})
        self.scaling = {"default": alpha / RANK}
        self.fan_in_fan_out = fan_in_fan_out
        self.use_dora = {"default": dora}
        self.lora_variant: dict[str, object] = {"default": object()} if variant else {}
        self.lora_bias = {"default": lora_bias}
        self.merged_adapters: list[str] = []
        self.active_adapters = ["default"]


class FanInFanOut(nn.Module):
    """A GPT-2 ``Conv1D``-like layer: weight stored as ``in x out``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(IN, OUT))
        self.bias = nn.Parameter(torch.randn(OUT))


class SavedCopy(nn.Module):
    """Shaped like peft's ``ModulesToSaveWrapper``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.original_module = module
        self.modules_to_save = nn.ModuleDict({"default": nn.Linear(OUT, OUT)})
        self.active_adapters = ["default"]


class Model(nn.Module):
    def __init__(self, proj: nn.Module, head: nn.Module | None = None) -> None:
        super().__init__()
        self.proj = proj
        self.head = head if head is not None else nn.Linear(OUT, OUT)
        self.register_buffer("scale", torch.arange(3.0))


def _model(**lora: Any) -> Model:
    torch.manual_seed(0)
    return Model(LoraLayer(nn.Linear(IN, OUT), **lora))


def _read(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(path)))
    return out


def _delta(layer: LoraLayer) -> torch.Tensor:
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return (b @ a) * layer.scaling["default"]


def test_merged_export_adds_scaled_product_under_base_names(tmp_path: Path) -> None:
    model = _model()
    layer = model.proj
    assert isinstance(layer, LoraLayer)
    save_pretrained(model, tmp_path / "m", merge_adapters=True)
    saved = _read(tmp_path / "m")
    assert set(saved) == {"proj.weight", "proj.bias", "head.weight", "head.bias", "scale"}
    base = layer.base_layer
    assert isinstance(base, nn.Linear)
    assert torch.equal(saved["proj.weight"], base.weight.detach() + _delta(layer).detach())
    assert torch.equal(saved["proj.bias"], base.bias.detach())
    # The model is not changed by the export.
    assert not layer.merged_adapters
    assert "proj.base_layer.weight" in dict(model.named_parameters())


def test_merged_export_matches_a_merged_plain_model(tmp_path: Path) -> None:
    model = _model(alpha=3.0)
    save_pretrained(model, tmp_path / "m", merge_adapters=True)
    layer = model.proj
    assert isinstance(layer, LoraLayer)
    assert isinstance(layer.base_layer, nn.Linear)
    plain = Model(nn.Linear(IN, OUT), head=model.head)
    with torch.no_grad():
        plain.proj.weight.copy_(layer.base_layer.weight + _delta(layer))  # type: ignore[operator]
        plain.proj.bias.copy_(layer.base_layer.bias)  # type: ignore[operator]
    x = torch.randn(4, IN)
    reloaded = Model(nn.Linear(IN, OUT))
    reloaded.load_state_dict(_read(tmp_path / "m"))
    torch.testing.assert_close(reloaded.proj(x), plain.proj(x))
    torch.testing.assert_close(reloaded.proj(x), layer.base_layer(x) + _lora_forward(layer, x))


def _lora_forward(layer: LoraLayer, x: torch.Tensor) -> torch.Tensor:
    hidden: torch.Tensor = layer.lora_A["default"](x)
    out: torch.Tensor = layer.lora_B["default"](hidden)
    return out * layer.scaling["default"]


def test_fan_in_fan_out_and_lora_bias(tmp_path: Path) -> None:
    torch.manual_seed(1)
    layer = LoraLayer(FanInFanOut(), fan_in_fan_out=True, lora_bias=True)
    save_pretrained(Model(layer), tmp_path / "m", merge_adapters=True)
    saved = _read(tmp_path / "m")
    base = layer.base_layer
    assert isinstance(base, FanInFanOut)
    assert torch.equal(saved["proj.weight"], (base.weight + _delta(layer).T).detach())
    up_bias = layer.lora_B["default"].bias
    assert up_bias is not None
    want_bias = base.bias + up_bias * layer.scaling["default"]
    assert torch.equal(saved["proj.bias"], want_bias.detach())


def test_half_precision_adapters_are_multiplied_in_fp32() -> None:
    torch.manual_seed(2)
    base = torch.randn(OUT, IN, dtype=torch.bfloat16)
    up = torch.randn(OUT, RANK, dtype=torch.bfloat16)
    down = torch.randn(RANK, IN, dtype=torch.bfloat16)
    term = _lora.AdapterAddition(up=up, down=down, scaling=0.5)
    got = _lora.merged(base, [(up, down, term)])
    want = base.clone()
    want += ((up.float() @ down.float()) * 0.5).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_already_merged_adapter_is_not_added_twice(tmp_path: Path) -> None:
    model = _model()
    layer = model.proj
    assert isinstance(layer, LoraLayer)
    assert isinstance(layer.base_layer, nn.Linear)
    layer.merged_adapters.append("default")  # as peft's merge_adapter() leaves it
    save_pretrained(model, tmp_path / "m", merge_adapters=True)
    assert torch.equal(_read(tmp_path / "m")["proj.weight"], layer.base_layer.weight.detach())


def test_saved_module_copy_replaces_the_original(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = Model(LoraLayer(nn.Linear(IN, OUT)), head=SavedCopy(nn.Linear(OUT, OUT)))
    save_pretrained(model, tmp_path / "m", merge_adapters=True)
    saved = _read(tmp_path / "m")
    head = model.head
    assert isinstance(head, SavedCopy)
    trained = head.modules_to_save["default"]
    assert isinstance(trained, nn.Linear)
    assert torch.equal(saved["head.weight"], trained.weight.detach())
    assert not any("original_module" in k or "modules_to_save" in k for k in saved)


def test_plain_export_of_wrapped_model_names_the_option_and_writes_nothing(
    tmp_path: Path,
) -> None:
    with pytest.raises(
        ValueError, match=r"adapter-wrapped modules \['proj'\].*merge_adapters=True"
    ):
        save_pretrained(_model(), tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"dora": True}, "uses DoRA"),
        ({"variant": True}, "uses a LoRA variant"),
    ],
)
def test_unimplemented_adapters_are_refused_before_writing(
    tmp_path: Path, lora: dict[str, bool], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        save_pretrained(_model(**lora), tmp_path / "m", merge_adapters=True)
    assert not (tmp_path / "m").exists()


def test_embedding_lora_is_refused(tmp_path: Path) -> None:
    model = _model()
    layer = model.proj
    assert isinstance(layer, LoraLayer)
    layer.lora_embedding_A = nn.ParameterDict({"default": nn.Parameter(torch.zeros(RANK, IN))})
    with pytest.raises(ValueError, match="LoRA on an embedding"):
        save_pretrained(model, tmp_path / "m", merge_adapters=True)


def test_merge_without_adapters_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no adapter-wrapped modules to merge"):
        save_pretrained(Model(nn.Linear(IN, OUT)), tmp_path / "m", merge_adapters=True)
    with pytest.raises(TypeError, match="merge_adapters must be a bool"):
        save_pretrained(Model(nn.Linear(IN, OUT)), tmp_path / "m", merge_adapters="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------- the model's own method


class Config:
    dtype: Any = None
    architectures: Any = None

    def save_pretrained(self, directory: str) -> None:
        (Path(directory) / "config.json").write_text(json.dumps({"kind": "toy"}))


class HubModel(Model):
    """Saves like a transformers model (same names), through a class-level method."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Linear(IN, OUT))
        self.config = Config()

    def save_pretrained(self, directory: str, *, state_dict: dict[str, torch.Tensor]) -> None:
        safetensors_torch.save_file(
            {k: v.contiguous() for k, v in state_dict.items()},
            str(Path(directory) / "model.safetensors"),
        )


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_bound_save_pretrained_is_the_library_export(tmp_path: Path) -> None:
    model = HubModel()
    assert install_collective_save(model) == ("",)
    model.save_pretrained(tmp_path / "own", max_shard_size="100B")
    save_pretrained(model, tmp_path / "lib", max_shard_size="100B")
    assert _files(tmp_path / "own") == _files(tmp_path / "lib")
    assert "model.safetensors.index.json" in _files(tmp_path / "lib")
    # The class's method is still there, and the library uses it to learn names.
    assert type(model).save_pretrained is HubModel.save_pretrained
    # The instance's method travels with the model.
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        copied.save_pretrained(tmp_path / "copy", max_shard_size="100B")
        assert _files(tmp_path / "copy") == _files(tmp_path / "lib")


def test_bound_save_pretrained_takes_accelerates_save_function_and_never_calls_it(
    tmp_path: Path,
) -> None:
    """accelerate's examples pass ``save_function=accelerator.save`` (transformers 5 and peft
    accept it and never call it); the export writes the same files with it."""
    model = HubModel()
    install_collective_save(model)
    called: list[object] = []
    model.save_pretrained(tmp_path / "with", is_main_process=True, save_function=called.append)
    model.save_pretrained(tmp_path / "without")
    assert _files(tmp_path / "with") == _files(tmp_path / "without")
    assert called == []


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"state_dict": {}}, ValueError, "cannot honour state_dict="),
        ({"push_to_hub": True}, ValueError, "push_to_hub=True"),
        ({"safe_serialization": False}, ValueError, "safe_serialization=False"),
        ({"variant": "fp16"}, ValueError, "variant='fp16'"),
        ({"is_main_process": "yes"}, TypeError, "is_main_process must be a bool"),
        ({"shard_everything": True}, TypeError, r"unexpected keyword arguments \['shard_ev"),
        ({"save_function": "torch.save"}, TypeError, "save_function must be callable"),
    ],
)
def test_bound_save_pretrained_refuses_what_it_cannot_honour(
    tmp_path: Path, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    model = HubModel()
    install_collective_save(model)
    with pytest.raises(error, match=message):
        model.save_pretrained(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_apply_plan_binds_save_pretrained_to_transformers_like_models() -> None:
    with fake_process_group(2, rank=0):
        model = HubModel()
        ModelParallelizer().parallelize(model, mesh=build_mesh())
        assert "save_pretrained" in vars(model)
        plain = Model(nn.Linear(IN, OUT))  # no save_pretrained of its own: left alone
        ModelParallelizer().parallelize(plain, mesh=build_mesh())
        assert "save_pretrained" not in vars(plain)
