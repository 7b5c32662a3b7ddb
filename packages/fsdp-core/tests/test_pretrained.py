"""fsdp_core.hf.pretrained: Hugging Face checkpoint directories in and out (safetensors only).

Loading is checked under the fake process group on several ranks: it issues no
collectives, so each rank's shards must come out right from its own reads. Export
gathers with collectives, so here it runs on unsharded models in one process; the
sharded export is covered by the multi-process tests in ``tests/``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

safetensors_torch = pytest.importorskip("safetensors.torch")

from fsdp_core.collective_count import CommCounter  # noqa: E402
from fsdp_core.fake_group import fake_process_group  # noqa: E402
from fsdp_core.hf import _safetensors_dir  # noqa: E402
from fsdp_core.hf.pretrained import PretrainedLoad, load_pretrained, save_pretrained  # noqa: E402
from fsdp_core.mesh import build_mesh  # noqa: E402
from fsdp_core.parallelizer import ModelParallelizer  # noqa: E402
from fsdp_core.precision import mixed_precision_policy  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
VOCAB, DIM, WIDE = 7, 4, 5  # odd sizes: uneven shards, an empty one on 4 ranks


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.to(x.dtype)


class Rotary(nn.Module):
    """A non-persistent buffer computed at construction, like a rotary ``inv_freq``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10.0 ** torch.arange(DIM), persistent=False)


class Toy(nn.Module):
    """Tied head, uneven layers, an fp32 norm (island under bf16), buffers of both kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([nn.Linear(DIM, WIDE), nn.Linear(WIDE, DIM)])
        self.norm = Norm()
        self.rotary = Rotary()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.rotary.inv_freq.to(self.embed.weight.dtype)
        h = self.norm(self.layers[1](self.layers[0](h)))
        return self.head(h)


def _toy(*, dtype: torch.dtype = FP32, device: str = "cpu", seed: int = 0) -> Toy:
    torch.manual_seed(seed)
    with torch.device(device):
        model = Toy()
    model.to(dtype)
    model.norm.weight.data = model.norm.weight.data.float()  # fp32 island
    if device != "meta":
        with torch.no_grad():
            model.norm.weight.uniform_(0.5, 1.5)
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter name (aliases too) and every buffer."""
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers()),
    }


def _write(directory: Path, tensors: dict[str, torch.Tensor], *, files: int = 1) -> Path:
    """A checkpoint directory written with safetensors alone (``files`` > 1: with an index)."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    if files == 1:
        safetensors_torch.save_file(
            {k: tensors[k].contiguous() for k in keys}, str(directory / "model.safetensors")
        )
        return directory
    weight_map = {}
    for index in range(files):
        name = f"model-{index + 1:05d}-of-{files:05d}.safetensors"
        part = {k: tensors[k].contiguous() for k in keys[index::files]}
        safetensors_torch.save_file(part, str(directory / name))
        weight_map.update(dict.fromkeys(part, name))
    index_file = directory / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def _checkpoint(reference: Toy) -> dict[str, torch.Tensor]:
    """The reference's saved state: persistent tensors, the tied alias once."""
    state = reference.state_dict()
    del state["head.weight"]
    return {k: v.clone() for k, v in state.items()}


def _shard(model: nn.Module, *, replicate_layer0: bool = False, dp_replicate: int = 1) -> nn.Module:
    ignored = set(model.layers[0].parameters()) if replicate_layer0 else None  # type: ignore[index]
    ModelParallelizer().parallelize(
        model,
        mesh=build_mesh(dp_replicate=dp_replicate),
        mp_policy=mixed_precision_policy("bf16", "fp32"),
        ignored_params=ignored,
    )
    return model


def _expected_local(full: torch.Tensor, param: DTensor, rank: int, world: int) -> torch.Tensor:
    """The shard of ``full`` FSDP gives ``rank`` (dim-0 chunks over the shard dimension)."""
    shard_world = param.device_mesh.size(param.device_mesh.ndim - 1)
    shard_rank = rank % shard_world
    chunks = torch.chunk(full, shard_world, dim=0)
    return chunks[shard_rank] if shard_rank < len(chunks) else full[:0]


@pytest.fixture
def reference() -> Toy:
    return _toy(seed=3)


