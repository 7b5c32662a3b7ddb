"""Weights out of sharded transformers and peft models, on real ranks.

One scenario per VLM family (LLaVA, Qwen2-VL). For each frozen-tower policy and
each LoRA placement (decoder only; tower and decoder) it builds the tiny model,
wraps it with peft, shards it, trains one step and exports it every way a user
would: the library's ``save_pretrained`` of the ``PeftModel`` (the adapter in
peft's format), peft's own ``peft_model.save_pretrained``, the merged export
(``merge_adapters=True``) of the ``PeftModel`` and of ``get_base_model()``, and the
plain export of ``get_base_model()``, which must fail on every rank before
anything is written. For each policy it also exports a plain (non-LoRA) model
both through the library and through transformers' own ``model.save_pretrained``.
The tests (``test_hf_export_distributed.py``) load the directories in one process.

transformers and peft are imported inside: without them the scenario reports
``skipped``.
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
from fsdp_core.hf import save_pretrained

FAMILIES = ("llava", "qwen2_vl")
POLICIES = ("root", "per_layer", "replicate")
WHERE = ("decoder", "tower")
LR = 0.05
#: Small enough that each tiny model's export spans several files.
SHARD_SIZE = "40KB"


def case_dir(out: Path, name: str, policy: str, where: str) -> Path:
    return out / "hf_export" / f"{name}_{policy}_{where}"


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    named = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    return {n: full(t) for n, t in named.items()}


def _train_step(model: nn.Module, ctx: DistributedContext, name: str) -> None:
    from hf_vlms import HF_VLMS

    batch = HF_VLMS[name].batch(seed=ctx.rank)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    model(
        **{k: v.to(ctx.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    ).loss.backward()
    opt.step()
    opt.zero_grad()


def _every_rank(call: Any) -> list[str | None]:
    """Run ``call``; the error each rank got (``"Type: message"``) or None, from every rank."""
    try:
        call()
        mine = None
    except Exception as exc:  # recorded for the test
        mine = f"{type(exc).__name__}: {exc}"
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _lora_case(ctx: DistributedContext, out: Path, name: str, policy: str, where: str) -> Any:
    from hf_lora import with_lora
    from hf_vlms import HF_VLMS

    from multimodal_fsdp import MultimodalParallelizer

    model = with_lora(HF_VLMS[name].build(), name, where)
    MultimodalParallelizer(frozen_multimodal_sharding=policy).parallelize(model, mesh=build_mesh())
    _train_step(model, ctx, name)
    root = case_dir(out, name, policy, where)
    base: Any = model.get_base_model()  # type: ignore[operator]
    errors = {
        "adapter_lib": _every_rank(lambda: save_pretrained(model, root / "adapter_lib")),
        "adapter_own": _every_rank(lambda: model.save_pretrained(root / "adapter_own")),  # type: ignore[operator]
        "merged_lib": _every_rank(
            lambda: save_pretrained(
                model, root / "merged_lib", merge_adapters=True, max_shard_size=SHARD_SIZE
            )
        ),
        "merged_base": _every_rank(
            lambda: save_pretrained(
                base, root / "merged_base", merge_adapters=True, max_shard_size=SHARD_SIZE
            )
        ),
        "wrapped_lib": _every_rank(lambda: save_pretrained(base, root / "wrapped_lib")),
        "wrapped_own": _every_rank(lambda: base.save_pretrained(root / "wrapped_own")),
    }
    return {"state": _state(model), "errors": errors}


def _plain_case(ctx: DistributedContext, out: Path, name: str, policy: str) -> Any:
    from hf_vlms import HF_VLMS

    from multimodal_fsdp import MultimodalParallelizer

    model = HF_VLMS[name].build()
    model.get_submodule(HF_VLMS[name].tower).requires_grad_(False)
    MultimodalParallelizer(frozen_multimodal_sharding=policy).parallelize(model, mesh=build_mesh())
    _train_step(model, ctx, name)
    root = case_dir(out, name, policy, "none")
    errors = {
        "plain_lib": _every_rank(
            lambda: save_pretrained(model, root / "plain_lib", max_shard_size=SHARD_SIZE)
        ),
        "plain_own": _every_rank(
            lambda: model.save_pretrained(root / "plain_own", max_shard_size=SHARD_SIZE)  # type: ignore[operator]
        ),
    }
    return {"state": _state(model), "errors": errors}


def _family(ctx: DistributedContext, out: Path, name: str) -> dict[str, Any]:
    missing = [
        m for m in ("transformers", "peft", "safetensors") if not importlib.util.find_spec(m)
    ]
    if missing:
        return {"skipped": f"needs {missing}"}
    cases: dict[str, Any] = {}
    for policy in POLICIES:
        for where in WHERE:
            cases[f"{policy}/{where}"] = _lora_case(ctx, out, name, policy, where)
        cases[f"{policy}/none"] = _plain_case(ctx, out, name, policy)
    return {"cases": cases}


for _name in FAMILIES:

    def _run(ctx: DistributedContext, out: Path, _n: str = _name) -> dict[str, Any]:
        return _family(ctx, out, _n)

    scenario(f"hf_export_{_name}")(_run)
