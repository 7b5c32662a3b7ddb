"""Tensor-parallel plans for language models, applied before the library shards.

The caller applies tensor parallelism (TP) with torch's ``parallelize_module`` on the
``tp`` mesh dimension before handing the data-parallel dimensions to ``parallelize``
(``docs/n-d-parallelism.md``). These helpers write and check the usual plan for
Llama/Qwen2-style layers: q/k/v and gate/up column-wise, o/down row-wise; frozen modules
are left out unless asked (the library shards them already). A plan is a plain
``dict[str, ParallelStyle]`` the user may edit.

With ``sequence_parallel=True`` each decoder layer also runs its norms and residual adds
on 1/tp of the sequence; the layer still takes and returns the whole sequence, so
nothing outside it needs a plan (the sequence length must be a multiple of tp).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = [
    "ATTENTION_PROJECTIONS",
    "MLP_PROJECTIONS",
    "apply_tensor_parallel",
    "check_divisible",
    "llama_style_plan",
]

#: Attention projections of a Llama/Qwen2-style layer: the column-wise ones, then the
#: row-wise one.
ATTENTION_PROJECTIONS: tuple[tuple[str, ...], str] = (("q_proj", "k_proj", "v_proj"), "o_proj")
#: MLP projections of a Llama/Qwen2-style layer: the column-wise ones, then the row-wise one.
MLP_PROJECTIONS: tuple[tuple[str, ...], str] = (("gate_proj", "up_proj"), "down_proj")
#: The children of a Llama/Qwen2-style decoder layer that sequence parallelism plans.
DECODER_LAYER_PARTS: tuple[str, ...] = (
    "input_layernorm",
    "self_attn",
    "post_attention_layernorm",
    "mlp",
)
#: The sequence dimension of ``(batch, sequence, hidden)`` activations.
_SEQ = 1


def check_divisible(what: str, count: int, tp_size: int, *, where: str) -> None:
    """Raise a ``ValueError`` naming the fix unless ``tp_size`` divides ``count``.

    Args:
        what: the dimension's name (``"attention heads"``).
        count: its size.
        tp_size: the TP degree.
        where: the module, for the message.

    Raises:
        ValueError: ``count`` (``what`` of ``where``) is not a multiple of ``tp_size``.
    """
    if count % tp_size:
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        raise ValueError(
            f"tp size {tp_size} does not divide the {count} {what} of {where}: each TP rank "
            f"must hold an equal share; use a tp size among {divisors}"
        )


def _check_tp_size(tp_size: object) -> int:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    return tp_size


def _linear(module: nn.Module, name: str) -> nn.Linear | None:
    child = getattr(module, name, None)
    return child if isinstance(child, nn.Linear) else None


def _projection_plan(
    path: str, projections: tuple[tuple[str, ...], str], sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """Column-wise, then row-wise (its output reduce-scattered along the sequence with
    sequence parallelism instead of all-reduced)."""
    columns, row = projections
    plan: dict[str, ParallelStyle] = {f"{path}.{name}": ColwiseParallel() for name in columns}
    plan[f"{path}.{row}"] = (
        RowwiseParallel(output_layouts=Shard(_SEQ)) if sequence_parallel else RowwiseParallel()
    )
    return plan


def _attention_plan(
    path: str, attn: nn.Module, tp_size: int, *, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    columns, _ = ATTENTION_PROJECTIONS
    head_dim = getattr(attn, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(
            f"{path} has q/k/v/o projections but no int head_dim attribute; write its "
            "TP plan by hand (the library shards whatever TP was applied)"
        )
    for name in columns:
        linear = _linear(attn, name)
        assert linear is not None  # _has_linears checked it
        heads = linear.out_features // head_dim
        kind = "query heads" if name == "q_proj" else "key/value heads"
        check_divisible(kind, heads, tp_size, where=f"{path}.{name}")
    return _projection_plan(path, ATTENTION_PROJECTIONS, sequence_parallel)


def _decoder_layer_plan(path: str) -> dict[str, ParallelStyle]:
    """Sequence parallelism around one decoder layer: each block's input is gathered."""
    return {
        path: _SequenceSplitLayer(),
        f"{path}.input_layernorm": SequenceParallel(),
        f"{path}.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(_SEQ)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        ),
        f"{path}.post_attention_layernorm": SequenceParallel(),
        f"{path}.mlp": PrepareModuleInput(
            input_layouts=(Shard(_SEQ),),
            desired_input_layouts=(Replicate(),),
            use_local_output=True,
        ),
    }