@pytest.fixture
def checkpoint(tmp_path: Path, reference: Toy) -> Path:
    return _write(tmp_path / "ckpt", _checkpoint(reference), files=3)


def _given_rotary(model: nn.Module) -> dict[str, torch.Tensor]:
    return {"rotary.inv_freq": Rotary().inv_freq}


# ------------------------------------------------------------------- loading, sharded


@pytest.mark.parametrize(("world", "rank"), [(2, 0), (2, 1), (3, 2), (4, 3)])
def test_each_rank_gets_its_shards(world: int, rank: int, checkpoint: Path, reference: Toy) -> None:
    with fake_process_group(world, rank=rank):
        model = _shard(_toy(device="meta"), replicate_layer0=True)
        report = load_pretrained(model, checkpoint, buffers=_given_rotary(model))
        expected = _state(reference)
        for name, tensor in _state(model).items():
            if isinstance(tensor, DTensor):
                want = _expected_local(expected[name], tensor, rank, world)
                assert torch.equal(tensor.to_local(), want), name
            else:  # replicated parameters and buffers: whole on every rank
                assert torch.equal(tensor, expected[name]), name
        assert not isinstance(model.layers[0].weight, DTensor)
        assert model.head.weight is model.embed.weight
        assert model.norm.weight.dtype == FP32
    assert report.naming == "module"
    assert set(report.loaded) == set(_state(reference)) - {"rotary.inv_freq"}
    assert report.missing == report.unexpected == report.cast == ()


def test_hsdp_mesh_rank_gets_its_shards(checkpoint: Path, reference: Toy) -> None:
    with fake_process_group(4, rank=3):
        model = _shard(_toy(device="meta"), dp_replicate=2)
        load_pretrained(model, checkpoint, buffers=_given_rotary(model))
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor)
            want = _expected_local(_state(reference)[name], param, 3, 4)
            assert torch.equal(param.to_local(), want), name


