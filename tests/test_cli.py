"""``python -m multimodal_fsdp plan``: run in-process through ``main(argv)``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from multimodal_fsdp.balance.traffic import SLOT_INTS
from multimodal_fsdp.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def fail(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *argv])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_deepseek_tree_with_totals(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(capsys, "--model", "deepseek-v41-tiny", "--world-size", "8")
    assert out.startswith("DeepseekV41ForCausalLM: ")
    assert "world size 8 (dp_shard 8)" in out
    assert "frozen-tower policy root" in out
    assert "<root>" in out
    assert "fp32_norms" in out  # the trainable tower's grouped fp32 norm unit
    assert "totals per rank and step" in out
    assert "peak gathered params" in out
    assert "nothing frozen" in out


def test_frozen_tower_per_layer(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(
        capsys,
        "--model",
        "deepseek-v41-tiny",
        "--world-size",
        "8",
        "--policy",
        "per_layer",
        "--freeze",
        "vision",
    )
    assert "frozen (no bwd)" in out
    assert "{0..1} x2" in out
    assert "implicit-prefetch waste   1 all-gathers" in out
    assert "note: frozen: vision" in out


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    out = run(
        capsys,
        "--model",
        "deepseek-v41-tiny",
        "--world-size",
        "8",
        "--dp-replicate",
        "2",
        "--freeze",
        "vision",
        "--policy",
        "replicate",
        "--json",
    )
    data = json.loads(out)
    assert (data["world_size"], data["dp_replicate"], data["dp_shard"]) == (8, 2, 4)
    assert data["policy"] == "replicate"
    totals = data["totals"]
    assert totals["units"] == len(data["units"])
    assert totals["collectives"]["backward"]["all_reduce"]["count"] > 0
    assert not any(p.startswith("vision") for u in data["units"] for p in u["paths"])


def test_unguarded_and_reshard_options(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "deepseek-v41-tiny", "--freeze", "vision", "--policy", "per_layer"]
    guarded = json.loads(run(capsys, *base, "--json"))
    default = json.loads(run(capsys, *base, "--json", "--no-prefetch-guard"))
    count = "count"
    bwd = "backward"
    assert (
        default["totals"]["collectives"][bwd]["all_gather"][count]
        == guarded["totals"]["collectives"][bwd]["all_gather"][count] + 1
    )
    kept = json.loads(run(capsys, *base, "--json", "--reshard-after-forward", "false"))
    assert "all_gather" not in kept["totals"]["collectives"].get(bwd, {})
    out = run(capsys, *base, "--reshard-after-forward", "2", "--no-collapse")
    assert "to 2" in out
    assert "blocks" in out


def test_memory_figures_are_marked_predicted(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "deepseek-v41-tiny", "--world-size", "4", "--freeze", "vision"]
    out = run(capsys, *base)
    assert "gradients (predicted)" in out
    assert "optimizer (predicted)" in out
    assert "(adamw)" in out
    assert "peak total (predicted)" in out
    assert "(without activations)" in out
    assert "note: memory figures are predicted from the plan; nothing here is measured" in out
    adamw = json.loads(run(capsys, *base, "--json"))["memory"]
    assert adamw["source"] == "predicted"
    assert adamw["peak_includes_activations"] is False
    assert adamw["gradient_bytes"] > 0
    # Two states per trainable shard plus a 4-byte step per trainable parameter tensor.
    steps = adamw["optimizer_bytes"] - 2 * adamw["gradient_bytes"]
    assert 0 < steps < 1000
    assert steps % 4 == 0
    sgd = json.loads(run(capsys, *base, "--json", "--optimizer", "sgd"))["memory"]
    assert sgd["optimizer_bytes"] == 0
    assert sgd["peak_bytes"] < adamw["peak_bytes"]
    given = json.loads(run(capsys, *base, "--json", "--activations", "1MiB"))["memory"]
    assert given["activation_bytes"] == 2**20
    assert given["peak_includes_activations"] is True
    assert given["peak_bytes"] >= adamw["peak_bytes"] + 2**20
    assert "(without activations)" not in run(capsys, *base, "--activations", "1.5GB")


def test_batch_traces_activations_into_the_peak(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "deepseek-v41-tiny", "--world-size", "4", "--freeze", "vision"]
    without = json.loads(run(capsys, *base, "--json"))["memory"]
    traced = json.loads(run(capsys, *base, "--json", "--batch", "2x16"))["memory"]
    assert traced["peak_includes_activations"] is True
    assert traced["activation_bytes"] > 0
    assert traced["step_peak_bytes"] >= traced["activation_bytes"]
    assert traced["peak_bytes"] > without["peak_bytes"]
    bigger = json.loads(run(capsys, *base, "--json", "--batch", "4x16"))["memory"]
    assert bigger["activation_bytes"] > traced["activation_bytes"]
    text = run(capsys, *base, "--batch", "2x16")
    assert "(without activations)" not in text
    chosen = json.loads(run(capsys, *base, "--json", "--batch", "2x16", "--memory-budget", "1GiB"))
    assert all(c["peak_bytes"] > 0 for c in chosen["policy_choice"]["candidates"])
    assert not any("no batch" in note for note in chosen["policy_choice"]["notes"])


def _budget_run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    base = ["--model", "deepseek-v41-tiny", "--world-size", "4", "--freeze", "vision"]
    data: dict[str, Any] = json.loads(run(capsys, *base, "--json", *argv))
    return data


def test_memory_budget_chooses_the_policy(capsys: pytest.CaptureFixture[str]) -> None:
    everything = _budget_run(capsys, "--memory-budget", "1GiB")
    peaks = {c["policy"]: c["peak_bytes"] for c in everything["policy_choice"]["candidates"]}
    assert everything["policy"] == everything["policy_choice"]["policy"] == "replicate"
    tight = _budget_run(capsys, "--memory-budget", str(peaks["replicate"] - 1))
    assert tight["policy"] == "per_layer"
    assert tight["memory"]["peak_bytes"] == peaks["per_layer"] <= peaks["replicate"] - 1
    assert any("policy 'per_layer' chosen" in note for note in tight["notes"])
    text = run(
        capsys,
        *["--model", "deepseek-v41-tiny", "--world-size", "4", "--freeze", "vision"],
        *["--memory-budget", f"{peaks['replicate']}"],
    )
    assert "frozen-tower policy replicate" in text
    assert "note: policy 'root' not chosen" in text


def test_memory_budget_that_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    err = fail(
        capsys, "--model", "deepseek-v41-tiny", "--freeze", "vision", "--memory-budget", "1KiB"
    )
    assert "no frozen-tower policy fits a per-rank budget of 1.0 KiB" in err
    assert "with policy 'per_layer'" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "sideways"], "unknown frozen multimodal sharding 'sideways'"),
        (["--freeze", "everything"], "invalid choice: 'everything'"),
        (["--precision", "bf17"], "unknown dtype 'bf17'; valid names:"),
        (["--world-size", "0"], "expected a positive integer, got '0'"),
        (["--world-size", "8", "--dp-replicate", "3"], "not divisible by 3"),
        (["--reshard-after-forward", "maybe"], "invalid reshard setting 'maybe'"),
        (["--world-size", "8", "--reshard-after-forward", "3"], "positive divisor"),
        (["--freeze", "audio"], "--freeze audio: no such module"),
        (["--optimizer", "lion"], "invalid choice: 'lion'"),
        (["--activations", "lots"], "invalid size 'lots'"),
        (["--activations", "3 parsecs"], "units: b, kb"),
        (["--memory-budget", "big"], "invalid size 'big'"),
        (["--batch", "2by16"], "invalid batch '2by16'"),
        (["--batch", "1x99999"], "--batch 1x99999: seq_len=99999"),
        (["--batch", "2x16", "--activations", "1MiB"], "not both"),
        (["--memory-budget", "1GiB", "--policy", "root"], "not both"),
    ],
)
def test_bad_arguments_fail_with_a_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = fail(capsys, "--model", "deepseek-v41-tiny", *argv)
    assert message in err


def test_missing_command_and_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([])
    assert "required" in capsys.readouterr().err
    assert "--model" in fail(capsys)


def test_missing_deepseek_package(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the package its entry point cannot load: no preset of that name.
    monkeypatch.setitem(sys.modules, "model_deepseek_v41", None)
    monkeypatch.setitem(sys.modules, "model_deepseek_v41.presets", None)
    err = fail(capsys, "--model", "deepseek-v41-base")
    assert "not a registered preset (none installed)" in err
    # Not on a public index yet: the message says where the package is.
    assert "pip install ./packages/model-deepseek-v41 from a source checkout" in err


def test_presets_come_from_the_entry_point_group() -> None:
    from multimodal_fsdp.cli.presets import ENTRY_POINT_GROUP, model_presets

    presets = model_presets()
    assert {"deepseek-v41-tiny", "deepseek-v41-small", "deepseek-v41-base"} <= set(presets)
    model, parallelizer = presets["deepseek-v41-tiny"].build(torch.bfloat16)
    assert next(model.parameters()).device.type == "meta"
    assert type(parallelizer).__name__ == "DeepseekV41ModelParallelizer"
    assert ENTRY_POINT_GROUP == "multimodal_fsdp.models"


def test_a_broken_or_duplicate_preset_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from multimodal_fsdp.cli import presets as models

    def entry(value: str) -> metadata.EntryPoint:
        return metadata.EntryPoint("x", value, models.ENTRY_POINT_GROUP)

    broken = [entry("no_such_module_here:presets")]
    monkeypatch.setattr(models.metadata, "entry_points", lambda group: broken)
    assert models.model_presets() == {}  # logged and left out
    twice = [entry("model_deepseek_v41.presets:model_presets")] * 2
    monkeypatch.setattr(models.metadata, "entry_points", lambda group: twice)
    with pytest.raises(ValueError, match="registered twice"):
        models.model_presets()


def test_missing_transformers_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    err = fail(capsys, "--model", "llava")
    assert "multimodal-fsdp[transformers]" in err


@pytest.fixture
def transformers() -> Any:
    return pytest.importorskip("transformers")


@pytest.mark.transformers
def test_transformers_model_type(capsys: pytest.CaptureFixture[str], transformers: Any) -> None:
    out = run(capsys, "--model", "llava", "--world-size", "8", "--freeze", "vision")
    assert out.startswith("LlavaForConditionalGeneration: ")
    assert "language_model" in out
    assert "note: frozen: model.vision_tower" in out


@pytest.mark.transformers
def test_transformers_config_json(
    capsys: pytest.CaptureFixture[str], transformers: Any, tmp_path: Path
) -> None:
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    text = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        vocab_size=100,
    )
    transformers.LlavaConfig(vision_config=vision, text_config=text).save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    data = json.loads(
        run(capsys, "--model", str(config), "--world-size", "4", "--policy", "per_layer", "--json")
    )
    assert data["model"] == "LlavaForConditionalGeneration"
    labels = [u["label"] for u in data["units"]]
    assert "model.language_model.layers.2" in labels
    assert run(capsys, "--model", str(tmp_path), "--world-size", "4").startswith("Llava")


@pytest.mark.transformers
def test_batch_needs_a_deepseek_preset(
    capsys: pytest.CaptureFixture[str], transformers: Any
) -> None:
    err = fail(capsys, "--model", "llava", "--batch", "1x4")
    assert "for other models give --activations SIZE" in err


@pytest.mark.transformers
def test_unknown_model_suggests_names(
    capsys: pytest.CaptureFixture[str], transformers: Any
) -> None:
    err = fail(capsys, "--model", "lava")
    assert "unknown --model 'lava'" in err
    assert "did you mean" in err
    assert "llava" in err


def test_memory_budget_chooses_per_frozen_module(capsys: pytest.CaptureFixture[str]) -> None:
    both = ["--model", "deepseek-v41-tiny", "--world-size", "4", "--freeze", "multimodal"]
    everything = json.loads(run(capsys, *both, "--json", "--memory-budget", "1GiB"))
    candidates = everything["policy_choice"]["candidates"]
    assert len(candidates) == 9
    peaks = {
        (c["policies"]["vision"], c["policies"]["aligner"]): c["peak_bytes"] for c in candidates
    }
    budget = peaks["replicate", "replicate"] - 1
    mixed = json.loads(run(capsys, *both, "--json", "--memory-budget", str(budget)))
    assert mixed["policy_choice"]["policies"] == {"vision": "replicate", "aligner": "per_layer"}
    assert mixed["policy"] == "vision=replicate, aligner=per_layer"
    text = run(capsys, *both, "--memory-budget", str(budget))
    assert "frozen-tower policy vision=replicate, aligner=per_layer" in text
    assert "note: tower 'vision' (vision): policy 'replicate'" in text
    assert "note: projector 'aligner' (vision): policy 'per_layer'" in text
    assert "note: policy 'replicate' not chosen for 'aligner': needs" in text


@pytest.mark.parametrize("spelling", ["per-layer", "Per_Layer", " per_layer ", "PER-LAYER"])
def test_policy_takes_every_spelling_the_api_takes(
    capsys: pytest.CaptureFixture[str], spelling: str
) -> None:
    out = run(capsys, "--model", "deepseek-v41-tiny", "--policy", spelling, "--freeze", "vision")
    assert "frozen-tower policy per_layer" in out
    err = fail(capsys, "--model", "deepseek-v41-tiny", "--policy", "per-block")
    assert "unknown frozen multimodal sharding 'per-block'" in err
    assert "root, per_layer, replicate" in err


def test_the_output_names_the_model_and_its_parameter_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = run(capsys, "--model", "deepseek-v41-tiny")
    assert "note: model: DeepseekV41ForCausalLM from the registered preset" in out
    assert "(264,128) parameters" in out


@pytest.mark.transformers
def test_a_model_type_says_it_plans_the_default_config(
    capsys: pytest.CaptureFixture[str], transformers: Any
) -> None:
    data = json.loads(run(capsys, "--model", "qwen2_vl", "--json"))
    (note,) = [n for n in data["notes"] if n.startswith("model: ")]
    assert "transformers' default Qwen2VLConfig" in note
    assert "not a released checkpoint" in note
    assert "config.json" in note
    assert "73.4B (73,381,962,752) parameters" in note


@pytest.mark.transformers
def test_a_config_json_is_named_in_the_output(
    capsys: pytest.CaptureFixture[str], transformers: Any, tmp_path: Path
) -> None:
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**small),
        text_config=transformers.LlamaConfig(**small, vocab_size=100),
    ).save_pretrained(tmp_path)
    out = run(capsys, "--model", str(tmp_path / "config.json"))
    assert f"LlavaConfig read from {tmp_path / 'config.json'}" in out


@pytest.mark.transformers
def test_a_hub_id_says_to_pass_the_downloaded_config(
    capsys: pytest.CaptureFixture[str],
    transformers: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    err = fail(capsys, "--model", "Qwen/Qwen2-VL-7B-Instruct")
    assert "is no local path and looks like a Hugging Face hub ID" in err
    assert "huggingface-cli download Qwen/Qwen2-VL-7B-Instruct config.json" in err
    assert "--model path/to/config.json" in err
    # Downloaded before (any from_pretrained): the error names the cached file.
    repo = tmp_path / "models--Qwen--Qwen2-VL-7B-Instruct"
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (snapshot / "config.json").write_text("{}")
    err = fail(capsys, "--model", "Qwen/Qwen2-VL-7B-Instruct")
    assert f"--model {snapshot / 'config.json'}" in " ".join(err.split())


def test_balance_media_shows_the_balanced_towers_and_their_collectives(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["--model", "deepseek-v41-tiny", "--world-size", "2", "--policy", "per_layer"]
    plain = run(capsys, *base)
    assert "balance_media" not in plain
    assert "balanced-media" not in plain
    out = run(capsys, *base, "--balance-media")
    assert "hook: balance_media" in out
    assert "'vision' (batch-first)" in out
    assert "2 all_gathers and 2 all_to_all in forward when items move" in out
    assert "balanced-media exchange NOT counted above" in out
    assert "schedule_check" not in out  # balanced towers are no media regions
    # With a batch, the exchange of that batch on every rank is counted: the same batch on
    # every rank, so every item stays home (the call's slot gather and the barrier's).
    counted = run(capsys, *base, "--balance-media", "--batch", "2x16")
    assert "balanced-media exchange   2 collectives" in counted
    data = json.loads(run(capsys, *base, "--balance-media", "--batch", "2x16", "--json"))
    assert data["balanced_towers"] == ["vision"]
    assert data["exchange_collectives"] == {
        "forward": {"all_gather": {"count": 2, "bytes": 2 * 2 * SLOT_INTS * 8}}
    }


def test_memory_budget_counts_the_balanced_exchange_of_the_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--memory-budget`` costs the plans it compares as ``--policy`` costs one: with
    ``--balance-media --batch`` the batch's exchange is counted, not left out with a note
    asking for the ``--batch`` that was given."""
    base = ["--model", "deepseek-v41-tiny", "--world-size", "2", "--balance-media"]
    base += ["--batch", "2x16", "--json"]
    given = json.loads(run(capsys, *base, "--policy", "root"))
    chosen = json.loads(run(capsys, *base, "--memory-budget", "1GiB"))
    assert chosen["policy"] == "root"
    assert not any("NOT counted" in note for note in chosen["notes"])
    assert chosen["exchange_collectives"] == given["exchange_collectives"] is not None
    assert chosen["totals"] == given["totals"]
    assert chosen["memory"] == given["memory"]
    collectives = given["totals"]["collectives"].values()
    count = sum(kind["count"] for phase in collectives for kind in phase.values())
    assert [c["comm_count"] for c in chosen["policy_choice"]["candidates"]] == [count] * 3


