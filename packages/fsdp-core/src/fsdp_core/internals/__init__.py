"""Every access to private FSDP2, autograd and torch internals, in one place, checked up front.

Runtime hooks read state FSDP2 (torch 2.13) keeps private (parameter groups, unsharded
tensors, accumulated gradients, autograd's callback queue); read anywhere else, a renamed
attribute would switch a fix off silently. So only this package touches them, through
accessors that raise [`FSDPInternalsError`][fsdp_core.internals.FSDPInternalsError] rather
than guess; [`check_internals`][fsdp_core.internals.check_internals] probes a sharded model
once, when hooks are installed, naming what is missing and the hook to switch off. Private
torch modules outside FSDP2's unit state live in
[`fsdp_core.internals.torch_modules`][fsdp_core.internals.torch_modules].
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode  # re-exported for subclassing

__all__ = [
    "FSDPInternalsError",
    "Probe",
    "check_internals",
    "fsdp_params",
    "param_groups",
    "distinct_units",
    "reduces_gradients",
    "never_unsharded",
    "accumulated_gradient",
    "set_accumulated_gradient",
    "unsharded_parameter",
    "sharded_parameter",
    "reduce_dtype",
    "in_backward",
    "is_gathered",
    "initialize_root",
    "queue_end_of_backward",
    "unit_modules",
    "applied_unit_paths",
    "fsdp_state_module",
    "TorchDispatchMode",
    "param_fqn",
    "has_grouped_forward_hooks",
    "casts_per_grouped_module",
    "tracks_grouped_passes",
    "set_ddp_ignored",
]

_FSDP_STATE_MODULE: Final = "torch.distributed.fsdp._fully_shard._fsdp_state"


class FSDPInternalsError(RuntimeError):
    """The installed torch lacks an FSDP2 internal that a runtime hook relies on."""


@dataclass(frozen=True)
class Probe:
    """One private attribute a runtime hook reads (``RuntimeHook.reads``), and where."""

    where: str  # "state", "group", "param" or "autograd"
    name: str
    #: For attributes FSDP creates lazily (at the first forward): the method creating it.
    created_by: str | None = None

    def describe(self) -> str:
        """Where the attribute lives, for error messages.

        Returns:
            E.g. ``"FSDPState._post_forward_hook_handle"``.
        """
        owner = {
            "state": "FSDPState",
            "group": "FSDPParamGroup",
            "param": "FSDPParam",
            "autograd": "torch autograd",
        }[self.where]
        return f"{owner}.{self.name}"


# The probes: what each runtime hook declares it reads (``RuntimeHook.reads``).
STATE_GROUPS = Probe("state", "_fsdp_param_groups")
_STATE_MODULES = Probe("state", "_modules")
GROUP_PARAMS = Probe("group", "fsdp_params")
GROUP_REDUCE = Probe("group", "reduce_grads")
PARAM_UNSHARDED = Probe("param", "_unsharded_param", created_by="init_unsharded_param")
PARAM_ACCUMULATED = Probe("param", "unsharded_accumulated_grad")
PARAM_REDUCE_DTYPE = Probe("param", "reduce_dtype", created_by="init_dtype_attrs")
PARAM_SHARDED = Probe("param", "sharded_param")
GRAPH_TASK = Probe("autograd", "_current_graph_task_id")
QUEUE_CALLBACK = Probe("autograd", "queue_callback")
GROUP_UNSHARDED = Probe("group", "is_unsharded")
STATE_IS_ROOT = Probe("state", "_is_root")
STATE_LAZY_INIT = Probe("state", "_lazy_init")
STATE_CTX = Probe("state", "_state_ctx")


# ------------------------------------------------------------------------ accessors
def _require(obj: object, probe: Probe) -> Any:
    try:
        return getattr(obj, probe.name)
    except AttributeError:
        raise FSDPInternalsError(
            f"this torch ({torch.__version__}) has no {probe.describe()}, which the "
            "runtime hooks of fsdp_core rely on; switch the hook off (see "
            "ModelParallelizer(disabled_hooks=...)) or use a supported torch"
        ) from None


def _autograd(probe: Probe) -> Any:
    owner = torch._C if probe is GRAPH_TASK else torch.autograd.Variable._execution_engine
    value = getattr(owner, probe.name, None)
    if value is None:
        raise FSDPInternalsError(f"this torch ({torch.__version__}) has no {probe.describe()}")
    return value


def _state(unit: FSDPModule) -> Any:
    getter = getattr(unit, "_get_fsdp_state", None)
    if getter is None:
        raise FSDPInternalsError(
            f"this torch ({torch.__version__}) has no FSDPModule._get_fsdp_state"
        )
    return getter()


def distinct_units(model: nn.Module) -> list[FSDPModule]:
    """One FSDP module per unit: the members of a grouped unit share one state.

    Args:
        model: a sharded model.

    Returns:
        The units, in module order.
    """
    units: dict[int, FSDPModule] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            units.setdefault(id(_state(module)), module)
    return list(units.values())


def unit_modules(unit: FSDPModule) -> tuple[nn.Module, ...]:
    """The member modules of ``unit``: one, or several for a grouped ``fully_shard([...])``.

    Args:
        unit: an FSDP module (any member of a grouped unit).

    Returns:
        Its member modules.
    """
    return tuple(_require(_state(unit), _STATE_MODULES))


def applied_unit_paths(model: nn.Module) -> list[tuple[str, ...]]:
    """Each unit FSDP made in ``model`` as its member paths (``""``: ``model``), in order.

    Args:
        model: a sharded model.

    Returns:
        Each unit's member paths.
    """
    names = {id(module): name for name, module in model.named_modules()}
    return [
        tuple(names.get(id(member), "<outside the model>") for member in unit_modules(unit))
        for unit in distinct_units(model)
    ]


def finishes_backward(unit: FSDPModule) -> bool:
    """Whether FSDP ends the current backward itself (not after ``set_is_last_backward(False)``:
    pipeline schedules reduce by hand)."""
    context = getattr(_state(unit), STATE_CTX.name, None)
    return bool(getattr(context, "is_last_backward", True))


def param_groups(unit: FSDPModule) -> tuple[Any, ...]:
    """The unit's parameter groups (several when parameters live on different meshes).

    Args:
        unit: an FSDP module (any member of a grouped unit).

    Returns:
        FSDP2's parameter groups of the unit.
    """
    return tuple(_require(_state(unit), STATE_GROUPS))


def fsdp_params(unit: FSDPModule) -> Iterator[Any]:
    """Every FSDP-managed parameter record of the unit, over all its groups.

    Args:
        unit: an FSDP module (any member of a grouped unit).

    Yields:
        FSDP2's parameter records.
    """
    for group in param_groups(unit):
        yield from _require(group, GROUP_PARAMS)


def reduces_gradients(unit: FSDPModule) -> bool:
    """Whether this backward reduce-scatters the unit's gradients (not a no-sync step).

    Args:
        unit: an FSDP module (any member of a grouped unit).

    Returns:
        Whether its gradients are reduced in this backward.
    """
    return any(bool(_require(group, GROUP_REDUCE)) for group in param_groups(unit))


def unsharded_parameter(fsdp_param: Any) -> nn.Parameter | None:
    """The unsharded parameter autograd accumulates into; ``None`` before the first gather.

    Args:
        fsdp_param: one of FSDP2's parameter records (``fsdp_params``).

    Returns:
        The unsharded parameter, or None.
    """
    value = getattr(fsdp_param, PARAM_UNSHARDED.name, None)
    return value if isinstance(value, nn.Parameter) else None


def sharded_parameter(fsdp_param: Any) -> nn.Parameter:
    """The sharded (DTensor) parameter registered on the module between steps.

    Args:
        fsdp_param: one of FSDP2's parameter records (``fsdp_params``).

    Returns:
        The sharded parameter.

    Raises:
        FSDPInternalsError: this torch's record has no sharded parameter.
    """
    value = _require(fsdp_param, PARAM_SHARDED)
    if not isinstance(value, nn.Parameter):
        raise FSDPInternalsError(f"FSDPParam.sharded_param is a {type(value).__name__}")
    return value


def never_unsharded(unit: FSDPModule) -> bool:
    """Whether a non-syncing unit has a never-gathered parameter (no-sync backward fails).

    Args:
        unit: an FSDP module (any member of a grouped unit).

    Returns:
        Whether a parameter of it has no unsharded tensor yet.
    """
    if reduces_gradients(unit):
        return False
    return any(unsharded_parameter(param) is None for param in fsdp_params(unit))


def accumulated_gradient(fsdp_param: Any) -> torch.Tensor | None:
    """The gradient FSDP2 holds for the record across no-sync steps (gradient accumulation).

    Args:
        fsdp_param: one of FSDP2's parameter records (``fsdp_params``).

    Returns:
        The accumulated unsharded gradient, or None.
    """
    value = _require(fsdp_param, PARAM_ACCUMULATED)
    return value if isinstance(value, torch.Tensor) else None


def set_accumulated_gradient(fsdp_param: Any, value: torch.Tensor) -> None:
    """Replace the gradient FSDP2 holds for the record across no-sync steps.

    Args:
        fsdp_param: one of FSDP2's parameter records (``fsdp_params``).
        value: the new accumulated gradient.
    """
    _require(fsdp_param, PARAM_ACCUMULATED)
    fsdp_param.unsharded_accumulated_grad = value


def reduce_dtype(fsdp_param: Any) -> torch.dtype | None:
    """The dtype FSDP2 reduces the record's gradient in (its mixed-precision policy).

    Args:
        fsdp_param: one of FSDP2's parameter records (``fsdp_params``).

    Returns:
        The reduce dtype, or None when gradients keep the parameter's dtype.
    """
    value = _require(fsdp_param, PARAM_REDUCE_DTYPE)
    return value if isinstance(value, torch.dtype) else None


def in_backward() -> bool:
    """Whether autograd runs a backward now (a checkpoint recomputation runs forwards in it).

    Returns:
        Whether a backward is running.

    Raises:
        FSDPInternalsError: this torch's autograd engine hides it.
    """
    return bool(_autograd(GRAPH_TASK)() != -1)


def is_gathered(unit: FSDPModule) -> bool:
    """Whether every parameter group of ``unit`` holds its unsharded parameters now.

    Args:
        unit: an FSDP module (any member of a grouped unit).

    Returns:
        Whether its parameters are unsharded now.
    """
    return all(bool(_require(group, GROUP_UNSHARDED)) for group in param_groups(unit))


def initialize_root(root: FSDPModule) -> None:
    """Make ``root`` the FSDP root now: else a tower block called first would become it.

    Args:
        root: the model's root unit.
    """
    state = _state(root)
    if _require(state, STATE_IS_ROOT) is None:
        _require(state, STATE_LAZY_INIT)()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` after the current backward and the callbacks queued before it.

    Args:
        callback: what to run.

    Raises:
        FSDPInternalsError: this torch has no way to queue it.
    """
    _autograd(QUEUE_CALLBACK)(callback)


