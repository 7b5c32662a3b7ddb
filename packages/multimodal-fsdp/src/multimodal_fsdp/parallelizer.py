"""``MultimodalParallelizer``: the frozen-tower policy on top of layer-container sharding.

How a multimodal module (tower or projector, see :mod:`multimodal_fsdp.discovery`)
is planned:

1. Its *frozen parts* are its maximal fully frozen submodules (the module itself
   when all of it is frozen). Each frozen part follows the policy:
   ``root`` - no unit, its parameters fall to the root unit;
   ``per_layer`` - :func:`shard_multimodal_module` (one unit per layer item, or
   the part as one unit when it has no layer container);
   ``replicate`` - not sharded: its parameters are ignored by every unit that
   owns them, placed on the mesh device and cast to the compute dtype (odd-dtype
   islands such as fp32 norms keep their dtype), and made equal on every rank.
2. Its *trainable parts* (maximal submodules without any frozen parameter) are
   sharded normally, as any other module: the items of their layer containers
   become units, and what is left (a projector MLP, ``visual.merger``, a patch
   embedding) stays in the enclosing unit - the root - which every rank runs,
   so a text-only batch on one rank cannot make the ranks' collectives diverge.
3. Everything outside multimodal modules follows :class:`fsdp_core.ModelParallelizer`:
   one unit per layer-container item, then the root.
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_core import ModelParallelizer, PlanContext, ShardingPlan, iter_layer_items
from fsdp_core.containers import join_path
from multimodal_fsdp.discovery import (
    MultimodalModule,
    _check_names,
    _check_paths,
    resolve_multimodal_modules,
)
from multimodal_fsdp.layers import shard_multimodal_module
from multimodal_fsdp.policy import (
    FrozenMultimodalSharding,
    module_is_fully_frozen,
    normalize_frozen_multimodal_sharding,
)
from multimodal_fsdp.uneven import install_uneven_media_guard

__all__ = ["MultimodalParallelizer", "MultimodalParts", "split_frozen_parts"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, repr=False)
class MultimodalParts:
    """A multimodal module split into maximal frozen and trainable submodule paths."""

    found: MultimodalModule
    frozen: list[str]
    trainable: list[str]

    def __repr__(self) -> str:
        return (
            f"MultimodalParts({self.found.path!r}, frozen={self.frozen}, "
            f"trainable={self.trainable})"
        )


def _has_frozen_param(module: nn.Module) -> bool:
    return any(not p.requires_grad for p in module.parameters())


def split_frozen_parts(module: nn.Module, path: str) -> tuple[list[str], list[str]]:
    """Maximal fully frozen and maximal fully trainable submodules of ``module``.

    Parameters held directly by a mixed module stay with the enclosing unit.
    """
    if module_is_fully_frozen(module):
        return [path], []
    if not _has_frozen_param(module):
        return [], ([path] if any(True for _ in module.parameters()) else [])
    frozen: list[str] = []
    trainable: list[str] = []
    for name, child in module.named_children():
        child_frozen, child_trainable = split_frozen_parts(child, join_path(path, name))
        frozen.extend(child_frozen)
        trainable.extend(child_trainable)
    return frozen, trainable


class MultimodalParallelizer(ModelParallelizer):
    """A :class:`~fsdp_core.ModelParallelizer` that applies the frozen-tower policy."""

    def __init__(
        self,
        *,
        frozen_multimodal_sharding: str = "root",
        extra_tower_names: Iterable[str] = (),
        extra_projector_names: Iterable[str] = (),
        exclude: Iterable[str] = (),
        sync_replicated: bool = True,
        dtype_safe: bool = True,
    ) -> None:
        super().__init__(dtype_safe=dtype_safe)
        self.frozen_multimodal_sharding: FrozenMultimodalSharding = (
            normalize_frozen_multimodal_sharding(frozen_multimodal_sharding)
        )
        self.extra_tower_names = _check_names(extra_tower_names, "extra_tower_names")
        self.extra_projector_names = _check_names(extra_projector_names, "extra_projector_names")
        self.exclude = _check_paths(exclude, "exclude")
        if not isinstance(sync_replicated, bool):
            raise TypeError(f"sync_replicated must be a bool, got {sync_replicated!r}")
        self.sync_replicated = sync_replicated

    def with_options(self, *, frozen_multimodal_sharding: str) -> MultimodalParallelizer:
        """A copy of this parallelizer with another frozen-tower policy."""
        clone = copy.copy(self)
        clone.frozen_multimodal_sharding = normalize_frozen_multimodal_sharding(
            frozen_multimodal_sharding
        )
        return clone

    # ------------------------------------------------------------ discovery
    def multimodal_parts(self, model: nn.Module) -> list[MultimodalParts]:
        """Discovered multimodal modules with their frozen and trainable parts."""
        found = resolve_multimodal_modules(
            model,
            extra_tower_names=self.extra_tower_names,
            extra_projector_names=self.extra_projector_names,
            exclude=self.exclude,
        )
        result = []
        for item in found:
            frozen, trainable = split_frozen_parts(item.module, item.path)
            result.append(MultimodalParts(item, frozen, trainable))
        return result

    def _replicated_paths(self, model: nn.Module) -> list[str]:
        if self.frozen_multimodal_sharding != "replicate":
            return []
        return [path for parts in self.multimodal_parts(model) for path in parts.frozen]

    def _replicated_param_names(self, model: nn.Module) -> list[str]:
        """Parameters kept whole on every rank (subclasses may add more)."""
        return _param_names_under(model, self._replicated_paths(model))

    # ------------------------------------------------------- planning hooks
    def _ignored_param_names(self, model: nn.Module, names: tuple[str, ...]) -> Iterable[str]:
        return (*names, *(n for n in self._replicated_param_names(model) if n not in names))

    def _unit_paths(self, ctx: PlanContext) -> list[str]:
        model = ctx.model
        parts = self.multimodal_parts(model)
        roots = [p.found.path for p in parts]
        paths = [
            path
            for path, _ in iter_layer_items(model)
            if not any(_is_under(path, root) for root in roots)
        ]
        ids = {id(module): name for name, module in model.named_modules()}
        for part in parts:
            for trainable in part.trainable:
                module = model.get_submodule(trainable) if trainable else model
                paths.extend(join_path(trainable, p) for p, _ in iter_layer_items(module))
            if self.frozen_multimodal_sharding == "per_layer":
                for frozen in part.frozen:
                    paths.extend(_layer_unit_paths(model, frozen, ids))
        return paths

    def _plan_notes(self, ctx: PlanContext) -> list[str]:
        notes = []
        policy = self.frozen_multimodal_sharding
        for part in self.multimodal_parts(ctx.model):
            head = f"{part.found.role} {part.found.path!r} ({part.found.modality})"
            if not part.frozen:
                notes.append(f"{head}: trainable, sharded like any other module")
            elif not part.trainable:
                notes.append(f"{head}: frozen, policy {policy!r}")
            else:
                notes.append(
                    f"{head}: frozen parts {part.frozen} follow {policy!r}, "
                    f"trainable parts {part.trainable} are sharded like any other module"
                )
        return notes

    def plan(
        self,
        model: nn.Module,
        *,
        mp_policy: torch.distributed.fsdp.MixedPrecisionPolicy | None = None,
        reshard_after_forward: bool | int | None = None,
        ignored_params: set[nn.Parameter] | None = None,
    ) -> ShardingPlan:
        plan = super().plan(
            model,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored_params,
        )
        replicated = tuple(sorted(set(self._replicated_param_names(model))))
        return ShardingPlan(
            calls=plan.calls,
            ignored_param_names=plan.ignored_param_names,
            notes=plan.notes,
            replicated_param_names=replicated,
        )

    def apply_plan(
        self,
        model: nn.Module,
        plan: ShardingPlan,
        *,
        mesh: DeviceMesh,
        offload_policy: torch.distributed.fsdp.OffloadPolicy | None = None,
    ) -> nn.Module:
        """Shard as planned, then guard against uneven media where units make it unsafe."""
        super().apply_plan(model, plan, mesh=mesh, offload_policy=offload_policy)
        owners = self.modules_with_units(model, plan)
        if owners:
            install_uneven_media_guard(model, modules=owners, device=_mesh_device(mesh.device_type))
        return model

    def modules_with_units(self, model: nn.Module, plan: ShardingPlan) -> list[str]:
        """Multimodal modules that own FSDP units: only ranks with media would run them."""
        roots = [part.found.path for part in self.multimodal_parts(model)]
        return [
            root
            for root in roots
            if any(_is_under(path, root) for unit in plan.units for path in unit.paths)
        ]

    # -------------------------------------------------------- apply hooks
    def replicated_param_dtypes(
        self, model: nn.Module, plan: ShardingPlan
    ) -> dict[str, torch.dtype]:
        """The dtype each replicated parameter has once the plan is applied: the plan's
        compute dtype, except odd-dtype islands (fp32 norms), which keep their own."""
        compute = _plan_compute_dtype(plan)
        named = dict(model.named_parameters())
        keep = set(self._replicated_keep_dtype(model, plan.replicated_param_names))
        return {
            name: named[name].dtype
            if compute is None or name in keep or not named[name].dtype.is_floating_point
            else compute
            for name in plan.replicated_param_names
        }

    def _before_apply(self, model: nn.Module, plan: ShardingPlan, *, mesh: DeviceMesh) -> None:
        """Place replicated parameters: mesh device, compute dtype, same values everywhere."""
        if not plan.replicated_param_names:
            return
        named = dict(model.named_parameters())
        dtypes = self.replicated_param_dtypes(model, plan)
        device = _mesh_device(mesh.device_type)
        for name, dtype in dtypes.items():
            param = named[name]
            # A meta parameter stays on meta (materialised later with the rest).
            target = param.device if param.device.type == "meta" else device
            if param.device != target or param.dtype != dtype:
                param.data = param.data.to(device=target, dtype=dtype)
        if self.sync_replicated and dist.is_initialized() and dist.get_world_size() > 1:
            for name in plan.replicated_param_names:
                param = named[name]
                if param.device.type != "meta":
                    dist.broadcast(param.data, src=0)
        logger.info(
            "replicated %d parameters on %s (dtypes %s)",
            len(dtypes),
            device,
            sorted({str(d) for d in dtypes.values()}),
        )

    def _after_apply(self, model: nn.Module, plan: ShardingPlan, *, mesh: DeviceMesh) -> None:
        """Post-sharding adjustments; each lives in its own module."""
        from multimodal_fsdp.prefetch import guard_backward_prefetch

        guard_backward_prefetch(model, plan)

    def _replicated_keep_dtype(self, model: nn.Module, names: Iterable[str]) -> Iterator[str]:
        """Replicated parameters that keep their dtype: odd-dtype islands of each module.

        Within each replicated module the dtype holding most elements is the
        module's own; parameters of another floating dtype (fp32 norms in a bf16
        tower) are islands and are not cast. Subclasses may add more.
        """
        wanted = set(names)
        for part in self.multimodal_parts(model):
            # The module's own dtype is judged over all of it, trainable parts included,
            # so a LoRA-split tower still sees its fp32 norms as islands.
            params = list(part.found.module.named_parameters(prefix=part.found.path))
            counts: Counter[torch.dtype] = Counter()
            for _, param in params:
                counts[param.dtype] += param.numel()
            if not counts:
                continue
            dominant = max(counts, key=lambda d: counts[d])
            yield from (n for n, p in params if n in wanted and p.dtype != dominant)


def _is_under(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def _param_names_under(model: nn.Module, roots: Iterable[str]) -> list[str]:
    prefixes = list(roots)
    if not prefixes:
        return []
    return [
        name for name, _ in model.named_parameters() if any(_is_under(name, r) for r in prefixes)
    ]


def _layer_unit_paths(model: nn.Module, path: str, ids: dict[int, str]) -> list[str]:
    """Paths :func:`shard_multimodal_module` would shard for the module at ``path``."""
    chosen: list[str] = []
    module = model.get_submodule(path) if path else model
    shard_multimodal_module(module, lambda m: chosen.append(ids[id(m)]))
    return chosen


def _plan_compute_dtype(plan: ShardingPlan) -> torch.dtype | None:
    roots = [call for call in plan.calls if call.paths == ("",)]
    return roots[-1].mp_policy.param_dtype if roots else None


def _mesh_device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)
