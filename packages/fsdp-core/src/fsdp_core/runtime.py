"""Runtime hooks: what a parallelizer installs around FSDP2 after sharding, as data.

FSDP2 alone is not correct in every training loop (gradient accumulation with text-only
micro-batches, ranks that skip part of a unit, ...), so parallelizers add small hooks.
Each is a [`RuntimeHook`][fsdp_core.runtime.RuntimeHook] planned like a unit: a
[`HookPlan`][fsdp_core.runtime.HookPlan] in
[`ShardingPlan.hooks`][fsdp_core.plan.ShardingPlan.hooks] says which hook, why, and its
cost per step (its own cost model, read from a [`HookStep`][fsdp_core.runtime.HookStep],
so the estimates add hooks up without knowing any); ``disabled_hooks=`` opts out.
"""

from __future__ import annotations

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


class InstalledHook(Protocol):
    """What an installed hook must offer: its plan name and a way to take it off."""

    @property
    def name(self) -> str: ...

    def remove(self) -> None:
        """Take the hook off the model (idempotent)."""


@dataclass(frozen=True)
class HookStep:
    """One training step as a hook's cost model reads it (every module runs once)."""

    plan: ShardingPlan
    #: The model the plan was made for (meta is enough).
    model: nn.Module
    mesh: MeshShape
    #: Per unit, its ``(name, parameter)`` pairs (``fsdp_core.plan.unit_parameters``).
    owned: Sequence[Sequence[tuple[str, nn.Parameter]]] = ()
    #: The step's media (``multimodal_fsdp.estimate.exchange.StepMedia``), or ``None``.
    media: object = None
    #: The job's dimensions beyond data parallelism (``mesh`` is their DP shape), or ``None``.
    parallel: ParallelDims | None = None

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def dims(self) -> int:
        """Data-parallel mesh dimensions of more than one rank (each repeats an all-reduce)."""
        return sum(1 for size in self.mesh.sizes if size > 1)


class RuntimeHook(ABC):
    """A planned runtime hook: subclasses are frozen dataclasses whose fields are its plan
    data, computed once at plan time."""

    #: The hook's name in plans, ``disabled_hooks=`` and ``installed_hooks``.
    name: ClassVar[str]
    #: The private FSDP internals it reads; applying a plan checks them first.
    reads: ClassVar[tuple[Probe, ...]] = ()

    @abstractmethod
    def install(self, model: nn.Module, *, dims: ParallelDims) -> InstalledHook | None:
        """Put the hook on the sharded ``model``; ``None`` (with a warning) when this torch
        cannot.

        Args:
            model: the sharded model.
            dims: the job's parallel dimensions (``dp_mesh`` for FSDP's own reductions,
                ``lockstep_mesh`` for checks that keep the forward in step).

        Returns:
            The installed hook, or None.
        """

    def collectives(self, step: HookStep) -> CommTally:
        """The collectives the hook issues per rank in ``step`` (none by default).

        Args:
            step: the step costed.

        Returns:
            The hook's collectives by phase and kind.
        """
        return CommTally()

    def unit_runs(self, step: HookStep) -> Mapping[str, int]:
        """How often the units under each module path run in ``step`` (default: once).

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
        return {key: getattr(self, key) for key in ("name", "reason", "targets", "cost")}

    def format(self) -> str:
        """One line for a printed plan.

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
    removed = [name for name in dict.fromkeys(hooks if names is None else names) if name in hooks]
    for name in removed:
        hooks.pop(name).remove()
    return removed


def nested_tensors(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in ``value``'s lists, tuples, mappings and dataclasses, 8 levels deep."""
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
    """Calls ``on_backward`` when a backward reaches a grad-requiring output of ``model``:
    possibly several times per backward (several outputs or forwards), so it must be
    idempotent within one.

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
