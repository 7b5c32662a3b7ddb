"""``MultimodalParallelizer``: the frozen-tower policy on top of layer-container sharding.

How a multimodal module (tower or projector, see
[`multimodal_fsdp.discovery.walk`][multimodal_fsdp.discovery.walk]) is planned:

1. Its *frozen parts* are its maximal fully frozen submodules (the module itself
   when all of it is frozen). Each frozen part follows the module's policy (one
   policy for all modules, or one per module path: see
   [`MultimodalParallelizer`][multimodal_fsdp.parallelizer.MultimodalParallelizer]):
   ``root`` - no unit, its parameters fall to the root unit;
   ``per_layer`` - [`shard_multimodal_module`][multimodal_fsdp.layers.shard_multimodal_module] (one
   unit per layer item, or the part as one unit when it has no layer container);
   ``replicate`` - not sharded: its parameters are ignored by every unit that
   owns them, placed on the mesh device and cast to the compute dtype (odd-dtype
   islands such as fp32 norms keep their dtype), and made equal on every rank.
2. Its *trainable parts* (maximal submodules without any frozen parameter) are
   sharded normally, as any other module: the items of their layer containers
   become units, and what is left (a projector MLP, ``visual.merger``, a patch
   embedding) stays in the enclosing unit - the root - which every rank runs,
   so a text-only batch on one rank cannot make the ranks' collectives diverge.
3. A *partly trainable* module (frozen and trainable parameters, e.g. LoRA on a
   frozen tower, or a trainable merger) is decided per layer: its layer-container
   items (the module itself when it has none) are *frozen*, *trainable* or
   *adapted* (frozen weights with trainable ones inside, such as a block with
   LoRA in its ``q_proj``). Trainable layers are units under every policy.
   Frozen and adapted layers follow the policy as one piece, so adapters stay
   with the layer they adapt and the units are those of the fully frozen module:
   ``root`` - no unit, root unit; ``per_layer`` - one unit per layer, frozen
   weights and adapters together (FSDP reduces only the adapters' gradients);
   ``replicate`` - the frozen parameters (those of maximal frozen submodules) are
   replicated, the adapters join the root unit. Anything outside layers joins the
   root unit (replicated when frozen under ``replicate``).
4. Everything outside multimodal modules follows
[`fsdp_core.ModelParallelizer`][fsdp_core.parallelizer.ModelParallelizer]:
   one unit per layer-container item, then the root. Adapters there (LoRA on
   decoder projections) sit inside decoder layers and so in their units; adapter
   dicts never make units of their own
   ([`fsdp_core.containers.is_branch_dict`][fsdp_core.containers.is_branch_dict]).

Code that only runs with media and owns units (towers and projectors with units, decoder
layers that text-only batches skip, see
[`multimodal_fsdp.discovery.conditional`][multimodal_fsdp.discovery.conditional]) is a *media
region*. By default regions keep their units and the ``schedule_check`` hook
([`multimodal_fsdp.runtime.schedule_check`][multimodal_fsdp.runtime.schedule_check]) stops a
step with uneven media on every rank before a mismatched collective. ``uneven_media=True``
folds every region into the root unit (kept gathered, gradients unreduced, for the whole
step); ``balance_media=True`` has every rank take part in every tower call and join the
calls of projectors and media-dependent decoder layers with units, so nothing is a region.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.distributed.fsdp import OffloadPolicy

from fsdp_core import ModelParallelizer, ShardingPlan
from fsdp_core.containers import is_under, iter_layer_items, join_path
from fsdp_core.dtype_units import dominant_dtype
from fsdp_core.plan import ShardCall
from fsdp_core.plan_context import PlanAdditions, PlanContext
from fsdp_core.runtime import HookPlan
from multimodal_fsdp._plan_checks import (
    _check_discovery,
    _check_folded,
    _check_offload,
    _compute_dtype,
    _param_names_under,
    _part_of,
    _plan_notes_of,
)
from multimodal_fsdp.discovery.validation import check_attribute_names, check_module_paths
from multimodal_fsdp.layers import multimodal_unit_paths
from multimodal_fsdp.media_hook_planning import media_hook_plans, shared_params
from multimodal_fsdp.model_discovery import Discovery, DiscoveryOptions, discover_with
from multimodal_fsdp.offload import OffloadPart, PartOffload
from multimodal_fsdp.parts import (
    MultimodalParts,
    classify_layers,
)
from multimodal_fsdp.policy import FrozenMultimodalSharding, FrozenPolicies, frozen_policy
from multimodal_fsdp.reachability import backward_free_paths
from multimodal_fsdp.record import MultimodalRecord, PlannedPart, media_regions_of, plan_record
from multimodal_fsdp.runtime.balance_media import BalanceMediaRuntimeHook, check_balance_group
from multimodal_fsdp.runtime.prefetch_guard import PrefetchGuardRuntimeHook
from multimodal_fsdp.runtime.schedule_check import (
    MediaRegion,
    ScheduleCheckRuntimeHook,
)

__all__ = ["MultimodalParallelizer"]

logger = logging.getLogger(__name__)


class MultimodalParallelizer(ModelParallelizer[Discovery]):
    """A [`ModelParallelizer`][fsdp_core.parallelizer.ModelParallelizer] that applies the
    frozen-tower policy.

    ``frozen_multimodal_sharding`` is one policy for every frozen tower and projector, or
    a mapping from discovered multimodal module paths to policies with ``"*"`` for the
    rest (default ``root``), e.g. ``{"model.vision_tower": "per_layer"}``; an unknown path
    fails when planning, listing the discovered ones. ``frozen_policies`` holds it as a
    [`FrozenPolicies`][multimodal_fsdp.policy.FrozenPolicies], which the plan records.

    ``uneven_media=True`` folds media regions into the root unit (see the module
    docstring); it cannot be combined with ``per_layer`` for any module, whose
    point is a unit per tower block, unless ``balance_media=True``.

    ``balance_media=True`` spreads each call of every discovered tower over the
    data-parallel ranks (the ``balance_media`` hook,
    [`multimodal_fsdp.runtime.balance_media`][multimodal_fsdp.runtime.balance_media]), so
    ``per_layer`` and trainable towers train under any media distribution; a tower no
    layout adapter understands is a ``ValueError`` at plan time. A rank without media
    joins the calls of projectors and media-dependent decoder layers with units
    ([`multimodal_fsdp.runtime.joined_layers`][multimodal_fsdp.runtime.joined_layers]);
    with ``uneven_media=True`` as well, those fold into the root unit instead.
    ``balance_media_group``: over which ranks each call is balanced: ``"auto"`` (the
    default: every data-parallel rank up to 64, above that blocks of 32 to 64 consecutive
    ranks, see [`balance_group_ranks`][multimodal_fsdp.runtime.balance_media.balance_group_ranks];
    every rank when a balanced tower or joined module owns units), ``"all"`` (every
    data-parallel rank), ``"shard"`` / ``"replicate"`` (the groups of one dimension of
    an HSDP mesh) or a block size ``k`` (``k`` consecutive ranks, e.g. a node), so the
    exchange per rank stays bounded as the world grows.

    ``offload``: which parts keep their sharded parameters (gradients and optimizer
    state) in host memory: one ``OffloadPolicy`` for every unit, or a mapping from
    ``"tower"``, ``"projector"`` and ``"language_model"`` (the rest) to a policy, e.g.
    ``{"tower": CPUOffloadPolicy()}`` ([`PartOffload`][multimodal_fsdp.offload.PartOffload]).
    A tower or projector offloaded unlike the language model gets a unit for what its
    layer units leave (a patch embedding, a final norm); a frozen part under ``root`` or
    ``replicate`` cannot be (a ``ValueError`` at plan time names ``per_layer``).

    Args:
        frozen_multimodal_sharding: one policy, or ``{path or "*": policy}``.
        extra_tower_names: more attribute names of towers.
        extra_projector_names: more attribute names of projectors.
        exclude: qualified paths discovery skips.
        sync_replicated: broadcast replicated parameters from the first rank when applied.
        dtype_safe: split odd-dtype islands into units of their own.
        uneven_media: fold media regions into the root unit.
        disabled_hooks: runtime hooks not to plan.
        balance_media: balance every tower call over the data-parallel ranks.
        balance_media_group: over which ranks each call is balanced.
        offload: host offload for every unit, or per part.

    Raises:
        TypeError: an option has the wrong type.
        ValueError: an option has an invalid value (the message lists the valid ones).
    """

    HOOKS = (
        *ModelParallelizer.HOOKS,
        PrefetchGuardRuntimeHook,
        ScheduleCheckRuntimeHook,
        BalanceMediaRuntimeHook,
    )

    def __init__(
        self,
        *,
        frozen_multimodal_sharding: str | Mapping[str, str] = "root",
        extra_tower_names: Iterable[str] = (),
        extra_projector_names: Iterable[str] = (),
        exclude: Iterable[str] = (),
        sync_replicated: bool = True,
        dtype_safe: bool = True,
        uneven_media: bool = False,
        disabled_hooks: Iterable[str] = (),
        balance_media: bool = False,
        balance_media_group: str | int = "auto",
        offload: OffloadPolicy | Mapping[str, OffloadPolicy | None] | PartOffload | None = None,
    ) -> None:
        super().__init__(dtype_safe=dtype_safe, disabled_hooks=disabled_hooks)
        self.offload = PartOffload.parse(offload)
        if not isinstance(uneven_media, bool):
            raise TypeError(f"uneven_media must be a bool, got {uneven_media!r}")
        if not isinstance(balance_media, bool):
            raise TypeError(f"balance_media must be a bool, got {balance_media!r}")
        self.uneven_media = uneven_media
        self.balance_media = balance_media
        self.balance_media_group = check_balance_group(balance_media_group)
        self.frozen_policies = FrozenPolicies()
        self._set_frozen_sharding(frozen_multimodal_sharding)
        self.extra_tower_names = check_attribute_names(extra_tower_names, "extra_tower_names")
        self.extra_projector_names = check_attribute_names(
            extra_projector_names, "extra_projector_names"
        )
        self.exclude = check_module_paths(exclude, "exclude")
        if not isinstance(sync_replicated, bool):
            raise TypeError(f"sync_replicated must be a bool, got {sync_replicated!r}")
        self.sync_replicated = sync_replicated

    def with_options(
        self, *, frozen_multimodal_sharding: str | Mapping[str, str]
    ) -> MultimodalParallelizer:
        """A copy of this parallelizer with another frozen-tower policy (a string: the
        same for every module) or per-module policies (a mapping).

        Args:
            frozen_multimodal_sharding: the new policy option.

        Returns:
            The copy.
        """
        clone = copy.copy(self)
        clone._set_frozen_sharding(frozen_multimodal_sharding)
        return clone

    def _set_frozen_sharding(self, value: str | Mapping[str, str]) -> None:
        policies = FrozenPolicies.parse(value)
        # per_layer and uneven_media exclude each other, for every module, unless the
        # towers are balanced (balanced towers keep their units under uneven_media).
        where = policies.per_layer_where
        if where and self.uneven_media and not self.balance_media:
            raise ValueError(
                f"{where} gives frozen towers one unit per block, "
                "which only ranks with media run; with uneven_media=True use 'root' or "
                "'replicate' (or keep per_layer and the same media calls on every rank)"
            )
        self.frozen_policies = policies

    def _parts_with_policies(
        self, found: Discovery
    ) -> list[tuple[MultimodalParts, FrozenMultimodalSharding]]:
        policies = self.frozen_policies.resolve(found.paths, owner=type(found.model).__name__)
        return [(part, policies[part.found.path]) for part in found.parts]

    # ------------------------------------------------------------ discovery
    @property
    def discovery_options(self) -> DiscoveryOptions:
        """The options of this parallelizer that change what discovery finds."""
        return DiscoveryOptions(
            extra_tower_names=self.extra_tower_names,
            extra_projector_names=self.extra_projector_names,
            exclude=self.exclude,
        )

    def discover(self, model: nn.Module) -> Discovery:
        """The multimodal discovery of ``model`` with this parallelizer's options
        ([`discover`][multimodal_fsdp.model_discovery.discover]); ``plan(model,
        discovery=...)`` accepts it, so that planning one model many times discovers once.

        Args:
            model: the model.

        Returns:
            Its discovery.
        """
        return discover_with(model, self.discovery_options)

    def multimodal_parts(self, model: nn.Module) -> list[MultimodalParts]:
        """Discovered multimodal modules with their frozen and trainable parts.

        Args:
            model: the model.

        Returns:
            One entry per discovered tower or projector.
        """
        return list(self.discover(model).parts)

    def _find(self, model: nn.Module) -> Discovery:
        return self.discover(model)

    def _planned_parts(self, found: Discovery) -> list[PlannedPart]:
        """The discovered modules as the plan records them, with their policies."""
        return [
            PlannedPart(
                path=part.found.path,
                rule=part.found.rule,
                modality=part.found.modality,
                role=part.found.role,
                frozen=tuple(part.frozen),
                trainable=tuple(part.trainable),
                policy=policy,
            )
            for part, policy in self._parts_with_policies(found)
        ]

    def _replicated_paths(self, found: Discovery) -> list[str]:
        return [
            path
            for part, policy in self._parts_with_policies(found)
            for path in frozen_policy(policy).replicated_paths(part.frozen)
        ]

    # ------------------------------------------------------- planning hooks
    def _replicated_param_names(self, ctx: PlanContext[Discovery]) -> list[str]:
        """Parameters of the frozen parts the policy replicates (subclasses may add more)."""
        return _param_names_under(ctx.model, self._replicated_paths(ctx.found))

    def _units(self, ctx: PlanContext[Discovery]) -> list[str | ShardCall]:
        model = ctx.model
        found = ctx.found
        parts = self._parts_with_policies(found)
        roots = found.paths
        conditional = set(found.conditional)
        paths: list[str | ShardCall] = [
            path
            for path, _ in iter_layer_items(model)
            if not any(is_under(path, root) for root in roots)
            and not (self.uneven_media and path in conditional)
        ]
        if self.uneven_media and not self.balance_media:
            return paths  # towers, projectors and conditional layers stay in the root
        if self.uneven_media:
            # Only balanced towers keep their units; projectors fold into the root unit.
            # (Under balance_media alone projectors keep theirs: ranks without media join
            # their calls in the exchange's rounds.)
            parts = [(part, policy) for part, policy in parts if part.found.role == "tower"]
        for part, policy in parts:
            if part.frozen and part.trainable:
                paths.extend(self._partly_trainable_unit_paths(part, policy))
                continue
            for trainable in part.trainable:
                module = model.get_submodule(trainable) if trainable else model
                paths.extend(join_path(trainable, p) for p, _ in iter_layer_items(module))
            if frozen_policy(policy).layer_units:
                for frozen in part.frozen:
                    paths.extend(multimodal_unit_paths(model, frozen))
        paths.extend(
            part.found.path for part, policy in parts if self._offload_needs_own_unit(part, policy)
        )
        return paths

    # ------------------------------------------------------------------ offload
    def _offload_needs_own_unit(
        self, part: MultimodalParts, policy: FrozenMultimodalSharding
    ) -> bool:
        """Whether ``part`` becomes a unit for what its layer units leave: offloaded unlike
        the language model, with units of its own anyway (trainable, or frozen under a
        policy with layer units)."""
        role: OffloadPart = part.found.role
        if self.offload.for_part(role) == self.offload.for_part("language_model"):
            return False
        return not part.frozen or frozen_policy(policy).layer_units

    def _unit_offload(
        self, paths: tuple[str, ...], ctx: PlanContext[Discovery]
    ) -> OffloadPolicy | None:
        """The offload of the part the unit's members belong to (the root unit and the
        decoder layers: ``language_model``)."""
        if not self.offload.any:
            return None
        found = ctx.found
        parts = {_part_of(path, found) for path in paths} if any(paths) else set()
        chosen = [self.offload.for_part(role) for role, _ in sorted(parts)]
        if "" in paths or not chosen:
            chosen.append(self.offload.for_part("language_model"))
        if any(policy != chosen[0] for policy in chosen):
            raise ValueError(
                f"one FSDP unit groups modules of parts offloaded differently "
                f"({', '.join(repr(p) for p in paths)}: {', '.join(r for r, _ in sorted(parts))}"
                f"; offload {self.offload.label()}); give those parts the same offload"
            )
        return chosen[0]

    def _partly_trainable_unit_paths(
        self, part: MultimodalParts, policy: FrozenMultimodalSharding
    ) -> list[str]:
        """Units of a partly trainable module, decided per layer (see the module doc)."""
        return frozen_policy(policy).partly_trainable_units(classify_layers(part))

    def _plan_notes(self, ctx: PlanContext[Discovery]) -> list[str]:
        return _plan_notes_of(
            ctx,
            self._parts_with_policies(ctx.found),
            balanced=bool(self._balanced_towers(ctx.found)),
            uneven_media=self.uneven_media,
            balance_media=self.balance_media,
            policies=self.frozen_policies,
            offload=self.offload,
        )

    def plan(
        self,
        model: nn.Module,
        *,
        mp_policy: torch.distributed.fsdp.MixedPrecisionPolicy | None = None,
        reshard_after_forward: bool | int | None = None,
        ignored_params: set[nn.Parameter] | None = None,
        discovery: Discovery | None = None,
    ) -> ShardingPlan:
        """Decide the units (see the module doc) without touching the model or needing a
        process group, reusing ``discovery`` (this parallelizer's ``discover``) if given.

        Args:
            model: the model (on ``meta`` is enough).
            mp_policy: the mixed-precision policy (bf16 compute, fp32 reduction if None).
            reshard_after_forward: as ``fully_shard`` takes it.
            ignored_params: parameters FSDP leaves alone (besides the replicated ones).
            discovery: the model's discovery, to reuse.

        Returns:
            The plan.
        """
        if discovery is not None:
            _check_discovery(discovery, model, self.discovery_options)
        return self._plan(
            model,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored_params,
            found=discovery,
        )

    def _plan_additions(
        self, ctx: PlanContext[Discovery], calls: tuple[ShardCall, ...]
    ) -> PlanAdditions:
        """The replicated parameters' dtypes, the paths no gradient reaches and the
        record of what was found and decided, from the plan's one discovery."""
        found = ctx.found
        if self.offload.any:
            _check_offload(self.offload, found, self._parts_with_policies(found), ctx, calls)
        units = ShardingPlan(calls=calls)
        balanced = self._balanced_towers(found)
        joined = self._joined_paths(found)
        parts = tuple(self._planned_parts(found))
        regions = media_regions_of(parts, found.conditional, units, balanced=[*balanced, *joined])
        if self.uneven_media:
            _check_folded(regions)
        record = MultimodalRecord(
            parts=parts,
            conditional_layers=found.conditional,
            media_regions=tuple(regions),
            policies=self.frozen_policies,
            uneven_media=self.uneven_media,
            balanced_towers=tuple(balanced),
            joined=tuple(joined),
        )
        dtypes = self._replicated_dtypes(found, calls, ctx.replicated_param_names)
        return PlanAdditions(
            replicated_param_dtypes=tuple(dtypes.items()),
            backward_free_paths=tuple(backward_free_paths(ctx.model, parts=list(found.parts))),
            sync_replicated=self.sync_replicated,
            records=(record,),
        )

    def media_regions(self, model: nn.Module, plan: ShardingPlan) -> list[MediaRegion]:
        """Modules that only run with media and own units of ``plan`` (see the module doc),
        from the plan's record (a plan without one: from this parallelizer's discovery).

        Args:
            model: the planned model.
            plan: its plan.

        Returns:
            The media regions.
        """
        record = plan_record(plan)
        if record is not None:
            return media_regions_of(
                record.parts,
                record.conditional_layers,
                plan,
                balanced=(*record.balanced_towers, *record.joined),
            )
        found = self.discover(model)
        return media_regions_of(
            self._planned_parts(found),
            found.conditional,
            plan,
            balanced=[*self._balanced_towers(found), *self._joined_paths(found)],
        )

    def modules_with_units(self, model: nn.Module, plan: ShardingPlan) -> list[str]:
        """Paths of the media regions of ``plan``: only ranks with media would run them.

        Args:
            model: the planned model.
            plan: its plan.

        Returns:
            The paths.
        """
        return [region.path for region in self.media_regions(model, plan)]

    def _entry_paths(self, ctx: PlanContext[Discovery]) -> list[str]:
        """Besides the base's: models that compute media features (``get_image_features``
        and the like, called by ``generate()``), then towers and projectors."""
        paths = super()._entry_paths(ctx)
        paths += [
            path
            for path, module in ctx.model.named_modules()
            if path
            and path not in paths
            and any(callable(getattr(type(module), f, None)) for f in _FEATURE_METHODS)
        ]
        towers = ctx.found.paths
        return paths + [path for path in towers if path not in paths]

    def _balanced_towers(self, found: Discovery) -> list[str]:
        """The towers ``balance_media=True`` balances: every discovered tower (none when
        the ``balance_media`` hook is disabled: they stay media regions then)."""
        if not self.balance_media or BalanceMediaRuntimeHook.name in self.disabled_hooks:
            return []
        return found.towers

    def _joined_paths(self, found: Discovery) -> list[str]:
        """What ``balance_media=True`` joins (run on a placeholder by ranks without media):
        projectors and media-dependent decoder layers; none under ``uneven_media=True`` or
        without balanced towers."""
        if self.uneven_media or not self._balanced_towers(found):
            return []
        return [*found.projectors, *found.conditional]

    def _shared_params(self, ctx: PlanContext[Discovery], plan: ShardingPlan) -> list[str]:
        """The balanced modules' trainable parameters a TP data group sums
        (``media_hook_planning.shared_params``)."""
        return shared_params(ctx.found, plan)

    def _plan_hooks(self, ctx: PlanContext[Discovery], plan: ShardingPlan) -> list[HookPlan]:
        record = plan_record(plan)
        if record is None:
            raise ValueError("a multimodal plan carries its MultimodalRecord before its hooks")
        return [
            *super()._plan_hooks(ctx, plan),
            *media_hook_plans(
                ctx.found,
                plan,
                record,
                per_layer=self.frozen_policies.per_layer_where,
                group=self.balance_media_group,
            ),
        ]

    # ------------------------------------------------- replicated parameters
    def replicated_param_dtypes(
        self, model: nn.Module, plan: ShardingPlan
    ) -> dict[str, torch.dtype]:
        """The dtype each replicated parameter has once applied: the plan's compute dtype,
        except odd-dtype islands (fp32 norms); read from the plan when it recorded them.

        Args:
            model: the planned model.
            plan: its plan.

        Returns:
            ``{parameter name: dtype}``.
        """
        recorded = dict(plan.replicated_param_dtypes)
        if set(recorded) == set(plan.replicated_param_names):
            return {name: recorded[name] for name in plan.replicated_param_names}
        return self._replicated_dtypes(
            self.discover(model), plan.calls, plan.replicated_param_names
        )

    def _replicated_dtypes(
        self, found: Discovery, calls: Iterable[ShardCall], names: Iterable[str]
    ) -> dict[str, torch.dtype]:
        """The root call's compute dtype per name (non-floating and kept ones keep theirs)."""
        wanted = list(names)
        compute = _compute_dtype(calls)
        named = dict(found.model.named_parameters())
        keep = set(self._replicated_keep_dtype(found, wanted))
        return {
            name: named[name].dtype
            if compute is None or name in keep or not named[name].dtype.is_floating_point
            else compute
            for name in wanted
        }

    def _replicated_keep_dtype(self, found: Discovery, names: Iterable[str]) -> Iterator[str]:
        """Replicated parameters that keep their dtype: those of another floating dtype
        than the one holding most of their module's elements (fp32 norms in a bf16 tower).
        Subclasses may add more."""
        wanted = set(names)
        for part in found.parts:
            # The module's own dtype is judged over all of it, trainable parts included,
            # so a LoRA-split tower still sees its fp32 norms as islands.
            params = list(part.found.module.named_parameters(prefix=part.found.path))
            dominant = dominant_dtype(param for _, param in params)
            if dominant is None:
                continue
            yield from (n for n, p in params if n in wanted and p.dtype != dominant)


#: Methods of transformers models that run towers and projectors outside the forward.
_FEATURE_METHODS = ("get_image_features", "get_video_features", "get_audio_features")
