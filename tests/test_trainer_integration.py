"""fsdp_core.integrations.transformers / trl / accelerate in one process: the guard an
unmodified Trainer meets, the refusals, and the checks against the supported releases.

The training itself (2 gloo ranks against one process) is
``tests/test_trainer_distributed.py``.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("trl")
accelerate = pytest.importorskip("accelerate")

import torch  # noqa: E402
from hf_vlms import build_llava  # noqa: E402
from torch import nn  # noqa: E402

from fsdp_core.hf import _trainer_guard  # noqa: E402
from fsdp_core.hf import _transformers as tf  # noqa: E402
from fsdp_core.integrations import IntegrationRequiredError  # noqa: E402
from fsdp_core.integrations import accelerate as acc_integration  # noqa: E402
from fsdp_core.integrations import transformers as tf_integration  # noqa: E402
from fsdp_core.integrations.transformers import ShardedTrainer  # noqa: E402
from fsdp_core.integrations.trl import ShardedSFTTrainer  # noqa: E402

pytestmark = pytest.mark.transformers


def _as_trainer(value: object) -> bool:
    """``bool(value)`` as transformers' Trainer module evaluates it."""
    scope = {"__name__": tf.TRAINER_MODULE, "value": value}
    exec("result = bool(value)", scope)  # a module namespace of that name
    return bool(scope["result"])


# ---------------------------------------------------------------- the unmodified Trainer
def test_transformers_declares_the_flag_the_guard_sets() -> None:
    assert hasattr(transformers.PreTrainedModel, tf.IS_DISTRIBUTED_LOADING)
    assert transformers.Trainer.__module__ == tf.TRAINER_MODULE


def test_the_flag_reads_false_except_in_trainers_decision() -> None:
    model = build_llava()
    assert _trainer_guard.mark_sharded_by_library(model)
    assert _trainer_guard.is_guarded(model)
    flag = model.is_distributed_loading_by_transformers
    assert not flag  # any other reader: transformers' default
    with pytest.raises(IntegrationRequiredError, match="ShardedTrainer"):
        _as_trainer(flag)
    with _trainer_guard.accepting_trainer():
        assert not _as_trainer(flag)


def test_a_peft_model_is_guarded_through_its_base() -> None:
    model = peft.get_peft_model(build_llava(), peft.LoraConfig(target_modules=["q_proj"]))
    assert _trainer_guard.mark_sharded_by_library(model)
    assert _trainer_guard.is_guarded(model)
    with pytest.raises(IntegrationRequiredError):
        _as_trainer(model.is_distributed_loading_by_transformers)


def test_the_flag_survives_copies() -> None:
    model = build_llava()
    _trainer_guard.mark_sharded_by_library(model)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert _trainer_guard.is_guarded(copied)


def test_a_model_of_no_transformers_class_is_not_touched() -> None:
    assert not _trainer_guard.mark_sharded_by_library(nn.Linear(2, 2))


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("model", "error", "match"),
    [
        ("llava-hf/llava-1.5-7b-hf", TypeError, "takes the sharded model, not a name"),
        (None, TypeError, "needs model="),
        ("unsharded", ValueError, "has no FSDP unit"),
        ("plain", TypeError, "trains transformers and peft models"),
    ],
)
def test_sharded_trainer_refuses(model: Any, error: type[Exception], match: str) -> None:
    if model == "unsharded":
        model = build_llava()
    elif model == "plain":
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(error, match=match):
        ShardedTrainer(model=model)


def test_sharded_trainer_refuses_model_init() -> None:
    with pytest.raises(ValueError, match="model_init"):
        ShardedTrainer(model_init=build_llava)


def test_sharded_sft_trainer_refuses_peft_config() -> None:
    with pytest.raises(ValueError, match="Add them before sharding"):
        ShardedSFTTrainer(model=build_llava(), peft_config=peft.LoraConfig())


def test_accelerate_prepare_refuses_an_unsharded_model() -> None:
    with pytest.raises(ValueError, match="needs a model sharded by the library"):
        acc_integration.prepare(accelerate.Accelerator(cpu=True), build_llava())


# ------------------------------------------------------------------ supported releases
@pytest.mark.parametrize("version", ["4.57.0", "6.0.0"])
def test_a_transformers_release_outside_the_range_is_refused(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tf_integration.transformers, "__version__", version)
    with pytest.raises(ImportError, match=r"supports transformers>=5,<6, found"):
        tf_integration._check_release()


def test_a_trainer_without_an_overridden_method_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(tf_integration.Trainer, "_load_best_model")
    with pytest.raises(ImportError, match=r"lacks \['_load_best_model'\]"):
        tf_integration._check_overrides()


def test_an_accelerate_release_outside_the_range_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import accelerate as current  # the module the integration reads now

    for version in ("1.15.1", "2.0.0"):
        monkeypatch.setattr(current, "__version__", version)
        with pytest.raises(ImportError, match=r"supports accelerate>=1\.16,<2, found"):
            acc_integration._check_release()


def test_a_trl_release_outside_the_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import trl as current

    from fsdp_core.integrations import trl as trl_integration

    for version in ("0.29.0", "2.0.0"):
        monkeypatch.setattr(current, "__version__", version)
        with pytest.raises(ImportError, match=r"supports trl>=1\.16,<2, found"):
            trl_integration._check_release()


# ------------------------------------------------------------------------ prediction
def test_prediction_leaves_media_outputs_out() -> None:
    # Trainer's own expression: ignore_keys + ["loss"]
    keys = tf_integration._WithoutMediaOutputs(["cache"]) + ["loss"]  # noqa: RUF005
    for left_out in ("cache", "loss", "image_outputs", "image_hidden_states", "audio_features"):
        assert left_out in keys
    assert "logits" not in keys


# ------------------------------------------------------------- accelerate's own files
def test_accelerates_optimizer_file_is_a_placeholder_only_while_saving() -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    state = acc_integration.ShardedState(model, optimizer)
    optimizer.register_state_dict_post_hook(state.optimizer_state_dict)
    optimizer.register_load_state_dict_pre_hook(state.optimizer_load_state_dict)
    assert optimizer.state_dict()["param_groups"]  # the real one outside save_state
    state._saving = True
    placeholder = optimizer.state_dict()
    assert placeholder["state"] == {}
    assert placeholder["param_groups"] == []
    assert state.state_dict()["directory"] == acc_integration.CHECKPOINT_DIR
    assert not state._saving
    optimizer.load_state_dict(placeholder)  # skipped: read from the checkpoint instead
    assert len(optimizer.param_groups) == 1
