"""Modules called outside the model's forward: gather the units that own their parameters.

A tower's parameters usually belong to the root unit, gathered only during the root
forward, yet ``generate()`` and users call towers on their own (``got mixed torch.Tensor
and DTensor``; a tower block run first would even become FSDP's root).
[EntryUnshardHook][fsdp_core.entry_unshard.EntryUnshardHook] hooks each entry module a
parallelizer names: outside the root forward it makes the model FSDP's root, all-gathers
the owning units, casts inputs as their mixed precision would and reshards afterwards.
``generate`` holds the owners gathered for the whole call, so a rank without images runs
the same collectives. A backward through such a call raises: FSDP cannot reduce those
gradients.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fsdp_core import internals
from fsdp_core.containers import is_under
from fsdp_core.forward_agreement import EMPTY_BATCH, agreement_scope, record_call
from fsdp_core.plan import ShardingPlan, UnitPlan, unit_parameters
from fsdp_core.runtime import RuntimeHook, output_tensors
from fsdp_core.step_agreement import is_empty_batch

if TYPE_CHECKING:
    from fsdp_core.parallel_dims import ParallelDims

__all__ = [
    "EntryUnshardHook",
    "EntryUnshardRuntimeHook",
    "entry_owners",
    "install_entry_unshard",
]

logger = logging.getLogger(__name__)

NAME = "entry_unshard"


def entry_owners(
    model: nn.Module, plan: ShardingPlan, paths: Iterable[str]
) -> dict[str, tuple[int, ...]]:
    """For each entry path holding parameters of ``plan``'s units: the indices of the
    units that own some of them but whose forward does not run when the entry is called
    on its own (no member module inside it; usually the root unit). ``()`` when its units
    are its own (the hook then only fixes the root); left out when it holds none.

    Args:
        model: the model (meta is enough).
        plan: its plan.
        paths: the entry modules' paths (towers and projectors called on their own).

    Returns:
        ``{entry path: unit indices}``.
    """
    owned = unit_parameters(plan, model)
    result: dict[str, tuple[int, ...]] = {}
    for path in paths:
        holding = [i for i, params in enumerate(owned) if any(is_under(n, path) for n, _ in params)]
        if holding:
            units = plan.units
            result[path] = tuple(
                i for i in holding if not any(is_under(m, path) for m in units[i].paths)
            )
    return result


@dataclass
class _Entry:
    path: str
    owners: tuple[FSDPModule, ...]
    labels: tuple[str, ...]
    #: The parameter dtype floating inputs are cast to (the owners' mixed precision).
    dtype: torch.dtype | None


@dataclass
class EntryUnshardHook:
    """The installed hook; ``calls`` counts the entry calls that had to gather."""

    model: nn.Module
    name: str = NAME
    calls: int = 0
    #: Root forwards in progress (counted by hooks on ``model``): 0 means outside.
    _depth: int = field(default=0, repr=False)
    _root_ready: bool = field(default=False, repr=False)
    _handles: list[RemovableHandle] = field(default_factory=list, repr=False)
    #: One frame per entry call in progress outside the forward: (module, units gathered).
    _frames: list[tuple[nn.Module, list[FSDPModule]]] = field(default_factory=list, repr=False)
    #: Modules whose ``generate`` this hook wrapped (an instance attribute, removed again).
    _generators: list[nn.Module] = field(default_factory=list, repr=False)

    def watch_root(self) -> None:
        """Count the model's own forwards, so entry calls inside one gather nothing extra."""

        def enter(*_: object) -> None:
            self._depth += 1

        def leave(*_: object) -> None:
            # always called, also when an earlier pre-hook raised before ``enter`` ran
            self._depth = max(0, self._depth - 1)

        self._handles.append(self.model.register_forward_pre_hook(enter, prepend=True))
        self._handles.append(self.model.register_forward_hook(leave, always_call=True))

    def attach(self, module: nn.Module, entry: _Entry) -> None:
        """Hook one entry module: its calls outside the model's forward gather its owners.

        Args:
            module: the entry module.
            entry: its owner units and what the hook records of its calls.
        """
        before = functools.partial(self._before, entry)
        self._handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        after = functools.partial(self._after, entry)
        self._handles.append(module.register_forward_hook(after, always_call=True))

    def _before(
        self, entry: _Entry, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._depth or internals.in_backward():
            return None  # inside the model's forward (or a recomputation): FSDP gathers
        if entry.owners:  # a collective call of the model: every rank must make it
            record_call(self.model, f"a call of {entry.path!r} outside the forward")
        gathered: list[FSDPModule] = []
        self._frames.append((module, gathered))
        self._gather(entry.owners, gathered)
        if gathered:
            self.calls += 1
            logger.debug("gathered %s to run %r outside the forward", entry.labels, entry.path)
        if entry.dtype is None:
            return None
        return _cast(args, entry.dtype), {k: _cast(v, entry.dtype) for k, v in kwargs.items()}

    def _gather(self, units: Iterable[FSDPModule], gathered: list[FSDPModule]) -> None:
        """All-gather each of ``units`` not gathered yet into ``gathered``, after making
        the model FSDP's root as its first forward would."""
        if not self._root_ready:
            if isinstance(self.model, FSDPModule):
                internals.initialize_root(self.model)
            self._root_ready = True
        for unit in units:
            if not internals.is_gathered(unit):  # still gathered after a no-grad forward
                unit.unshard()
                gathered.append(unit)

    def wrap_generate(self, module: nn.Module, owners: tuple[FSDPModule, ...]) -> None:
        """Hold ``owners`` gathered for a whole ``module.generate(...)`` call, which every
        rank makes, with images or not (transformers' ``synced_gpus`` keeps ranks that
        generate different lengths in step).

        Args:
            module: a module with ``generate`` (the model or a wrapper of it).
            owners: the units to hold gathered.
        """
        original: Callable[..., Any] = module.generate  # type: ignore[assignment]

        @functools.wraps(original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return original(*args, **kwargs)
            empty = is_empty_batch(args, kwargs)
            kind = f"generate(){EMPTY_BATCH if empty else ''}"
            with agreement_scope(self.model, kind):
                if not owners:
                    return original(*args, **kwargs)
                gathered: list[FSDPModule] = []
                try:
                    self._gather(owners, gathered)
                    return original(*args, **kwargs)
                finally:
                    for unit in gathered:
                        unit.reshard()

        object.__setattr__(module, "generate", generate)
        self._generators.append(module)

    def _after(self, entry: _Entry, module: nn.Module, _args: Any, output: Any) -> None:
        if not self._frames or self._frames[-1][0] is not module:
            return
        _, gathered = self._frames.pop()
        for unit in gathered:
            unit.reshard()
        if entry.owners and torch.is_grad_enabled():
            message = (
                f"backward through {entry.path!r}, which ran outside the model's forward with "
                f"gradients enabled: its parameters belong to the FSDP unit(s) "
                f"{', '.join(entry.labels)}, gathered only for that call, so FSDP cannot "
                "compute or reduce their gradients. Call it under torch.no_grad() for "
                "inference (generate() does), or pass the inputs to the model's forward (e.g. "
                "model(input_ids=..., pixel_values=...)) to train through it."
            )

            def refuse(_grad: torch.Tensor) -> torch.Tensor:
                raise RuntimeError(message)

            for tensor in output_tensors(output):
                tensor.register_hook(refuse)  # type: ignore[no-untyped-call]

    def remove(self) -> None:
        """Remove every hook and wrapper this installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._generators:
            module.__dict__.pop("generate", None)
        self._generators.clear()


def install_entry_unshard(
    model: nn.Module, owners: Mapping[str, Sequence[UnitPlan]]
) -> EntryUnshardHook:
    """Hook each entry module of ``owners`` on the sharded ``model``.

    Args:
        model: the sharded model.
        owners: ``{entry path: the plan's units that own its parameters}``
            ([entry_owners][fsdp_core.entry_unshard.entry_owners]).

    Returns:
        The installed hook.
    """
    hook = EntryUnshardHook(model)
    hook.watch_root()
    entries: dict[str, tuple[FSDPModule, ...]] = {}
    for path, units in owners.items():
        modules = tuple(_unit_module(model, unit.paths[0]) for unit in units)
        casts = [u.mp_policy.param_dtype for u in units if u.mp_policy.cast_forward_inputs]
        dtype = next((dtype for dtype in casts if dtype is not None), None)
        entry = _Entry(path, modules, tuple(unit.label for unit in units), dtype)
        hook.attach(model.get_submodule(path) if path else model, entry)
        entries[path] = modules
    for path, module in model.named_modules():
        if callable(getattr(type(module), "generate", None)):
            inside = [units for entry, units in entries.items() if is_under(entry, path)]
            hook.wrap_generate(module, tuple(dict.fromkeys(u for units in inside for u in units)))
    return hook


@dataclass(frozen=True)
class EntryUnshardRuntimeHook(RuntimeHook):
    """The ``entry_unshard`` runtime hook; plan data: each entry path with the units that
    own its parameters ([entry_owners][fsdp_core.entry_unshard.entry_owners])."""

    name: ClassVar[str] = NAME
    reads: ClassVar[tuple[internals.Probe, ...]] = (
        internals.STATE_GROUPS,
        internals.GROUP_UNSHARDED,
        internals.STATE_IS_ROOT,
        internals.STATE_LAZY_INIT,
        internals.GRAPH_TASK,
    )

    owners: tuple[tuple[str, tuple[UnitPlan, ...]], ...]

    @classmethod
    def from_plan(
        cls, plan: ShardingPlan, owners: Mapping[str, tuple[int, ...]]
    ) -> EntryUnshardRuntimeHook:
        """The hook for ``owners`` (entry path to unit indices in ``plan.units``).

        Args:
            plan: the plan.
            owners: what ``entry_owners`` returned.

        Returns:
            The hook with its plan data.
        """
        units = plan.units
        return cls(tuple((path, tuple(units[i] for i in idx)) for path, idx in owners.items()))

    def install(self, model: nn.Module, *, dims: ParallelDims) -> EntryUnshardHook:
        return install_entry_unshard(model, dict(self.owners))


def _unit_module(model: nn.Module, path: str) -> FSDPModule:
    module = model.get_submodule(path) if path else model
    if not isinstance(module, FSDPModule):
        raise RuntimeError(
            f"the plan's unit {path or '<root>'!r} is not an FSDP module; apply the plan "
            "before installing the entry_unshard hook"
        )
    return module


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    """Floating tensors (in tuples, lists and dicts) cast to ``dtype``, as FSDP's
    ``cast_forward_inputs`` does; dict subclasses (``ModelOutput``, read by attribute) and
    namedtuples keep their type."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple):
        items = [_cast(v, dtype) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    if isinstance(value, dict):
        cast = {key: _cast(v, dtype) for key, v in value.items()}
        if type(value) is dict:
            return cast
        kept = copy.copy(value)
        for key, item in cast.items():
            kept[key] = item
        return kept
    return value
