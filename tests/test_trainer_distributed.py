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
def _reference(
    build: str, images: str, schedule: str = "linear", steps: int = tc.STEPS
) -> tc.Reference:
    return tc.reference_run(build, images=images, schedule=schedule, steps=steps)


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


# ------------------------------------------------------- accelerate's own export calls
def _exports(mp2: MpResults) -> dict[str, Any]:
    return _result(mp2, "accelerate_exports")


def _export_path(mp2: MpResults, name: str) -> Path:
    return Path(case_dir(mp2.out, "accelerate_exports")) / name  # type: ignore[attr-defined]


def _returned_everywhere(errors: list[str | None]) -> None:
    assert errors == [None] * tc.WORLD, errors


def _refused_everywhere(errors: list[str | None], *words: str) -> None:
    assert len(set(errors)) == 1, f"ranks differ: {errors}"
    assert errors[0] is not None, "not refused"
    for word in words:
        assert word in errors[0], errors[0]


@pytest.mark.parametrize("unwrap", [True, False])
def test_accelerate_get_state_dict_holds_full_tensors_on_the_main_process(
    unwrap: bool, mp2: MpResults
) -> None:
    """What accelerate's FSDP2 path returns: every tensor of ``model.state_dict()`` whole,
    on CPU, on the main process; an empty dict elsewhere."""
    result = _exports(mp2)
    _returned_everywhere(result["get_state_dict"])
    found = result[f"unwrap={unwrap}"]
    state = found["state"]
    initial = tc.build_frozen_tower().state_dict()
    assert found["sizes"] == [len(initial), 0]
    assert found["plain"] == [True, True]
    assert set(state) == set(initial)
    for name, value in state.items():
        assert torch.equal(value, result["full"][name]), name
    trained = _reference("frozen", "all", "constant", steps=1).params
    _close({name: state[name] for name in trained}, trained)
    for name in set(initial) - set(trained):
        assert torch.equal(state[name], initial[name]), name


def test_accelerate_get_state_dict_returns_on_each_rank_what_its_fsdp2_path_returns(
    mp2: MpResults,
) -> None:
    fsdp2 = _result(mp2, "accelerate_fsdp2_plugin")["state_dict_sizes"]
    assert fsdp2 == _exports(mp2)["unwrap=True"]["sizes"]


def test_on_the_fsdp2_path_save_pretrained_is_the_library_export(mp2: MpResults) -> None:
    """There ``save_model`` is accelerate's own (weights only, no config, as documented);
    ``unwrap_model(model).save_pretrained`` is the library's export, which
    ``from_pretrained`` loads with the tensors of accelerate's ``get_state_dict``."""
    result = _result(mp2, "accelerate_fsdp2_plugin")
    _returned_everywhere(result["errors"]["save_model"])
    assert set(result["listings"]["save_model"]) == {"model.safetensors"}
    _returned_everywhere(result["errors"]["save_pretrained"])
    assert {"config.json", "model.safetensors"} <= set(result["listings"]["save_pretrained"])
    path = Path(case_dir(mp2.out, "accelerate_fsdp2_plugin")) / "save_pretrained"  # type: ignore[attr-defined]
    loaded = type(tc.build_llava()).from_pretrained(path, dtype=torch.float32).state_dict()
    state = result["gathered"]
    assert set(loaded) == set(state)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize(
    "name", ["save_model", "save_model_shards", "save_pretrained", "save_pretrained_accelerate"]
)
def test_accelerate_exports_load_with_from_pretrained_bit_exactly(
    name: str, mp2: MpResults
) -> None:
    """``accelerator.save_model`` (one file, or several with ``max_shard_size``) and
    ``unwrap_model(model).save_pretrained`` (as accelerate's examples call it): the
    library's export, which ``from_pretrained`` loads with the main process's tensors."""
    result = _exports(mp2)
    _returned_everywhere(result["errors"][name])
    listing = set(result["listings"][name])
    assert "config.json" in listing
    if name == "save_model_shards":
        shards = {f for f in listing if f.endswith(".safetensors")}
        assert len(shards) > 1, listing
        assert "model.safetensors.index.json" in listing
    else:
        assert "model.safetensors" in listing
    loaded = type(tc.build_llava()).from_pretrained(_export_path(mp2, name), dtype=torch.float32)
    want = result["unwrap=True"]["state"]
    got = loaded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_accelerate_save_model_refuses_pickle_files_on_every_rank(mp2: MpResults) -> None:
    result = _exports(mp2)
    _refused_everywhere(
        result["errors"]["save_model_bin"],
        "ValueError: ",
        "safe_serialization=False",
        "fsdp_core.hf.save_pretrained",
    )
    assert result["listings"]["save_model_bin"] is None