def test_loading_needs_no_collectives_and_reads_only_slices(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole_reads: list[str] = []
    original = _safetensors_dir.open_file

    class Spy:
        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def __getattr__(self, name: str) -> Any:
            return getattr(self.handle, name)

        def get_tensor(self, key: str) -> torch.Tensor:
            whole_reads.append(key)
            return self.handle.get_tensor(key)  # type: ignore[no-any-return]

    class SpyOpen:
        def __init__(self, path: Path) -> None:
            self.context = original(path)

        def __enter__(self) -> Spy:
            return Spy(self.context.__enter__())

        def __exit__(self, *exc: object) -> None:
            self.context.__exit__(*exc)  # type: ignore[arg-type]

    monkeypatch.setattr("fsdp_core.hf._load.open_file", SpyOpen)  # the load's own reads
    with fake_process_group(2, rank=1):
        model = _shard(_toy(device="meta"), replicate_layer0=True)
        with CommCounter() as counter:
            load_pretrained(model, checkpoint, buffers=_given_rotary(model))
    assert counter.records == []
    # Sharded parameters are read as slices; only unsharded tensors are read whole.
    assert sorted(whole_reads) == ["layers.0.bias", "layers.0.weight", "scale"]


# ------------------------------------------------------------------- dtypes


def test_model_dtype_wins_and_fp32_island_stays_fp32(tmp_path: Path, reference: Toy) -> None:
    bf16_file = {k: v.to(BF16) for k, v in _checkpoint(reference).items()}
    directory = _write(tmp_path / "bf16", bf16_file)
    model = _toy(dtype=BF16, device="meta")
    report = load_pretrained(model, directory, buffers=_given_rotary(model))
    assert model.norm.weight.dtype == FP32
    assert torch.equal(model.norm.weight, bf16_file["norm.weight"].float())
    assert model.layers[0].weight.dtype == BF16
    assert "norm.weight" in report.cast
    assert "layers.0.weight" not in report.cast
    # An fp32 file into the bf16 model: cast down, the island kept in full precision.
    fp32_dir = _write(tmp_path / "fp32", _checkpoint(reference))
    report = load_pretrained(model, fp32_dir)
    assert torch.equal(model.layers[0].weight, reference.layers[0].weight.to(BF16))
    assert torch.equal(model.norm.weight, reference.norm.weight)
    assert "layers.0.weight" in report.cast
    assert "norm.weight" not in report.cast


def test_integer_file_into_floating_tensor_fails(tmp_path: Path, reference: Toy) -> None:
    state = _checkpoint(reference)
    state["scale"] = torch.arange(3)
    with pytest.raises(TypeError, match=r"'scale'.*I64.*floating"):
        load_pretrained(_toy(), _write(tmp_path / "c", state))


# ------------------------------------------------------------------- mismatches


def test_missing_and_unexpected_keys_are_named(tmp_path: Path, reference: Toy) -> None:
    state = _checkpoint(reference)
    del state["layers.1.bias"]
    state["extra.weight"] = torch.zeros(2)
    directory = _write(tmp_path / "c", state)
    with pytest.raises(ValueError, match=r"missing \['layers\.1\.bias'\].*\['extra\.weight'\]"):
        load_pretrained(_toy(), directory)
    model = _toy(seed=9)
    kept = model.layers[1].bias.detach().clone()
    report = load_pretrained(model, directory, strict=False)
    assert report.missing == ("layers.1.bias",)
    assert report.unexpected == ("extra.weight",)
    assert torch.equal(model.layers[1].bias, kept)
    assert torch.equal(model.layers[0].weight, reference.layers[0].weight)


def test_keys_the_model_declines_are_ignored(tmp_path: Path, reference: Toy) -> None:
    state = _checkpoint(reference)
    state["layers.0.rotary.inv_freq"] = torch.ones(DIM)  # an old checkpoint saved it
    state["extra.weight"] = torch.zeros(2)
    directory = _write(tmp_path / "c", state)
    with pytest.raises(ValueError, match=r"1 unexpected checkpoint keys \['extra\.weight'\]"):
        load_pretrained(_toy(), directory)

    class Declining(Toy):
        _keys_to_ignore_on_load_unexpected: ClassVar[list[str]] = [r"^extra\."]

    torch.manual_seed(3)
    model = Declining()
    report = load_pretrained(model, directory)
    assert report.ignored == ("extra.weight", "layers.0.rotary.inv_freq")
    assert report.unexpected == ()
    assert torch.equal(model.rotary.inv_freq, reference.rotary.inv_freq)


def test_shape_mismatch_is_named(tmp_path: Path, reference: Toy) -> None:
    state = _checkpoint(reference)
    state["layers.0.weight"] = torch.zeros(WIDE + 1, DIM)
    with pytest.raises(ValueError, match=r"'layers\.0\.weight' has shape \(6, 4\).*\(5, 4\)"):
        load_pretrained(_toy(), _write(tmp_path / "c", state))


def test_key_mapping_renames(tmp_path: Path, reference: Toy) -> None:
    state = {f"backbone.{k}": v for k, v in _checkpoint(reference).items()}
    directory = _write(tmp_path / "c", state)
    model = _toy(seed=5)
    report = load_pretrained(model, directory, key_mapping=lambda name: f"backbone.{name}")
    assert report.naming == "key_mapping"
    assert torch.equal(model.embed.weight, reference.embed.weight)
    with pytest.raises(TypeError, match="key_mapping must be a function"):
        load_pretrained(model, directory, key_mapping={"a": "b"})  # type: ignore[arg-type]


def test_missing_directory_and_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(_toy(), tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor"):
        load_pretrained(_toy(), tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="names files that are not in"):
        load_pretrained(_toy(), broken)


# ------------------------------------------------------------------- buffers and ties


def test_meta_buffer_nobody_computes_is_an_error(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"\['rotary\.inv_freq'\].*buffers="):
        load_pretrained(_toy(device="meta"), checkpoint)
    with pytest.raises(ValueError, match="not buffers of the model"):
        load_pretrained(_toy(device="meta"), checkpoint, buffers={"nope": torch.zeros(1)})


def test_materialised_model_keeps_its_buffers_and_ties(checkpoint: Path, reference: Toy) -> None:
    model = _toy(seed=8)
    load_pretrained(model, checkpoint)
    assert torch.equal(model.rotary.inv_freq, reference.rotary.inv_freq)
    assert model.head.weight is model.embed.weight
    for name, tensor in _state(reference).items():
        assert torch.equal(_state(model)[name], tensor), name


def test_unsharded_meta_model_is_retied(checkpoint: Path, reference: Toy) -> None:
    model = _toy(device="meta")
    load_pretrained(model, checkpoint, buffers=_given_rotary(model))
    assert model.head.weight is model.embed.weight  # to_empty alone would untie them
    assert model.embed.weight.device.type == "cpu"
    assert torch.equal(model.head.weight, reference.embed.weight)


# ------------------------------------------------------------------- transformers-like models


class Config:
    """Duck-typed like a transformers config: ``save_pretrained`` writes config.json."""

    def __init__(self) -> None:
        self.dtype: Any = None
        self.architectures: Any = None
        self.base = 10.0

    def save_pretrained(self, directory: str) -> None:
        data = {"dtype": self.dtype, "architectures": self.architectures, "base": self.base}
        (Path(directory) / "config.json").write_text(json.dumps(data))


class HubToy(Toy):
    """A model that saves like transformers 5: renamed keys, tied alias dropped."""

    rename: Callable[[str], str] = staticmethod(lambda name: f"legacy.{name}")

    def __init__(self) -> None:
        super().__init__()
        self.config = Config()

    def save_pretrained(self, directory: str, *, state_dict: dict[str, torch.Tensor]) -> None:
        self.config.dtype, self.config.architectures = "set-by-save", ["HubToy"]
        out = {self.rename(k): v for k, v in state_dict.items() if k != "head.weight"}
        safetensors_torch.save_file(out, str(Path(directory) / "model.safetensors"))
        self.config.save_pretrained(directory)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, Rotary):
            module.inv_freq.copy_(1.0 / self.config.base ** torch.arange(DIM))


def _hub_toy(device: str = "cpu", seed: int = 0) -> HubToy:
    torch.manual_seed(seed)
    with torch.device(device):
        return HubToy()


def test_transformers_like_names_and_buffers(tmp_path: Path) -> None:
    reference = _hub_toy(seed=4)
    state = {f"legacy.{k}": v for k, v in _checkpoint(reference).items()}
    directory = _write(tmp_path / "c", state)
    with fake_process_group(2, rank=1):
        model = _shard(_hub_toy(device="meta"))
        report = load_pretrained(model, directory)
        assert report.naming == "save_pretrained"
        assert report.recomputed_buffers == ("rotary.inv_freq",)
        assert torch.equal(model.rotary.inv_freq, reference.rotary.inv_freq)
        weight = model.layers[0].weight
        assert isinstance(weight, DTensor)
        assert torch.equal(weight.to_local(), reference.layers[0].weight[3:])
    # Deriving the names ran save_pretrained, which must leave the config as it was.
    assert (model.config.dtype, model.config.architectures) == (None, None)


def test_transforming_save_is_refused(tmp_path: Path) -> None:
    class Fused(HubToy):
        def save_pretrained(self, directory: str, *, state_dict: dict[str, torch.Tensor]) -> None:
            fused = torch.stack([state_dict["layers.0.bias"], state_dict["layers.1.bias"]])
            rest = {k: v for k, v in state_dict.items() if "bias" not in k and k != "head.weight"}
            out = {"fused_bias": fused, **rest}
            safetensors_torch.save_file(out, str(Path(directory) / "model.safetensors"))

    directory = _write(tmp_path / "c", {"fused_bias": torch.zeros(2)})
    with pytest.raises(ValueError, match="only renaming is supported"):
        load_pretrained(Fused(), directory)

    class Failing(HubToy):
        def save_pretrained(self, directory: str, *, state_dict: dict[str, torch.Tensor]) -> None:
            raise RuntimeError("no saving today")

    with pytest.raises(ValueError, match=r"names of Failing .*no saving today.*key_mapping="):
        load_pretrained(Failing(), directory)

    class AdaptersOnly(HubToy):
        def save_pretrained(self, directory: str, *, state_dict: dict[str, torch.Tensor]) -> None:
            safetensors_torch.save_file({}, str(Path(directory) / "adapter_model.safetensors"))

    with pytest.raises(ValueError, match=r"AdaptersOnly.save_pretrained does not write") as err:
        load_pretrained(AdaptersOnly(), directory)
    assert "fsdp-core-names" not in str(err.value)  # no internal temporary directory


# ------------------------------------------------------------------- export


def _read(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(path)))
    return out


