"""The training loops users write, as cases shared by the torchrun scenarios and the tests.

A :class:`LoopCase` names a model (hand-made or a tiny transformers VLM), how it is
sharded (frozen-tower policy, ``uneven_media``, activation checkpointing, mesh), the
loop shape (a no-grad pass between forward and backward, eval and ``generate()``
between steps, two forwards per backward, ...), which media each rank gets in each
step, the optimizer, and what must happen: train exactly like the single-process
reference (``"match"``), or stop on every rank with ``UnevenMediaError`` before any
mismatched collective (``"uneven_error"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from loop_models import CrossLayer, ToyBlock, build_toy_vlm, per_image_deepseek, toy_vlm_batch
from reference import OptimizerFn, StepFn, adamw, sgd
from torch import nn

LR = 0.05
Media = Callable[[int, int], dict[str, int]]  # (step, rank) -> {"images": n, "videos": m}


def same(images: int = 1, videos: int = 0) -> Media:
    return lambda step, rank: {"images": images, "videos": videos}


def per_rank(*media: dict[str, int]) -> Media:
    """Rank ``r`` gets ``media[r % len(media)]`` in every step."""
    return lambda step, rank: media[rank % len(media)]


def no_media_in_step(step_without: int, images: int = 1) -> Media:
    return lambda step, rank: {"images": 0 if step == step_without else images, "videos": 0}


# ----------------------------------------------------------------------------- models
def toy(*, freeze: str = "tower", **kwargs: Any) -> Callable[[], nn.Module]:
    """A ToyVLM builder; ``freeze``: "tower", "none" or "stage1" (only the projector trains)."""

    def build() -> nn.Module:
        model = build_toy_vlm(0, **kwargs)
        if freeze == "tower":
            model.vision_tower.requires_grad_(False)
        elif freeze == "stage1":
            model.requires_grad_(False)
            model.multi_modal_projector.requires_grad_(True)
        elif freeze != "none":
            raise ValueError(f"unknown freeze {freeze!r}")
        return model

    return build


def toy_batch(seed: int, media: dict[str, int]) -> dict[str, Any]:
    return toy_vlm_batch(images=media.get("images", 0), videos=media.get("videos", 0), seed=seed)


def toy_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    loss: torch.Tensor = model(**batch)
    return loss


#: The activation-checkpointing forms of :func:`apply_checkpointing`.
CHECKPOINTING = ("hf", "hf_reentrant", "wrapper", "wrapper_reentrant")


def apply_checkpointing(model: nn.Module, how: str | None) -> None:
    """``"hf"``: transformers' ``gradient_checkpointing_enable()`` (non-reentrant, its
    default), ``"hf_reentrant"`` with ``use_reentrant=True``; ``"wrapper"``: torch's
    ``checkpoint_wrapper`` (non-reentrant) around every block and cross-attention layer
    (of a transformers model: every ``GradientCheckpointingLayer``, decoder layers and
    tower blocks), ``"wrapper_reentrant"`` the same with ``CheckpointImpl.REENTRANT``."""
    if how is None:
        return
    if how in ("hf", "hf_reentrant"):
        options = {"use_reentrant": True} if how == "hf_reentrant" else None
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)  # type: ignore[operator]
        return
    if how not in CHECKPOINTING:
        raise ValueError(f"unknown checkpointing {how!r}; valid: {CHECKPOINTING}")
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    layers: tuple[type[nn.Module], ...] = (ToyBlock, CrossLayer)
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = (*layers, GradientCheckpointingLayer)
    except ImportError:  # pragma: no cover - the toy models need no transformers
        pass
    impl = CheckpointImpl.REENTRANT if how == "wrapper_reentrant" else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, layers),
    )


# ------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class LoopCase:
    name: str
    build: Callable[[], nn.Module]
    loop: str = "plain"  # plain | nograd | eval | two_forwards
    media: Media = field(default_factory=same)
    #: A frozen-tower policy, or per-module policies (module path -> policy, "*" the rest).
    policy: str | dict[str, str] = "root"
    uneven_media: bool = False
    #: ``MultimodalParallelizer(balance_media=True)``: every tower call spread over the ranks.
    balance_media: bool = False
    precision: str = "fp32"  # fp32 | bf16 (bf16 compute, fp32 master weights and reduction)
    optimizer: str = "sgd"  # sgd | adamw
    expect: str = "match"  # match | uneven_error
    checkpointing: str | None = None  # None or one of CHECKPOINTING
    #: Apply ``checkpointing`` after sharding (as transformers' Trainer and users do), not
    #: before planning.
    checkpoint_after_sharding: bool = False
    world: int = 2
    dp_replicate: int = 1
    steps: int = 3
    batch: Callable[[int, dict[str, int]], dict[str, Any]] = toy_batch
    loss: Callable[[nn.Module, dict[str, Any]], torch.Tensor] = toy_loss
    #: Extra no-grad calls for the "eval" loop, e.g. ``generate()`` of a transformers model.
    eval_extra: Callable[[nn.Module, dict[str, Any]], object] | None = None
    parallelizer: str = "multimodal"  # multimodal | deepseek
    keep_fp32: Callable[[str], bool] = lambda name: False
    #: Tolerance after optimizer steps when weights are *stored* in bf16 (see compare.py).
    update_tol: float | None = None
    #: Gradient tolerance, when not the compute dtype's (see the case that sets it).
    grad_tol: float | None = None

    def build_model(self) -> nn.Module:
        """The model with activation checkpointing applied (before any sharding), or
        without it when ``checkpoint_after_sharding`` (``after_sharding`` applies it)."""
        model = self.build()
        if not self.checkpoint_after_sharding:
            apply_checkpointing(model, self.checkpointing)
        return model

    def after_sharding(self, model: nn.Module) -> None:
        """Apply ``checkpointing`` to the sharded model when ``checkpoint_after_sharding``."""
        if self.checkpoint_after_sharding:
            apply_checkpointing(model, self.checkpointing)

    def reference_model(self) -> nn.Module:
        """The model of the one-process reference: checkpointed whenever the case is."""
        model = self.build_model()
        self.after_sharding(model)
        return model

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16" else None

    def optimizer_fn(self) -> OptimizerFn:
        if self.optimizer == "adamw":
            return adamw(lr=1e-2, weight_decay=0.1)
        return sgd(LR)

    def step_fn(self, device: torch.device | None = None) -> StepFn:
        """The loop's step; batches are moved to ``device`` when given."""

        def batch(step: int, rank: int, k: int = 0) -> dict[str, Any]:
            made = self.batch(1000 * step + 10 * rank + k, self.media(step, rank))
            if device is None:
                return made
            return {
                key: value.to(device) if isinstance(value, torch.Tensor) else value
                for key, value in made.items()
            }

        def step_fn(model: nn.Module, step: int, rank: int) -> torch.Tensor:
            if self.loop == "eval":
                model.eval()
                with torch.no_grad():
                    self.loss(model, batch(step, rank, 7))
                    if self.eval_extra is not None:
                        self.eval_extra(model, batch(step, rank, 8))
                model.train()
            loss = self.loss(model, batch(step, rank))
            if self.loop == "nograd":
                with torch.no_grad():
                    self.loss(model, batch(step, rank, 1))
            elif self.loop == "two_forwards":
                loss = loss + self.loss(model, batch(step, rank, 2))
            elif self.loop not in ("plain", "eval"):
                raise ValueError(f"unknown loop {self.loop!r}")
            return loss

        return step_fn


