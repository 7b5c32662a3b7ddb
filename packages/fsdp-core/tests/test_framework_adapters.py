"""The Lightning and torchtitan adapters without a framework (issue 25): which mesh they
shard over, what they pass to the parallelizer from the framework's configs, and what
they refuse with a message naming the option to change. Under the fake process group
(meshes) or none; Lightning and torchtitan themselves are not needed (their objects are
read by attribute). The training runs are in tests/test_lightning_distributed.py and
tests/test_torchtitan_distributed.py (2 gloo ranks against one process).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_core.integrations import lightning, torchtitan
from fsdp_core.parallelizer import ModelParallelizer


class Recording(ModelParallelizer):
    """Records each ``parallelize`` call instead of sharding."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def parallelize(self, model: nn.Module, **kwargs: Any) -> nn.Module:  # type: ignore[override]
        self.calls.append(kwargs)
        return model


# ------------------------------------------------------------------------------ Lightning
def _lightning_mesh(dp: int, tp: int) -> DeviceMesh:
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))


def test_lightning_shards_over_the_data_parallel_ranks(fake_pg2: None) -> None:
    mesh = lightning.data_parallel_mesh(_lightning_mesh(2, 1))
    assert mesh.mesh_dim_names == ("data_parallel",)
    assert mesh.size() == 2


def test_lightning_tensor_parallel_is_seen_beside_the_data_parallel_ranks(
    fake_pg4: None,
) -> None:
    """tensor_parallel_size > 1: the data_parallel sub-mesh of Lightning's 2-D mesh, from
    which the library's ParallelDims reads the tensor_parallel dimension."""
    from fsdp_core.parallel_dims import ParallelDims

    mesh = lightning.data_parallel_mesh(_lightning_mesh(2, 2))
    assert mesh.mesh_dim_names == ("data_parallel",)
    dims = ParallelDims.from_mesh(mesh)
    assert dims.names == ("data_parallel", "tensor_parallel")
    assert dims.sizes == (2, 2)
    assert dims.dp_names == ("data_parallel",)
    assert dims.data_group_names == ("tensor_parallel",)
    assert not dims.is_data_parallel_only


def test_lightning_a_mesh_without_data_parallel_is_refused(fake_pg4: None) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    with pytest.raises(ValueError, match="none named 'data_parallel'"):
        lightning.data_parallel_mesh(mesh)


def test_lightning_a_plain_1d_mesh_is_taken_as_it_is(mesh2: DeviceMesh) -> None:
    assert lightning.data_parallel_mesh(mesh2) is mesh2


def test_lightning_parallelize_fn_passes_the_mesh_and_options(fake_pg2: None) -> None:
    recording = Recording()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fn = lightning.parallelize_fn(recording, mp_policy=policy, reshard_after_forward=False)
    model = nn.Linear(2, 2)
    assert fn(model, _lightning_mesh(2, 1)) is model
    (call,) = recording.calls
    assert call["mesh"].mesh_dim_names == ("data_parallel",)
    assert call["mp_policy"] is policy
    assert call["reshard_after_forward"] is False


def test_lightning_configure_model_twice_shards_once(mesh2: DeviceMesh) -> None:
    """Lightning calls configure_model() for every fit/validate/test of one module."""
    from fsdp_core.sharding import apply_fully_shard

    model = nn.Linear(2, 2)
    apply_fully_shard(model, mesh=mesh2, mp_policy=MixedPrecisionPolicy())
    recording = Recording()
    assert lightning.parallelize_fn(recording)(model, mesh2) is model
    assert recording.calls == []


def test_lightning_parallelize_fn_needs_a_parallelizer() -> None:
    with pytest.raises(TypeError, match="ModelParallelizer"):
        lightning.parallelize_fn(object())  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- torchtitan
@dataclass
class Dims:
    """The attributes of torchtitan's ParallelDims the adapter reads."""

    meshes: dict[str, DeviceMesh]
    tp_enabled: bool = False
    cp_enabled: bool = False
    pp_enabled: bool = False
    ep_enabled: bool = False
    dp_replicate_enabled: bool = False
    asked: list[Any] = field(default_factory=list)

    def get_optional_mesh(self, dims: str) -> DeviceMesh | None:
        if dims not in self.meshes:
            raise ValueError(f"Invalid mesh dim: {dims!r}")
        return self.meshes[dims]

    def get_mesh(self, dims: str | list[str]) -> DeviceMesh:
        self.asked.append(dims)
        return self.meshes[dims if isinstance(dims, str) else "+".join(dims)]


