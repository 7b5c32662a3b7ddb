"""LoRA (PEFT) on the tiny transformers VLMs of :mod:`hf_vlms`, for plans and loops.

``where="decoder"`` adapts the decoder's ``q_proj`` / ``v_proj`` only; ``"tower"``
also adapts the vision tower's attention (CLIP's ``q_proj`` / ``v_proj``, Qwen2-VL's
fused ``qkv``). ``get_peft_model`` freezes every base weight, tower and projector
included, so the model *without* LoRA to compare with is :func:`frozen_like_peft`.
Adapters start non-zero (``init_lora_weights=False``) so that both adapter
matrices get a gradient in the first step.
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: PEFT ``target_modules`` per (model, where): a regex string or a list of name suffixes.
TARGETS: dict[tuple[str, str], str | list[str]] = {
    ("llava", "decoder"): r".*language_model.*\.(q_proj|v_proj)",
    ("llava", "tower"): ["q_proj", "v_proj"],
    # The tower and the last decoder layer only: decoder layer 0 is a fully frozen unit.
    ("llava", "tower_last_layer"): (
        r".*(vision_tower.*|language_model\.layers\.1\.).*(q_proj|v_proj)"
    ),
    ("qwen2_vl", "decoder"): r".*language_model.*\.(q_proj|v_proj)",
    ("qwen2_vl", "tower"): ["q_proj", "v_proj", "qkv"],
    # SigLIP, Idefics3's vision transformer and the Whisper-style audio encoder name
    # their attention projections like the decoders: one list adapts both.
    ("paligemma", "tower"): ["q_proj", "v_proj"],
    ("idefics3", "tower"): ["q_proj", "v_proj"],
    ("qwen2_audio", "tower"): ["q_proj", "v_proj"],
}

#: The path prefix a ``PeftModel`` puts before the wrapped model's names.
PEFT_PREFIX = "base_model.model."


def with_lora(model: nn.Module, name: str, where: str, *, rank: int = 4) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with LoRA adapters of ``rank``."""
    import peft

    config = peft.LoraConfig(
        r=rank, lora_alpha=8, target_modules=TARGETS[name, where], init_lora_weights=False
    )
    wrapped: nn.Module = peft.get_peft_model(model, config)
    return wrapped


def frozen_like_peft(model: nn.Module) -> nn.Module:
    """``model`` with every parameter frozen, as ``get_peft_model`` leaves the base."""
    model.requires_grad_(False)
    return model


def strip_peft(name: str) -> str:
    """A PEFT parameter or module name in the wrapped model's terms."""
    return (
        name.removeprefix(PEFT_PREFIX)
        .replace(".base_layer.", ".")
        .replace("_checkpoint_wrapped_module.", "")
    )


def lora_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" in n]


def checkpoint_layers(model: nn.Module) -> Any:
    """torch's ``checkpoint_wrapper`` around every decoder layer and tower block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from transformers.modeling_layers import GradientCheckpointingLayer

    apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, GradientCheckpointingLayer)
    )
    return model
