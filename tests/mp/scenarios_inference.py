"""Inference on a sharded VLM through entries that bypass the root forward, on real ranks.

transformers' ``generate()`` computes image features before the first forward
(``get_image_features`` on the base model), and users call towers and projectors
by hand. Each scenario shards a tiny model under several frozen-tower policies in
a row and, right after ``parallelize`` and again after one training step, in
``eval()`` and in ``train()`` mode, runs every such entry on the sharded model and
on a single-process copy of the same (gathered) weights, on every rank. A last
training step then checks that the sharded model still trains from the right
weights, and a grad-enabled call outside the forward records what its backward
does.

The results are per rank: one row per (policy, moment, mode, entry) with the error
text, if any, and how far the sharded output is from the copy's.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from torch import nn

from fsdp_core import DistributedContext, build_mesh

#: Parallelizer options of each configuration, by name (several policies per scenario).
CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "llava": {
        "root": {"frozen_multimodal_sharding": "root"},
        "per_layer": {"frozen_multimodal_sharding": "per_layer"},
        "replicate": {"frozen_multimodal_sharding": "replicate"},
        "mapping": {
            "frozen_multimodal_sharding": {"model.vision_tower": "per_layer", "*": "replicate"}
        },
        "uneven_media": {"frozen_multimodal_sharding": "root", "uneven_media": True},
    },
    "qwen2_vl": {
        "root": {"frozen_multimodal_sharding": "root"},
        "per_layer": {"frozen_multimodal_sharding": "per_layer"},
        "replicate": {"frozen_multimodal_sharding": "replicate"},
        "mapping": {"frozen_multimodal_sharding": {"model.visual": "per_layer"}},
        "uneven_media": {"frozen_multimodal_sharding": "root", "uneven_media": True},
    },
}
MOMENTS = ("fresh", "trained")
MODES = ("eval", "train")
NEW_TOKENS = 3
LR = 0.05
#: Largest difference allowed between the sharded model's features and the copy's (fp32).
TOL = 1e-5

Batch = dict[str, Any]
Entry = Callable[[nn.Module, Batch], Any]


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor of an output (ModelOutput, tuple, list, nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _generate(model: nn.Module, prompt: Batch) -> Any:
    return model.generate(  # type: ignore[operator]
        **prompt,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )


def _llava_prompt(rank: int) -> Batch:
    from hf_vlms import HF_VLMS

    batch = HF_VLMS["llava"].batch(100 + rank, images=1)
    return {"input_ids": batch["input_ids"][:1, :20], "pixel_values": batch["pixel_values"][:1]}


def _qwen_prompt(rank: int) -> Batch:
    from hf_vlms import HF_VLMS

    batch = HF_VLMS["qwen2_vl"].batch(100 + rank, images=1, videos=1, seq=24)
    keys = (
        "input_ids",
        "mm_token_type_ids",
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
    )
    return {key: batch[key] for key in keys}


def _llava_entries() -> dict[str, Entry]:
    def features(m: nn.Module, p: Batch) -> Any:
        return m.model.get_image_features(pixel_values=p["pixel_values"])  # type: ignore[operator]

    def tower(m: nn.Module, p: Batch) -> Any:
        return m.model.vision_tower(p["pixel_values"]).last_hidden_state  # type: ignore[operator]

    def projector(m: nn.Module, p: Batch) -> Any:
        hidden = torch.randn(1, 4, 36, generator=torch.Generator().manual_seed(3))
        return m.model.multi_modal_projector(hidden)  # type: ignore[operator]

    def base_model(m: nn.Module, p: Batch) -> Any:
        return m.model(**p).last_hidden_state  # type: ignore[operator]

    def language_model(m: nn.Module, p: Batch) -> Any:
        return m.model.language_model(input_ids=p["input_ids"]).last_hidden_state  # type: ignore[operator]

    return {
        "generate": _generate,
        "get_image_features": features,
        "vision_tower": tower,
        "multi_modal_projector": projector,
        "base_model": base_model,
        "language_model": language_model,
    }


def _qwen_entries() -> dict[str, Entry]:
    def images(m: nn.Module, p: Batch) -> Any:
        return m.model.get_image_features(  # type: ignore[operator]
            pixel_values=p["pixel_values"], image_grid_thw=p["image_grid_thw"]
        )

    def videos(m: nn.Module, p: Batch) -> Any:
        return m.model.get_video_features(  # type: ignore[operator]
            pixel_values_videos=p["pixel_values_videos"], video_grid_thw=p["video_grid_thw"]
        )

    def tower(m: nn.Module, p: Batch) -> Any:
        return m.model.visual(p["pixel_values"], grid_thw=p["image_grid_thw"])  # type: ignore[operator]

    def base_model(m: nn.Module, p: Batch) -> Any:
        return m.model(**p).last_hidden_state  # type: ignore[operator]

    def language_model(m: nn.Module, p: Batch) -> Any:
        return m.model.language_model(input_ids=p["input_ids"]).last_hidden_state  # type: ignore[operator]

    return {
        "generate": _generate,
        "get_image_features": images,
        "get_video_features": videos,
        "visual": tower,
        "base_model": base_model,
        "language_model": language_model,
    }


MODELS: dict[str, tuple[Callable[[int], Batch], Callable[[], dict[str, Entry]]]] = {
    "llava": (_llava_prompt, _llava_entries),
    "qwen2_vl": (_qwen_prompt, _qwen_entries),
}


def _build(name: str) -> nn.Module:
    from hf_vlms import HF_VLMS

    vlm = HF_VLMS[name]
    model = vlm.build()
    model.get_submodule(vlm.tower).requires_grad_(False)
    return model


def _copy(name: str, model: nn.Module) -> nn.Module:
    """A single-process model with the sharded model's current weights (collective)."""
    state = {n: full(p) for n, p in model.named_parameters()}
    copy = _build(name)
    with torch.no_grad():
        for n, p in copy.named_parameters():
            p.copy_(state[n])
    return copy