@dataclass
class Training:
    mixed_precision_param: str = "bfloat16"
    mixed_precision_reduce: str = "float32"
    enable_cpu_offload: bool = False


@dataclass
class Parallelism:
    fsdp_reshard_after_forward: str = "default"


@dataclass
class Compile:
    enable: bool = False
    components: list[str] = field(default_factory=lambda: ["model", "loss"])
    backend: Any = "aot_eager"


def _call(dims: Dims, **configs: Any) -> dict[str, Any]:
    recording = Recording()
    model = nn.Linear(2, 2)
    assert torchtitan.parallelize_fn(recording)(model, parallel_dims=dims, **configs) is model
    (call,) = recording.calls
    return call


def test_torchtitan_shards_over_dp_shard(mesh2: DeviceMesh) -> None:
    dims = Dims({"dp_shard": mesh2})
    call = _call(dims, training=Training(), parallelism=Parallelism(), compile_config=Compile())
    assert call["mesh"] is mesh2
    assert dims.asked == ["dp_shard"]
    # torchtitan's defaults: bf16 compute, fp32 reduction, FSDP's reshard default.
    assert call["mp_policy"].param_dtype == torch.bfloat16
    assert call["mp_policy"].reduce_dtype == torch.float32
    assert call["reshard_after_forward"] is None
    assert call["offload_policy"] is None


def test_torchtitan_hsdp_and_the_legacy_fsdp_name(hsdp_mesh: DeviceMesh) -> None:
    dims = Dims({"dp_replicate+dp_shard": hsdp_mesh, "dp_shard": hsdp_mesh["dp_shard"]})
    dims.dp_replicate_enabled = True
    assert _call(dims)["mesh"] is hsdp_mesh
    shard = hsdp_mesh["dp_shard"]
    assert _call(Dims({"fsdp": shard}))["mesh"] is shard


def test_torchtitan_configs_map_to_the_options(mesh2: DeviceMesh) -> None:
    call = _call(
        Dims({"dp_shard": mesh2}),
        training=Training(mixed_precision_param="float32", enable_cpu_offload=True),
        parallelism=Parallelism(fsdp_reshard_after_forward="never"),
    )
    assert call["mp_policy"].param_dtype == torch.float32
    assert call["reshard_after_forward"] is False
    assert call["offload_policy"] is not None


def test_torchtitan_options_given_to_the_factory_win(mesh2: DeviceMesh) -> None:
    recording = Recording()
    policy = MixedPrecisionPolicy()
    fn = torchtitan.parallelize_fn(recording, mp_policy=policy, reshard_after_forward=True)
    fn(nn.Linear(2, 2), parallel_dims=Dims({"dp_shard": mesh2}), training=Training())
    assert recording.calls[0]["mp_policy"] is policy
    assert recording.calls[0]["reshard_after_forward"] is True


def test_torchtitan_ep_beside_tp_is_refused_and_ep_needs_the_sharding_mesh(
    mesh2: DeviceMesh,
) -> None:
    dims = Dims({"dp_shard": mesh2}, tp_enabled=True, ep_enabled=True)
    with pytest.raises(ValueError, match=r"expert_parallel_degree\) beside tp.*set tp to 1"):
        _call(dims)
    dims.tp_enabled = False
    with pytest.raises(ValueError, match=r"expert_parallel_degree.*sharding_mesh"):
        torchtitan.data_parallel_mesh(dims)


def test_torchtitan_tensor_parallel_needs_the_callers_plan(mesh2: DeviceMesh) -> None:
    """torchtitan's parallelize_fn applies TP; the library has no plan of its own."""
    dims = Dims({"dp_shard": mesh2, "dp_shard+tp": mesh2, "tp": mesh2}, tp_enabled=True)
    dims.tp = 2  # type: ignore[attr-defined]
    recording = Recording()
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=2.*tensor_parallel=fn"):
        torchtitan.parallelize_fn(recording)(nn.Linear(2, 2), parallel_dims=dims)
    assert recording.calls == []
    with pytest.raises(TypeError, match="tensor_parallel must be a function"):
        torchtitan.parallelize_fn(recording, tensor_parallel=3)  # type: ignore[arg-type]


