"""transformers Trainer, TRL SFTTrainer and accelerate train a sharded model like one process.

The scenarios (``mp/scenarios_trainer.py``) fine-tune a tiny LLaVA on 2 gloo ranks (3
steps of 2 micro-batches per rank, gradients clipped) through the integrations in
``fsdp_core.integrations``. Here, against one process on the global batch
(``trainer_cases.reference_run``): the loss of every step, the clipped gradients of step
0 and the trained parameters, for a frozen tower under ``root`` and ``per_layer``,
``balance_media`` with every image on rank 0, LoRA and TRL's SFTTrainer; the model
``save_model`` exported; ``predict()`` with images on one rank; a checkpoint resumed for
one more step equal to the run that never stopped (Trainer and accelerate); and the
clear errors an unmodified Trainer, SFTTrainer, ``accelerator.prepare(model)`` and DDP
give on every rank instead of crashing in DDP.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("trl")
pytest.importorskip("accelerate")
pytest.importorskip("datasets")

import torch  # noqa: E402
import trainer_cases as tc  # noqa: E402
from launches import MpResults  # noqa: E402
from scenarios_trainer import EVAL_SAMPLES, case_dir  # noqa: E402
from trainer_cases import CASES  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.transformers]

#: fp32 on 2 ranks against one process: reduction order only.
TOL = 1e-5


@functools.cache
def _reference(build: str, images: str, schedule: str = "linear") -> tc.Reference:
    return tc.reference_run(build, images=images, schedule=schedule)


def _result(mp2: MpResults, name: str) -> dict[str, Any]:
    result = mp2(name)
    if "skipped" in result:
        pytest.fail(f"the ranks lacked a dependency the test process has: {result['skipped']}")
    return result


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=TOL, atol=TOL, msg=name)


def _like_one_process(result: dict[str, Any], ref: tc.Reference) -> None:
    assert result["losses"] == pytest.approx(ref.losses, rel=TOL, abs=TOL)
    _close(result["grads0"], ref.grads0)
    _close(result["params"], ref.params)


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_trains_like_one_process(case: str, mp2: MpResults) -> None:
    build, _, _, images, _, _ = CASES[case]
    _like_one_process(_result(mp2, f"trainer_{case}"), _reference(build, images))


def _trained_model(build: str, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = tc.BUILDERS[build]()
    with torch.no_grad():
        named = dict(model.named_parameters())
        for name, value in params.items():
            named[name].copy_(value)
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_predict_with_images_on_one_rank(case: str, mp2: MpResults) -> None:
    """Every sample's logits, in order, as one process computes them with the trained
    weights; the evaluation loss is the same on every rank."""
    build, _, _, images, _, eval_images = CASES[case]
    result = _result(mp2, f"trainer_{case}")
    eval_loss = result["eval_loss"]
    assert len(set(eval_loss)) == 1
    assert torch.isfinite(torch.tensor(eval_loss[0]))
    model = _trained_model(build, _reference(build, images).params)
    data = tc.LlavaSamples(EVAL_SAMPLES, images=eval_images)
    with torch.no_grad():
        want = torch.cat([model(**tc.collate([data[i]])).logits for i in range(EVAL_SAMPLES)])
    torch.testing.assert_close(result["predictions"], want, rtol=1e-4, atol=1e-4)
    assert result["resharded"], "evaluate()/predict() left the root's parameters gathered"


@pytest.mark.parametrize("case", ["root", "lora"])
def test_save_model_writes_the_library_export(case: str, mp2: MpResults) -> None:
    build, _, _, images, _, _ = CASES[case]
    result = _result(mp2, f"trainer_{case}")
    export = case_dir(mp2.out, case) / "export"  # type: ignore[attr-defined]
    want = _reference(build, images).params
    if build == "lora":
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(result["export"])
        assert not any(name.startswith("model") for name in result["export"])
        loaded = peft.PeftModel.from_pretrained(tc.build_llava(), export)
    else:
        assert "model.safetensors" in result["export"]
        loaded = type(tc.build_llava()).from_pretrained(export, dtype=torch.float32)
    got = {n: p.detach() for n, p in loaded.named_parameters() if n in want}
    _close(got, want)


def test_a_resumed_run_continues_exactly(mp2: MpResults) -> None:
    result = _result(mp2, "trainer_resume")
    uninterrupted, resumed = result["uninterrupted"], result["resumed"]
    ref = _reference("lora", "rank0")
    assert uninterrupted["losses"] == pytest.approx(ref.losses, rel=TOL, abs=TOL)
    _close(uninterrupted["params"], ref.params)
    assert result["step"] == tc.STEPS
    assert resumed["losses"][-1] == uninterrupted["losses"][-1]
    for name, value in uninterrupted["params"].items():
        assert torch.equal(resumed["params"][name], value), name


def test_a_checkpoint_holds_the_sharded_model_and_optimizer(mp2: MpResults) -> None:
    listing = set(_result(mp2, "trainer_resume")["checkpoint"])
    assert {
        "fsdp_checkpoint/.metadata",
        "fsdp_checkpoint/__0_0.distcp",
        "fsdp_checkpoint/__1_0.distcp",
        "scheduler.pt",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "trainer_state.json",
        "adapter_model.safetensors",  # save_model's export, beside the sharded state
    } <= listing
    assert "optimizer.pt" not in listing  # one rank's shards: what Trainer would write


def test_an_unmodified_framework_refuses_before_any_step(mp2: MpResults) -> None:
    result = _result(mp2, "trainer_unmodified")
    errors = result["errors"]
    for framework, names in {
        "trainer": "ShardedTrainer",
        "sft": "ShardedSFTTrainer",
        "accelerate": "fsdp_core.integrations.accelerate.prepare",
        "ddp": "ShardedTrainer",
    }.items():
        got = errors[framework]
        assert len(set(got)) == 1, f"{framework}: ranks differ: {got}"
        assert got[0] is not None
        assert got[0].startswith("IntegrationRequiredError: "), got
        assert names in got[0], got[0]
        assert "Cannot flatten" not in got[0]
    assert result["unchanged"]


@pytest.mark.parametrize("name", ["accelerate_loop", "accelerate_fsdp2_plugin"])
def test_accelerate_trains_and_resumes(name: str, mp2: MpResults) -> None:
    result = _result(mp2, name)
    _like_one_process(result, _reference("frozen", "all", "constant"))
    assert result["resumed_loss"] == result["losses"][-1]
    for key, value in result["params"].items():
        assert torch.equal(result["resumed_params"][key], value), key


def test_accelerate_state_keeps_model_and_optimizer_in_the_library_checkpoint(
    mp2: MpResults,
) -> None:
    listing = set(_result(mp2, "accelerate_loop")["state"])
    assert {
        "fsdp_checkpoint/.metadata",
        "fsdp_checkpoint/__0_0.distcp",
        "fsdp_checkpoint/__1_0.distcp",
        "random_states_0.pkl",
        "random_states_1.pkl",
    } <= listing
    state_dir = case_dir(mp2.out, "accelerate_loop") / "state"  # type: ignore[attr-defined]
    placeholder = torch.load(Path(state_dir) / "optimizer.bin", weights_only=True)
    assert placeholder["state"] == {}, "accelerate's optimizer file holds one rank's shards"


def test_accelerate_refuses_a_state_it_saved_alone(mp2: MpResults) -> None:
    refused = _result(mp2, "accelerate_loop")["refused"]
    assert len(set(refused)) == 1
    assert refused[0].startswith("IntegrationRequiredError: ")
    assert "holds no fsdp_checkpoint/" in refused[0]


def test_the_fsdp2_plugin_path_keeps_accelerate_checkpoints(mp2: MpResults) -> None:
    listing = set(_result(mp2, "accelerate_fsdp2_plugin")["state"])
    assert {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"} <= listing


def test_load_best_model_at_end_reads_the_best_checkpoint(mp2: MpResults) -> None:
    result = _result(mp2, "trainer_checkpoint_variants")
    assert result["best_step"] != tc.STEPS, "the best checkpoint is the last: nothing loaded"
    for name, value in result["best_params"].items():
        assert torch.equal(result["loaded_params"][name], value), name


def test_a_save_only_model_checkpoint_resumes_the_weights_with_a_new_optimizer(
    mp2: MpResults,
) -> None:
    result = _result(mp2, "trainer_checkpoint_variants")
    listing = set(result["only_model_listing"])
    assert "model.safetensors" in listing
    assert not any(name.startswith("fsdp_checkpoint/") for name in listing)
    want = tc.one_step_from(result["step2_params"], images="rank0", step=2)
    _close(result["resumed_params"], want)
