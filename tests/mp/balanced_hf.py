"""balance_media=True on real models: tiny transformers LLaVA, Qwen2-VL and Idefics3, and
the DeepSeek-V4.1 reference model, as loop cases (``loops.LoopCase``) and one
accumulation scenario, each compared with one process running the whole global batch.

Every case runs three steps, each with its own media distribution (``STEPS``): even, one
rank text-only, all media on one rank; for Qwen2-VL the middle step gives images and
videos to one rank and images only to the other (the tower runs twice there, once on
the other rank). Every step starts with an eval pass (the tower runs locally, or
balanced where it owns units) and, for the transformers models, ``generate()`` on a
prompt with one image on every rank, whose tokens are recorded (``GENERATED``) and
compared with the reference's. Per model the risky combinations (``per_layer`` with a
trainable tower and with LoRA in the tower, ``replicate`` with a frozen tower) and one
``root`` case; Qwen2-VL also with one tower call per image, and with a 2 x 2 HSDP mesh
on 4 ranks.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from balanced_families import CASES as FAMILY_CASES
from loops import LoopCase, Media, _hf, _hf_batch, _hf_lora, _hf_loss, deepseek, deepseek_batch
from torch import Tensor, nn

#: Per model, per step, each rank's media (2 ranks).
STEPS: dict[str, tuple[tuple[dict[str, int], ...], ...]] = {
    "images": (
        ({"images": 1}, {"images": 1}),  # even
        ({"images": 2}, {"images": 0}),  # rank 1 text-only
        ({"images": 0}, {"images": 3}),  # all media on rank 1
    ),
    "qwen2_vl": (
        ({"images": 1, "videos": 1}, {"images": 1, "videos": 1}),  # even, two calls each
        ({"images": 1, "videos": 1}, {"images": 2, "videos": 0}),  # image+video on rank 0 only
        ({"images": 0, "videos": 0}, {"images": 2, "videos": 1}),  # all media on rank 1
    ),
}
#: 4 ranks (HSDP 2 x 2): a text-only rank, video on one rank only, all media on one rank.
HSDP_STEPS: tuple[tuple[dict[str, int], ...], ...] = (
    ({"images": 1, "videos": 1}, {"images": 0}, {"images": 2}, {"images": 1}),
    ({"images": 0}, {"images": 0}, {"images": 0}, {"images": 2, "videos": 1}),
)


def steps(per_step: tuple[tuple[dict[str, int], ...], ...]) -> Media:
    return lambda step, rank: per_step[step][rank]


#: Tokens ``generate()`` produced in each eval pass, in call order (one list per process).
GENERATED: list[list[int]] = []
NEW_TOKENS = 3


def _prompt(name: str, seed: int, media: bool) -> dict[str, Any]:
    """One sample with one image (Qwen2-VL: and one video), or none."""
    from hf_vlms import HF_VLMS

    count = int(media)
    if name == "llava":
        batch = HF_VLMS[name].batch(seed, images=count)
        prompt = {"input_ids": batch["input_ids"][:1, :20]}
        if media:
            prompt["pixel_values"] = batch["pixel_values"]
        return prompt
    if name == "qwen2_vl":
        batch = HF_VLMS[name].batch(seed, images=count, videos=count, seq=20)
    else:
        batch = HF_VLMS[name].batch(seed, images=count)
    return {key: value for key, value in batch.items() if key != "labels"}


def generate_tokens(name: str) -> Callable[[nn.Module, dict[str, Any]], object]:
    """The eval pass's extra call: greedy ``generate()`` on a prompt with media where the
    rank's batch of the step has media (uneven across ranks in most steps), recorded."""

    def run(model: nn.Module, batch: dict[str, Any]) -> object:
        seed = int(batch["input_ids"][0, -1])  # differs per rank and step, same in both runs
        media = any(key.startswith("pixel_values") for key in batch)
        prompt = _prompt(name, seed, media)
        out = model.generate(  # type: ignore[operator]
            **prompt,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        GENERATED.append(out[0, -NEW_TOKENS:].tolist())
        return out

    return run


# ------------------------------------------------------------------------------ models
def _lora_deepseek() -> nn.Module:
    import peft

    model = deepseek(dtype=torch.float32)()
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        # The tower's attention and MLP, and the decoder's attention (as for the
        # transformers models: a text-only rank's loss then needs a gradient too).
        target_modules=r".*(vision\.blocks\.\d+\.(attn\.qkv|mlp\.down)|layers\.\d+\.self_attn\.qkv)",
        init_lora_weights=False,
    )
    torch.manual_seed(0)  # the adapters' random init (init_lora_weights=False)
    wrapped: nn.Module = peft.get_peft_model(model, config)
    return wrapped