def test_save_single_file_round_trip(tmp_path: Path) -> None:
    model = _toy(dtype=BF16, seed=2)
    files = save_pretrained(model, tmp_path / "out")
    assert files == ("model.safetensors",)
    saved = _read(tmp_path / "out")
    assert "head.weight" not in saved  # the tied alias once
    assert saved["norm.weight"].dtype == FP32
    assert saved["layers.0.weight"].dtype == BF16
    for name, tensor in model.state_dict().items():
        if name != "head.weight":
            assert torch.equal(saved[name], tensor), name
    fresh = _toy(dtype=BF16, device="meta")
    load_pretrained(fresh, tmp_path / "out", buffers=_given_rotary(fresh))
    for name, tensor in _state(model).items():
        assert torch.equal(_state(fresh)[name], tensor), name


def test_save_in_several_files_with_index(tmp_path: Path) -> None:
    model = _toy(seed=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_text("stale")
    files = save_pretrained(model, out, max_shard_size=64)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == sorted(set(index["weight_map"].values())) == sorted(files[:-1])
    assert len(shards) > 2
    assert "model-00001-of-00009.safetensors" not in shards
    sizes = {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}
    assert index["metadata"]["total_size"] == sum(sizes.values()) - sizes["head.weight"]
    assert set(_read(out)) == set(model.state_dict()) - {"head.weight"}


def test_save_transformers_like_names_and_config(tmp_path: Path) -> None:
    model = _hub_toy(seed=6)
    files = save_pretrained(model, tmp_path / "out")
    assert files == ("model.safetensors", "config.json")
    assert set(_read(tmp_path / "out")) == {
        f"legacy.{k}" for k in model.state_dict() if k != "head.weight"
    }
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {"dtype": "float32", "architectures": ["HubToy"], "base": 10.0}
    assert (model.config.dtype, model.config.architectures) == (None, None)
    fresh = _hub_toy(device="meta")
    assert load_pretrained(fresh, tmp_path / "out").naming == "save_pretrained"
    assert torch.equal(fresh.layers[1].weight, model.layers[1].weight)


def test_save_refuses_meta_tensors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="meta device"):
        save_pretrained(_toy(device="meta"), tmp_path / "out")


