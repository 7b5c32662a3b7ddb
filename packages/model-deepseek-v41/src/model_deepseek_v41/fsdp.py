"""FSDP2 policy for DeepSeek-V4.1: vision-tower norms stay fp32 in their own units.

V4.1 reuses the V4 vision tower, whose RMSNorm weights (``norm1``/``norm2`` of
each block and the tower's final ``norm``) are stored in fp32 and must compute
in fp32 while the rest of the model runs in bf16. FSDP2 cannot hold those
weights in a unit with bf16 weights, and a bf16 ``param_dtype`` would round
them, so they become fp32 units (fp32 params and reduction, output cast back to
the caller's compute dtype) before the module itself is sharded.

Which modules are vision towers is decided once, by the multimodal discovery
([`multimodal_fsdp.discovery`][multimodal_fsdp.discovery]; its name table knows the V4.1
attribute ``vision``): the parallelizer reads the discovery its ``plan()`` made, so
``exclude`` and ``extra_tower_names`` apply to the norms too, and
``fully_shard_deepseek_v41`` runs it with default options on the module it is given.
Inside a tower the norms are found by the V4 layout, never by storage dtypes, so it
holds for a bf16 model with fp32 norms and for fp32 master weights under a bf16
policy alike:

- a *norm* is a module without parameterised children whose parameters are all
  1-D and include ``weight`` (RMSNorm, LayerNorm);
- a *vision block* has the V4 block layout: norms registered as ``norm1`` and
  ``norm2`` beside other parameterised layers (the text decoder's layers name
  theirs ``input_layernorm`` / ``post_attention_layernorm``);
- the *vision norms* of a tower are the norms that are direct children of the
  blocks in its layer containers and of the tower itself (``norm1``, ``norm2``
  and the final ``norm``); those of a block are its ``norm1`` and ``norm2``.

Activation-checkpoint wrappers are looked through. The grouped norm unit needs a
torch whose grouped units survive a module being called again in the same
iteration (the tower run once per image); elsewhere each norm is its own unit
(``compat.GROUPED_UNIT_REUSE``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_core import compat, fp32_island_policy
from fsdp_core.containers import is_module_container, is_under, join_path, unwrap_module
from fsdp_core.dtype_units import UnitGroups, dominant_dtype, dtype_island_groups
from fsdp_core.plan import ShardCall
from fsdp_core.plan_context import PlanContext
from fsdp_core.sharding import ShardOptions, is_sharded
from multimodal_fsdp import MultimodalParallelizer
from multimodal_fsdp.discovery import resolve_multimodal_modules
from multimodal_fsdp.discovery.names import MultimodalModule
from multimodal_fsdp.model_discovery import Discovery

__all__ = [
    "DeepseekV41ModelParallelizer",
    "PARALLELIZER",
    "NormGroup",
    "fully_shard_deepseek_v41",
    "is_norm_module",
    "is_vision_block",
    "plan_fp32_norm_groups",
]

logger = logging.getLogger(__name__)

#: Child names of the norms of a V4 vision block.
BLOCK_NORM_NAMES: tuple[str, ...] = ("norm1", "norm2")


def _unwrap(module: nn.Module) -> nn.Module:
    return unwrap_module(module)


def is_norm_module(module: nn.Module) -> bool:
    """A normalisation layer by shape: only 1-D parameters, ``weight`` among them.

    Args:
        module: any module.

    Returns:
        Whether it looks like a norm.
    """
    own = dict(module.named_parameters(recurse=False))
    if "weight" not in own or not all(p.dim() == 1 for p in own.values()):
        return False
    return not any(True for child in module.children() for _ in child.parameters())


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def is_vision_block(module: nn.Module) -> bool:
    """The V4 block layout: ``norm1`` and ``norm2`` norms beside other layers.

    Args:
        module: any module.

    Returns:
        Whether it is a vision block.
    """
    inner = _unwrap(module)
    children = {name: _unwrap(child) for name, child in inner.named_children()}
    if not all(is_norm_module(children.get(name, nn.Identity())) for name in BLOCK_NORM_NAMES):
        return False
    others = [
        child
        for name, child in children.items()
        if name not in BLOCK_NORM_NAMES and _has_params(child)
    ]
    return bool(others) and not any(is_module_container(child) for child in children.values())


def _block_containers(tower: nn.Module) -> list[nn.Module]:
    return [
        child
        for child in tower.children()
        if is_module_container(child)
        and _has_params(child)
        and all(is_vision_block(item) for item in child.children())
    ]


def vision_norm_paths(module: nn.Module, prefix: str = "") -> list[str]:
    """Paths of the vision norms of a vision tower or block (see the module doc); none
    for a module that holds no vision blocks. Which modules are towers is the
    discovery's decision: this only reads the layout inside one."""
    inner = _unwrap(module)
    inner_prefix = _inner_prefix(module, prefix)
    if is_vision_block(inner):
        return [join_path(inner_prefix, name) for name in BLOCK_NORM_NAMES]
    containers = _block_containers(inner)
    if not containers:
        return []
    paths: list[str] = []
    for name, child in inner.named_children():
        path = join_path(inner_prefix, name)
        if any(child is container for container in containers):
            for key, block in child.named_children():
                paths.extend(vision_norm_paths(block, join_path(path, key)))
        elif is_norm_module(_unwrap(child)):
            paths.append(_inner_prefix(child, path))
    return paths


