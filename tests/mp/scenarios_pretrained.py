"""Pretrained weights in, trained weights out, on real ranks.

Each scenario: rank 0 writes a checkpoint directory the way users get one
(transformers ``save_pretrained``, forced into several files; for DeepSeek-V4.1 a
safetensors state dict in the same layout), every rank builds the model on
``meta``, shards it, loads the directory with ``fsdp_core.hf.load_pretrained``,
trains a few steps and exports with ``fsdp_core.hf.save_pretrained``. The result
holds the gathered state right after loading and after training, which the
tests compare with ``from_pretrained`` of both directories in one process.

transformers (and safetensors) are imported inside the scenarios: without them a
scenario reports ``skipped`` instead of failing the whole launch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from registry import scenario
from scenarios_core import full
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_core import DistributedContext, build_mesh, mixed_precision_policy
from fsdp_core.hf import load_pretrained, save_pretrained

POLICIES = ("root", "per_layer", "replicate")
STEPS = 2
LR = 0.05
#: Small enough that each tiny model's checkpoint spans several files.
SHARD_SIZE = "40KB"

#: name -> (transformers class, tower path, tie the LM head to the embeddings)
HF_MODELS: dict[str, tuple[str, str, bool]] = {
    "llava": ("LlavaForConditionalGeneration", "model.vision_tower", True),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "model.visual", False),
}


def missing_dependencies() -> list[str]:
    return [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]


def checkpoint_dir(out: Path, name: str) -> Path:
    return out / "pretrained" / name / "checkpoint"


def export_dir(out: Path, name: str) -> Path:
    return out / "pretrained" / name / "export"


def build_source(name: str) -> nn.Module:
    """The pretrained model a user starts from (seeded, fp32, on the CPU)."""
    from hf_vlms import HF_VLMS

    model = HF_VLMS[name].build()
    if HF_MODELS[name][2]:
        config = model.config  # type: ignore[union-attr]
        config.tie_word_embeddings = True
        config.get_text_config().tie_word_embeddings = True
        torch.manual_seed(0)
        model = type(model)(config)
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter and buffer (on every rank: collectives)."""
    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return {n: full(t) for n, t in named.items()}


def _replicated_equal(model: nn.Module) -> tuple[list[str], bool]:
    """Names of the plain (unsharded) parameters and whether every rank holds the same."""
    plain = [(n, p) for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    equal = True
    for _, param in plain:
        low, high = param.detach().float().clone(), param.detach().float().clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        equal = equal and bool(torch.equal(low, high))
    return [n for n, _ in plain], equal


def _train(model: nn.Module, ctx: DistributedContext, batches: list[dict[str, Any]]) -> list[float]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batch in batches:
        on_device = {k: v.to(ctx.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        loss = model(**on_device).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _hf_round_trip(ctx: DistributedContext, out: Path, name: str, policy: str) -> dict[str, Any]:
    missing = missing_dependencies()
    if missing:
        return {"skipped": f"needs {missing}"}
    import transformers
    from hf_vlms import HF_VLMS

    from multimodal_fsdp import MultimodalParallelizer

    class_name, tower, _ = HF_MODELS[name]
    source = checkpoint_dir(out, f"{name}_{policy}")
    if ctx.rank == 0:
        build_source(name).save_pretrained(source, max_shard_size=SHARD_SIZE)
    dist.barrier()

    config = transformers.AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    model.get_submodule(tower).requires_grad_(False)
    parallelizer = MultimodalParallelizer(frozen_multimodal_sharding=policy)
    parallelizer.parallelize(model, mesh=build_mesh(), mp_policy=mixed_precision_policy("bf16"))
    report = load_pretrained(model, source)
    loaded = _state(model)
    replicated, replicated_equal = _replicated_equal(model)

    batches = [HF_VLMS[name].batch(seed=100 * step + ctx.rank) for step in range(STEPS)]
    losses = _train(model, ctx, batches)
    files = save_pretrained(model, export_dir(out, f"{name}_{policy}"), max_shard_size=SHARD_SIZE)
    return {
        "naming": report.naming,
        "source_files": report.files,
        "recomputed_buffers": report.recomputed_buffers,
        "loaded": loaded,
        "replicated": replicated,
        "replicated_equal": replicated_equal,
        "losses": losses,
        "trained": _state(model),
        "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
        "files": files,
    }


for _name in HF_MODELS:
    for _policy in POLICIES:

        def _run(ctx: DistributedContext, out: Path, _n: str = _name, _p: str = _policy) -> Any:
            return _hf_round_trip(ctx, out, _n, _p)

        scenario(f"pretrained_{_name}_{_policy}")(_run)


@scenario("pretrained_deepseek_fp32_norms")
def pretrained_deepseek(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    """bf16 DeepSeek-V4.1 with fp32 vision norms from an all-bf16 file: the model's dtype wins."""
    if importlib.util.find_spec("safetensors") is None:
        return {"skipped": "needs safetensors"}
    from safetensors.torch import save_file
    from vlm import build_vlm, is_vision_norm, to_device, vlm_batches

    from model_deepseek_v41 import PARALLELIZER

    source = checkpoint_dir(out, "deepseek")
    if ctx.rank == 0:
        source.mkdir(parents=True, exist_ok=True)
        state = build_vlm(dtype=torch.bfloat16, frozen_tower=False).state_dict()
        # Norm weights get values that bf16 holds exactly but a bf16 model would not draw.
        for key in state:
            if is_vision_norm(key):
                state[key] = torch.linspace(0.5, 1.5, state[key].numel())
        tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
        save_file(tensors, source / "model.safetensors")
    dist.barrier()

    model = build_vlm(dtype=torch.bfloat16, frozen_tower=False, device="meta")
    PARALLELIZER.parallelize(model, mesh=build_mesh(), mp_policy=mixed_precision_policy("bf16"))
    report = load_pretrained(model, source)
    loaded = _state(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for per_rank in vlm_batches(STEPS, ctx.world_size):
        model(**to_device(per_rank[ctx.rank], ctx.device)).backward()
        opt.step()
        opt.zero_grad()
    files = save_pretrained(model, export_dir(out, "deepseek"), max_shard_size="20KB")
    return {
        "naming": report.naming,
        "cast": report.cast,
        "loaded": loaded,
        "trained": _state(model),
        "files": files,
    }
