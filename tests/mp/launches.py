"""Which scenarios each torchrun launch runs (one launch per world size)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from balanced_hf import cases_for as balanced_hf_cases
from balanced_joined import CASES as BALANCED_JOINED_CASES
from framework_cases import FABRIC, LIGHTNING, TORCHTITAN
from loops import cases_for
from phi4 import CASES as PHI4_CASES
from trainer_cases import SCENARIOS as TRAINER_SCENARIOS

#: Lightning's Trainer and Fabric cases (they take over the launch's process group).
LIGHTNING_CASES = (*LIGHTNING, *FABRIC)

#: Loads one scenario's saved result (the fixtures ``mp2`` / ``mp4`` return one).
MpResults = Callable[[str], dict[str, Any]]

#: Hard limit of one launch: a hang fails the launch (and its tests) instead of stalling CI.
MP_TIMEOUT_S = 300.0

#: Scenarios that read the output of an earlier launch (FSDP_TEST_PREVIOUS_OUT).
NEEDS_PREVIOUS = frozenset({"ckpt_load_other_world"})

LAUNCHES: dict[int, list[str]] = {
    # World size 1 runs only under NCCL (FSDP_TEST_BACKEND=nccl) with one GPU or more.
    1: [
        "core_fp32_1d",
        "core_bf16_1d",
        "mm_frozen_root",
        "ds_trainable",
        "init_meta",
        "mm_offload_tower",
    ],
    2: [
        "core_fp32_1d",
        "core_bf16_1d",
        "core_bf16_fp32_norms",
        "mm_frozen_root",
        "mm_frozen_per_layer",
        "mm_frozen_replicate",
        "mm_offload_tower",
        "ds_frozen_root",
        "ds_frozen_per_layer",
        "ds_frozen_replicate",
        "ds_trainable",
        "init_meta",
        "uneven_root",
        "uneven_replicate",
        "uneven_per_layer",
        "accum_text_only",
        "balance_media",
        "balance_media_accumulation",
        "balance_media_hf",
        *(f"balance_hf_{name}" for name in balanced_hf_cases(2)),
        "balance_hf_accumulation",
        "balance_trainer_checkpointing",
        *(f"balance_joined_{name}" for name in BALANCED_JOINED_CASES),
        "ckpt_load_other_world",
        *(f"loop_{name}" for name in cases_for(2)),
        *(
            f"pretrained_{model}_{policy}"
            for model in ("llava", "qwen2_vl")
            for policy in ("root", "per_layer", "replicate")
        ),
        "pretrained_deepseek_fp32_norms",
        "ckpt_safety_write_failure",
        "ckpt_safety_load_then_save",
        "ckpt_safety_unwritable",
        "ckpt_safety_rank0_only",
        "ckpt_safety_plan_mismatch",
        "hf_export_llava",
        "hf_export_qwen2_vl",
        "inference_llava",
        "inference_qwen2_vl",
        "inference_more_vlms",
        "inference_lora",
        "inference_uneven",
        "misuse_optimizer_before_parallelize",
        "misuse_lora_after_parallelize",
        "misuse_plan_before_lora",
        "crash_uneven_micro_batches",
        "crash_sync_set_after_forward",
        "crash_empty_batch",
        "crash_never_loaded",
        "crash_checkpoint_after_to_empty",
        "crash_sync_never_on",
        "lora_load_llava",
        "arrival_eval_then_train",
        "arrival_eval_alone",
        "arrival_tower_by_hand",
        "arrival_eval_everywhere",
        "arrival_generate_empty_batch",
        "arrival_warns_then_gives_up",
        "arrival_slow_rank_goes_on",
        "arrival_slow_training_rank",
        "entry_ds_fully_shard_module",
        "entry_ds_function",
        *(f"entry_mm_flow_{policy}" for policy in ("root", "per_layer", "replicate")),
        *PHI4_CASES,
        *TRAINER_SCENARIOS,
        "staged_three_stages",
        "staged_shape_changed",
        *LIGHTNING_CASES,
        *TORCHTITAN,
    ],
    4: [
        "core_fp32_1d",
        "core_bf16_1d",
        "core_fp32_hsdp",
        "core_bf16_hsdp",
        "init_meta",
        "uneven_root",
        "uneven_per_layer",
        "accum_text_only",
        "balance_media_hsdp",
        *(f"balance_hf_{name}" for name in balanced_hf_cases(4)),
        "ckpt_save_resume",
        *(f"loop_{name}" for name in cases_for(4)),
        "nd_dp_tp",
        "nd_tp_peer_empty_batch",
        "nd_encoder_work",
        "nd_tp_tower",
        "nd_balanced_input_grads",
        "tp_helper_llava",
        "pp_dp_stages",
        "cp_dp_llava",
        "torchtitan_dp_tp",
        "ep_deepseek_moe",
        "ep_nemo_calls",
        "ep_balance_media",
        "torchtitan_dp_ep",
        # Last: Lightning takes over the launch's process group.
        "lightning_dp_tp",
    ],
}
