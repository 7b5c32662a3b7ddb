"""Gradient reductions over ranks FSDP does not reduce over: the ``replica_grad_reduce`` hook.

Summed over a mesh of [`ParallelDims`][fsdp_core.parallel_dims.ParallelDims]
(``REPLICA_MESHES``), by a gradient hook on the parameter object each module holds when
it runs (``to_empty`` and checkpoint loading may replace it):

- ``expert_replicas``: experts an EP plan sharded, outside FSDP
  ([`fsdp_core.expert_parallel`][fsdp_core.expert_parallel]), over the ranks holding the
  same expert shard, divided like FSDP's gradients;
- ``data_group``: trainable balanced modules whose items a TP data group splits, over
  that group, before FSDP averages them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from fsdp_core.expert_parallel import expert_param_names
from fsdp_core.parallel_dims import local_shape
from fsdp_core.runtime import HookPlan, HookStep, RuntimeHook

if TYPE_CHECKING:
    from fsdp_core.collective_count import CommTally
    from fsdp_core.parallel_dims import ParallelDims

__all__ = [
    "REPLICA_MESHES",
    "ReplicaGradReduceRuntimeHook",
    "ReplicaSet",
    "replica_grad_reduce_plans",
]

NAME = "replica_grad_reduce"
_Reduce = Callable[[torch.Tensor], torch.Tensor]

#: The meshes a parameter set's gradients are summed over, by name: what each reads from
#: ``ParallelDims`` (its dimension names, its mesh) and whether the sum is divided by
#: FSDP's divisor (parameters FSDP does not reduce at all).
REPLICA_MESHES: dict[str, tuple[str, str, bool]] = {
    "expert_replicas": ("expert_replica_names", "expert_replica_mesh", True),
    "data_group": ("sharing_names", "sharing_mesh", False),
}


@dataclass(frozen=True)
class ReplicaSet:
    """Parameters (names in the model) whose gradients are summed over ``over``, one of
    ``REPLICA_MESHES``."""

    over: str
    params: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.over not in REPLICA_MESHES:
            raise ValueError(f"over={self.over!r}; valid choices: {sorted(REPLICA_MESHES)}")

    def dims(self, parallel: ParallelDims) -> int:
        """Dimensions of more than one rank of this set's mesh.

        Args:
            parallel: the job's parallel dimensions.

        Returns:
            How many all-reduces each gradient of the set takes per backward.
        """
        names: tuple[str, ...] = getattr(parallel, REPLICA_MESHES[self.over][0])
        return sum(1 for n in names if parallel.size(n) > 1)


def replica_grad_reduce_plans(
    model: nn.Module, ignored: Sequence[str], shared: Sequence[str] = ()
) -> list[HookPlan]:
    """The ``replica_grad_reduce`` hook a plan needs.

    Args:
        model: the model the plan is for.
        ignored: the plan's ignored parameters (trainable experts among them are summed
            over their replicas).
        shared: parameters of modules whose items the ranks of a data group split (the
            trainable ones are summed over the data group).

    Returns:
        The hook's plan entry, or nothing when no trainable parameter needs it.
    """
    named = dict(model.named_parameters())
    experts = set(expert_param_names(model))
    candidates = {"expert_replicas": [n for n in ignored if n in experts], "data_group": shared}
    sets = [
        ReplicaSet(over, tuple(n for n in names if named[n].requires_grad))
        for over, names in candidates.items()
    ]
    sets = [s for s in sets if s.params]
    if not sets:
        return []
    hook = ReplicaGradReduceRuntimeHook(sets=tuple(sets))
    return [
        hook.planned(
            reason="gradients FSDP does not sum over every rank that holds a part of them: "
            + "; ".join(_REASONS[s.over] for s in sets),
            targets=[n for s in sets for n in s.params],
            cost="one all-reduce of each such parameter's gradient per backward and "
            "dimension of more than one rank of its mesh ("
            + ", ".join(f"{s.over}: {len(s.params)} parameters" for s in sets)
            + ")",
        )
    ]


_REASONS = {
    "expert_replicas": "expert parameters sharded over EP stay out of FSDP; summed over the "
    "ranks holding the same expert shard and divided like FSDP's",
    "data_group": "trainable balanced modules whose items the ranks of a TP data group "
    "split; summed over the data group before FSDP averages them",
}


@dataclass(frozen=True)
class ReplicaGradReduceRuntimeHook(RuntimeHook):
    """The ``replica_grad_reduce`` runtime hook; ``sets``: the parameters and the mesh
    each set's gradients are summed over."""

    name: ClassVar[str] = NAME
    sets: tuple[ReplicaSet, ...] = ()

    def install(self, model: nn.Module, *, dims: ParallelDims) -> ReplicaGradReduceHook:
        """Hooks each parameter with the reduction over its set's mesh (none on one rank).

        Args:
            model: the model the plan was applied to.
            dims: the job's parallel dimensions (the meshes to reduce over).

        Returns:
            The installed hook.

        Raises:
            ValueError: expert parameters but the mesh given to ``parallelize`` has no EP
                dimension (every rank raises: they were given the same kind of mesh).
        """
        reducers: dict[str, _Reduce] = {}
        for replica in self.sets:
            if replica.over == "expert_replicas" and not dims.ep_names:
                raise ValueError(
                    "the model has parameters sharded over expert parallelism "
                    f"({replica.params[0]}, ...) but the mesh given to the library "
                    f"({dims.describe()}) has no ep dimension: pass the whole mesh with "
                    "dp_dims=..., or the data-parallel sub-mesh of the mesh whose ep "
                    "dimension the experts are placed on"
                )
            if not replica.dims(dims):
                continue
            _, mesh_name, divide = REPLICA_MESHES[replica.over]
            mesh: DeviceMesh = getattr(dims, mesh_name)
            groups = [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]
            reduce = _reducer(groups, dims.dp_shape.world_size if divide else 1)
            reducers.update(dict.fromkeys(replica.params, reduce))
        return ReplicaGradReduceHook(model, reducers)

    def collectives(self, step: HookStep) -> CommTally:
        """One all-reduce of each parameter's local bytes per dimension of its set's mesh.

        Args:
            step: the step the estimate costs.

        Returns:
            The backward all-reduces (none without parallel dimensions).
        """
        tally = super().collectives(step)  # empty
        if step.parallel is None:
            return tally
        named = dict(step.model.named_parameters())
        for replica in self.sets:
            for name in replica.params:
                size = local_shape(named[name]).numel() * named[name].element_size()
                for _ in range(replica.dims(step.parallel)):
                    tally.add("backward", "all_reduce", size)
        return tally


