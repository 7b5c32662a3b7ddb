"""FSDP2 policy for DeepSeek-V4.1: vision-tower norms stay fp32 in their own units.

V4.1 reuses the V4 vision tower, whose RMSNorm weights (``norm1``/``norm2`` of
each block and the tower's final ``norm``) are stored in fp32 and must compute
in fp32 while the rest of the model runs in bf16. FSDP2 cannot hold those
weights in a unit with bf16 weights, and a bf16 ``param_dtype`` would round
them, so they become fp32 units (fp32 params and reduction, output cast back to
the caller's compute dtype) before the module itself is sharded.

Recognition is structural, so other implementations of the same architecture
are served too:

- a *norm* is a module without parameterised children whose parameters are all
  1-D and include ``weight`` (RMSNorm, LayerNorm);
- a *vision tower* holds a layer container of blocks, at least one fp32 norm,
  and no token embedding (``nn.Embedding``) - which tells it from the text model;
- a *vision block* holds norms and other layers as direct children, and its
  norms are fp32 while its other weights are not (dtype evidence: a text layer
  of the same shape has norms in the model dtype).

Activation-checkpoint wrappers are looked through.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_core import (
    PlanContext,
    ShardCall,
    apply_fully_shard,
    check_reshard_after_forward,
    compat,
    dominant_dtype,
    fp32_island_policy,
    is_sharded,
    shard_group_size,
    shard_groups_then_module,
)
from fsdp_core.containers import is_module_container, join_path
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.discovery import _check_names

__all__ = [
    "DeepseekV41ModelParallelizer",
    "PARALLELIZER",
    "NormGroup",
    "fully_shard_deepseek_v41",
    "find_vision_towers",
    "is_norm_module",
    "is_vision_block",
    "is_vision_tower",
    "plan_fp32_norm_groups",
]

logger = logging.getLogger(__name__)

_WRAPPED_ATTR = "_checkpoint_wrapped_module"


def _unwrap(module: nn.Module) -> nn.Module:
    """The module inside activation-checkpoint wrappers (any depth)."""
    while isinstance(getattr(module, _WRAPPED_ATTR, None), nn.Module):
        module = getattr(module, _WRAPPED_ATTR)
    return module


def is_norm_module(module: nn.Module) -> bool:
    """A normalisation layer by shape: only 1-D parameters, ``weight`` among them."""
    own = dict(module.named_parameters(recurse=False))
    if "weight" not in own or not all(p.dim() == 1 for p in own.values()):
        return False
    return not any(True for child in module.children() for _ in child.parameters())


def _is_fp32_norm(module: nn.Module) -> bool:
    return is_norm_module(module) and module.weight.dtype == torch.float32


def _param_children(module: nn.Module) -> list[nn.Module]:
    return [child for child in module.children() if any(True for _ in child.parameters())]


def is_vision_block(module: nn.Module) -> bool:
    """Norms beside other layers, the norms fp32 and the other weights not."""
    inner = _unwrap(module)
    children = [_unwrap(child) for child in _param_children(inner)]
    norms = [child for child in children if is_norm_module(child)]
    others = [child for child in children if not is_norm_module(child)]
    if not norms or not others or any(is_module_container(child) for child in children):
        return False
    if not all(_is_fp32_norm(norm) for norm in norms):
        return False
    rest = dominant_dtype(p for child in others for p in child.parameters())
    return rest is not None and rest != torch.float32


def is_vision_tower(module: nn.Module) -> bool:
    """A stack of blocks with fp32 norms and no token embedding."""
    inner = _unwrap(module)
    if any(isinstance(sub, nn.Embedding) for sub in inner.modules()):
        return False
    has_stack = any(
        is_module_container(child) and any(True for _ in child.parameters())
        for child in inner.children()
    )
    return has_stack and any(_is_fp32_norm(sub) for sub in inner.modules())


def find_vision_towers(model: nn.Module) -> list[str]:
    """Qualified names of the maximal vision towers in ``model`` (by structure)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if any(name == f or name.startswith(f + ".") for f in found):
            continue
        if name and is_vision_tower(module):
            found.append(name)
    return found


def _fp32_norm_paths(
    module: nn.Module, prefix: str, skip: set[str], skip_module: set[int]
) -> Iterator[str]:
    """fp32 norms below ``module``, not descending into existing or planned units."""
    for name, sub in module.named_children():
        path = join_path(prefix, name)
        if id(sub) in skip_module or is_sharded(sub):
            continue
        if _is_fp32_norm(sub):
            if not any(n in skip for n, _ in sub.named_parameters(prefix=path)):
                yield path
            continue
        yield from _fp32_norm_paths(sub, path, skip, skip_module)


@dataclass(frozen=True)
class NormGroup:
    """fp32 norms that share one FSDP unit (one all-gather, one reduce-scatter)."""

    paths: tuple[str, ...]
    mp_policy: MixedPrecisionPolicy


