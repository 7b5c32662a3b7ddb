"""Runtime hooks: what a parallelizer installs around FSDP2 after sharding, as data.

FSDP2 alone is not correct in every training loop a user writes (gradient
accumulation with text-only micro-batches, ranks that skip part of a unit, ...),
so the parallelizers add small hooks after sharding. Each hook is planned like a
unit: a [`HookPlan`][fsdp_core.runtime.HookPlan] in
[`fsdp_core.ShardingPlan.hooks`][fsdp_core.plan.ShardingPlan.hooks] says which hook, why, and what
it costs per step; ``disabled_hooks=`` on the parallelizer opts out of any of them.
[`installed_hooks`][fsdp_core.runtime.installed_hooks] tells what a sharded model carries, and
[`remove_runtime_hooks`][fsdp_core.runtime.remove_runtime_hooks] takes hooks off again.

Each hook is an object ([`RuntimeHook`][fsdp_core.runtime.RuntimeHook]): its class says its
name and the private FSDP internals it reads (checked before it is installed), its fields
are its plan data (computed once, by ``plan()``, and kept in the
[`HookPlan`][fsdp_core.runtime.HookPlan]), and ``install`` puts it on a sharded model. Each
package defines its own hooks; a parallelizer lists the hook classes it may plan.

Each hook also owns its cost model:
[`RuntimeHook.collectives`][fsdp_core.runtime.RuntimeHook.collectives] says what it issues in
one step, read from a [`HookStep`][fsdp_core.runtime.HookStep] (the plan,
its model, the mesh shape, the step's media), and
[`unit_runs`][fsdp_core.runtime.RuntimeHook.unit_runs] how often it makes units run; the
estimates add these up without knowing any hook.

[`BackwardWatch`][fsdp_core.runtime.BackwardWatch] is the shared piece several hooks need: a
callback when a backward through the model's outputs starts.
"""

from __future__ import annotations

import logging
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fsdp_core.collective_count import CommTally

if TYPE_CHECKING:
    from fsdp_core.internals import Probe
    from fsdp_core.mesh import MeshShape
    from fsdp_core.parallel_dims import ParallelDims
    from fsdp_core.plan import ShardingPlan

__all__ = [
    "HookPlan",
    "HookStep",
    "RuntimeHook",
    "InstalledHook",
    "BackwardWatch",
    "installed_hooks",
    "register_installed_hook",
    "remove_runtime_hooks",
    "output_tensors",
]

logger = logging.getLogger(__name__)


class InstalledHook(Protocol):
    """What an installed hook must offer: its plan name and a way to take it off."""

    @property
    def name(self) -> str: ...

    def remove(self) -> None:
        """Take the hook off the model (idempotent)."""


@dataclass(frozen=True)
class HookStep:
    """One training step as a hook's cost model reads it: every module runs once, on a
    mesh of ``mesh``'s shape, with ``media`` when given. Resolved once by the estimates,
    so each hook's tally is a function of the step alone."""

    plan: ShardingPlan
    #: The model the plan was made for (the meta device is enough: shapes and flags).
    model: nn.Module
    mesh: MeshShape
    #: Per unit of the plan, its ``(name, parameter)`` pairs (``fsdp_core.plan.unit_parameters``).
    owned: Sequence[Sequence[tuple[str, nn.Parameter]]] = ()
    #: The step's media, as the package whose hooks depend on it describes them
    #: (``multimodal_fsdp.estimate.exchange.StepMedia``); ``None``: not given.
    media: object = None
    #: The job's parallel dimensions when the mesh has more than the data-parallel ones
    #: (``mesh`` is their data-parallel shape); ``None``: data-parallel only.
    parallel: ParallelDims | None = None

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def dims(self) -> int:
        """Data-parallel mesh dimensions with more than one rank: each repeats an
        all-reduce over the data-parallel mesh."""
        return sum(1 for size in self.mesh.sizes if size > 1)


class RuntimeHook(ABC):
    """A planned runtime hook: subclasses are frozen dataclasses whose fields are the
    hook's plan data, computed once when the plan is made, so installing it derives
    nothing again."""

    #: The hook's name in plans, ``disabled_hooks=`` and ``installed_hooks``.
    name: ClassVar[str]
    #: The private FSDP internals ``install`` and the installed hook read; applying a
    #: plan checks them first (``fsdp_core.internals.check_internals``).
    reads: ClassVar[tuple[Probe, ...]] = ()

    @abstractmethod
    def install(self, model: nn.Module, *, dims: ParallelDims) -> InstalledHook | None:
        """Put the hook on the sharded ``model``; ``None`` when this torch cannot (it
        says so in a warning). ``dims`` are the job's parallel dimensions: a hook's
        collectives run over the group its docstring names (``dims.dp_mesh`` for FSDP's
        own reductions, ``dims.lockstep_mesh`` for checks that keep the whole forward in
        step).

        Args:
            model: the sharded model.
            dims: the job's parallel dimensions.

        Returns:
            The installed hook, or None.
        """

    def collectives(self, step: HookStep) -> CommTally:
        """The collectives the hook issues in ``step`` (per rank; none by default): its
        cost model, which the estimates add to the units' collectives.

        Args:
            step: the step costed (the plan, its model, the mesh shape, the step's media).

        Returns:
            The hook's collectives by phase and kind.
        """
        return CommTally()

    def unit_runs(self, step: HookStep) -> Mapping[str, int]:
        """How often the units under each module path run in ``step`` when the hook
        repeats them (units elsewhere run once; empty by default).

        Args:
            step: the step costed.

        Returns:
            ``{module path: runs}``.
        """
        return {}

    def planned(self, *, reason: str, targets: Iterable[str] = (), cost: str) -> HookPlan:
        """This hook as a plan entry: why it is there, what it acts on, what it costs.

        Args:
            reason: why the plan has the hook.
            targets: the module paths it acts on.
            cost: what it costs per step, in words.

        Returns:
            The plan entry, holding this hook as its plan data.
        """
        return HookPlan(name=self.name, reason=reason, targets=tuple(targets), cost=cost, hook=self)


