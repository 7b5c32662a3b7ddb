"""The one call site of ``torch.distributed.fsdp.fully_shard`` in the project.

Every FSDP unit is made by [`shard_units`][fsdp_core.sharding.shard_units], with options
checked where they entered the library ([`ShardOptions`][fsdp_core.sharding.ShardOptions])
and what FSDP2 checks late (or never) checked for every unit before the first is made.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from fsdp_core import compat
from fsdp_core.ddp_guard import refuse_ddp
from fsdp_core.rank_wait import names_text

__all__ = [
    "ShardTarget",
    "ShardOptions",
    "SHARD_OPTION_NAMES",
    "shard_targets",
    "shard_units",
    "apply_fully_shard",
    "owned_ignored_params",
    "shard_group_size",
    "is_sharded",
    "original_class",
    "check_reshard_after_forward",
    "check_ignored_params_supported",
]

logger = logging.getLogger(__name__)

#: One module, or several modules that share one unit (one all-gather).
ShardTarget = nn.Module | Sequence[nn.Module]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` already is (or belongs to a group that is) an FSDP unit.

    Args:
        module: any module.

    Returns:
        Whether it is an FSDP unit.
    """
    return isinstance(module, FSDPModule)


def original_class(module: nn.Module) -> type[nn.Module]:
    """The class ``fully_shard`` replaced by its ``FSDP<name>`` subclass (else the class),
    read from the subclass's bases, not from a name prefix a user's class may carry too.

    Args:
        module: any module.

    Returns:
        Its class before sharding.
    """
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0] is FSDPModule and issubclass(bases[1], nn.Module):
        return bases[1]
    return cls


def _as_modules(target: object) -> list[nn.Module]:
    if isinstance(target, nn.Module):
        return [target]
    if isinstance(target, (str, bytes)) or not isinstance(target, Sequence):
        raise TypeError(f"expected an nn.Module or a sequence of them, got {type(target).__name__}")
    modules = list(target)
    if not modules:
        raise ValueError("cannot shard an empty group of modules")
    for item in modules:
        if not isinstance(item, nn.Module):
            raise TypeError(f"group members must be nn.Module, got {type(item).__name__}")
    return modules


def shard_targets(target: object) -> list[nn.Module]:
    """The member modules of a sharding call's ``target`` (one module, or a list or
    tuple of modules that share one unit), checked.

    Args:
        target: a module, or a list or tuple of modules.

    Returns:
        The member modules.

    Raises:
        TypeError: ``target`` (or one of its members) is not a module.
    """
    if not isinstance(target, (nn.Module, list, tuple)):
        raise TypeError(f"module must be an nn.Module, got {type(target).__name__}")
    return _as_modules(target)


@dataclass(frozen=True)
class ShardOptions:
    """The options of one sharding call, checked on construction (a bad call shards nothing).

    ``mesh`` and ``mp_policy`` have no default (as in the reference
    ``fully_shard_deepseek_v41``); ``MixedPrecisionPolicy()`` is no mixed precision.
    """

    mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy | None = None
    reshard_after_forward: bool | int | None = None
    ignored_params: frozenset[nn.Parameter] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(self.mesh).__name__}")
        if not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise TypeError(
                f"mp_policy must be a MixedPrecisionPolicy, got {type(self.mp_policy).__name__}"
            )
        if self.offload_policy is not None and not isinstance(self.offload_policy, OffloadPolicy):
            raise TypeError(
                "offload_policy must be an OffloadPolicy or None, got "
                f"{type(self.offload_policy).__name__}"
            )
        check_reshard_after_forward(self.reshard_after_forward, shard_group_size(self.mesh))
        if self.ignored_params is not None:
            params = self.ignored_params
            if isinstance(params, (str, bytes, nn.Module)) or not isinstance(params, Iterable):
                raise TypeError(
                    "ignored_params must be a set of nn.Parameter or None, got "
                    f"{type(params).__name__}"
                )
            object.__setattr__(self, "ignored_params", frozenset(params) or None)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, object], *, caller: str) -> ShardOptions:
        """The options of a ``**kwargs`` call: unknown or missing names are a
        ``TypeError`` that names them and the valid ones.

        Args:
            kwargs: the call's keyword arguments.
            caller: the function called, for the message.

        Returns:
            The options.

        Raises:
            TypeError: a name is unknown or a required one is missing.
        """
        unknown = [name for name in kwargs if name not in SHARD_OPTION_NAMES]
        if unknown:
            listed = ", ".join(repr(name) for name in unknown)
            raise TypeError(
                f"{caller} got unexpected option {listed}; valid options: "
                f"{', '.join(SHARD_OPTION_NAMES)}"
            )
        missing = [name for name in ("mesh", "mp_policy") if name not in kwargs]
        if missing:
            raise TypeError(
                f"{caller} needs {' and '.join(f'{name}=' for name in missing)} "
                "(a DeviceMesh and a MixedPrecisionPolicy; MixedPrecisionPolicy() for no "
                "mixed precision)"
            )
        return cls(**cast("Mapping[str, Any]", kwargs))


