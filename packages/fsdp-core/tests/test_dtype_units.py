"""fsdp_core.dtype_units: dtype islands and dtype-safe FSDP units."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fsdp_core import compat, dtype_units
from fsdp_core.dtype_units import (
    DtypeIsland,
    MixedDtypeError,
    dominant_dtype,
    find_dtype_islands,
    fully_shard_dtype_safe,
    group_islands,
)
from fsdp_core.precision import default_mp_policy

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class Block(nn.Module):
    """A pre-norm MLP block: fp32 norms around bf16 linears once ``_bf16_with_fp32_norms``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(self.norm1(x))))
        return self.norm2(x + h)


class Model(nn.Module):
    def __init__(self, dim: int = 8, layers: int = 2) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.layers = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.final = nn.Sequential(nn.LayerNorm(dim), nn.LayerNorm(dim))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.final(h))


def _bf16_with_fp32_norms(model: nn.Module) -> nn.Module:
    model.to(BF16)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.float()
    return model


def _islands(*items: tuple[str, torch.dtype]) -> tuple[DtypeIsland, ...]:
    return tuple(DtypeIsland(path, dtype) for path, dtype in items)


# dominant_dtype ----------------------------------------------------------------------------------


def test_dominant_dtype_counts_elements() -> None:
    small = nn.Parameter(torch.zeros(3, dtype=FP32))
    large = nn.Parameter(torch.zeros(10, dtype=BF16))
    assert dominant_dtype([small, large]) is BF16
    assert dominant_dtype([small, small, small, small, large]) is FP32


def test_dominant_dtype_tie_goes_to_first_seen() -> None:
    a = nn.Parameter(torch.zeros(4, dtype=FP32))
    b = nn.Parameter(torch.zeros(4, dtype=BF16))
    assert dominant_dtype([a, b]) is FP32
    assert dominant_dtype([b, a]) is BF16


def test_dominant_dtype_empty() -> None:
    assert dominant_dtype([]) is None
    assert dominant_dtype(iter(())) is None


# find_dtype_islands ------------------------------------------------------------------------------


def test_uniform_model_has_no_islands() -> None:
    assert find_dtype_islands(Model()) == (FP32, ())
    assert find_dtype_islands(Model().to(BF16)) == (BF16, ())


def test_module_without_params() -> None:
    assert find_dtype_islands(nn.ReLU()) == (None, ())
    assert find_dtype_islands(nn.Sequential(nn.ReLU(), nn.Dropout())) == (None, ())


def test_fp32_norms_in_bf16_model_are_maximal_islands() -> None:
    model = _bf16_with_fp32_norms(Model())
    dominant, islands = find_dtype_islands(model)
    assert dominant is BF16
    assert islands == _islands(
        ("layers.0.norm1", FP32),
        ("layers.0.norm2", FP32),
        ("layers.1.norm1", FP32),
        ("layers.1.norm2", FP32),
        # the Sequential of two norms is one island, not two
        ("final", FP32),
    )


def test_prefix_is_applied_to_paths() -> None:
    block = _bf16_with_fp32_norms(Block())
    dominant, islands = find_dtype_islands(block, prefix="model.layers.3")
    assert dominant is BF16
    assert islands == _islands(("model.layers.3.norm1", FP32), ("model.layers.3.norm2", FP32))


def test_several_island_dtypes() -> None:
    model = Model().to(BF16)
    model.layers[0].norm1.float()
    model.final.half()
    _, islands = find_dtype_islands(model)
    assert islands == _islands(("layers.0.norm1", FP32), ("final", FP16))


def test_frozen_odd_dtype_params_only_count_when_asked() -> None:
    model = _bf16_with_fp32_norms(Model())
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.requires_grad_(False)
    assert find_dtype_islands(model) == (BF16, ())
    assert find_dtype_islands(model, trainable_only=True) == (BF16, ())
    dominant, islands = find_dtype_islands(model, trainable_only=False)
    assert dominant is BF16
    assert [island.path for island in islands] == [
        "layers.0.norm1",
        "layers.0.norm2",
        "layers.1.norm1",
        "layers.1.norm2",
        "final",
    ]