POLICIES = ("root", "per_layer", "replicate")
TWO_CALLS = {"images": 1, "videos": 1}
ONE_CALL = {"images": 1, "videos": 0}
NO_MEDIA = {"images": 0, "videos": 0}


def _toy_cases() -> list[LoopCase]:
    cases: list[LoopCase] = []
    for p in POLICIES:
        cases += [
            # LLaVA stage 1: only the projector trains; a metric pass before backward.
            LoopCase(f"nograd_stage1_{p}", toy(freeze="stage1"), loop="nograd", policy=p),
            LoopCase(f"eval_{p}", toy(), loop="eval", policy=p),
            LoopCase(f"two_forwards_{p}", toy(), loop="two_forwards", policy=p),
            # Images and videos: the tower runs twice per forward on every rank.
            LoopCase(
                f"calls_even_{p}",
                toy(),
                media=per_rank(TWO_CALLS, {"images": 2, "videos": 1}),
                policy=p,
            ),
            LoopCase(
                f"calls_uneven_{p}",
                toy(),
                media=per_rank(TWO_CALLS, ONE_CALL),
                policy=p,
                expect="uneven_error" if p == "per_layer" else "match",
            ),
            LoopCase(f"ckpt_wrapper_{p}", toy(), policy=p, checkpointing="wrapper"),
            LoopCase(
                f"adamw_no_media_{p}",
                toy(),
                media=no_media_in_step(1),
                policy=p,
                optimizer="adamw",
            ),
        ]
    cases += [
        LoopCase(
            "nograd_stage1_per_layer_bf16",
            toy(freeze="stage1"),
            "nograd",
            policy="per_layer",
            precision="bf16",
        ),
        LoopCase("nograd_trainable", toy(freeze="none"), loop="nograd"),
        LoopCase("two_forwards_trainable", toy(freeze="none"), loop="two_forwards"),
        LoopCase(
            "two_forwards_per_layer_bf16",
            toy(),
            loop="two_forwards",
            policy="per_layer",
            precision="bf16",
        ),
        LoopCase(
            "calls_even_trainable",
            toy(freeze="none"),
            media=per_rank(TWO_CALLS, {"images": 3, "videos": 2}),
        ),
        LoopCase(
            "calls_uneven_trainable",
            toy(freeze="none"),
            media=per_rank(TWO_CALLS, ONE_CALL),
            expect="uneven_error",
        ),
        LoopCase(
            "calls_uneven_trainable_uneven_media",
            toy(freeze="none"),
            media=per_rank(TWO_CALLS, ONE_CALL),
            uneven_media=True,
        ),
        LoopCase(
            "text_vs_media_trainable_uneven_media",
            toy(freeze="none"),
            media=per_rank(ONE_CALL, NO_MEDIA),
            uneven_media=True,
            precision="bf16",
        ),
        # One tower call per image.
        LoopCase(
            "per_image_even_per_layer",
            toy(tower_calls="per_image"),
            media=same(images=2),
            policy="per_layer",
        ),
        LoopCase(
            "per_image_even_trainable",
            toy(freeze="none", tower_calls="per_image"),
            media=same(images=2),
        ),
        LoopCase(
            "per_image_uneven_per_layer",
            toy(tower_calls="per_image"),
            media=per_rank({"images": 3}, {"images": 1}),
            policy="per_layer",
            expect="uneven_error",
        ),
        LoopCase(
            "per_image_uneven_root",
            toy(tower_calls="per_image"),
            media=per_rank({"images": 3}, {"images": 1}),
        ),
        LoopCase(
            "per_image_uneven_trainable_uneven_media",
            toy(freeze="none", tower_calls="per_image"),
            media=per_rank({"images": 3}, {"images": 1}),
            uneven_media=True,
        ),
        # Cross-attention decoder layers skipped by text-only batches.
        LoopCase("cross_even_root", toy(cross_every=2), media=same()),
        LoopCase(
            "cross_uneven_root",
            toy(cross_every=2),
            media=per_rank(ONE_CALL, NO_MEDIA),
            expect="uneven_error",
        ),
        LoopCase(
            "cross_uneven_replicate",
            toy(cross_every=2),
            media=per_rank(ONE_CALL, NO_MEDIA),
            policy="replicate",
            expect="uneven_error",
        ),
        LoopCase(
            "cross_uneven_media_true",
            toy(cross_every=2),
            media=per_rank(ONE_CALL, NO_MEDIA),
            uneven_media=True,
        ),
        LoopCase(
            "ckpt_wrapper_trainable",
            toy(freeze="none"),
            checkpointing="wrapper",
            loop="two_forwards",
        ),
        LoopCase(
            "adamw_no_media_trainable_uneven_media",
            toy(freeze="none"),
            media=no_media_in_step(1),
            uneven_media=True,
            optimizer="adamw",
        ),
    ]
    return cases


