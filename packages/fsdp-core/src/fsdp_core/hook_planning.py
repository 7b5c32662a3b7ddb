"""Which runtime hooks a ``ModelParallelizer`` plan gets, planned from the finished plan:
the accumulation warm-up and usage flags for units with trainable parameters, the entry
unshard of modules called outside the forward, and the forward agreement (last)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fsdp_core.accumulation import AccumulationWarmupRuntimeHook
from fsdp_core.entry_unshard import EntryUnshardRuntimeHook, entry_owners
from fsdp_core.forward_agreement import ForwardAgreementRuntimeHook
from fsdp_core.plan import ShardingPlan, unit_parameters
from fsdp_core.replica_grad import replica_grad_reduce_plans
from fsdp_core.runtime import HookPlan
from fsdp_core.unused_params import UnusedParamsRuntimeHook

__all__ = ["core_hook_plans", "forward_agreement_hook", "is_entry"]


def core_hook_plans(
    model: nn.Module, plan: ShardingPlan, entry_paths: list[str], shared: Sequence[str] = ()
) -> list[HookPlan]:
    """``accumulation_warmup`` and ``unused_params`` when a unit holds trainable
    parameters, ``entry_unshard`` for the ``entry_paths`` that own units, then
    ``replica_grad_reduce`` for ignored experts and the ``shared`` parameters.

    Args:
        model: the planned model.
        plan: the finished plan.
        entry_paths: modules users call on their own (towers, projectors).
        shared: trainable parameters whose items a data group's ranks split.

    Returns:
        The hooks' plan entries, in install order.
    """
    entries = [
        *_entry_hooks(entry_owners(model, plan, entry_paths), plan),
        *replica_grad_reduce_plans(model, plan.ignored_param_names, shared),
    ]
    trainable = [
        unit.label
        for unit, params in zip(plan.units, unit_parameters(plan, model), strict=True)
        if any(p.requires_grad for _, p in params)
    ]
    if not trainable:
        return entries
    return [
        AccumulationWarmupRuntimeHook().planned(
            reason="no-sync backwards stay valid when a unit has not run yet or a "
            "parameter is first reached by a later micro-batch",
            targets=trainable,
            cost="no collective in an ordinary step; one all-gather per never-gathered "
            "unit, once, in no-sync steps",
        ),
        UnusedParamsRuntimeHook().planned(
            reason="ranks that skip part of a unit send zeros in its reduce-scatter; "
            "parameters that no rank used keep grad None",
            targets=trainable,
            cost="one all-reduce of one byte per trainable parameter tensor per syncing backward",
        ),
        *entries,
    ]


def is_entry(module: nn.Module) -> bool:
    """A module users call on its own: one that generates, or a transformers model.

    Args:
        module: any module.

    Returns:
        Whether it is an entry module.
    """
    cls = type(module)
    if callable(getattr(cls, "generate", None)):
        return True
    return callable(getattr(cls, "get_input_embeddings", None)) and hasattr(module, "config")


def _entry_hooks(owners: dict[str, tuple[int, ...]], plan: ShardingPlan) -> list[HookPlan]:
    if not owners:
        return []
    units = sorted({plan.units[i].label for indices in owners.values() for i in indices})
    return [
        EntryUnshardRuntimeHook.from_plan(plan, owners).planned(
            reason="modules called outside the model's forward (generate()'s image "
            "features, a PeftModel's generate(), a tower called by hand) gather the units "
            f"that own their parameters ({', '.join(units) or 'their own units only'}) and "
            "reshard them after",
            targets=owners,
            cost="no collective inside the model's forward; outside it one all-gather "
            "of each owning unit per call (per generate() call: held for all of it)",
        )
    ]


def forward_agreement_hook() -> HookPlan:
    """Planned last, so that its forward pre-hook runs before every other hook's (each
    is put in front) and before any collective of the forward.

    Returns:
        Its plan entry.
    """
    return ForwardAgreementRuntimeHook().planned(
        reason="before each call of the model (forward, eval, generate()) the ranks agree "
        "on the call, the micro-batch, gradient sync and a non-empty batch: a call on some "
        "ranks only or uneven steps fail on every rank with an error naming the ranks, "
        "instead of hanging",
        targets=["<root>"],
        cost="no collective: four to six round trips to the c10d store per call",
    )