@dataclass(frozen=True)
class HookPlan:
    """One runtime hook of a plan: its name, why it is there, and its cost per step."""

    name: str
    reason: str
    #: What the hook acts on: unit labels, or module paths it watches.
    targets: tuple[str, ...] = ()
    cost: str = "no collective"
    #: The hook itself, with its plan data; ``apply_plan`` installs it.
    hook: RuntimeHook | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.hook is not None and self.hook.name != self.name:
            raise ValueError(
                f"a HookPlan named {self.name!r} holds a {self.hook.name!r} hook "
                f"({type(self.hook).__name__})"
            )

    def as_dict(self) -> dict[str, Any]:
        """Name, reason, targets and cost (the hook's plan data stays out: JSON-ready).

        Returns:
            ``{"name", "reason", "targets", "cost"}``.
        """
        return {
            "name": self.name,
            "reason": self.reason,
            "targets": self.targets,
            "cost": self.cost,
        }

    def format(self) -> str:
        """One line for a printed plan: the hook, how many targets, why, and its cost.

        Returns:
            The line.
        """
        where = f" on {len(self.targets)} targets" if self.targets else ""
        return f"{self.name}{where}: {self.reason} (cost: {self.cost})"


_INSTALLED: weakref.WeakKeyDictionary[nn.Module, dict[str, InstalledHook]] = (
    weakref.WeakKeyDictionary()
)


def register_installed_hook(model: nn.Module, hook: InstalledHook) -> None:
    """Record ``hook`` as installed on ``model`` (one hook per name).

    Args:
        model: the sharded model.
        hook: the installed hook.

    Raises:
        ValueError: a hook of that name is installed already.
    """
    hooks = _INSTALLED.setdefault(model, {})
    if hook.name in hooks:
        raise ValueError(f"a {hook.name!r} hook is already installed on this model")
    hooks[hook.name] = hook


def installed_hooks(model: nn.Module) -> Mapping[str, InstalledHook]:
    """The runtime hooks installed on ``model``, by name.

    Args:
        model: the sharded model.

    Returns:
        ``{name: installed hook}``.
    """
    return dict(_INSTALLED.get(model, {}))


def remove_runtime_hooks(model: nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """Take hooks off ``model`` (all when ``names`` is ``None``); returns the names removed.

    Args:
        model: the sharded model.
        names: the hooks to remove.

    Returns:
        The names of the hooks removed.
    """
    hooks = _INSTALLED.get(model, {})
    wanted = list(hooks) if names is None else list(names)
    removed = []
    for name in wanted:
        hook = hooks.pop(name, None)
        if hook is not None:
            hook.remove()
            removed.append(name)
    return removed


def nested_tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in ``value``: nested lists, tuples, mappings (``ModelOutput``) and
    dataclasses, eight levels deep (the one tensor walker of the project)."""
    if depth > 8:
        return []
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in nested_tensors(v, depth + 1)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in nested_tensors(v, depth + 1)]
    fields = getattr(value, "__dataclass_fields__", None)
    if isinstance(fields, dict) and not isinstance(value, type):
        return [t for name in fields for t in nested_tensors(getattr(value, name, None), depth + 1)]
    return []


def output_tensors(value: Any) -> list[torch.Tensor]:
    """Tensors of a forward output that require a gradient (see ``nested_tensors``).

    Args:
        value: a forward's output (tensors in tuples, lists, mappings, dataclasses).

    Returns:
        The tensors that require a gradient.
    """
    return [tensor for tensor in nested_tensors(value) if tensor.requires_grad]


class BackwardWatch:
    """Calls ``on_backward`` once for every backward that starts from ``model``'s outputs.

    A forward hook on ``model`` puts a gradient hook on every grad-requiring output
    tensor; each of them calls ``on_backward`` when a backward reaches it, so
    ``on_backward`` may run several times per backward (several outputs, several
    forwards before one backward) and must be idempotent within one. Every rank
    that runs backward through the model's output calls it, so work queued from it
    happens on every rank.

    Args:
        model: the module whose outputs are watched.
        on_backward: called when a backward reaches them.
    """

    def __init__(self, model: nn.Module, on_backward: Callable[[], None]) -> None:
        self._on_backward = on_backward
        self._handle: RemovableHandle | None = model.register_forward_hook(self._after_forward)

    def _after_forward(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return

        def grad_hook(grad: torch.Tensor) -> torch.Tensor:
            self._on_backward()
            return grad

        for tensor in output_tensors(output):
            tensor.register_hook(grad_hook)  # type: ignore[no-untyped-call]

    def remove(self) -> None:
        """Stop watching (the forward hook is removed)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