def _run_entry(entry: Entry, sharded: nn.Module, copy: nn.Module, prompt: Batch) -> dict[str, Any]:
    row: dict[str, Any] = {"error": None, "diff": None, "tokens": None, "ref_tokens": None}
    with torch.no_grad():
        expected = entry(copy, prompt)
        try:
            got = entry(sharded, prompt)
        except Exception as exc:  # recorded for the test (the same on every rank)
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            return row
    if entry is _generate:
        row["tokens"] = got[:, -NEW_TOKENS:].tolist()
        row["ref_tokens"] = expected[:, -NEW_TOKENS:].tolist()
        return row
    pairs = list(zip(_tensors(got), _tensors(expected), strict=True))
    row["diff"] = max(
        ((g.float() - e.float()).abs().max().item() for g, e in pairs if g.is_floating_point()),
        default=0.0,
    )
    return row


def _train_step(name: str, model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> float:
    from hf_vlms import HF_VLMS, hf_loss

    loss = hf_loss(model, HF_VLMS[name].batch(rank, images=1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _grad_call(name: str, model: nn.Module, prompt: Batch) -> str:
    """A grad-enabled feature call outside the forward, then its backward: the outcome."""
    entries = MODELS[name][1]()
    try:
        with torch.enable_grad():
            out = entries["get_image_features"](model, prompt)
            needing = [t for t in _tensors(out) if t.requires_grad]
            if not needing:
                return "no gradient needed"
            sum(t.float().sum() for t in needing).backward()  # type: ignore[union-attr]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "backward ran"


def run_inference(name: str, ctx: DistributedContext) -> dict[str, Any]:
    from multimodal_fsdp import MultimodalParallelizer

    prompt_fn, entries_fn = MODELS[name]
    prompt = prompt_fn(ctx.rank)
    entries = entries_fn()
    rows: list[dict[str, Any]] = []
    hooks: dict[str, tuple[str, ...]] = {}
    after: dict[str, tuple[float, float]] = {}
    grad_calls: dict[str, str] = {}
    for config, options in CONFIGS[name].items():
        model = _build(name)
        parallelizer = MultimodalParallelizer(**options)
        plan = parallelizer.plan(model)
        parallelizer.apply_plan(model, plan, mesh=build_mesh())
        hooks[config] = plan.hook_names()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        for moment in MOMENTS:
            if moment == "trained":
                _train_step(name, model, opt, ctx.rank)
            copy = _copy(name, model)
            for mode in MODES:
                model.train(mode == "train")
                copy.train(mode == "train")
                for entry_name, entry in entries.items():
                    row = _run_entry(entry, model, copy, prompt)
                    row.update(config=config, moment=moment, mode=mode, entry=entry_name)
                    rows.append(row)
        # The sharded model must train on from the weights it had, not from stale copies.
        model.train()
        copy = _copy(name, model)
        copy_opt = torch.optim.SGD([p for p in copy.parameters() if p.requires_grad], lr=LR)
        after[config] = (
            _train_step(name, model, opt, ctx.rank),
            _train_step(name, copy, copy_opt, ctx.rank),
        )
        grad_calls[config] = _grad_call(name, model, prompt)
        dist.barrier()
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"rows": rows, "after": after, "grad_calls": grad_calls})
    return {"ranks": gathered, "hooks": hooks}


#: Other families, generate() only, right after parallelize (PaliGemma and Idefics3
#: crashed like LLaVA; Mllama and Qwen2-Audio compute media inside the forward).
MORE_VLMS = ("paligemma", "idefics3", "mllama", "qwen2_audio")
MORE_POLICIES = ("root", "per_layer", "replicate")


def run_more_vlms(ctx: DistributedContext) -> dict[str, Any]:
    from hf_vlms import HF_VLMS

    from multimodal_fsdp import MultimodalParallelizer

    rows: list[dict[str, Any]] = []
    for name in MORE_VLMS:
        batch = HF_VLMS[name].batch(100 + ctx.rank, images=2 if name == "mllama" else 1)
        batch.pop("labels")
        for policy in MORE_POLICIES:
            model = _build(name)
            MultimodalParallelizer(frozen_multimodal_sharding=policy).parallelize(
                model, mesh=build_mesh()
            )
            copy = _copy(name, model)
            model.eval()
            copy.eval()
            row = _run_entry(_generate, model, copy, batch)
            row.update(config=policy, moment="fresh", mode="eval", entry="generate", model=name)
            rows.append(row)
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, rows)
    return {"ranks": gathered}