def _hsdp_cases() -> list[LoopCase]:
    hsdp = {"world": 4, "dp_replicate": 2}
    return [
        LoopCase(
            "hsdp_nograd_stage1_per_layer",
            toy(freeze="stage1"),
            loop="nograd",
            policy="per_layer",
            **hsdp,
        ),
        LoopCase("hsdp_calls_uneven_root", toy(), media=per_rank(TWO_CALLS, ONE_CALL), **hsdp),
        LoopCase(
            "hsdp_calls_uneven_per_layer",
            toy(),
            media=per_rank(TWO_CALLS, ONE_CALL),
            policy="per_layer",
            expect="uneven_error",
            **hsdp,
        ),
        LoopCase(
            "hsdp_adamw_no_media_root", toy(), media=no_media_in_step(1), optimizer="adamw", **hsdp
        ),
        LoopCase(
            "hsdp_cross_uneven_media_true",
            toy(cross_every=2),
            media=per_rank(ONE_CALL, NO_MEDIA),
            uneven_media=True,
            precision="bf16",
            **hsdp,
        ),
    ]


# --------------------------------------------------------------- DeepSeek-V4.1 reference
def _is_vision_norm(name: str) -> bool:
    return name.startswith("vision.") and name.split(".")[-2] in ("norm1", "norm2", "norm")