#: The keyword options of a sharding call, as ``fully_shard`` and the reference
#: ``_fully_shard_module(module, **kwargs)`` name them.
SHARD_OPTION_NAMES: Final[tuple[str, ...]] = tuple(f.name for f in fields(ShardOptions))


def owned_ignored_params(
    modules: Iterable[nn.Module], ignored_params: Iterable[nn.Parameter] | None
) -> set[nn.Parameter] | None:
    """The subset of ``ignored_params`` that ``modules`` own; ``None`` when empty.

    Args:
        modules: a unit's members.
        ignored_params: every parameter FSDP leaves alone.

    Returns:
        Those the members own, or None.
    """
    wanted = set(ignored_params or ())
    owned = {p for m in modules for p in m.parameters() if p in wanted}
    return owned or None


def shard_group_size(mesh: DeviceMesh) -> int:
    """Number of ranks a parameter is sharded over (the last mesh dimension).

    Args:
        mesh: the data-parallel mesh.

    Returns:
        The size of its last dimension.
    """
    return int(mesh.size(mesh.ndim - 1))


def check_reshard_after_forward(value: object, shard_size: int | None) -> None:
    """Validate ``reshard_after_forward`` before FSDP sees it: an int must divide
    ``shard_size`` (any positive int without a mesh, ``shard_size=None``: plans).

    Args:
        value: the user's ``reshard_after_forward``.
        shard_size: the shard group's size (None while planning).

    Raises:
        TypeError: ``value`` is neither a bool, an int nor None.
        ValueError: an int that is not positive or does not divide ``shard_size``.
    """
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int):
        raise TypeError(
            "reshard_after_forward must be a bool, an int or None, "
            f"got {type(value).__name__} ({value!r})"
        )
    if value < 1 or (shard_size is not None and shard_size % value):
        raise ValueError(
            f"reshard_after_forward={value} must be a positive divisor of the shard group "
            f"size {shard_size} (or True/False/None)"
        )


def _usable_offload(policy: OffloadPolicy | None) -> OffloadPolicy:
    if policy is None:
        return OffloadPolicy()
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy, got {type(policy).__name__}")
    if (
        isinstance(policy, CPUOffloadPolicy)
        and policy.pin_memory
        and not torch.accelerator.is_available()
    ):
        logger.info("no accelerator: CPU offload runs without pinned memory")
        return CPUOffloadPolicy(pin_memory=False)
    return policy


def shard_units(units: Iterable[tuple[ShardTarget, ShardOptions]]) -> None:
    """Make each target one FSDP unit with its options, in order: the only call of
    torch's ``fully_shard`` in the library.

    Every unit is checked before the first is made (no member already a unit, grouped
    units and ignored parameters supported by this torch), so a refused call shards
    nothing. Each unit gets only the ignored parameters its members own (none when that
    set is empty), and CPU offload without an accelerator runs without pinned memory.

    Args:
        units: ``(target, options)`` per unit, in the order they are made.
    """
    checked = [_checked_unit(_as_modules(target), options) for target, options in units]
    for modules, options, owned in checked:
        fully_shard(  # type: ignore[call-overload]
            modules[0] if len(modules) == 1 else modules,
            mesh=options.mesh,
            mp_policy=options.mp_policy,
            offload_policy=_usable_offload(options.offload_policy),
            reshard_after_forward=options.reshard_after_forward,
            **({} if owned is None else {"ignored_params": owned}),
        )
        for module in modules:
            refuse_ddp(module)  # DDP around a unit would fail deep in DTensor