def test_fully_frozen_module() -> None:
    model = _bf16_with_fp32_norms(Model()).requires_grad_(False)
    assert find_dtype_islands(model) == (None, ())
    assert find_dtype_islands(model, trainable_only=False)[0] is BF16


def test_direct_mixed_params_raise_naming_each_offender() -> None:
    model = Model().to(BF16)
    model.layers[1].fc1.weight.data = model.layers[1].fc1.weight.data.float()
    model.head.bias.data = model.head.bias.data.half()
    with pytest.raises(MixedDtypeError) as info:
        find_dtype_islands(model)
    message = str(info.value)
    assert "cannot make dtype-safe FSDP units for 'Model'" in message
    assert "layers.1.fc1.weight (torch.float32)" in message
    assert "head.bias (torch.float16)" in message
    assert "next to torch.bfloat16 parameters" in message
    assert "freeze them" in message
    assert isinstance(info.value, ValueError)


def test_mixed_params_in_the_root_itself() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.big = nn.Parameter(torch.zeros(16, dtype=BF16))
            self.scale = nn.Parameter(torch.ones(1))

    with pytest.raises(MixedDtypeError, match=re.escape("parameters scale (torch.float32)")):
        find_dtype_islands(Root())
    with pytest.raises(MixedDtypeError, match=r"for 'model.root'"):
        find_dtype_islands(Root(), prefix="model.root")


def test_frozen_direct_mixed_params_are_fine() -> None:
    model = Model().to(BF16)
    model.head.bias.data = model.head.bias.data.float()
    model.head.bias.requires_grad_(False)
    assert find_dtype_islands(model) == (BF16, ())
    with pytest.raises(MixedDtypeError, match=re.escape("head.bias (torch.float32)")):
        find_dtype_islands(model, trainable_only=False)


def test_skip_predicate_removes_subtrees() -> None:
    model = _bf16_with_fp32_norms(Model())
    seen: list[str] = []

    def skip(path: str, module: nn.Module) -> bool:
        seen.append(path)
        return path.startswith("layers.")

    dominant, islands = find_dtype_islands(model, skip=skip)
    assert dominant is BF16
    assert islands == _islands(("final", FP32))
    assert "layers.0" in seen
    assert "layers.0.norm1" not in seen  # never looked inside a skipped subtree


def test_skip_predicate_changes_the_dominant_dtype() -> None:
    model = Model().to(BF16)
    model.final.float()
    model.head.float()
    # Skip all bf16 parts except proj (8x8+8 = 72 elements) -> fp32 (32 + 72) wins.
    dominant, islands = find_dtype_islands(model, skip=lambda path, _m: path == "layers")
    assert dominant is FP32
    assert islands == _islands(("proj", BF16))


def test_ignored_param_names_are_left_out() -> None:
    model = Model().to(BF16)
    model.head.bias.data = model.head.bias.data.float()
    assert find_dtype_islands(model, ignored_param_names={"head.bias"}) == (BF16, ())
    block = Block().to(BF16)
    block.norm1.float()
    # Names are qualified with the prefix.
    ignored = ["layers.0.norm1.weight", "layers.0.norm1.bias"]
    assert find_dtype_islands(block, prefix="layers.0", ignored_param_names=ignored) == (BF16, ())
    assert find_dtype_islands(block, prefix="layers.0")[1] == _islands(("layers.0.norm1", FP32))


def test_island_below_a_mixed_child() -> None:
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.LayerNorm(8)))
    ).to(BF16)
    model[1][1].float()
    assert find_dtype_islands(model) == (BF16, _islands(("1.1", FP32)))


# group_islands -----------------------------------------------------------------------------------

ISLANDS = _islands(("a.norm", FP32), ("b", FP16), ("c.norm", FP32))


