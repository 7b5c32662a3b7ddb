"""Private torch modules and objects outside FSDP2's unit state, checked where they are
reached: the ``fake`` backend's ``FakeStore``, ``FSDPMemTracker``, ``DeviceMesh``'s root
and flattening, a process group's timeout. Each raises
[`FSDPInternalsError`][fsdp_core.internals.FSDPInternalsError] naming what this torch lacks.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Final

import torch
from torch import nn

from fsdp_core.internals import FSDPInternalsError

__all__ = [
    "has_fake_store",
    "fake_store",
    "require_attributes",
    "fsdp_mem_tracker_class",
    "memory_timeline_tracker",
    "process_group_timeout",
    "root_mesh",
    "flatten_mesh",
]

_FAKE_PG_MODULE: Final = "torch.testing._internal.distributed.fake_pg"
_MEM_TRACKER_MODULE: Final = "torch.distributed._tools.fsdp2_mem_tracker"


def has_fake_store() -> bool:
    """Whether this torch ships the store of the single-process ``fake`` backend.

    Returns:
        Whether ``FakeStore`` can be imported.
    """
    try:
        importlib.import_module(_FAKE_PG_MODULE)
    except ImportError:
        return False
    return True


def fake_store() -> Any:
    """A new ``FakeStore`` (from a torch testing module) for ``init_process_group("fake")``.

    Returns:
        A new ``FakeStore``.

    Raises:
        FSDPInternalsError: this torch has no ``FakeStore``.
    """
    try:
        store = importlib.import_module(_FAKE_PG_MODULE).FakeStore
    except (ImportError, AttributeError) as error:
        raise FSDPInternalsError(
            f"the fake process group needs {_FAKE_PG_MODULE}.FakeStore (a private torch "
            f"module; torch {torch.__version__} lacks it: {error})"
        ) from None
    return store()


def require_attributes(obj: object, names: Sequence[str], *, owner: str, user: str) -> None:
    """Raise [`FSDPInternalsError`][fsdp_core.internals.FSDPInternalsError] unless ``obj`` has
    every attribute ``user`` reads (those set in ``__init__`` cannot be checked on the class).

    Args:
        obj: the private torch object.
        names: the attributes ``user`` reads.
        owner: ``obj``'s class name, for the message.
        user: the library feature that reads them, for the message.

    Raises:
        FSDPInternalsError: an attribute is missing.
    """
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise FSDPInternalsError(
            f"torch {torch.__version__}'s {owner} lacks {missing}, which {user} reads; "
            "use a torch it was tested with (2.13)"
        )


def fsdp_mem_tracker_class(needs: Sequence[str], *, user: str) -> type[Any]:
    """torch's ``FSDPMemTracker`` class, checked for the private attributes ``needs``.

    Args:
        needs: private attributes the caller reads.
        user: the library feature, for the message.

    Returns:
        ``FSDPMemTracker``.

    Raises:
        FSDPInternalsError: the class or an attribute is missing.
    """
    try:
        module = importlib.import_module(_MEM_TRACKER_MODULE)
        tracker = module.FSDPMemTracker
    except (ImportError, AttributeError) as error:
        raise FSDPInternalsError(
            f"measuring memory needs {_MEM_TRACKER_MODULE}.FSDPMemTracker (a private torch "
            f"module; torch {torch.__version__} lacks it: {error})"
        ) from None
    require_attributes(tracker, needs, owner="FSDPMemTracker", user=user)
    if not isinstance(tracker, type):
        raise FSDPInternalsError(f"{_MEM_TRACKER_MODULE}.FSDPMemTracker is not a class")
    return tracker


#: What ``memory_timeline_tracker`` reads beyond public methods: on the class, on an instance.
_TRACKER_NEEDS: Final = ("_update_peak_stats", "get_tracker_snapshot", "track_inputs")
_TRACKER_STATE: Final = ("_curr_mem_snap", "_in_opt", "_mod_tracker")


def memory_timeline_tracker(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    on_change: Callable[[str, dict[torch.device, dict[str, int]]], None],
    user: str,
) -> Any:
    """A new ``FSDPMemTracker`` of ``model`` (and ``optimizer``) that also calls
    ``on_change(phase, snapshot)`` whenever its byte counts change (``phase``: ``"forward"``,
    ``"backward"`` or ``"optimizer"``; ``snapshot``: bytes per device and category).

    Args:
        model: the sharded model.
        optimizer: its optimizer (its state is tracked too).
        on_change: called with the phase and the bytes after each change.
        user: the library feature, for the message.

    Returns:
        The tracker, a context manager.
    """
    base = fsdp_mem_tracker_class(_TRACKER_NEEDS, user=user)

    class _Timeline(base):  # type: ignore[misc,valid-type]
        def _update_peak_stats(self, peak_state: Any) -> None:
            super()._update_peak_stats(peak_state)
            if self._in_opt:
                phase = "optimizer"
            else:
                phase = "backward" if self._mod_tracker.is_bw else "forward"
            on_change(phase, self._curr_mem_snap)

    tracker = _Timeline(model, optimizer)
    require_attributes(tracker, _TRACKER_STATE, owner="FSDPMemTracker", user=user)
    return tracker


def process_group_timeout(group: Any = None) -> timedelta:
    """The group's collective timeout: the backend's private option, else its store's
    (``init_process_group`` gives both the same), else torch's default.

    Args:
        group: a process group (the default one if None).

    Returns:
        Its collective timeout.
    """
    import torch.distributed as dist

    pg: Any = dist.group.WORLD if group is None else group
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            value = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(value, timedelta) and value.total_seconds() > 0:
            return value
    try:
        value = pg.get_group_store().timeout
    except (AttributeError, RuntimeError):
        value = None
    if isinstance(value, timedelta) and value.total_seconds() > 0:
        return value
    return timedelta(minutes=30)


def root_mesh(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced, flattened or unflattened from (itself if none).

    Args:
        mesh: a device mesh.

    Returns:
        Its root mesh.

    Raises:
        FSDPInternalsError: this torch's ``DeviceMesh`` has no ``_get_root_mesh``.
    """
    getter = getattr(mesh, "_get_root_mesh", None)
    if not callable(getter):
        raise FSDPInternalsError(
            "this torch's DeviceMesh has no _get_root_mesh(): the library cannot find the "
            "mesh a data-parallel sub-mesh was sliced from; pass the whole mesh and name its "
            "data-parallel dimensions (dp_dims=...)"
        )
    return getter()


@functools.cache
def flatten_mesh(mesh: Any, name: str, *, keep: int = 0) -> Any:
    """``mesh``'s dimensions after its first ``keep`` as one, named ``name`` (cached: the
    process groups are made once); how the dp shard and CP dimensions become FSDP's one.

    Args:
        mesh: a device mesh.
        name: the flattened dimension's name.
        keep: how many leading dimensions stay as they are.

    Returns:
        The mesh with its trailing dimensions flattened into one.

    Raises:
        FSDPInternalsError: this torch's ``DeviceMesh`` cannot flatten.
    """
    if not all(callable(getattr(mesh, method, None)) for method in ("_flatten", "_unflatten")):
        raise FSDPInternalsError(
            "this torch's DeviceMesh has no _flatten()/_unflatten(): the library cannot shard "
            "over the data-parallel and context-parallel ranks together; flatten them yourself "
            "and pass that mesh as the data-parallel one"
        )
    names = tuple(mesh.mesh_dim_names)
    if not keep:
        return mesh._flatten(name)
    whole = mesh._flatten("_".join(names))
    sizes = tuple(int(s) for s in mesh.shape)
    folded = math.prod(sizes[keep:])
    return whole._unflatten(0, (*sizes[:keep], folded), (*names[:keep], name))
