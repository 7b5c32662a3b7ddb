"""The training runs of the framework adapters (Lightning, Fabric, torchtitan), as cases
shared by the torchrun scenarios and the tests that compare them with one process.

Each :class:`FrameworkCase` is a :class:`loops.LoopCase` (model, media per rank and
step, frozen-tower policy, ``balance_media``, optimizer) plus what the framework adds:
gradient clipping by norm. Rank ``r`` trains step ``s`` on ``case.batch(1000 s + 10 r,
case.media(s, r))``, exactly the batches of the single-process reference
(``reference.reference_training`` with the same clipping), so losses, first-step
gradients (before clipping) and final parameters must agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from loops import NO_MEDIA, LoopCase, _hf_batch, _hf_lora, _hf_loss, per_rank, toy
from reference import ReferenceRun, reference_training

#: Every framework run: 2 ranks.
WORLD = 2
#: The clipping norm of the cases that clip (the toy model's gradient norm is ~3).
MAX_NORM = 0.5
#: Rank 0 has every image, rank 1 none (balance_media spreads them over both).
ALL_IMAGES_ON_RANK0 = per_rank({"images": 2}, NO_MEDIA)


@dataclass(frozen=True)
class FrameworkCase:
    loop: LoopCase
    #: ``gradient_clip_val`` / ``clip_gradients(max_norm=...)``; None: no clipping.
    max_norm: float | None = None
    #: torchtitan's ``compile.backend`` with ``compile.enable`` (None: no compile).
    compile_backend: str | None = None

    @property
    def name(self) -> str:
        return self.loop.name

    def batch(self, step: int, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s batch of step ``step`` (the reference's, see the module doc)."""
        made: dict[str, Any] = self.loop.batch(1000 * step + 10 * rank, self.loop.media(step, rank))
        return made

    def loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return self.loop.loss(model, batch)


def _case(
    name: str, *, max_norm: float | None = None, compile_backend: str | None = None, **loop: Any
) -> FrameworkCase:
    loop.setdefault("build", toy())
    loop.setdefault("optimizer", "adamw")
    return FrameworkCase(LoopCase(name, **loop), max_norm=max_norm, compile_backend=compile_backend)


def _llava_lora(name: str, **loop: Any) -> FrameworkCase:
    """LoRA on LLaVA's language model (base and tower frozen) under ``per_layer``."""
    return _case(
        name,
        build=_hf_lora("llava", "decoder"),
        batch=_hf_batch("llava"),
        loss=_hf_loss,
        policy="per_layer",
        **loop,
    )


#: Lightning's Trainer with ModelParallelStrategy (configure_model calls the library).
LIGHTNING: dict[str, FrameworkCase] = {
    case.name: case
    for case in (
        _case("lightning_root", max_norm=MAX_NORM),
        _case("lightning_per_layer", policy="per_layer", max_norm=MAX_NORM),
        _case(
            "lightning_balance_media",
            policy="per_layer",
            balance_media=True,
            media=ALL_IMAGES_ON_RANK0,
        ),
        _llava_lora("lightning_lora"),
        # Trained for 2 steps, saved, resumed with fit(ckpt_path=...) for the third.
        _case("lightning_resume", policy="per_layer", max_norm=MAX_NORM),
    )
}

#: Fabric with ModelParallelStrategy(parallelize_fn=...) and the user's own loop.
FABRIC: dict[str, FrameworkCase] = {
    case.name: case
    for case in (
        _case("fabric_per_layer", policy="per_layer", max_norm=MAX_NORM),
        _case(
            "fabric_balance_media",
            policy="per_layer",
            balance_media=True,
            media=ALL_IMAGES_ON_RANK0,
        ),
    )
}

#: torchtitan's parallelize_fn on a meta-device model and ParallelDims' mesh.
TORCHTITAN: dict[str, FrameworkCase] = {
    case.name: case
    for case in (
        _case("torchtitan_root", max_norm=MAX_NORM),
        _case("torchtitan_per_layer", policy="per_layer"),
        _case(
            "torchtitan_balance_media",
            policy="per_layer",
            balance_media=True,
            media=ALL_IMAGES_ON_RANK0,
        ),
        # compile.enable: every tower block and decoder layer compiled (fullgraph=True).
        _case(
            "torchtitan_compile", policy="per_layer", max_norm=MAX_NORM, compile_backend="aot_eager"
        ),
    )
}

CASES: dict[str, FrameworkCase] = {**LIGHTNING, **FABRIC, **TORCHTITAN}


@functools.cache
def reference(name: str) -> ReferenceRun:
    """One process on the global batches of every step (with the case's clipping)."""
    case = CASES[name]
    return reference_training(
        case.loop.build_model,
        case.loop.step_fn(),
        steps=case.loop.steps,
        world=WORLD,
        compute_dtype=case.loop.compute_dtype,
        optimizer=case.loop.optimizer_fn(),
        max_norm=case.max_norm,
    )


# ------------------------------------------------------------------ staged training
#: The usual vision-language recipe: the projector alone, then with the language model,
#: then everything (the tower too). Each stage is a new run from the last one's checkpoint.
STAGES: tuple[tuple[str, ...], ...] = (
    ("multi_modal_projector.",),
    ("multi_modal_projector.", "language_model.", "lm_head."),
    ("",),
)
STEPS_PER_STAGE = 2
STAGE_POLICY = "per_layer"


def stage_model(stage: int) -> torch.nn.Module:
    """The toy VLM with stage ``stage``'s freeze set (its initial values: seed 0)."""
    model = toy(freeze="none")()
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(STAGES[stage]))
    return model


def stage_batch(step: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s batch of global step ``step`` (steps count on across stages)."""
    from loops import toy_batch

    return toy_batch(1000 * step + 10 * rank, {"images": 1})


def stage_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