def deepseek(*, dtype: torch.dtype, per_image: bool = False) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from model_deepseek_v41 import DeepseekV41Config, build_deepseek_v41

        model = build_deepseek_v41(DeepseekV41Config.tiny(), seed=0, dtype=dtype)
        with torch.no_grad():  # norms away from 1.0, so bf16 rounding of them would show
            gen = torch.Generator().manual_seed(3)
            for name, param in model.named_parameters():
                if _is_vision_norm(name):
                    param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
        return per_image_deepseek(model) if per_image else model

    return build


def deepseek_batch(seed: int, media: dict[str, int]) -> dict[str, Any]:
    from model_deepseek_v41 import DeepseekV41Config, make_batch

    batch = make_batch(
        DeepseekV41Config.tiny(),
        batch_size=2,
        seq_len=16,
        num_images_per_sample=media.get("images", 0),
        seed=seed,
    )
    return dict(batch)


def _deepseek_cases() -> list[LoopCase]:
    from compare import BF16_STORAGE_TOL

    return [
        # The tower runs once per image: the grouped fp32-norm unit's modules run twice.
        # Stored in bf16, each block unit reduces once per call and adds the two halves
        # into its bf16 sharded gradient, which rounds differently from one sum: a few
        # bf16 ulps on the gradients too (the fp32-master cases below hold 1e-4).
        LoopCase(
            "ds_per_image_trainable",
            deepseek(dtype=torch.bfloat16, per_image=True),
            parallelizer="deepseek",
            batch=deepseek_batch,
            keep_fp32=_is_vision_norm,
            update_tol=BF16_STORAGE_TOL,
            grad_tol=BF16_STORAGE_TOL,
        ),
        # fp32 master weights, bf16 compute: the norms must still compute with fp32 weights.
        LoopCase(
            "ds_fp32_master_weights",
            deepseek(dtype=torch.float32),
            parallelizer="deepseek",
            batch=deepseek_batch,
            precision="bf16",
            keep_fp32=_is_vision_norm,
        ),
        LoopCase(
            "ds_fp32_master_weights_per_image",
            deepseek(dtype=torch.float32, per_image=True),
            parallelizer="deepseek",
            batch=deepseek_batch,
            precision="bf16",
            keep_fp32=_is_vision_norm,
            loop="two_forwards",
        ),
    ]