def _reducer(groups: list[dist.ProcessGroup], divisor: int) -> _Reduce:
    def reduce(grad: torch.Tensor) -> torch.Tensor:
        local = (grad.to_local() if isinstance(grad, DTensor) else grad).clone()
        for group in groups:
            dist.all_reduce(local, group=group)
        if divisor != 1:
            local.div_(divisor)
        if not isinstance(grad, DTensor):
            return local
        return DTensor.from_local(
            local, grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()
        )

    return reduce


class ReplicaGradReduceHook:
    """The installed hook: a gradient hook on the parameter object each module holds when
    it runs."""

    name = NAME

    def __init__(self, model: nn.Module, reducers: Mapping[str, _Reduce]) -> None:
        self._hooked: dict[tuple[int, str], tuple[nn.Parameter, RemovableHandle]] = {}
        owners: dict[str, dict[str, _Reduce]] = {}
        for name, reduce in reducers.items():
            path, _, local = name.rpartition(".")
            owners.setdefault(path, {})[local] = reduce
        self._handles = [
            model.get_submodule(path).register_forward_pre_hook(self._hook_params(locals_))
            for path, locals_ in owners.items()
        ]

    def _hook_params(self, reducers: dict[str, _Reduce]) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            for name, reduce in reducers.items():
                param = module.get_parameter(name)
                key = (id(module), name)
                held = self._hooked.get(key)
                if held is not None and held[0] is param:
                    continue
                if held is not None:
                    held[1].remove()
                handle = param.register_hook(reduce)  # type: ignore[no-untyped-call]
                self._hooked[key] = (param, handle)

        return hook

    def remove(self) -> None:
        """Removes the module and gradient hooks."""
        for handle in [*self._handles, *(h for _, h in self._hooked.values())]:
            handle.remove()
        self._handles, self._hooked = [], {}