#: LoRA (PEFT) models: ``PeftModel.generate`` calls the wrapped transformers model's
#: ``generate``, so the whole decoder, not only the tower, runs outside the root
#: (``PeftModel``) forward. (name, LoRA targets, policy or None for ModelParallelizer).
LORA_CONFIGS: tuple[tuple[str, str, str | None], ...] = (
    ("llava", "tower", "root"),
    ("llava", "tower", "per_layer"),
    ("llava", "tower", "replicate"),
    ("qwen2_vl", "tower", "root"),
    ("text_llama", "decoder", None),
)


def _build_lora(name: str, where: str) -> nn.Module:
    from hf_lora import with_lora

    if name != "text_llama":
        from hf_vlms import HF_VLMS

        return with_lora(HF_VLMS[name].build(), name, where)
    import peft
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=97,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    wrapped: nn.Module = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora)
    return wrapped


def _lora_batch(name: str, rank: int) -> Batch:
    if name == "text_llama":
        gen = torch.Generator().manual_seed(rank)
        ids = torch.randint(3, 97, (2, 12), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}
    from hf_vlms import HF_VLMS

    return HF_VLMS[name].batch(rank, images=1)


def run_lora(ctx: DistributedContext) -> dict[str, Any]:
    from fsdp_core import ModelParallelizer
    from multimodal_fsdp import MultimodalParallelizer

    rows: list[dict[str, Any]] = []
    hooks: dict[str, tuple[str, ...]] = {}
    for name, where, policy in LORA_CONFIGS:
        config = f"{name}_{where}_{policy or 'core'}"
        model = _build_lora(name, where)
        parallelizer = (
            ModelParallelizer()
            if policy is None
            else MultimodalParallelizer(frozen_multimodal_sharding=policy)
        )
        plan = parallelizer.plan(model)
        parallelizer.apply_plan(model, plan, mesh=build_mesh())
        hooks[config] = plan.hook_names()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        prompt = _lora_batch(name, 100 + ctx.rank)
        prompt.pop("labels")
        for moment in MOMENTS:
            if moment == "trained":
                model(**_lora_batch(name, ctx.rank)).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            state = {n: full(p) for n, p in model.named_parameters()}
            copy = _build_lora(name, where)
            with torch.no_grad():
                for n, p in copy.named_parameters():
                    p.copy_(state[n])
            for mode in MODES:
                model.train(mode == "train")
                copy.train(mode == "train")
                row = _run_entry(_generate, model, copy, prompt)
                row.update(config=config, moment=moment, mode=mode, entry="generate")
                rows.append(row)
        dist.barrier()
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, rows)
    return {"ranks": gathered, "hooks": hooks}


