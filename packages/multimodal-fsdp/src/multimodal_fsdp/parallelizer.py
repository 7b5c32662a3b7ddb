"""``MultimodalParallelizer``: the frozen-tower policy on top of layer-container sharding.

How a discovered tower or projector is planned:

1. Its *frozen parts* (maximal fully frozen submodules) follow its policy: ``root`` (no
   unit: the root unit holds them), ``per_layer``
   ([`shard_multimodal_module`][multimodal_fsdp.layers.shard_multimodal_module]: a unit
   per layer item) or ``replicate`` (ignored by FSDP, cast to the compute dtype except
   odd-dtype islands, made equal on every rank).
2. Its *trainable parts* are sharded as any module: layer items become units, the rest
   stays in the root unit, which every rank runs.
3. A *partly trainable* module (LoRA on a frozen tower) is decided per layer: trainable
   layers are units; frozen and *adapted* layers follow the policy as one piece, so
   adapters stay in their layer's unit.
4. Everything else follows
   [`fsdp_core.ModelParallelizer`][fsdp_core.parallelizer.ModelParallelizer].

Code that only runs with media and owns units is a *media region*; the
[`schedule_check`][multimodal_fsdp.runtime.schedule_check] hook stops a step with uneven
media before a mismatched collective. ``uneven_media=True`` folds regions into the root
unit; ``balance_media=True`` has every rank take part in every media call instead.
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
    _offload_kept_notes,
    _param_names_under,
    _part_of,
)
from multimodal_fsdp.discovery.validation import check_attribute_names, check_module_paths
from multimodal_fsdp.layers import multimodal_unit_paths
from multimodal_fsdp.media_hook_planning import media_hook_plans, shared_params
from multimodal_fsdp.model_discovery import Discovery, DiscoveryOptions, discover_with
from multimodal_fsdp.offload import OffloadPart, PartOffload
from multimodal_fsdp.parts import (
    MultimodalParts,
    classify_layers,
    partly_trainable_note,
    summarise,
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
    frozen-tower policy (see the module docstring).

    Args:
        frozen_multimodal_sharding: one policy, or ``{path or "*": policy}`` over the
            discovered module paths (``"*"``: the rest, default ``root``), recorded as
            [`FrozenPolicies`][multimodal_fsdp.policy.FrozenPolicies].
        extra_tower_names: more attribute names of towers.
        extra_projector_names: more attribute names of projectors.
        exclude: qualified paths discovery skips.
        sync_replicated: broadcast replicated parameters from the first rank when applied.
        dtype_safe: split odd-dtype islands into units of their own.
        uneven_media: fold media regions into the root unit (not with ``per_layer``
            unless ``balance_media``).
        disabled_hooks: runtime hooks not to plan.
        balance_media: spread each tower call over the data-parallel ranks
            ([`balance_media`][multimodal_fsdp.runtime.balance_media]); ranks without
            media join projectors and media-dependent layers with units.
        balance_media_group: over which ranks each call is balanced: ``"auto"``,
            ``"all"``, ``"shard"``, ``"replicate"`` or a block size
            ([`balance_group_ranks`][multimodal_fsdp.runtime.balance_media.balance_group_ranks]).
        offload: one ``OffloadPolicy`` for every unit, or one per ``"tower"``,
            ``"projector"`` and ``"language_model"``
            ([`PartOffload`][multimodal_fsdp.offload.PartOffload]).

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
        """A copy of this parallelizer with another frozen-tower policy.

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
        """The multimodal discovery of ``model`` with this parallelizer's options, for
        ``plan(model, discovery=...)``.

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
                layers = classify_layers(part)
                paths.extend(frozen_policy(policy).partly_trainable_units(layers))
                continue
            for trainable in part.trainable:
                items = iter_layer_items(model.get_submodule(trainable))
                paths.extend(join_path(trainable, p) for p, _ in items)
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
        """Whether ``part``, offloaded unlike the language model and with units of its own
        anyway, becomes a unit for what its layer units leave."""
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

    def _plan_notes(self, ctx: PlanContext[Discovery]) -> list[str]:
        notes = []
        found = ctx.found
        balanced = bool(self._balanced_towers(found))
        if found.conditional:
            where = (
                "join the root unit"
                if self.uneven_media
                else "are joined by ranks that skip them"
                if balanced
                else "are media regions"
            )
            notes.append(
                f"{len(found.conditional)} decoder layers run only with media "
                f"({summarise(found.conditional)}) and {where}"
            )
        if self.uneven_media and self.balance_media:
            notes.append(
                "uneven_media=True with balance_media=True: projectors join the root unit, "
                "balanced towers keep their units"
            )
        elif balanced:
            notes.append(
                "balance_media=True: projectors with units and media-dependent decoder layers "
                "are joined by ranks without media"
            )
        elif self.uneven_media:
            notes.append("uneven_media=True: towers and projectors join the root unit")
        if self.frozen_policies.by_path:
            notes.append(f"frozen-tower policies per module: {self.frozen_policies.label}")
        if self.offload.any:
            notes.append(f"offload per part: {self.offload.label()}")
            notes.extend(_offload_kept_notes(self.offload, ctx, found))
        for part, policy in self._parts_with_policies(found):
            head = f"{part.found.role} {part.found.path!r} ({part.found.modality})"
            if not part.frozen:
                notes.append(f"{head}: trainable, sharded like any other module")
            elif not part.trainable:
                notes.append(f"{head}: frozen, policy {policy!r}")
            else:
                notes.append(f"{head}: {partly_trainable_note(part, policy)}")
        return notes

    def plan(
        self,
        model: nn.Module,
        *,
        mp_policy: torch.distributed.fsdp.MixedPrecisionPolicy | None = None,
        reshard_after_forward: bool | int | None = None,
        ignored_params: set[nn.Parameter] | None = None,
        discovery: Discovery | None = None,
    ) -> ShardingPlan:
        """Decide the units without touching the model or needing a process group.

        Args:
            model: the model (on ``meta`` is enough).
            mp_policy: the mixed-precision policy (None: ``MixedPrecisionPolicy()``, no casts).
            reshard_after_forward: as ``fully_shard`` takes it.
            ignored_params: parameters FSDP leaves alone (besides the replicated ones).
            discovery: the model's discovery (this parallelizer's ``discover``), to reuse.

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
        """The replicated dtypes, backward-free paths and the plan's record."""
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
        """Modules that only run with media and own units of ``plan``.

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
        """Besides the base's: models with ``get_image_features`` and the like, then the
        towers and projectors."""
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
        """Every discovered tower under ``balance_media`` (none when its hook is disabled)."""
        if not self.balance_media or BalanceMediaRuntimeHook.name in self.disabled_hooks:
            return []
        return found.towers

    def _joined_paths(self, found: Discovery) -> list[str]:
        """Projectors and media-dependent layers ``balance_media`` joins (none under
        ``uneven_media`` or without balanced towers)."""
        if self.uneven_media or not self._balanced_towers(found):
            return []
        return [*found.projectors, *found.conditional]

    def _shared_params(self, ctx: PlanContext[Discovery], plan: ShardingPlan) -> list[str]:
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
        except odd-dtype islands (fp32 norms).

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
        """Replicated parameters of another dtype than most of their module (fp32 norms in
        a bf16 tower, judged over the whole module). Subclasses may add more."""
        wanted = set(names)
        for part in found.parts:
            params = list(part.found.module.named_parameters(prefix=part.found.path))
            dominant = dominant_dtype(param for _, param in params)
            if dominant is None:
                continue
            yield from (n for n, p in params if n in wanted and p.dtype != dominant)


#: Methods of transformers models that run towers and projectors outside the forward.
_FEATURE_METHODS = ("get_image_features", "get_video_features", "get_audio_features")
