"""Remedies that fsdp_core's error messages propose, checked with the parallelizers of
every package (single process, fake process group).

A torch without ``fully_shard(ignored_params=...)`` cannot keep any parameter out of
FSDP. The error must say what works with each parallelizer: a plain one given
``ignored_params=``, the ``replicate`` policy, and DeepSeek-V4.1's frozen fp32 vision
norms, which it replicates under every policy.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vlm import CONFIG

from fsdp_core import ModelParallelizer, build_mesh, compat
from fsdp_core.fake_group import fake_process_group
from model_deepseek_v41 import DeepseekV41ModelParallelizer, build_deepseek_v41
from multimodal_fsdp import MultimodalParallelizer

NO_IGNORED = "has no fully_shard(ignored_params=...)"


@pytest.fixture
def old_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(compat, "FULLY_SHARD_IGNORED_PARAMS", False)
    with fake_process_group(2):
        yield


def deepseek(*, frozen_tower: bool) -> torch.nn.Module:
    model = build_deepseek_v41(CONFIG, seed=0, dtype=torch.float32)
    if frozen_tower:
        model.vision.requires_grad_(False)
    return model


def raised(action: object) -> str:
    with pytest.raises(ValueError, match=NO_IGNORED.replace("(", r"\(").replace(")", r"\)")) as e:
        action()  # type: ignore[operator]
    return str(e.value)


def test_ignored_params_remedy(old_torch: None) -> None:
    model = deepseek(frozen_tower=False)
    message = raised(
        lambda: ModelParallelizer().parallelize(
            model, mesh=build_mesh(), ignored_params=set(model.lm_head.parameters())
        )
    )
    assert "pass no ignored_params=" in message
    ModelParallelizer().parallelize(deepseek(frozen_tower=False), mesh=build_mesh())


def test_replicate_policy_remedy(old_torch: None) -> None:
    message = raised(
        lambda: MultimodalParallelizer(frozen_multimodal_sharding="replicate").parallelize(
            deepseek(frozen_tower=True), mesh=build_mesh()
        )
    )
    assert "other than 'replicate'" in message
    for policy in ("root", "per_layer"):
        MultimodalParallelizer(frozen_multimodal_sharding=policy).parallelize(
            deepseek(frozen_tower=True), mesh=build_mesh()
        )


def test_parallelizer_replicating_its_own_parameters_remedy(old_torch: None) -> None:
    """DeepSeek replicates frozen fp32 vision norms under every policy: 'root' cannot help,
    and the message must not pretend it does."""
    message = raised(
        lambda: DeepseekV41ModelParallelizer(frozen_multimodal_sharding="root").parallelize(
            deepseek(frozen_tower=True), mesh=build_mesh()
        )
    )
    assert "replicated by the parallelizer itself" in message
    assert "make them trainable" in message
    model = deepseek(frozen_tower=True)
    for name, param in model.named_parameters():
        if name.startswith("vision.") and param.dim() == 1 and "norm" in name:
            param.requires_grad_(True)
    DeepseekV41ModelParallelizer(frozen_multimodal_sharding="root").parallelize(
        model, mesh=build_mesh()
    )