@pytest.mark.parametrize(
    "options",
    [
        ["--dp-replicate", "2"],
        ["--reshard-after-forward", "false", "--no-prefetch-guard"],
        ["--optimizer", "sgd", "--precision", "fp32", "--storage-dtype", "bf16"],
        ["--activations", "1MiB"],
        ["--balance-media", "--batch", "2x16"],
    ],
)
def test_memory_budget_honours_every_option_policy_honours(
    capsys: pytest.CaptureFixture[str], options: list[str]
) -> None:
    """No option counts in one mode only: the plan ``--memory-budget`` chooses is costed
    exactly as ``--policy`` with that policy costs it."""
    base = ["--model", "deepseek-v41-tiny", "--world-size", "4", "--freeze", "vision"]
    chosen = json.loads(run(capsys, *base, *options, "--json", "--memory-budget", "1GiB"))
    given = json.loads(run(capsys, *base, *options, "--json", "--policy", chosen["policy"]))
    for key in ("notes", "policy_choice"):
        chosen.pop(key)
        given.pop(key, None)
    assert chosen == given


def test_a_memory_budget_that_chooses_per_layer_says_what_it_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``per_layer`` makes the tower's units collectives: the chooser's note says it needs
    the same tower calls on every rank (even media) or ``balance_media=True``; with
    ``--balance-media`` it needs neither, and the note says nothing of it."""
    peaks = {
        c["policy"]: c["peak_bytes"]
        for c in _budget_run(capsys, "--memory-budget", "1GiB")["policy_choice"]["candidates"]
    }
    tight = ["--memory-budget", str(peaks["replicate"] - 1)]
    chosen = _budget_run(capsys, *tight)
    assert chosen["policy"] == "per_layer"
    needs = [note for note in chosen["notes"] if "needs even media" in note]
    assert needs == [
        "policy 'per_layer' for 'vision' needs even media (every rank calls it the same number "
        "of times in each forward; otherwise every rank raises UnevenMediaError) or "
        "balance_media=True (CLI: --balance-media)"
    ]
    balanced = _budget_run(capsys, *tight, "--balance-media")
    assert balanced["policy"] == "per_layer"
    assert not any("needs even media" in note for note in balanced["notes"])
    roomy = _budget_run(capsys, "--memory-budget", "1GiB")
    assert not any("needs even media" in note for note in roomy["notes"])


@pytest.mark.transformers
def test_a_tower_that_cannot_run_on_meta_is_noted_as_checked_at_the_first_step(
    capsys: pytest.CaptureFixture[str], transformers: Any
) -> None:
    """Qwen2-VL's vision tower builds tensors on the CPU in its forward, so the layout probe
    cannot run it on the meta device; its family layout is trusted. The plan's note says
    so and that its calls are checked at the first step, not the raw RuntimeError."""
    out = run(capsys, "--model", "qwen2_vl", "--world-size", "8", "--balance-media")
    assert (
        "'model.visual': packed-by-grid, not probed (the tower ran on none of the 1 probe "
        "inputs on the meta device); its calls are checked at the first step" in out
    )
    assert "RuntimeError" not in out
    assert "Tensor on device meta" not in out


def test_balance_media_names_the_group_each_call_is_balanced_over(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The default balance group (``"auto"``): every rank up to 64, groups of 64 at 128
    ranks; a tower with units (``per_layer``) is balanced over every rank."""
    base = ["--model", "deepseek-v41-tiny", "--balance-media", "--freeze", "vision"]
    small = run(capsys, *base, "--world-size", "2", "--policy", "root")
    assert "each call balanced over all 2 data-parallel ranks" in small
    big = run(capsys, *base, "--world-size", "128", "--policy", "root")
    assert "over groups of at most 64 consecutive data-parallel ranks ('auto')" in big
    assert "each call balanced within a group of 64 of the 128 data-parallel ranks" in big
    assert "slot 170.0 KiB" in big  # 64 ranks' slots, not 128's
    units = run(capsys, *base, "--world-size", "128", "--policy", "per_layer")
    assert "tower calls balanced over all data-parallel ranks" in units
    assert "each call balanced over all 128 data-parallel ranks" in units