def test_group_islands_grouped_by_dtype() -> None:
    assert group_islands(ISLANDS, grouped=True) == [
        (FP32, ("a.norm", "c.norm")),
        (FP16, ("b",)),
    ]


def test_group_islands_not_grouped() -> None:
    assert group_islands(ISLANDS, grouped=False) == [
        (FP32, ("a.norm",)),
        (FP16, ("b",)),
        (FP32, ("c.norm",)),
    ]


def test_group_islands_default_follows_compat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "GROUPED_PER_MODULE_CASTING", True)
    assert group_islands(ISLANDS) == group_islands(ISLANDS, grouped=True)
    monkeypatch.setattr(compat, "GROUPED_PER_MODULE_CASTING", False)
    assert group_islands(ISLANDS) == group_islands(ISLANDS, grouped=False)


def test_group_islands_grouped_refused_without_torch_support(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compat, "GROUPED_PER_MODULE_CASTING", False)
    assert dtype_units.compat.GROUPED_PER_MODULE_CASTING is False
    with pytest.raises(
        ValueError, match=r"cannot cast per module inside a grouped unit; pass grouped=False"
    ):
        group_islands(ISLANDS, grouped=True)


def test_group_islands_empty() -> None:
    assert group_islands([]) == []
    assert group_islands(iter(ISLANDS), grouped=True)[0][1] == ("a.norm", "c.norm")


# fully_shard_dtype_safe (fake process group) -----------------------------------------------------


def _norm_state_policy(module: nn.Module) -> MixedPrecisionPolicy:
    assert isinstance(module, FSDPModule)
    param_group = module._get_fsdp_state()._fsdp_param_group
    assert param_group is not None
    return param_group.mp_policy


def test_plain_fully_shard_fails_at_first_forward(mesh2: DeviceMesh) -> None:
    block = _bf16_with_fp32_norms(Block())
    fully_shard(block, mesh=mesh2, mp_policy=default_mp_policy())  # sharding itself succeeds
    with pytest.raises(AssertionError, match=r"FSDP expects uniform original parameter dtype"):
        block(torch.randn(2, 8))


def test_fully_shard_dtype_safe_runs_forward_and_backward(mesh2: DeviceMesh) -> None:
    block = _bf16_with_fp32_norms(Block())
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def pre_hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        assert isinstance(module, nn.LayerNorm)
        seen.append((module.weight.dtype, args[0].dtype))

    block.norm1.register_forward_pre_hook(pre_hook)
    result = fully_shard_dtype_safe(block, mesh=mesh2, mp_policy=default_mp_policy())
    assert result is block
    for module in (block, block.norm1, block.norm2):
        assert isinstance(module, FSDPModule)
    assert not isinstance(block.fc1, FSDPModule)
    assert block.norm1._get_fsdp_state() is not block._get_fsdp_state()

    out = block(torch.randn(2, 8))
    assert out.dtype is BF16
    out.float().sum().backward()
    # The norm computes in fp32 on fp32 inputs.
    assert seen == [(FP32, FP32)]
    for name, param in block.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.grad is not None, name
        assert param.grad.dtype == param.dtype, name
        expected = FP32 if "norm" in name else BF16
        assert param.dtype is expected, name


def test_fully_shard_dtype_safe_island_policies(mesh2: DeviceMesh) -> None:
    block = _bf16_with_fp32_norms(Block())
    fully_shard_dtype_safe(block, mesh=mesh2, mp_policy=default_mp_policy(), grouped=False)
    for norm in (block.norm1, block.norm2):
        policy = _norm_state_policy(norm)
        assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (
            FP32,
            FP32,
            BF16,
        )
        assert policy.cast_forward_inputs
    assert block.norm1._get_fsdp_state() is not block.norm2._get_fsdp_state()
    root = _norm_state_policy(block)
    assert root == default_mp_policy()
    block(torch.randn(2, 8)).float().sum().backward()


