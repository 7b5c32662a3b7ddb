"""Expert parallelism: experts the caller's EP plan sharded, kept out of FSDP, their
gradients reduced like FSDP reduces the rest.

The caller's EP plan (e.g. ``model_deepseek_v41.moe.shard_experts``, or torchtitan's
and NeMo Automodel's ``ExpertParallel``) runs first and makes each expert weight a
``DTensor`` placed on a mesh dimension named for EP (``ep``, ``expert_parallel``). A plan
keeps those parameters out of every FSDP unit (the
[`expert_param_names`][fsdp_core.expert_parallel.expert_param_names] become ignored
parameters: FSDP leaves them, "retaining their existing DTensor
placements"), so FSDP neither gathers nor reduces them. Their gradients still need what
FSDP does for every other parameter: a rank's expert gradient holds the contributions
of the tokens its EP group sent it (the ``all_to_all`` backward brings them), and the
ranks with other batches that hold the same expert shard
([`ParallelDims.expert_replica_mesh`][fsdp_core.parallel_dims.ParallelDims.expert_replica_mesh])
hold the rest. The ``expert_grad_reduce`` hook sums each expert gradient over them and
divides by FSDP's own divisor, the size of the mesh FSDP shards over
(``ParallelDims.dp_shape``), so experts and the rest see the same loss normalisation.
The library owns this reduction (planned and costed like every hook), not the EP plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from fsdp_core.parallel_dims import dimension_role, local_shape
from fsdp_core.runtime import HookPlan, HookStep, RuntimeHook

if TYPE_CHECKING:
    from fsdp_core.collective_count import CommTally
    from fsdp_core.parallel_dims import ParallelDims

__all__ = ["ExpertGradReduceRuntimeHook", "expert_grad_reduce_plans", "expert_param_names"]

NAME = "expert_grad_reduce"


def expert_param_names(model: nn.Module) -> tuple[str, ...]:
    """The parameters an EP plan sharded: ``DTensor``s on a mesh with an EP dimension."""
    return tuple(
        name
        for name, param in model.named_parameters()
        if isinstance(param, DTensor)
        and any(dimension_role(d) == "ep" for d in param.device_mesh.mesh_dim_names or ())
    )


def expert_grad_reduce_plans(model: nn.Module, ignored: Sequence[str]) -> list[HookPlan]:
    """The ``expert_grad_reduce`` hook when the plan keeps trainable experts out of FSDP."""
    named = dict(model.named_parameters())
    experts = set(expert_param_names(model))
    params = tuple(n for n in ignored if n in experts and named[n].requires_grad)
    if not params:
        return []
    return [
        ExpertGradReduceRuntimeHook(params=params).planned(
            reason="expert parameters sharded over EP stay out of FSDP; their gradients are "
            "summed over the ranks holding the same expert shard and divided like FSDP's",
            targets=params,
            cost="one all-reduce of each expert parameter's local shard per backward, "
            "over the data-parallel ranks of its ep coordinate",
        )
    ]


@dataclass(frozen=True)
class ExpertGradReduceRuntimeHook(RuntimeHook):
    """The ``expert_grad_reduce`` runtime hook; ``params``: the trainable expert
    parameters the plan keeps out of FSDP."""

    name: ClassVar[str] = NAME
    params: tuple[str, ...] = ()

    def install(self, model: nn.Module, *, dims: ParallelDims) -> ExpertGradReduceHook:
        """Reduces over ``dims.expert_replica_mesh``, divides by ``dims.dp_shape``'s size.

        Raises:
            ValueError: the mesh given to ``parallelize`` has no EP dimension (every rank
                raises: they were given the same kind of mesh).
        """
        if not dims.ep_names:
            raise ValueError(
                f"the model has parameters sharded over expert parallelism ({self.params[0]}, "
                f"...) but the mesh given to the library ({dims.describe()}) has no ep "
                "dimension: pass the whole mesh with dp_dims=..., or the data-parallel "
                "sub-mesh of the mesh whose ep dimension the experts are placed on"
            )
        mesh = dims.expert_replica_mesh
        groups = [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]
        return ExpertGradReduceHook(model, self.params, _reducer(groups, dims.dp_shape.world_size))

    def collectives(self, step: HookStep) -> CommTally:
        """One all-reduce per expert parameter and replica dimension of more than one rank."""
        tally = super().collectives(step)  # empty
        parallel = step.parallel
        if parallel is None:
            return tally
        named = dict(step.model.named_parameters())
        replica_dims = sum(1 for n in parallel.expert_replica_names if parallel.size(n) > 1)
        for name in self.params:
            param = named[name]
            for _ in range(replica_dims):
                tally.add(
                    "backward", "all_reduce", local_shape(param).numel() * param.element_size()
                )
        return tally


def _reducer(
    groups: list[dist.ProcessGroup], divisor: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    def reduce(grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor):
            raise TypeError(f"an expert gradient is a {type(grad).__name__}, not a DTensor")
        local = grad.to_local().clone()
        for group in groups:
            dist.all_reduce(local, group=group)
        local.div_(divisor)
        return DTensor.from_local(
            local, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()
        )

    return reduce


class ExpertGradReduceHook:
    """The installed hook: a gradient hook on each expert parameter, put on the parameter
    object its module holds when the module runs (``to_empty`` and checkpoint loading
    may replace the objects after the plan is applied, as torchtitan's flow does)."""

    name = NAME

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[str],
        reduce: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self._reduce = reduce
        self._hooked: dict[tuple[int, str], tuple[nn.Parameter, RemovableHandle]] = {}
        owners: dict[str, list[str]] = {}
        for name in params:
            path, _, local = name.rpartition(".")
            owners.setdefault(path, []).append(local)
        self._handles = [
            model.get_submodule(path).register_forward_pre_hook(self._hook_params(locals_))
            for path, locals_ in owners.items()
        ]

    def _hook_params(self, names: list[str]) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            for name in names:
                param = module.get_parameter(name)
                key = (id(module), name)
                held = self._hooked.get(key)
                if held is not None and held[0] is param:
                    continue
                if held is not None:
                    held[1].remove()
                handle = param.register_hook(self._reduce)  # type: ignore[no-untyped-call]
                self._hooked[key] = (param, handle)

        return hook

    def remove(self) -> None:
        for handle in [*self._handles, *(h for _, h in self._hooked.values())]:
            handle.remove()
        self._handles, self._hooked = [], {}