def _frozen_deepseek() -> nn.Module:
    model = deepseek(dtype=torch.float32)()
    model.vision.requires_grad_(False)  # type: ignore[union-attr,operator]
    return model


def _deepseek_loss(model: nn.Module, batch: dict[str, Any]) -> Tensor:
    loss: Tensor = model(**batch)
    return loss


def per_image_qwen(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """Qwen2-VL whose ``get_image_features`` calls the tower once per image (the model's
    own function, one grid row at a time): ranks make different numbers of calls."""

    def make() -> nn.Module:
        model = build()
        base = next(m for m in model.modules() if type(m).__name__ == "Qwen2VLModel")
        original = base.get_image_features

        def per_image(
            self: nn.Module, pixel_values: Tensor, image_grid_thw: Tensor, **kwargs: Any
        ) -> Any:
            rows = image_grid_thw.prod(-1).tolist()
            parts = [
                original(chunk, image_grid_thw[i : i + 1], **kwargs)
                for i, chunk in enumerate(pixel_values.split(rows))
            ]
            out = parts[0]
            out.pooler_output = tuple(p for part in parts for p in part.pooler_output)
            return out

        base.get_image_features = types.MethodType(per_image, base)  # type: ignore[method-assign]
        return model

    return make


def _tower(name: str, tower: str) -> Callable[[], nn.Module]:
    if name == "deepseek":
        return {
            "frozen": _frozen_deepseek,
            "trainable": deepseek(dtype=torch.float32),
            "lora": _lora_deepseek,
        }[tower]
    if tower == "lora":
        return _hf_lora(name, "tower")
    return _hf(name, freeze_tower=tower == "frozen")


#: Per model: (policy, tower) combinations; every model has the risky three and one root.
COMBOS: tuple[tuple[str, str], ...] = (
    ("per_layer", "trainable"),
    ("per_layer", "lora"),
    ("replicate", "frozen"),
)
ROOT: dict[str, str] = {"llava": "lora", "qwen2_vl": "frozen", "idefics3": "trainable"}
MODELS = ("llava", "qwen2_vl", "idefics3", "deepseek")


def _case(model: str, policy: str, tower: str, **extra: Any) -> LoopCase:
    name = model
    hf = name != "deepseek"
    options: dict[str, Any] = {
        "media": steps(STEPS["qwen2_vl" if name == "qwen2_vl" else "images"]),
        "policy": policy,
        "balance_media": True,
        "loop": "eval",
        "batch": _hf_batch(name) if hf else deepseek_batch,
        "loss": _hf_loss if hf else _deepseek_loss,
        "eval_extra": generate_tokens(name) if hf else None,
        "parallelizer": "multimodal" if hf else "deepseek",
    }
    options.update(extra)
    options.setdefault("name", f"{name}_{policy}_{tower}")
    options.setdefault("build", _tower(name, tower))
    return LoopCase(**options)


def _cases() -> list[LoopCase]:
    cases = []
    for name in MODELS:
        combos = list(COMBOS)
        if name in ROOT:
            combos.append(("root", ROOT[name]))
        cases += [_case(name, policy, tower) for policy, tower in combos]
    cases += [
        # One tower call per image: 2 image calls and a video call on one rank, 1 + 1 or
        # none on the other.
        _case(
            "qwen2_vl",
            "per_layer",
            "lora",
            name="qwen2_vl_per_image_per_layer_lora",
            build=per_image_qwen(_tower("qwen2_vl", "lora")),
        ),
        _case("deepseek", "root", "lora", name="deepseek_root_lora", loop="plain"),
        _case(
            "qwen2_vl",
            "per_layer",
            "trainable",
            name="hsdp_qwen2_vl_per_layer_trainable",
            media=steps(HSDP_STEPS),
            steps=len(HSDP_STEPS),
            eval_extra=None,
            world=4,
            dp_replicate=2,
        ),
    ]
    return cases


CASES: dict[str, LoopCase] = {case.name: case for case in _cases()}

# ------------------------------------------------------------ activation checkpointing
#: Per step, each rank's LLaVA images: every image on rank 0 (one moves), then uneven.
CHECKPOINTED_STEPS: tuple[tuple[dict[str, int], ...], ...] = (
    ({"images": 2}, {"images": 0}),
    ({"images": 1}, {"images": 3}),
)
#: (form, policy, tower) of the checkpointed cases: each form of ``loops.CHECKPOINTING``
#: applied after sharding, with a frozen tower under a policy whose tower owns units
#: (``per_layer``: placeholder runs, units' backward) and one whose tower owns none, and
#: with a trainable tower. A frozen tower under transformers' forms returns outputs that
#: require grad (``enable_input_require_grads`` on its embeddings) on the ranks that run
#: it only; torch's wrapper puts the join site's pre-hook inside a checkpointed region.
CHECKPOINTED_COMBOS: tuple[tuple[str, str, str], ...] = (
    ("hf", "per_layer", "frozen"),  # the hang of issue 33
    ("hf", "replicate", "trainable"),
    ("hf_reentrant", "root", "frozen"),
    ("hf_reentrant", "per_layer", "trainable"),
    ("wrapper", "per_layer", "frozen"),
    ("wrapper", "root", "trainable"),
    ("wrapper_reentrant", "replicate", "frozen"),
    ("wrapper_reentrant", "per_layer", "trainable"),
)


def _checkpointed_cases() -> list[LoopCase]:
    return [
        _case(
            "llava",
            policy,
            tower,
            name=f"llava_{form}_{policy}_{tower}",
            media=steps(CHECKPOINTED_STEPS),
            steps=len(CHECKPOINTED_STEPS),
            loop="plain",
            eval_extra=None,
            checkpointing=form,
            checkpoint_after_sharding=True,
        )
        for form, policy, tower in CHECKPOINTED_COMBOS
    ]


#: balance_media under activation checkpointing applied after sharding (issue 33).
CHECKPOINTED: dict[str, LoopCase] = {case.name: case for case in _checkpointed_cases()}
#: These cases, the checkpointed ones and those of the tower families of issue 26
#: (``balanced_families``), which run as scenarios ``balance_hf_<case>`` in the same launch.
ALL_CASES: dict[str, LoopCase] = {**CASES, **CHECKPOINTED, **FAMILY_CASES}


def cases_for(world: int) -> list[str]:
    """Every case of ``ALL_CASES`` for ``world`` ranks (the launch's scenarios)."""
    return [name for name, case in ALL_CASES.items() if case.world == world]


def hf_cases_for(world: int) -> list[str]:
    """The cases of this module (without the families') for ``world`` ranks."""
    return [name for name, case in CASES.items() if case.world == world]


# ------------------------------------------------------------------ gradient accumulation
#: Per rank: the media of each micro-batch (a text-only one on each rank, at different
#: places), for LLaVA with LoRA in the tower and Qwen2-VL with a trainable tower.
ACCUMULATION: dict[str, tuple[str, tuple[tuple[dict[str, int], ...], ...]]] = {
    "llava": ("lora", (({"images": 0}, {"images": 2}), ({"images": 1}, {"images": 0}))),
    "qwen2_vl": (
        "trainable",
        (
            ({"images": 0, "videos": 0}, {"images": 1, "videos": 1}),
            ({"images": 1, "videos": 0}, {"images": 0, "videos": 0}),
        ),
    ),
}


def micro_batches(name: str, rank: int) -> list[dict[str, Any]]:
    media = ACCUMULATION[name][1][rank]
    return [_hf_batch(name)(500 + 10 * rank + k, m) for k, m in enumerate(media)]


def accumulation_model(name: str) -> nn.Module:
    return _tower(name, ACCUMULATION[name][0])()


def accumulation_reference(name: str, *, world: int = 2) -> dict[str, Tensor]:
    """One process: every rank's micro-batches' losses summed, divided by the ranks
    (FSDP averages the ranks' accumulated gradients)."""
    model = accumulation_model(name)
    total = sum(
        (_hf_loss(model, micro) for r in range(world) for micro in micro_batches(name, r)),
        start=torch.zeros(()),
    )
    (total / world).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
