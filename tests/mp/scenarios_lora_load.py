"""LoRA in the documented order on real ranks: build on meta, add adapters, shard, load.

For each frozen-tower policy: tiny LLaVA built on ``meta``, peft LoRA (default
initialisation) on the decoder's and the CLIP tower's ``q_proj``/``v_proj``,
``parallelize``, ``torch.manual_seed(SEED)`` then ``load_pretrained`` of a base
export (no adapter tensors in it). Recorded: the full loaded state, each rank's
view of the adapters (they must be identical), the state after one SGD step,
and, after saving the adapter export, the state of a fresh meta-built LoRA model
that loads the base export and then the adapter export. The tests
(``test_lora_load_distributed.py``) compare with ``from_pretrained`` and peft in
one process.
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

from fsdp_core import DistributedContext, build_mesh
from fsdp_core.hf import load_pretrained, save_pretrained

POLICIES = ("root", "per_layer", "replicate")
SEED = 1234
LR = 0.05
RANK = 4
ALPHA = 8


def base_dir(out: Path) -> Path:
    return out / "lora_load" / "base"


def adapter_dir(out: Path, policy: str) -> Path:
    return out / "lora_load" / f"adapter_{policy}"


def lora_config() -> Any:
    import peft
    from hf_lora import TARGETS

    return peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS["llava", "tower"])


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return {n: full(t) for n, t in named.items()}


def _meta_lora(source: Path) -> nn.Module:
    import peft
    import transformers

    config = transformers.AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        base = transformers.LlavaForConditionalGeneration(config)
    model: nn.Module = peft.get_peft_model(base, lora_config())
    return model


def _step(model: nn.Module, ctx: DistributedContext) -> None:
    from hf_vlms import HF_VLMS

    batch = HF_VLMS["llava"].batch(seed=ctx.rank)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    model(
        **{k: v.to(ctx.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    ).loss.backward()
    opt.step()
    opt.zero_grad()


def _case(ctx: DistributedContext, out: Path, policy: str) -> dict[str, Any]:
    from multimodal_fsdp import MultimodalParallelizer

    source = base_dir(out)
    model = _meta_lora(source)
    MultimodalParallelizer(frozen_multimodal_sharding=policy).parallelize(model, mesh=build_mesh())
    torch.manual_seed(SEED)
    report = load_pretrained(model, source)
    loaded = _state(model)
    adapters = {n: t for n, t in loaded.items() if ".lora_" in n}
    by_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, adapters)
    _step(model, ctx)
    trained = _state(model)
    save_pretrained(model, adapter_dir(out, policy))

    fresh = _meta_lora(source)
    MultimodalParallelizer(frozen_multimodal_sharding=policy).parallelize(fresh, mesh=build_mesh())
    load_pretrained(fresh, source)
    again = load_pretrained(fresh, adapter_dir(out, policy))
    return {
        "naming": report.naming,
        "adapter_naming": again.naming,
        "missing": report.missing,
        "loaded": loaded,
        "ranks_equal": all(
            set(other) == set(adapters)
            and all(torch.equal(other[n], adapters[n]) for n in adapters)
            for other in by_rank
        ),
        "trained": trained,
        "reloaded": _state(fresh),
    }


@scenario("lora_load_llava")
def lora_load_llava(ctx: DistributedContext, out: Path) -> dict[str, Any]:
    missing = [
        m for m in ("transformers", "peft", "safetensors") if not importlib.util.find_spec(m)
    ]
    if missing:
        return {"skipped": f"needs {missing}"}
    from hf_vlms import HF_VLMS

    if ctx.rank == 0:
        HF_VLMS["llava"].build().save_pretrained(base_dir(out), max_shard_size="40KB")
    dist.barrier()
    return {"source": str(base_dir(out)), "cases": {p: _case(ctx, out, p) for p in POLICIES}}