def _vision_tower_paths(found: Iterable[MultimodalModule]) -> list[str]:
    """The vision towers among discovered multimodal modules (role ``tower``, modality
    ``vision``): the regions whose norms become fp32 units."""
    return [item.path for item in found if item.role == "tower" and item.modality == "vision"]


def _vision_towers(found: Discovery) -> list[str]:
    """The vision towers of a plan's discovery."""
    return _vision_tower_paths(part.found for part in found.parts)


def _inner_prefix(module: nn.Module, prefix: str) -> str:
    """The path of the module inside ``module``'s wrappers."""
    while isinstance(wrapped := getattr(module, "_checkpoint_wrapped_module", None), nn.Module):
        prefix = join_path(prefix, "_checkpoint_wrapped_module")
        module = wrapped
    return prefix


def _fp32_norm_paths(
    module: nn.Module, prefix: str, skip: set[str], skip_module: set[int]
) -> Iterator[str]:
    """Vision norms of ``module`` that are not (inside) units already, not planned
    (``skip_module``: ids of planned modules) and not ignored (``skip``: names)."""
    for path in vision_norm_paths(module, prefix):
        relative = path[len(prefix) + 1 :] if prefix else path
        chain = [module]
        for part in relative.split("."):
            chain.append(chain[-1].get_submodule(part))
        if any(id(m) in skip_module or is_sharded(m) for m in chain[1:]):
            continue
        if any(n in skip for n, _ in chain[-1].named_parameters(prefix=path)):
            continue
        yield path


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

    With grouped per-module casting and grouped units that survive a module's
    reuse in one iteration (``compat.GROUPED_PER_MODULE_CASTING`` and
    ``compat.GROUPED_UNIT_REUSE``) all norms share one unit; otherwise each norm is
    its own unit. Norms that are already units, already planned, or ignored
    (replicated) are left out. The surrounding compute dtype (the norms' output
    dtype) is the policy's ``param_dtype``, else the dtype of the other weights.

    Args:
        module: a vision tower or block.
        mp_policy: the surrounding policy.
        prefix: ``module``'s qualified name.
        ignored_param_names: parameters left out (replicated).
        planned: ids of modules already planned as units.
        grouped: whether the norms may share a unit (None: what this torch supports).

    Returns:
        The norm groups, each with its fp32 policy.

    Raises:
        TypeError: ``mp_policy`` is not a ``MixedPrecisionPolicy``.
    """
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    paths = list(_fp32_norm_paths(module, prefix, set(ignored_param_names), planned or set()))
    if not paths:
        return []
    surrounding = dominant_dtype(p for p in module.parameters() if p.dim() > 1) or dominant_dtype(
        module.parameters()
    )
    policy = fp32_island_policy(mp_policy, surrounding_dtype=surrounding)
    group = (
        compat.GROUPED_PER_MODULE_CASTING and compat.GROUPED_UNIT_REUSE
        if grouped is None
        else grouped
    )
    if group:
        return [NormGroup(tuple(paths), policy)]
    return [NormGroup((path,), policy) for path in paths]


def _plan_norm_groups(
    model: nn.Module,
    regions: Iterable[str],
    *,
    mp_policy: MixedPrecisionPolicy,
    ignored_param_names: Iterable[str],
    planned: set[int] | None = None,
) -> list[NormGroup]:
    """The fp32-norm units of each region of ``model`` (a path; ``""`` is ``model``), in
    order: the one planning step behind both the parallelizer's plan and
    ``fully_shard_deepseek_v41``. A region that holds no vision blocks has none; a norm
    is planned once even if two regions reach it."""
    ignored = sorted(ignored_param_names)
    taken = set(planned or ())
    groups: list[NormGroup] = []
    for path in regions:
        found = plan_fp32_norm_groups(
            model.get_submodule(path) if path else model,
            mp_policy=mp_policy,
            prefix=path,
            ignored_param_names=ignored,
            planned=taken,
        )
        for group in found:
            taken.update(id(model.get_submodule(p)) for p in group.paths)
        groups.extend(found)
    return groups


def _vision_norm_parameters(
    model: nn.Module, towers: Iterable[str]
) -> Iterator[tuple[str, nn.Parameter]]:
    """Every parameter of the vision norms of the ``towers`` of ``model``, by name."""
    for tower in towers:
        for path in _fp32_norm_paths(model.get_submodule(tower), tower, set(), set()):
            yield from model.get_submodule(path).named_parameters(prefix=path)


def fully_shard_deepseek_v41(
    module: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``module`` in place; vision towers and blocks keep fp32 norm units.

    The fp32 norms of ``module`` (when it is a vision tower or block) and of the vision
    towers the multimodal discovery finds in it (default options) are sharded first as
    fp32 units (grouped when torch allows), then any other odd-dtype island, then the
    module with ``mp_policy``: the planning step of
    [`DeepseekV41ModelParallelizer`][model_deepseek_v41.fsdp.DeepseekV41ModelParallelizer],
    applied to ``module``, and exactly what its ``_fully_shard_module`` does outside a
    plan. Anything else gets ordinary FSDP with ``mp_policy`` unchanged. A module that
    already is an FSDP unit is left as it is (no double wrapping). A list of modules is
    sharded as one grouped unit with ``mp_policy`` (used for norm groups). Everything is
    checked before the first unit is made, so a bad call shards nothing.

    Args:
        module: the module (or list of modules) to shard.
        mesh: the data-parallel mesh.
        mp_policy: the caller's policy.
        offload_policy: FSDP2's offload policy.
        reshard_after_forward: as ``fully_shard`` takes it.
        ignored_params: parameters FSDP leaves alone.

    Returns:
        ``module``, sharded.
    """
    DeepseekV41ModelParallelizer()._fully_shard_module(
        module,
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
        ignored_params=ignored_params,
    )
    return module