def plan_fp32_norm_groups(
    module: nn.Module,
    *,
    mp_policy: MixedPrecisionPolicy,
    prefix: str = "",
    ignored_param_names: Sequence[str] = (),
    planned: set[int] | None = None,
    grouped: bool | None = None,
) -> list[NormGroup]:
    """The fp32-norm units of a vision tower or block, as few as torch allows.

    With grouped per-module casting (``compat.GROUPED_PER_MODULE_CASTING``) all
    norms share one unit; otherwise each norm is its own unit. Norms that are
    already units, already planned, or ignored (replicated) are left out.
    """
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    surrounding = dominant_dtype(p for p in module.parameters() if p.dim() > 1) or dominant_dtype(
        module.parameters()
    )
    policy = fp32_island_policy(mp_policy, surrounding_dtype=surrounding)
    paths = list(_fp32_norm_paths(module, prefix, set(ignored_param_names), planned or set()))
    if not paths:
        return []
    group = compat.GROUPED_PER_MODULE_CASTING if grouped is None else grouped
    if group:
        return [NormGroup(tuple(paths), policy)]
    return [NormGroup((path,), policy) for path in paths]


def fully_shard_deepseek_v41(
    module: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module`` in place; vision towers and blocks keep fp32 norm units.

    On a vision tower or block the fp32 norms are sharded first as fp32 units
    (grouped when torch allows), then the module with ``mp_policy``. Anything
    else gets ordinary FSDP with ``mp_policy`` unchanged. A module that already
    is an FSDP unit is left as it is (no double wrapping). A list of modules is
    sharded as one grouped unit with ``mp_policy`` (used for norm groups).
    """
    if isinstance(module, (list, tuple)):
        apply_fully_shard(
            list(module),
            mesh=mesh,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored_params,
        )
        return module
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    # Check everything before the first unit is made, so a bad call shards nothing.
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    check_reshard_after_forward(reshard_after_forward, shard_group_size(mesh))
    if is_sharded(module):
        logger.info("%s is already an FSDP unit; leaving it as it is", type(module).__name__)
        return module
    groups: list[tuple[Sequence[str], MixedPrecisionPolicy]] = []
    if is_vision_tower(module) or is_vision_block(module):
        ignored_names = [
            name for name, p in module.named_parameters() if ignored_params and p in ignored_params
        ]
        groups = [
            (group.paths, group.mp_policy)
            for group in plan_fp32_norm_groups(
                module, mp_policy=mp_policy, ignored_param_names=ignored_names
            )
        ]
    shard_groups_then_module(
        module,
        groups,
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
        ignored_params=ignored_params,
    )
    return module


class DeepseekV41ModelParallelizer(MultimodalParallelizer):
    """Keeps DeepSeek-V4.1 vision norms in fp32; routes every unit through
    :func:`fully_shard_deepseek_v41`.

    Before any layer is sharded, the *trainable* fp32 norms of each vision tower
    are planned as one unit per tower (one per norm on torch without grouped
    casting), so the tower's blocks and the root hold only the caller's dtype.
    *Frozen* fp32 norms are replicated under every policy: kept whole and fp32
    on every rank, outside FSDP, so they cost no collective and the RMSNorm
    computes in fp32. Towers are found by structure (:func:`find_vision_towers`)
    plus the multimodal discovery (the V4.1 attribute ``vision`` is added to the
    tower names).
    """

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
        towers = _check_names(extra_tower_names, "extra_tower_names")
        super().__init__(
            frozen_multimodal_sharding=frozen_multimodal_sharding,
            extra_tower_names=("vision", *(t for t in towers if t != "vision")),
            extra_projector_names=extra_projector_names,
            exclude=exclude,
            sync_replicated=sync_replicated,
            dtype_safe=dtype_safe,
        )

    def _fully_shard_module(self, module: object, **kwargs: object) -> None:
        fully_shard_deepseek_v41(module, **kwargs)  # type: ignore[arg-type]

    def _plan_leading_calls(self, ctx: PlanContext) -> list[ShardCall]:
        calls = []
        for tower in find_vision_towers(ctx.model):
            module = ctx.module(tower)
            for group in plan_fp32_norm_groups(
                module,
                mp_policy=ctx.mp_policy,
                prefix=tower,
                ignored_param_names=sorted(ctx.ignored_param_names),
                planned=ctx.planned,
            ):
                calls.append(
                    self._make_call(
                        group.paths,
                        ctx,
                        mp_policy=group.mp_policy,
                        reshard_after_forward=ctx.reshard_after_forward,
                        role="fp32_norms",
                    )
                )
        return calls

    def _replicated_param_names(self, model: nn.Module) -> list[str]:
        """Also replicate frozen fp32 vision norms, whatever the policy.

        A frozen norm needs no gradient reduction, and kept whole in fp32 on
        every rank it costs no collective at all (2L+1 vectors of the tower
        width), computes in fp32, and cannot make ranks diverge when only
        some of them see images. Trainable norms keep their fp32 unit.
        """
        names = super()._replicated_param_names(model)
        seen = set(names)
        for tower in find_vision_towers(model):
            for path in _fp32_norm_paths(model.get_submodule(tower), tower, set(), set()):
                for name, param in model.get_submodule(path).named_parameters(prefix=path):
                    if not param.requires_grad and name not in seen:
                        seen.add(name)
                        names.append(name)
        return names

    def _replicated_keep_dtype(self, model: nn.Module, names: Iterable[str]) -> Iterator[str]:
        wanted = list(names)
        yield from super()._replicated_keep_dtype(model, wanted)
        wanted_set = set(wanted)
        for tower in find_vision_towers(model):
            for path in _fp32_norm_paths(model.get_submodule(tower), tower, set(), set()):
                for name, _ in model.get_submodule(path).named_parameters(prefix=path):
                    if name in wanted_set:
                        yield name


#: The ready-to-use parallelizer (frozen towers follow ``root``; see ``with_options``).
PARALLELIZER = DeepseekV41ModelParallelizer()