def _checked_unit(
    modules: list[nn.Module], options: ShardOptions
) -> tuple[list[nn.Module], ShardOptions, set[nn.Parameter] | None]:
    """``modules`` with their options and the ignored parameters they own, or what FSDP
    would refuse (late, or after changing state)."""
    for module in modules:
        if is_sharded(module):
            raise ValueError(
                f"{type(module).__name__} is already an FSDP unit; sharding it again would "
                "wrap it twice"
            )
    if len(modules) > 1 and not compat.FULLY_SHARD_GROUPED_MODULES:
        raise ValueError(
            f"this torch ({torch.__version__}) cannot put several modules in one FSDP unit; "
            "shard them one by one"
        )
    owned = owned_ignored_params(modules, options.ignored_params)
    if owned is not None and not compat.FULLY_SHARD_IGNORED_PARAMS:
        raise ValueError(
            f"this torch ({torch.__version__}) has no fully_shard(ignored_params=...); "
            "pass no ignored_params= (with a parallelizer: use a frozen-tower policy other "
            "than 'replicate')"
        )
    return modules, options, owned


def apply_fully_shard(
    target: ShardTarget,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Make ``target`` (a module, or modules sharing one unit) one FSDP unit, after
    checking what FSDP would reject later ([`shard_units`][fsdp_core.sharding.shard_units]
    with these options).

    Args:
        target: a module, or the modules of one grouped unit.
        mesh: the data-parallel mesh.
        mp_policy: the unit's policy.
        offload_policy: FSDP2's offload policy.
        reshard_after_forward: as ``fully_shard`` takes it.
        ignored_params: parameters FSDP leaves alone.

    Raises:
        TypeError: ``target``, ``mesh``, ``mp_policy``, ``offload_policy`` or
            ``ignored_params`` has the wrong type.
        ValueError: a member already is a unit, ``reshard_after_forward`` does not divide
            the shard group, or this torch lacks grouped units or ``ignored_params``.
    """
    ignored = frozenset(ignored_params or ())
    options = ShardOptions(mesh, mp_policy, offload_policy, reshard_after_forward, ignored)
    shard_units([(target, options)])


def check_ignored_params_supported(
    ignored_param_names: Sequence[str], replicated_param_names: Sequence[str]
) -> None:
    """Before a plan is applied: on a torch without ``fully_shard(ignored_params=...)``
    no parameter can stay out of FSDP; say, for each cause, what to change.

    Args:
        ignored_param_names: the plan's ignored parameters.
        replicated_param_names: those of them the policy replicates.

    Raises:
        ValueError: this torch cannot ignore parameters, naming what to change.
    """
    if not ignored_param_names or compat.FULLY_SHARD_IGNORED_PARAMS:
        return
    replicated = [n for n in ignored_param_names if n in replicated_param_names]
    given = [n for n in ignored_param_names if n not in replicated_param_names]
    causes = []
    if given:
        causes.append(
            f"{len(given)} given as ignored_params= ({names_text(given)}): pass no ignored_params="
        )
    if replicated:
        causes.append(
            f"{len(replicated)} replicated by the parallelizer itself ({names_text(replicated)}): "
            "use a frozen-tower policy other than 'replicate', or make them trainable "
            "(a parallelizer may replicate some frozen parameters under every policy)"
        )
    raise ValueError(
        f"this torch ({torch.__version__}) has no fully_shard(ignored_params=...), so no "
        f"parameter can be kept out of FSDP, but the plan keeps {len(ignored_param_names)} "
        f"out; nothing was sharded. They are {'; and '.join(causes)}."
    )