#: Uneven media in generate(): rank 0 has an image, rank 1 none. Safe (as in training)
#: where the tower owns no unit; ``per_layer`` must stop every rank with UnevenMediaError.
UNEVEN_CONFIGS = ("root", "replicate", "uneven_media", "per_layer")


def _text_only(name: str, prompt: Batch) -> Batch:
    from hf_vlms import LLAVA_IMAGE_TOKEN, QWEN_END, QWEN_IMAGE, QWEN_START, QWEN_VIDEO

    ids = prompt["input_ids"].clone()
    media = (
        (LLAVA_IMAGE_TOKEN,) if name == "llava" else (QWEN_IMAGE, QWEN_VIDEO, QWEN_START, QWEN_END)
    )
    for token in media:
        ids[ids == token] = 7
    text: Batch = {"input_ids": ids}
    if name == "qwen2_vl":
        text["mm_token_type_ids"] = torch.zeros_like(ids, dtype=torch.int)
    return text


def run_uneven(ctx: DistributedContext) -> dict[str, Any]:
    """Uneven media across ranks, and generations of different lengths (one rank meets
    its end-of-sequence token first): every rank must finish, with one process's tokens."""
    from multimodal_fsdp import MultimodalParallelizer, UnevenMediaError

    rows: list[dict[str, Any]] = []
    for name in MODELS:
        prompts = [MODELS[name][0](rank) for rank in range(ctx.world_size)]
        mine = prompts[ctx.rank] if ctx.rank == 0 else _text_only(name, prompts[ctx.rank])
        for config in UNEVEN_CONFIGS:
            options = CONFIGS[name][config]
            model = _build(name)
            MultimodalParallelizer(**options).parallelize(model, mesh=build_mesh())
            copy = _copy(name, model)
            model.eval()
            copy.eval()
            # The end-of-sequence token: rank 0's second generated token, so that rank 0
            # stops early and the other ranks (other prompts) run on.
            with torch.no_grad():
                first = _generate(copy, prompts[0])[0, -NEW_TOKENS + 1].item()
            row: dict[str, Any] = {"model": name, "config": config, "error": None}
            forwards = [0]

            def count(*_: object, calls: list[int] = forwards) -> None:
                calls[0] += 1

            model.register_forward_pre_hook(count)
            try:
                with torch.no_grad():
                    got = model.generate(  # type: ignore[operator]
                        **mine, max_new_tokens=6, do_sample=False, eos_token_id=first
                    )
                    expected = copy.generate(  # type: ignore[operator]
                        **mine, max_new_tokens=6, do_sample=False, eos_token_id=first
                    )
                row["forwards"] = forwards[0]
                row["tokens"] = got[:, mine["input_ids"].shape[1] :].tolist()
                row["ref_tokens"] = expected[:, mine["input_ids"].shape[1] :].tolist()
            except UnevenMediaError as exc:
                row["error"] = f"UnevenMediaError: {str(exc).splitlines()[0]}"
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                rows.append(row)
                raise
            rows.append(row)
            dist.barrier()
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, rows)
    return {"ranks": gathered}


def _scenario(name: str) -> Callable[[DistributedContext, Path], dict[str, Any]]:
    def run(ctx: DistributedContext, out: Path) -> dict[str, Any]:
        if importlib.util.find_spec("transformers") is None:
            return {"skipped": "transformers"}
        return run_inference(name, ctx)

    return run


for _name in MODELS:
    scenario(f"inference_{_name}")(_scenario(_name))


@scenario("inference_lora")
def _lora(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    missing = [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": ", ".join(missing)}
    return run_lora(ctx)


@scenario("inference_uneven")
def _uneven(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers"}
    return run_uneven(ctx)


@scenario("inference_more_vlms")
def _more(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "transformers"}
    return run_more_vlms(ctx)