# --------------------------------------------------------------------------- --tp / --ep
def _tp_planned_bytes() -> tuple[int, int]:
    """(bytes of the tiny preset's parameters that its TP plan shards, all bytes), fp32."""
    from model_deepseek_v41.config import DeepseekV41Config
    from model_deepseek_v41.modeling import build_deepseek_v41
    from model_deepseek_v41.tensor_parallel import deepseek_v41_tp_plan

    model = build_deepseek_v41(DeepseekV41Config.preset("tiny"), device="meta")
    planned = deepseek_v41_tp_plan(model, tp_size=2)
    sharded = sum(p.numel() * 4 for path in planned for p in model.get_submodule(path).parameters())
    return sharded, sum(p.numel() * 4 for p in model.parameters())


def test_tp_counts_tp_sharded_parameters_by_their_share(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """8 ranks at tp=2 shard over 4 data-parallel ranks like a 4-rank job, except that
    the planned MLPs' parameters (and their gradients and AdamW state) are halved first."""
    tp = json.loads(
        run(capsys, "--model", "deepseek-v41-tiny", "--world-size", "8", "--tp", "2", "--json")
    )
    dp = json.loads(run(capsys, "--model", "deepseek-v41-tiny", "--world-size", "4", "--json"))
    assert tp["parallel_dims"] == {
        "names": ["dp_shard", "tp"],
        "sizes": [4, 2],
        "dp_names": ["dp_shard"],
    }
    assert dp["parallel_dims"] == {"names": ["dp_shard"], "sizes": [4], "dp_names": ["dp_shard"]}
    assert (tp["dp_shard"], dp["dp_shard"]) == (4, 4)
    sharded, total = _tp_planned_bytes()
    assert dp["totals"]["sharded_param_bytes_per_rank"] == total // 4
    saved = sharded // 2 // 4  # half of each planned parameter stays on the TP peer
    assert tp["totals"]["sharded_param_bytes_per_rank"] == total // 4 - saved
    for key, per_param in (("gradient_bytes", 1), ("optimizer_bytes", 2)):  # AdamW: 2 states
        assert dp["memory"][key] - tp["memory"][key] == per_param * saved, key
    assert any("tensor parallel: 8 ranks as ('dp', 'tp') = (4, 2)" in n for n in tp["notes"])
    assert any("the preset's TP plan" in n for n in tp["notes"])


def test_tp_uses_the_llama_plan_for_transformers_models_and_spares_frozen_towers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers")
    args = ("--model", "llava", "--freeze", "vision", "--policy", "per_layer", "--json")
    tp = json.loads(run(capsys, *args, "--world-size", "8", "--tp", "2"))
    (note,) = [n for n in tp["notes"] if n.startswith("tensor parallel")]
    assert "the Llama/Qwen2-style TP plan" in note
    # 7 projections per language layer of transformers' default Llama (32 layers).
    assert "(224 modules)" in note
    whole = json.loads(run(capsys, *args, "--world-size", "4"))
    assert (
        tp["totals"]["sharded_param_bytes_per_rank"]
        < whole["totals"]["sharded_param_bytes_per_rank"]
    )

    def tower(costs: dict[str, Any]) -> list[Any]:
        return [
            (u["paths"], u["sharded_bytes_per_rank"], u["collectives"])
            for u in costs["units"]
            if any(path.startswith("model.vision_tower") for path in u["paths"])
        ]

    assert tower(tp)
    assert tower(tp) == tower(whole)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--world-size", "8", "--tp", "3"), "--tp 3 does not divide --world-size 8"),
        (("--world-size", "8", "--ep", "2"), "has no EP plan"),
        (("--world-size", "8", "--tp", "2", "--batch", "1x32"), "with --tp give --activations"),
        (("--world-size", "8", "--tp", "8", "--dp-replicate", "2"), "(with --tp 8)"),
    ],
)
def test_tp_and_ep_refusals(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    err = fail(capsys, "--model", "deepseek-v41-tiny", *argv)
    assert message in err, err


def test_a_tp_size_the_model_cannot_divide_names_the_sizes_that_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = fail(capsys, "--model", "deepseek-v41-tiny", "--world-size", "7", "--tp", "7")
    assert "--tp 7: tp size 7 does not divide the" in err, err
    assert "use a tp size among [1, 2" in err, err