# -------------------------------------------------------------------- transformers VLMs
def _hf(name: str, *, freeze_tower: bool = True) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from hf_vlms import HF_VLMS

        vlm = HF_VLMS[name]
        model = vlm.build()
        if freeze_tower:
            model.get_submodule(vlm.tower).requires_grad_(False)
        return model

    return build


def _hf_batch(name: str) -> Callable[[int, dict[str, int]], dict[str, Any]]:
    def batch(seed: int, media: dict[str, int]) -> dict[str, Any]:
        from hf_vlms import HF_VLMS

        counts = {kind: n for kind, n in media.items() if n or kind == "images"}
        made: dict[str, Any] = HF_VLMS[name].batch(seed, **counts)
        return made

    return batch


def _hf_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    from hf_vlms import hf_loss

    return hf_loss(model, batch)


def _llava_generate(model: nn.Module, batch: dict[str, Any]) -> object:
    """Greedy generation of a fixed length from the first sample (image included)."""
    prompt = {"input_ids": batch["input_ids"][:1, :20]}
    if "pixel_values" in batch:
        prompt["pixel_values"] = batch["pixel_values"][:1]
    return model.generate(  # type: ignore[operator]
        **prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0
    )


def _hf_cases() -> list[LoopCase]:
    llava = {"build": _hf("llava"), "batch": _hf_batch("llava"), "loss": _hf_loss}
    qwen = {"build": _hf("qwen2_vl"), "batch": _hf_batch("qwen2_vl"), "loss": _hf_loss}
    mllama = {"build": _hf("mllama"), "batch": _hf_batch("mllama"), "loss": _hf_loss}
    cases: list[LoopCase] = []
    for p in POLICIES:
        cases += [
            LoopCase(
                f"hf_llava_generate_{p}", loop="eval", eval_extra=_llava_generate, policy=p, **llava
            ),
            LoopCase(f"hf_llava_checkpointing_{p}", checkpointing="hf", policy=p, **llava),
        ]
    cases += [
        LoopCase(
            "hf_qwen2_vl_calls_even_per_layer",
            media=per_rank(TWO_CALLS, {"images": 2, "videos": 1}),
            policy="per_layer",
            **qwen,
        ),
        LoopCase(
            "hf_qwen2_vl_calls_uneven_per_layer",
            media=per_rank(TWO_CALLS, ONE_CALL),
            policy="per_layer",
            expect="uneven_error",
            **qwen,
        ),
        LoopCase("hf_qwen2_vl_calls_uneven_root", media=per_rank(TWO_CALLS, ONE_CALL), **qwen),
        LoopCase(
            "hf_mllama_uneven_root",
            media=per_rank({"images": 2}, {"images": 0}),
            expect="uneven_error",
            **mllama,
        ),
        LoopCase(
            "hf_mllama_uneven_media",
            media=per_rank({"images": 2}, {"images": 0}),
            uneven_media=True,
            **mllama,
        ),
        LoopCase("hf_mllama_even_root_bf16", media=same(images=2), precision="bf16", **mllama),
    ]
    return cases


CASES: dict[str, LoopCase] = {
    case.name: case
    for case in (
        *_toy_cases(),
        *_hsdp_cases(),
        *_deepseek_cases(),
        *_hf_cases(),
    )
}


def cases_for(world: int) -> list[str]:
    return [name for name, case in CASES.items() if case.world == world]