def test_fully_shard_dtype_safe_grouped_islands(mesh2: DeviceMesh) -> None:
    block = _bf16_with_fp32_norms(Block())
    fully_shard_dtype_safe(block, mesh=mesh2, mp_policy=default_mp_policy(), grouped=True)
    assert block.norm1._get_fsdp_state() is block.norm2._get_fsdp_state()
    assert _norm_state_policy(block.norm1).output_dtype is BF16
    out = block(torch.randn(2, 8))
    assert out.dtype is BF16  # norm2 is the last call: its output is cast back
    out.float().sum().backward()


def test_fully_shard_dtype_safe_without_mixed_precision(mesh2: DeviceMesh) -> None:
    block = _bf16_with_fp32_norms(Block())
    fully_shard_dtype_safe(block, mesh=mesh2, mp_policy=MixedPrecisionPolicy())
    policy = _norm_state_policy(block.norm1)
    # The surrounding dtype comes from the parameters (bf16), as FSDP does not cast them.
    assert (policy.param_dtype, policy.output_dtype) == (FP32, BF16)
    out = block(torch.randn(2, 8, dtype=BF16))
    assert out.dtype is BF16
    out.float().sum().backward()


def test_fully_shard_dtype_safe_skips_existing_units(mesh2: DeviceMesh) -> None:
    model = _bf16_with_fp32_norms(Model())
    for layer in model.layers:
        fully_shard_dtype_safe(layer, mesh=mesh2, mp_policy=default_mp_policy())
    fully_shard_dtype_safe(model, mesh=mesh2, mp_policy=default_mp_policy())
    assert isinstance(model.final, FSDPModule)
    assert _norm_state_policy(model.final).param_dtype is FP32
    assert not isinstance(model.head, FSDPModule)
    out = model(torch.randn(2, 8))
    assert out.dtype is BF16
    out.float().sum().backward()


def test_fully_shard_dtype_safe_ignored_params(mesh2: DeviceMesh) -> None:
    block = _bf16_with_fp32_norms(Block())
    ignored = {block.norm1.weight, block.fc2.bias}
    fully_shard_dtype_safe(
        block, mesh=mesh2, mp_policy=MixedPrecisionPolicy(), ignored_params=ignored
    )
    assert not isinstance(block.norm1.weight, DTensor)
    assert not isinstance(block.fc2.bias, DTensor)
    assert isinstance(block.norm1.bias, DTensor)
    assert isinstance(block.fc2.weight, DTensor)


def test_fully_shard_dtype_safe_all_ignored_island_is_not_split(mesh2: DeviceMesh) -> None:
    block = _bf16_with_fp32_norms(Block())
    ignored = set(block.norm1.parameters())
    fully_shard_dtype_safe(
        block, mesh=mesh2, mp_policy=MixedPrecisionPolicy(), ignored_params=ignored
    )
    assert not isinstance(block.norm1, FSDPModule)
    assert isinstance(block.norm2, FSDPModule)


def test_fully_shard_dtype_safe_refuses_direct_mix(mesh2: DeviceMesh) -> None:
    block = Block().to(BF16)
    block.fc1.bias.data = block.fc1.bias.data.float()
    with pytest.raises(MixedDtypeError, match=re.escape("fc1.bias (torch.float32)")):
        fully_shard_dtype_safe(block, mesh=mesh2, mp_policy=default_mp_policy())
    assert not any(isinstance(m, FSDPModule) for m in block.modules())


def test_fully_shard_dtype_safe_grouped_refused_without_support(
    mesh2: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compat, "GROUPED_PER_MODULE_CASTING", False)
    block = _bf16_with_fp32_norms(Block())
    with pytest.raises(ValueError, match=r"pass grouped=False"):
        fully_shard_dtype_safe(block, mesh=mesh2, mp_policy=default_mp_policy(), grouped=True)
    # The default then shards each island on its own.
    fully_shard_dtype_safe(block, mesh=mesh2, mp_policy=default_mp_policy())
    assert block.norm1._get_fsdp_state() is not block.norm2._get_fsdp_state()