def test_torchtitan_tensor_parallel_first_then_the_whole_mesh_with_dp_dims(
    fake_pg4: None,
) -> None:
    """The caller's TP runs on the tp mesh before sharding; the library gets the
    (dp_shard, tp) mesh with dp_dims naming dp_shard, so it sees the TP dimension."""
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    dp, tp = world["dp_shard"], world["tp"]
    dims = Dims({"dp_shard": dp, "dp_shard+tp": world, "tp": tp}, tp_enabled=True)
    order: list[str] = []

    class Ordered(Recording):
        def parallelize(self, model: nn.Module, **kwargs: Any) -> nn.Module:
            order.append("shard")
            return super().parallelize(model, **kwargs)

    def tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
        assert tp_mesh is tp
        order.append("tp")

    recording = Ordered()
    fn = torchtitan.parallelize_fn(recording, tensor_parallel=tensor_parallel)
    fn(nn.Linear(2, 2), parallel_dims=dims)
    assert order == ["tp", "shard"]
    (call,) = recording.calls
    assert call["mesh"] is world
    assert call["dp_dims"] == ("dp_shard",)
    assert dims.asked == [["dp_shard", "tp"], "tp"]
    # Without TP: the data-parallel mesh alone, as before.
    assert torchtitan.sharding_mesh(Dims({"dp_shard": dp})) == (dp, ("dp_shard",))


def test_torchtitan_compiles_each_block_when_compile_names_the_model(mesh2: DeviceMesh) -> None:
    """torchtitan's ``compile.enable``: each block's ``forward`` compiled with
    ``compile.backend``, after the parallelizer ran; 'loss' alone compiles no block."""
    dims = Dims({"dp_shard": mesh2})
    for components, compiled in ((["model", "loss"], True), (["loss"], False)):
        model = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
        recording = Recording()
        config = Compile(enable=True, components=components)
        assert (
            torchtitan.parallelize_fn(recording)(model, parallel_dims=dims, compile_config=config)
            is model
        )
        assert len(recording.calls) == 1
        assert all(("forward" in vars(block)) is compiled for block in model[0])


def test_torchtitan_compile_and_unknown_reshard_are_refused(mesh2: DeviceMesh) -> None:
    dims = Dims({"dp_shard": mesh2})
    with pytest.raises(ValueError, match=r"Linear has no layer stack.*compile\.components"):
        _call(dims, compile_config=Compile(enable=True))
    layers = nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]))
    fn = torchtitan.parallelize_fn(Recording())
    with pytest.raises(TypeError, match=r"compile\.backend must be a string, got int"):
        fn(layers, parallel_dims=dims, compile_config=Compile(enable=True, backend=3))
    with pytest.raises(ValueError, match="always, never"):
        _call(dims, parallelism=Parallelism(fsdp_reshard_after_forward="sometimes"))


def test_torchtitan_activation_checkpointing_needs_model_layers(mesh2: DeviceMesh) -> None:
    applied: list[nn.Module] = []

    class Policy:
        def build(self, *, dump_folder: str) -> Policy:
            return self

        def apply(self, model: nn.Module) -> None:
            applied.append(model)

    with pytest.raises(ValueError, match=r"model\.layers"):
        _call(Dims({"dp_shard": mesh2}), ac_config=Policy())
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Linear(2, 2)])
    recording = Recording()
    fn = torchtitan.parallelize_fn(recording)
    fn(model, parallel_dims=Dims({"dp_shard": mesh2}), ac_config=Policy())
    assert applied == [model]
    assert len(recording.calls) == 1


@pytest.mark.parametrize(
    ("backend", "shard"), [("spmd_types", "dp_shard"), ("partial_dtensor", "fsdp")]
)
def test_torchtitan_hsdp_beside_tp_on_torchtitans_own_meshes(
    monkeypatch: pytest.MonkeyPatch, backend: str, shard: str
) -> None:
    """torchtitan's real ParallelDims (dp_replicate=2 x dp_shard=2 x tp=2, 8 fake ranks):
    the mesh given to the library is one of torchtitan's, in its dimension order, and the
    library's ParallelDims reads HSDP beside TP from it."""
    parallel_dims_module = pytest.importorskip("torchtitan.distributed.parallel_dims")
    from fsdp_core.fake_group import fake_process_group
    from fsdp_core.parallel_dims import ParallelDims

    monkeypatch.setattr(parallel_dims_module, "device_type", "cpu")
    with fake_process_group(8):
        dims = parallel_dims_module.ParallelDims(
            dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=8, spmd_backend=backend
        )
        mesh, dp_dims = torchtitan.sharding_mesh(dims)
        assert mesh.mesh_dim_names == ("dp_replicate", shard, "tp")
        assert dp_dims == ("dp_replicate", shard)
        library = ParallelDims.from_mesh(mesh, dp_dims=dp_dims)
        assert library.dp_shape.dp_replicate == 2
        assert library.dp_shape.dp_shard == 2
        assert library.data_group_names == ("tp",)
        assert library.lockstep_names == ("dp_replicate", shard, "tp")