# ------------------------------------------------------------------------------ LoRA (PEFT)
def _hf_lora(
    name: str, where: str, *, wrap_layers: bool = False, train: str | None = None
) -> Callable[[], nn.Module]:
    """A transformers VLM with LoRA adapters (see ``hf_lora``); ``wrap_layers`` puts torch's
    ``checkpoint_wrapper`` around every decoder layer and tower block; ``train`` unfreezes
    the parameters whose names contain it (e.g. the projector) after PEFT froze them."""

    def build() -> nn.Module:
        from hf_lora import checkpoint_layers, with_lora
        from hf_vlms import HF_VLMS

        model = with_lora(HF_VLMS[name].build(), name, where)
        if wrap_layers:
            checkpoint_layers(model)
        if train is not None:
            for param_name, param in model.named_parameters():
                if train in param_name:
                    param.requires_grad_(True)
        return model

    return build


def _lora_cases() -> list[LoopCase]:
    """LoRA on decoder and tower (the base frozen, tower included) under every policy,
    LoRA on the decoder only with both kinds of activation checkpointing, and uneven
    media under the policies whose tower has no units (adapters join the root unit)."""
    llava = {"batch": _hf_batch("llava"), "loss": _hf_loss}
    qwen = {"batch": _hf_batch("qwen2_vl"), "loss": _hf_loss}
    uneven = per_rank(TWO_CALLS, ONE_CALL)
    cases = [
        LoopCase(f"lora_llava_tower_{p}", _hf_lora("llava", "tower"), policy=p, **llava)
        for p in POLICIES
    ]
    cases += [
        LoopCase(
            "lora_qwen2_vl_tower_root_uneven", _hf_lora("qwen2_vl", "tower"), media=uneven, **qwen
        ),
        LoopCase(
            "lora_qwen2_vl_tower_per_layer",
            _hf_lora("qwen2_vl", "tower"),
            media=same(images=1, videos=1),
            policy="per_layer",
            **qwen,
        ),
        LoopCase(
            "lora_qwen2_vl_tower_replicate_uneven",
            _hf_lora("qwen2_vl", "tower"),
            media=uneven,
            policy="replicate",
            **qwen,
        ),
        LoopCase(
            "lora_llava_decoder_root_hf_checkpointing",
            _hf_lora("llava", "decoder"),
            checkpointing="hf",
            **llava,
        ),
        LoopCase(
            "lora_llava_decoder_per_layer",
            _hf_lora("llava", "decoder"),
            policy="per_layer",
            **llava,
        ),
        LoopCase(
            "lora_llava_tower_per_layer_checkpoint_wrapper",
            _hf_lora("llava", "tower", wrap_layers=True),
            policy="per_layer",
            **llava,
        ),
        LoopCase(
            "lora_llava_decoder_replicate",
            _hf_lora("llava", "decoder"),
            policy="replicate",
            **llava,
        ),
    ]
    cases += _lora_text_only_rank_cases()
    return cases


#: Rank 0 gets four images, rank 1 none: only rank 0 runs the tower and the projector.
TEXT_ONLY_RANK = per_rank({"images": 4}, NO_MEDIA)