# ------------------------------------------------------------------------- checking
def _probe_object(unit: FSDPModule, where: str) -> list[object]:
    if where == "state":
        return [_state(unit)]
    groups = list(getattr(_state(unit), STATE_GROUPS.name, ()))
    if where == "group":
        return groups
    return [p for g in groups for p in getattr(g, GROUP_PARAMS.name, ())]


def _has(obj: object, probe: Probe) -> bool:
    lazy = probe.created_by is not None and hasattr(type(obj), probe.created_by)
    return hasattr(obj, probe.name) or lazy


def missing_internals(
    model: nn.Module, hooks: Mapping[str, Iterable[Probe]]
) -> dict[str, list[str]]:
    """Per hook, the internals among its probes that this torch (and ``model``) lack."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    missing: dict[str, list[str]] = {}
    for hook, probes in hooks.items():
        gaps: list[str] = []
        for probe in probes:
            if probe.where == "autograd":
                try:
                    _autograd(probe)
                except FSDPInternalsError:
                    gaps.append(probe.describe())
                continue
            for unit in units:
                try:
                    objects = _probe_object(unit, probe.where)
                except FSDPInternalsError:
                    objects = []
                    gaps.append("FSDPModule._get_fsdp_state")
                if any(not _has(obj, probe) for obj in objects):
                    gaps.append(probe.describe())
                    break
        if gaps:
            missing[hook] = sorted(set(gaps))
    return missing


def check_internals(model: nn.Module, hooks: Mapping[str, Iterable[Probe]]) -> None:
    """Raise [`FSDPInternalsError`][fsdp_core.internals.FSDPInternalsError] if a hook cannot work.

    Args:
        model: the sharded model (for attributes FSDP creates per instance).
        hooks: each hook's name and the probes it reads.

    Raises:
        FSDPInternalsError: naming the hook, the attribute and this torch.
    """
    missing = missing_internals(model, hooks)
    if missing:
        lines = "; ".join(f"{hook} needs {', '.join(names)}" for hook, names in missing.items())
        raise FSDPInternalsError(
            f"this torch ({torch.__version__}) lacks FSDP2 internals that runtime hooks "
            f"need: {lines}. Pass disabled_hooks={tuple(missing)!r} to the parallelizer to "
            "run without them (and without what they fix), or install a torch version "
            "these hooks support."
        )


# ------------------------------------------------------------------- private modules
def param_fqn(fsdp_param: Any) -> str | None:
    """The model path FSDP recorded for a record, or ``None`` (for messages: never raises).

    Args:
        fsdp_param: one of FSDP2's parameter records (``fsdp_params``).

    Returns:
        The parameter's model path, or None.
    """
    name = getattr(fsdp_param, "_param_fqn", None)
    return name if isinstance(name, str) else None


def _state_class_has(name: str) -> bool:
    state = getattr(fsdp_state_module(), "FSDPState", None)
    return isinstance(state, type) and hasattr(state, name)


def has_grouped_forward_hooks() -> bool:
    """Whether FSDP2 can hook a group of modules as one unit (``fully_shard([m1, m2])``).

    Returns:
        Whether grouped units are supported.
    """
    return hasattr(fsdp_state_module(), "_register_group_forward_hooks")


def casts_per_grouped_module() -> bool:
    """Whether ``FSDPState`` casts inputs and outputs around each member of a grouped unit.

    Returns:
        Whether grouped units cast per member.
    """
    return _state_class_has("_cast_output_dtype")


def tracks_grouped_passes() -> bool:
    """Whether ``FSDPState`` tracks which grouped members ran, so one may run twice a pass.

    Returns:
        Whether a member may run twice per iteration.
    """
    return _state_class_has("_force_complete_incomplete_states")


def fsdp_state_module() -> ModuleType | None:
    """FSDP2's private state module (``FSDPState``, group hooks), or ``None`` without one.

    Returns:
        The module, or None.
    """
    try:
        return importlib.import_module(_FSDP_STATE_MODULE)
    except ImportError:
        return None


def set_ddp_ignored(module: nn.Module, value: object) -> None:
    """Set what ``DistributedDataParallel`` iterates for the names it ignores (``ddp_guard``).

    Args:
        module: a sharded unit.
        value: what DDP will iterate (a guard that refuses the wrap).
    """
    module.__dict__["_ddp_params_and_buffers_to_ignore"] = value