@pytest.mark.parametrize(
    ("backend", "names", "dp_dims", "replicate"),
    [
        ("spmd_types", ("dp_replicate", "dp_shard", "cp", "tp"), ("dp_replicate", "dp_shard"), 2),
        ("partial_dtensor", ("batch", "cp", "tp"), ("batch",), 1),
    ],
)
def test_torchtitan_context_parallel_on_torchtitans_own_meshes(
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    names: tuple[str, ...],
    dp_dims: tuple[str, ...],
    replicate: int,
) -> None:
    """torchtitan's real ParallelDims with cp=2 (dp_replicate=2 x dp_shard=2 x cp=2 x tp=2,
    16 fake ranks): the library gets a mesh that shows cp, shards over the data-parallel
    shard dimension times cp (8 ranks per replica; the legacy backend, whose fsdp folds
    cp, over batch x cp), and shares media within cp x tp; data_parallel_mesh, which
    cannot show cp, refuses."""
    parallel_dims_module = pytest.importorskip("torchtitan.distributed.parallel_dims")
    from fsdp_core.fake_group import fake_process_group
    from fsdp_core.parallel_dims import ParallelDims

    monkeypatch.setattr(parallel_dims_module, "device_type", "cpu")
    with fake_process_group(16):
        dims = parallel_dims_module.ParallelDims(
            dp_replicate=2, dp_shard=2, cp=2, tp=2, pp=1, ep=1, world_size=16, spmd_backend=backend
        )
        mesh, given = torchtitan.sharding_mesh(dims)
        assert (mesh.mesh_dim_names, given) == (names, dp_dims)
        library = ParallelDims.from_mesh(mesh, dp_dims=given)
        assert library.dp_shape.dp_replicate == replicate
        assert library.dp_shape.world_size == 8
        assert library.data_group_names == ("cp", "tp")
        assert library.dp_mesh.size() == 8
        with pytest.raises(ValueError, match=r"context_parallel_degree.*sharding_mesh"):
            torchtitan.data_parallel_mesh(dims)


class _StagePart(nn.Module):
    """A model part as torchtitan's pipeline split leaves it: modules of other stages set
    to ``None``, the layers a ``ModuleDict`` keyed by their indices in the whole model."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = None
        self.layers = nn.ModuleDict({"2": nn.Linear(4, 4), "3": nn.Linear(4, 4)})
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        out: torch.Tensor = self.norm(x)
        return out


def test_torchtitan_pipeline_parts_are_sharded_over_their_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchtitan's real ParallelDims with pp=2 x dp_shard=2 (4 fake ranks): its
    pipelining_fn calls parallelize_fn once per model part; each part is sharded over the
    data-parallel ranks of its stage (2 of the 4), whose ranks its hooks meet over."""
    parallel_dims_module = pytest.importorskip("torchtitan.distributed.parallel_dims")
    from torch.distributed.tensor import DTensor

    from fsdp_core.fake_group import fake_process_group
    from fsdp_core.parallel_dims import ParallelDims

    monkeypatch.setattr(parallel_dims_module, "device_type", "cpu")
    with fake_process_group(4):
        dims = parallel_dims_module.ParallelDims(
            dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=2, ep=1, world_size=4
        )
        assert dims.pp_enabled
        mesh, dp_dims = torchtitan.sharding_mesh(dims)
        library = ParallelDims.from_mesh(mesh, dp_dims=dp_dims)
        assert (library.world_size, library.lockstep_names) == (2, dp_dims)
        part = torchtitan.parallelize_fn(ModelParallelizer())(_StagePart(), parallel_dims=dims)
        weight = part.get_parameter("layers.3.weight")
        assert isinstance(weight, DTensor)
        assert weight.device_mesh.size() == 2
