"""The tensor-parallel plan of the DeepSeek-V4.1 reference model's language MLPs.

Apply it before the library shards (see ``docs/n-d-parallelism.md``)::

    plan = deepseek_v41_tp_plan(model, tp_size=world["tp"].size())
    apply_tensor_parallel(model, world["tp"], plan)
    DeepseekV41ModelParallelizer().parallelize(model, mesh=world["dp"])

Each MLP's fused ``gate_up`` Linear is column-wise and its ``down`` Linear row-wise.
Because the fused output is chunked into gate and up, ``gate_up`` keeps a DTensor output
(``use_local_output=False``): the chunk then sees the whole feature dimension (DTensor
gathers it), so the model computes what it computes in one process, at the cost of that
gather; a layout that interleaves gate and up rows per rank would avoid it but changes
the checkpoint's weights. The attention's fused ``qkv`` is not planned for the same
reason (a contiguous shard of its rows mixes q, k and v).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from model_deepseek_v41.layers import SwiGLU
from model_deepseek_v41.moe import MoE
from multimodal_fsdp.tensor_parallel import check_divisible

__all__ = ["deepseek_v41_tp_plan"]


def deepseek_v41_tp_plan(
    model: nn.Module, *, tp_size: int, include_vision: bool = False, include_frozen: bool = False
) -> dict[str, ParallelStyle]:
    """``{module path: ParallelStyle}`` for the language model's MLPs
    (``model.layers.<i>.mlp``), and the vision blocks' MLPs with ``include_vision``.

    Args:
        model: a ``DeepseekV41ForCausalLM`` (any device, ``meta`` included).
        tp_size: the size of the ``tp`` mesh dimension.
        include_vision: also plan the vision tower's MLPs (``vision.blocks.<i>.mlp``).
        include_frozen: plan frozen MLPs too (default: a frozen MLP is left to the
            library's sharding, e.g. a frozen vision tower's).

    Returns:
        The plan, for ``parallelize_module`` or ``apply_tensor_parallel``.

    Raises:
        ValueError: ``tp_size`` is not a positive int or does not divide an MLP's
            intermediate features (the message lists the sizes that do), or no MLP is
            planned.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    prefixes = ("model.layers.", "vision.blocks.") if include_vision else ("model.layers.",)
    plan: dict[str, ParallelStyle] = {}
    for path, module in model.named_modules():
        if not isinstance(module, SwiGLU) or not path.startswith(prefixes):
            continue
        if not include_frozen and not any(p.requires_grad for p in module.parameters()):
            continue
        check_divisible(
            "intermediate features", module.down.in_features, tp_size, where=f"{path}.down"
        )
        plan[f"{path}.gate_up"] = ColwiseParallel(use_local_output=False)
        plan[f"{path}.down"] = RowwiseParallel()
    if not plan:
        moe = any(isinstance(m, MoE) for m in model.modules())
        raise ValueError(
            f"no trainable MLP of {type(model).__name__} to plan (model.layers.<i>.mlp"
            + (", vision.blocks.<i>.mlp" if include_vision else "")
            + (
                "): its language MLPs are routed experts, sharded by expert parallelism "
                "(model_deepseek_v41.moe.shard_experts), not TP; pass include_vision=True "
                "for the vision MLPs"
                if moe
                else "); pass include_frozen=True to plan frozen ones"
            )
        )
    return plan