def _lora_text_only_rank_cases() -> list[LoopCase]:
    """A partly trainable module that runs on one rank only (issue 17, item 7): LoRA in
    the tower (and the decoder) while the other rank is text-only, under every policy,
    per-module policies and ``uneven_media=True``, on LLaVA and Qwen2-VL; and LoRA on
    the decoder with a trainable projector. ``per_layer`` gives the tower blocks units
    that only one rank would run: it must stop on every rank with ``UnevenMediaError``.

    Before the fix the first backward crashed in gloo: the first decoder layer's input
    required a gradient on the rank with images only, so that rank reduce-scattered the
    layer before the root unit and the text-only rank after it."""
    from hf_lora import PEFT_PREFIX

    llava = {"batch": _hf_batch("llava"), "loss": _hf_loss, "media": TEXT_ONLY_RANK}
    qwen = {
        "batch": _hf_batch("qwen2_vl"),
        "loss": _hf_loss,
        "media": per_rank({"images": 1, "videos": 1}, NO_MEDIA),
    }
    llava_tower = _hf_lora("llava", "tower")
    qwen_tower = _hf_lora("qwen2_vl", "tower")
    tower = f"{PEFT_PREFIX}model.vision_tower"
    return [
        LoopCase("lora_llava_tower_text_only_rank_root", llava_tower, **llava),
        LoopCase(
            "lora_llava_tower_text_only_rank_uneven_media",
            llava_tower,
            uneven_media=True,
            **llava,
        ),
        LoopCase(
            "lora_llava_tower_text_only_rank_replicate", llava_tower, policy="replicate", **llava
        ),
        LoopCase(
            "lora_llava_tower_text_only_rank_per_layer",
            llava_tower,
            policy="per_layer",
            expect="uneven_error",
            **llava,
        ),
        LoopCase(
            "lora_llava_tower_text_only_rank_mapping_uneven_media",
            llava_tower,
            policy={tower: "replicate", "*": "root"},
            uneven_media=True,
            **llava,
        ),
        LoopCase(
            "lora_llava_decoder_trained_projector_text_only_rank_root",
            _hf_lora("llava", "decoder", train="multi_modal_projector"),
            optimizer="adamw",
            **llava,
        ),
        # Decoder layer 0 is frozen: gradients pass through it on the rank with images only.
        LoopCase(
            "lora_llava_tower_last_layer_text_only_rank_root",
            _hf_lora("llava", "tower_last_layer"),
            **llava,
        ),
        LoopCase("lora_qwen2_vl_tower_text_only_rank_root", qwen_tower, **qwen),
        LoopCase(
            "lora_qwen2_vl_tower_text_only_rank_replicate_uneven_media",
            qwen_tower,
            policy="replicate",
            uneven_media=True,
            **qwen,
        ),
        LoopCase(
            "lora_qwen2_vl_tower_text_only_rank_per_layer",
            qwen_tower,
            policy="per_layer",
            expect="uneven_error",
            **qwen,
        ),
    ]


#: Real transformers models with different tower layouts (see ``hf_vlms``).
ARCHITECTURES = ("llava", "paligemma", "idefics3", "qwen2_vl", "qwen2_audio")


def _arch_cases() -> list[LoopCase]:
    """Each architecture under every policy, in fp32 and bf16 compute, with a frozen tower
    and with LoRA on decoder and tower (every base weight frozen).

    Ranks get one and two media items: a different batch on each rank, but the same
    number of tower calls, so every policy trains (``per_layer`` included)."""
    from compare import BF16_STORAGE_TOL

    variants = {"arch": lambda arch: _hf(arch), "arch_lora": lambda arch: _hf_lora(arch, "tower")}
    cases: list[LoopCase] = []
    for prefix, build in variants.items():
        for arch in ARCHITECTURES:
            for p in POLICIES:
                for precision in ("fp32", "bf16"):
                    # Qwen2-VL's tower passes fp32 rotary tables into every block; a
                    # block that is its own bf16 unit (per_layer) has FSDP2 cast them to
                    # bf16 (cast_forward_inputs), one process does not: about 0.7% on
                    # the gradients (docs/mixed-precision.md). Elsewhere 1e-4 holds.
                    rounded = arch == "qwen2_vl" and p == "per_layer" and precision == "bf16"
                    tol = BF16_STORAGE_TOL if rounded else None
                    cases.append(
                        LoopCase(
                            f"{prefix}_{arch}_{p}_{precision}",
                            build(arch),
                            media=per_rank({"images": 1}, {"images": 2}),
                            policy=p,
                            precision=precision,
                            batch=_hf_batch(arch),
                            loss=_hf_loss,
                            steps=2,
                            grad_tol=tol,
                            update_tol=tol,
                        )
                    )
    return cases


CASES.update({case.name: case for case in (*_lora_cases(), *_arch_cases())})