def test_save_pretrained_with_accelerates_state_dict_is_refused_on_every_rank(
    mp2: MpResults,
) -> None:
    result = _exports(mp2)
    _refused_everywhere(
        result["errors"]["save_pretrained_state_dict"], "ValueError: ", "state_dict="
    )
    assert result["listings"]["save_pretrained_state_dict"] is None


def test_accelerator_save_writes_the_gathered_state_dict(mp2: MpResults) -> None:
    result = _exports(mp2)
    _returned_everywhere(result["errors"]["save_full"])
    saved = torch.load(_export_path(mp2, "full.bin"), weights_only=True)
    want = result["unwrap=True"]["state"]
    assert set(saved) == set(want)
    for key, value in want.items():
        assert torch.equal(saved[key], value), key


@pytest.mark.parametrize(
    ("name", "names"),
    [
        ("save_sharded_model_state", "accelerator.get_state_dict(model)"),
        ("save_sharded_optimizer_state", "accelerator.save_state"),
    ],
)
def test_accelerator_save_of_sharded_tensors_is_refused_on_every_rank(
    name: str, names: str, mp2: MpResults
) -> None:
    """One process's shards in a file that looks whole: refused, nothing written."""
    result = _exports(mp2)
    _refused_everywhere(result["errors"][name], "ValueError: ", "DTensor", names)
    assert f"{name.removeprefix('save_')}.bin" not in result["files"]


@pytest.mark.parametrize("name", ["register_model", "register_optimizer"])
def test_registering_the_sharded_model_for_checkpointing_is_refused(
    name: str, mp2: MpResults
) -> None:
    """save_state already keeps them in fsdp_checkpoint/; accelerate's own copy would be
    rank 0's shards, loaded on every rank."""
    result = _exports(mp2)
    _refused_everywhere(result["errors"][name], "ValueError: ", "fsdp_checkpoint/")


def test_accelerate_clip_grad_norm_returns_the_whole_models_norm(mp2: MpResults) -> None:
    norm = _exports(mp2)["norm"]
    assert norm["type"] == "Tensor"
    assert norm["got"] == pytest.approx([norm["want"]] * tc.WORLD, rel=1e-6)


@pytest.mark.parametrize("name", ["save_model", "save_pretrained"])
def test_accelerate_exports_of_a_peft_model_are_its_adapter(name: str, mp2: MpResults) -> None:
    """A sharded ``PeftModel``: ``get_state_dict`` as for any model; ``save_model`` and
    ``save_pretrained`` write its adapter (as ``ShardedTrainer.save_model`` and peft do),
    which ``PeftModel.from_pretrained`` loads onto the base bit-exactly."""
    result = _result(mp2, "accelerate_exports_lora")
    _returned_everywhere(result["get_state_dict"])
    state = result["unwrap=True"]["state"]
    initial = tc.build_lora().state_dict()
    assert result["unwrap=True"]["sizes"] == [len(initial), 0]
    assert set(state) == set(initial)
    for key, value in state.items():
        assert torch.equal(value, result["full"][key]), key
        assert torch.equal(value, initial[key]), key
    _returned_everywhere(result["errors"][name])
    assert set(result["listings"][name]) == {"adapter_config.json", "adapter_model.safetensors"}
    path = Path(case_dir(mp2.out, "accelerate_exports_lora")) / name  # type: ignore[attr-defined]
    loaded = peft.PeftModel.from_pretrained(tc.build_llava(), path).state_dict()
    assert set(loaded) == set(state)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def test_the_routed_accelerator_leaves_unsharded_models_to_accelerate(mp2: MpResults) -> None:
    found = _exports(mp2)["unsharded"]
    assert found["same"]
    assert found["listing"] == ["model.safetensors"]  # accelerate's save_model: no config
    assert set(found["saved"]) == set(found["want"])
    assert all(torch.equal(found["saved"][k], v) for k, v in found["want"].items())