@pytest.mark.parametrize(
    ("size", "expected"),
    [(100, 100), ("100", 100), ("5GB", 5 * 10**9), ("2 MiB", 2 * 2**20), ("1.5kb", 1500)],
)
def test_shard_sizes(size: int | str, expected: int) -> None:
    from fsdp_core.sizes import parse_size

    assert parse_size(size) == expected


@pytest.mark.parametrize(("size", "error"), [("5 parsecs", ValueError), (0, ValueError)])
def test_bad_shard_sizes(size: Any, error: type[Exception], tmp_path: Path) -> None:
    with pytest.raises(error, match="max_shard_size"):
        save_pretrained(_toy(), tmp_path, max_shard_size=size)


def test_bad_shard_size_type(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="max_shard_size must be an int or a str"):
        save_pretrained(_toy(), tmp_path, max_shard_size=1.5)  # type: ignore[arg-type]


def test_without_safetensors_the_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, checkpoint: Path
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"fsdp-core\[hf\]"):
        load_pretrained(_toy(), checkpoint)


def test_report_is_frozen(checkpoint: Path) -> None:
    report = load_pretrained(_toy(), checkpoint)
    assert isinstance(report, PretrainedLoad)
    with pytest.raises(AttributeError):
        report.naming = "x"  # type: ignore[misc]


@pytest.fixture(autouse=True)
def _default_dtype() -> Iterator[None]:
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)


def test_one_default_shard_size_for_both_ways_to_export() -> None:
    """``model.save_pretrained(d)`` (the method bound at apply) and
    ``save_pretrained(model, d)`` write files of the same default size: rank 0 holds one
    output file of full tensors at a time, so the default bounds its host memory and must
    not depend on which way the user called the export."""
    import inspect

    from fsdp_core.hf import _hf_methods, _save, pretrained

    def default(fn: object) -> object:
        return inspect.signature(fn).parameters["max_shard_size"].default  # type: ignore[arg-type]

    assert default(_hf_methods.save_hf_model) == default(pretrained.save_pretrained)
    assert default(pretrained.save_pretrained) == _save.DEFAULT_MAX_SHARD_SIZE