class DeepseekV41ModelParallelizer(MultimodalParallelizer):
    """Keeps DeepSeek-V4.1 vision norms in fp32, with the planning step of
    [`fully_shard_deepseek_v41`][model_deepseek_v41.fsdp.fully_shard_deepseek_v41].

    Before any layer is sharded, the *trainable* fp32 norms of each vision tower
    are planned as one unit per tower (one per norm on torch without grouped
    casting), so the tower's blocks and the root hold only the caller's dtype.
    *Frozen* fp32 norms are replicated under every policy: kept whole and fp32
    on every rank, outside FSDP, so they cost no collective and the RMSNorm
    computes in fp32. The towers are the vision towers of the multimodal discovery
    that ``plan()`` made (its name table knows the V4.1 attribute ``vision``), so
    ``exclude`` and ``extra_tower_names`` decide the norms' units too; applying a plan
    only executes its calls. Every option of ``multimodal_fsdp.MultimodalParallelizer``
    is accepted with the same meaning and default.

    Its ``_fully_shard_module`` (the reference contract, inherited), called by a framework
    on a module of its choice (NeMo Automodel's MoE parallelizer: each vision block, then
    the tower, then the root, with ``mesh=`` and ``mp_policy=``), is exactly
    ``fully_shard_deepseek_v41(module, **kwargs)``, with this parallelizer's discovery
    options (``exclude=``, ``extra_tower_names=``) deciding the towers.
    """

    def _unit_groups(self, module: nn.Module, options: ShardOptions) -> UnitGroups:
        """Outside a plan: the fp32 norm units of ``module`` (a vision tower or block) and
        of the vision towers discovery finds in it, then the other dtype islands."""
        found = resolve_multimodal_modules(
            module,
            extra_tower_names=self.extra_tower_names,
            extra_projector_names=self.extra_projector_names,
            exclude=self.exclude,
        )
        ignored = options.ignored_params or frozenset()
        groups = _plan_norm_groups(
            module,
            ["", *_vision_tower_paths(found)],
            mp_policy=options.mp_policy,
            ignored_param_names=[n for n, p in module.named_parameters() if p in ignored],
        )
        taken = {path for group in groups for path in group.paths}
        units: UnitGroups = [(group.paths, group.mp_policy) for group in groups]
        if self.dtype_safe:
            units += dtype_island_groups(
                module,
                options.mp_policy,
                ignored_params=ignored,
                skip=lambda path, _sub: any(is_under(path, t) for t in taken),
            )
        return units

    def _units(self, ctx: PlanContext[Discovery]) -> list[str | ShardCall]:
        """The fp32 norm units of the discovered vision towers first (one per tower, as
        torch allows), then the multimodal parallelizer's units."""
        groups = _plan_norm_groups(
            ctx.model,
            _vision_towers(ctx.found),
            mp_policy=ctx.mp_policy,
            ignored_param_names=ctx.ignored_param_names,
            planned=ctx.planned,
        )
        norm_units: list[str | ShardCall] = [
            self._make_call(
                group.paths,
                ctx,
                mp_policy=group.mp_policy,
                reshard_after_forward=ctx.reshard_after_forward,
                role="fp32_norms",
            )
            for group in groups
        ]
        return [*norm_units, *super()._units(ctx)]

    def _replicated_param_names(self, ctx: PlanContext[Discovery]) -> list[str]:
        """Also replicate frozen fp32 vision norms, whatever the policy.

        A frozen norm needs no gradient reduction, and kept whole in fp32 on
        every rank it costs no collective at all (2L+1 vectors of the tower
        width), computes in fp32, and cannot make ranks diverge when only
        some of them see images. Trainable norms keep their fp32 unit.
        """
        names = super()._replicated_param_names(ctx)
        seen = set(names)
        towers = _vision_towers(ctx.found)
        for name, param in _vision_norm_parameters(ctx.model, towers):
            if not param.requires_grad and name not in seen:
                seen.add(name)
                names.append(name)
        return names

    def _replicated_keep_dtype(self, found: Discovery, names: Iterable[str]) -> Iterator[str]:
        wanted = list(names)
        yield from super()._replicated_keep_dtype(found, wanted)
        wanted_set = set(wanted)
        for name, _ in _vision_norm_parameters(found.model, _vision_towers(found)):
            if name in wanted_set:
                yield name


#: The ready-to-use parallelizer (frozen towers follow ``root``; see ``with_options``).
PARALLELIZER = DeepseekV41ModelParallelizer()