class _SequenceSplitLayer(ParallelStyle):
    """A decoder layer that takes and returns the whole sequence and works on 1/tp of it:
    its first input is split along the sequence, its output all-gathered."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(_SEQ),),
            use_local_output=True,
        )._apply(module, device_mesh)
        PrepareModuleOutput(
            output_layouts=(Shard(_SEQ),),
            desired_output_layouts=(Replicate(),),
            use_local_output=True,
        )._apply(module, device_mesh)
        return module


def _mlp_plan(
    path: str, mlp: nn.Module, tp_size: int, *, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    _, row = MLP_PROJECTIONS
    down = _linear(mlp, row)
    assert down is not None  # _has_linears checked it
    check_divisible("intermediate features", down.in_features, tp_size, where=f"{path}.{row}")
    return _projection_plan(path, MLP_PROJECTIONS, sequence_parallel)


def _is_decoder_layer(module: nn.Module) -> bool:
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in DECODER_LAYER_PARTS):
        return False
    attn, mlp = module.get_submodule("self_attn"), module.get_submodule("mlp")
    return _has_linears(attn, ATTENTION_PROJECTIONS) and _has_linears(mlp, MLP_PROJECTIONS)


def _has_linears(module: nn.Module, projections: tuple[tuple[str, ...], str]) -> bool:
    columns, row = projections
    return all(_linear(module, name) is not None for name in (*columns, row))


def llama_style_plan(
    model: nn.Module,
    *,
    tp_size: int,
    include_frozen: bool = False,
    sequence_parallel: bool = False,
) -> dict[str, ParallelStyle]:
    """The TP plan of every Llama/Qwen2-style attention and MLP in ``model``.

    An attention has ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` Linears and an int
    ``head_dim``; an MLP has ``gate_proj``, ``up_proj``, ``down_proj`` Linears.

    Args:
        model: the model, on any device (``meta`` included).
        tp_size: the size of the ``tp`` mesh dimension the plan will be applied on.
        include_frozen: also plan modules without trainable parameters (default: a frozen
            module is left to the library's sharding).
        sequence_parallel: also split each decoder layer's norms and residual adds along
            the sequence (see the module docstring); only attentions and MLPs inside
            such layers are planned then, and the sequence length must be a multiple
            of ``tp_size``.

    Returns:
        ``{module path: ParallelStyle}`` for ``parallelize_module`` (or
        [`apply_tensor_parallel`][multimodal_fsdp.tensor_parallel.apply_tensor_parallel]).

    Raises:
        ValueError: ``tp_size`` is not a positive int, it does not divide a planned
            module's heads or intermediate features (the message lists the sizes that
            do), or ``model`` has no such module (TP would change nothing).
    """
    tp_size = _check_tp_size(tp_size)
    plan: dict[str, ParallelStyle] = {}
    for path, module in model.named_modules():
        if not include_frozen and not any(p.requires_grad for p in module.parameters()):
            continue
        if sequence_parallel:
            if _is_decoder_layer(module):
                plan.update(_decoder_layer_plan(path))
                attn, mlp = module.get_submodule("self_attn"), module.get_submodule("mlp")
                plan.update(
                    _attention_plan(f"{path}.self_attn", attn, tp_size, sequence_parallel=True)
                )
                plan.update(_mlp_plan(f"{path}.mlp", mlp, tp_size, sequence_parallel=True))
            continue
        if _has_linears(module, ATTENTION_PROJECTIONS):
            plan.update(_attention_plan(path, module, tp_size))
        if _has_linears(module, MLP_PROJECTIONS):
            plan.update(_mlp_plan(path, module, tp_size))
    if not plan:
        frozen = "" if include_frozen else " trainable"
        wanted = (
            "decoder layer (input_layernorm, self_attn, post_attention_layernorm, mlp) "
            "around such an attention and MLP"
            if sequence_parallel
            else "attention (q_proj, k_proj, v_proj, o_proj) or MLP (gate_proj, up_proj, down_proj)"
        )
        raise ValueError(
            f"{type(model).__name__} has no{frozen} Llama/Qwen2-style {wanted}: write its TP "
            "plan by hand and apply it with parallelize_module before the library shards"
            + ("" if include_frozen else ", or pass include_frozen=True for frozen modules")
        )
    return plan


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]
) -> list[str]:
    """Apply ``plan`` over ``tp_mesh`` with torch's ``parallelize_module``; call it before
    the library's ``parallelize`` (FSDP then shards the TP-local shards).

    Args:
        model: the model the plan's paths are relative to.
        tp_mesh: the 1-D ``tp`` mesh (``world_mesh["tp"]``).
        plan: ``{module path: ParallelStyle}``, e.g. from
            [`llama_style_plan`][multimodal_fsdp.tensor_parallel.llama_style_plan] or
            the user's own.

    Returns:
        The planned module paths, sorted.

    Raises:
        TypeError: ``tp_mesh`` is not a ``DeviceMesh``, or a plan value not a
            ``ParallelStyle``.
        ValueError: ``tp_mesh`` is not 1-D, the plan is empty, or it names a module
            that ``model`` does not have.
    """
    if not isinstance(tp_mesh, DeviceMesh):
        raise TypeError(f"tp_mesh must be a DeviceMesh, got {type(tp_mesh).__name__}")
    if tp_mesh.ndim != 1:
        raise ValueError(
            f"tp_mesh has {tp_mesh.ndim} dimensions {tp_mesh.mesh_dim_names}; pass the 1-D "
            "tensor-parallel sub-mesh, e.g. world_mesh['tp']"
        )
    if not plan:
        raise ValueError("the TP plan is empty: there is nothing to apply")
    modules = dict(model.named_modules())
    missing = sorted(path for path in plan if path not in modules)
    if missing:
        raise ValueError(
            f"the TP plan names modules {type(model).__name__} does not have: {missing[:5]}"
        )
    for path, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"the TP plan's {path!r} is a {type(style).__name__}, not a ParallelStyle"
            )
    parallelize_module(model, tp_mesh, dict(plan))
    return sorted(plan)
