"""Sharded checkpoints with torch.distributed.checkpoint (DCP), resharding on load.

A checkpoint saved on N ranks loads on M ranks, or into an unsharded model in one
process, every tensor in the dtype it was saved in. Every function here is collective:
it checks that every rank of the model's mesh arrived, agrees on its preconditions and
raises a failure of any rank on every rank. DCP's own save writes in place (a failure
midway mixes new shards with the old ``.metadata``), so ``save_checkpoint`` writes into
a sibling directory and swaps it in: the directory holds the old checkpoint or the new.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fsdp_core import _export_swap
from fsdp_core.checkpoint_contents import CheckpointContents, check_model_matches
from fsdp_core.collective_entry import enter_collective, group_ranks, whole_world_ranks
from fsdp_core.rank_agreement import CollectiveCallError
from fsdp_core.weights_check import refill_unset_buffers

__all__ = [
    "save_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_stage_checkpoint",
    "StageLoadReport",
    "load_checkpoint_unsharded",
    "export_full_state_dict",
]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


#: What to do instead of the library's checkpoints on a pipeline stage.
_STAGES = (
    "save the stages into one DCP checkpoint from every rank (torch.distributed.checkpoint "
    "with each stage's get_model_state_dict, as torchtitan's checkpointer does)"
)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


_METADATA = ".metadata"
#: The number a checkpoint directory's name ends in (``step-12``, ``checkpoint-000012``).
_NUMBERED = re.compile(r"(\d+)$")


def _is_dcp_file(name: str) -> bool:
    """What a DCP save writes (replaced by the next save; other files are kept)."""
    return name == _METADATA or name.endswith(".distcp")


def _work_dir(root: Path) -> Path:
    """The sibling every rank writes the new checkpoint into (one name, no exchange)."""
    return root.parent / f".{root.name}.saving-checkpoint"


def _prepare_save(root: Path, main: bool) -> None:
    """Fail before anything is written; rank ``main`` makes the empty sibling (anew)."""
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "the checkpoint path is not a directory", str(root))
    if main:
        work = _work_dir(root)
        root.parent.mkdir(parents=True, exist_ok=True)
        if work.exists():
            shutil.rmtree(work)
        work.mkdir()
    elif not os.access(root.parent if root.parent.exists() else Path("."), os.W_OK):
        raise PermissionError(errno.EACCES, "cannot write beside the checkpoint", str(root))


def _seen(work: Path) -> None:
    if not work.is_dir():
        raise FileNotFoundError(
            errno.ENOENT,
            "this rank does not see the directory rank 0 made for the checkpoint; "
            "save_checkpoint needs a filesystem every rank sees",
            str(work),
        )


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    timeout: float | timedelta | None = None,
) -> None:
    """Save model (and optimizer) shards of every rank into the directory ``path``.

    Collective: call it on every rank (it waits at most ``timeout``). The checkpoint is
    written into the sibling ``.<name>.saving-checkpoint`` and swapped in once every
    rank wrote its part, so a failed save leaves the previous checkpoint loadable; other
    files in ``path`` are kept. The next save removes a sibling a killed job left.

    Args:
        path: the checkpoint directory (created or replaced).
        model: the sharded model.
        optimizer: its optimizer, saved beside it.
        step: a training step stored with the checkpoint.
        timeout: the arrival check's timeout in seconds or a timedelta.

    Raises:
        CollectiveCallError: a rank did not arrive or failed (on every rank).
    """
    root = _export_swap.destination(path)
    with enter_collective(
        "save_checkpoint",
        ranks=whole_world_ranks(model, "save_checkpoint", _STAGES),
        timeout=timeout,
    ) as call:
        main = call.is_main
        work = _work_dir(root)
        state = call.run(lambda: _state(model, optimizer), step="collecting the state")
        try:
            call.run(lambda: _prepare_save(root, main), step=f"preparing beside {str(root)!r}")
            call.run(lambda: _seen(work), step=f"finding {str(work)!r}")
            if step is not None:
                state["step"] = torch.tensor(step, dtype=torch.int64)
            call.run(lambda: _save_state(state, work), step=f"writing {str(work)!r}")
            call.run(
                lambda: _export_swap.swap_in(work, root, replaces=_is_dcp_file) if main else None,
                step=f"replacing the checkpoint in {str(root)!r}",
            )
        except BaseException:
            if main and work.exists():
                _export_swap.discard(work)
            raise
    logger.info("saved checkpoint to %s", path)


def _save_state(state: dict[str, Any], work: Path) -> None:
    dcp_save(state, checkpoint_id=work)


def latest_checkpoint(root: PathLike, *, timeout: float | timedelta | None = None) -> Path | None:
    """The newest complete checkpoint in ``root``: the one a restarted job resumes from.

    ``root`` holds one directory per checkpoint, its name ending in its step
    (``step-12``, ``checkpoint-000012``); the newest ends in the largest number. Only
    directories holding their ``.metadata`` count; a killed save's hidden
    ``.<name>.saving-checkpoint`` (every entry starting with ``.``) is skipped and
    logged, never deleted: another job might be saving into ``root`` right now.

    Collective when a process group is initialised: the ranks must find the same
    checkpoint, so that no rank resumes from another step than the others.

    Args:
        root: The directory of checkpoint directories (it need not exist yet).
        timeout: How long to wait for every rank to arrive (seconds or a ``timedelta``).

    Returns:
        The newest complete checkpoint's directory, or ``None`` when there is none.

    Raises:
        TypeError: ``root`` is not a ``str`` or ``os.PathLike``.
        NotADirectoryError: ``root`` exists and is not a directory.
        ValueError: Two complete checkpoints end in the same, largest number (such as
            ``step-3`` and ``ckpt-3``): which one is newer is unknown.
        CollectiveCallError: The ranks found different newest checkpoints, or not every
            rank called this.
    """
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a str or os.PathLike, got {type(root).__name__}")
    directory = Path(root)
    with enter_collective("latest_checkpoint", timeout=timeout) as call:
        newest = call.run(
            lambda: _newest_checkpoint(directory, log=call.is_main),
            step=f"looking for checkpoints in {str(directory)!r}",
        )
        call.agree_on(
            "none" if newest is None else newest.name,
            what=f"newest checkpoint in {str(directory)!r}",
            error=lambda text: CollectiveCallError(
                f"latest_checkpoint: {text}; the checkpoints must be on a filesystem that "
                "every rank sees"
            ),
        )
    return newest


def _newest_checkpoint(root: Path, *, log: bool) -> Path | None:
    """``latest_checkpoint`` on this rank alone."""
    if not root.exists():
        return None
    if not root.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "the checkpoint root is not a directory", str(root))
    complete: dict[int, list[Path]] = {}
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            if log and entry.is_dir():
                logger.info(
                    "latest_checkpoint: skipping %s, an unfinished save or an earlier "
                    "checkpoint set aside during one (the next save_checkpoint of that "
                    "name removes its leftover)",
                    entry,
                )
            continue
        number = _NUMBERED.search(entry.name)
        if number is not None and entry.is_dir() and (entry / _METADATA).is_file():
            complete.setdefault(int(number.group(1)), []).append(entry)
    if not complete:
        return None
    newest = complete[max(complete)]
    if len(newest) > 1:
        raise ValueError(
            f"the checkpoints {[entry.name for entry in newest]} in {str(root)!r} end in "
            f"the same number {max(complete)}: which one is newer is unknown; give each "
            "checkpoint its own step number at the end of its name"
        )
    return newest[0]


def _check_readable(path: PathLike) -> None:
    root = Path(path)
    if not (root / _METADATA).is_file():
        raise FileNotFoundError(
            errno.ENOENT,
            "no checkpoint here (no .metadata, what save_checkpoint writes)",
            str(root),
        )
    if not os.access(root, os.R_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "cannot read the checkpoint directory", str(root))


def _contents(path: PathLike) -> CheckpointContents:
    _check_readable(path)
    return CheckpointContents.read(path)


@dataclass(frozen=True)
class StageLoadReport:
    """What ``load_stage_checkpoint`` (and ``load_checkpoint``) loaded into the optimizer.

    Names are the model's parameter names, in the optimizer's order."""

    #: The step the checkpoint was saved at (``None``: saved without ``step=``).
    step: int | None
    #: Parameters whose optimizer state was loaded (trainable then and now).
    restored: tuple[str, ...]
    #: Parameters this optimizer trains that have no saved state: they start fresh, as
    #: in a new optimizer (newly trainable, or never given a gradient before the save).
    fresh: tuple[str, ...]
    #: Parameters with saved state that this optimizer does not train (frozen now).
    dropped: tuple[str, ...]


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    timeout: float | timedelta | None = None,
) -> int | None:
    """Load ``path`` into a (sharded) model and optimizer in place; returns the saved step.

    A resume of the run that saved it: the optimizer must train the same parameters in
    as many groups (its hyperparameters are loaded too); another freeze set starts from
    it with ``load_stage_checkpoint``. Collective: a checkpoint missing on any rank, a
    tensor whose shape changed or another freeze set fails on every rank before anything
    is read. Non-persistent buffers ``to_empty()`` left undefined are recomputed for
    transformers models (as ``load_pretrained`` does); others must be set by hand.

    Args:
        path: a directory ``save_checkpoint`` wrote.
        model: the sharded model, filled in place.
        optimizer: its optimizer, filled in place.
        timeout: the arrival check's timeout.

    Returns:
        The ``step`` given to ``save_checkpoint`` (None if none was).

    Raises:
        ValueError: a tensor changed shape, or the freeze set differs (on every rank).
    """
    return _load(path, model, optimizer, stage=False, timeout=timeout).step


def load_stage_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    timeout: float | timedelta | None = None,
) -> StageLoadReport:
    """Start a new training stage (another freeze set) from an earlier stage's checkpoint.

    Loads every model tensor and the optimizer state of the parameters trainable in both
    runs; newly trainable ones start fresh and the optimizer keeps this run's
    hyperparameters. The report (also logged) names the parameters restored, fresh and
    dropped (frozen now). Collective, like ``load_checkpoint``.

    Args:
        path: a directory ``save_checkpoint`` wrote in an earlier stage.
        model: the sharded model of this stage.
        optimizer: this stage's optimizer.
        timeout: the arrival check's timeout.

    Returns:
        The parameters whose optimizer state was restored, started fresh or dropped.

    Raises:
        ValueError: a model tensor changed shape or is missing (on every rank).
    """
    report = _load(path, model, optimizer, stage=True, timeout=timeout)
    if optimizer is not None:
        logger.info(
            "stage checkpoint %s (step %s): optimizer state restored for %d parameters, "
            "fresh for %d (%s), not loaded for %d frozen now (%s)",
            path,
            report.step,
            len(report.restored),
            len(report.fresh),
            _names_text(report.fresh),
            len(report.dropped),
            _names_text(report.dropped),
        )
    return report


def _names_text(names: tuple[str, ...], limit: int = 8) -> str:
    more = f", ... {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "none"


def _select(
    contents: CheckpointContents, optim_state: dict[str, Any] | None, path: PathLike
) -> StageLoadReport:
    """Which saved optimizer states a load reads (decided from the metadata alone)."""
    if optim_state is None:
        return StageLoadReport(None, (), (), ())
    state: dict[str, dict[str, Any]] = optim_state["state"]
    restored, fresh = [], []
    for name, fields in state.items():
        saved = contents.optimizer_state.get(name)
        if saved is None:
            fresh.append(name)
        elif saved != frozenset(fields):
            raise ValueError(
                f"the checkpoint {str(path)!r} holds optimizer state {sorted(saved)} for "
                f"{name!r}, this optimizer keeps {sorted(fields)}: it was saved by another "
                "kind of optimizer; load the model only (optimizer=None)"
            )
        else:
            restored.append(name)
    dropped = tuple(name for name in contents.optimizer_state if name not in state)
    return StageLoadReport(None, tuple(restored), tuple(fresh), dropped)


def _check_same_run(
    path: PathLike, optim_state: dict[str, Any], saved_groups: list[list[str]]
) -> None:
    """A resume must train what the saved run trained, in as many groups."""
    if not saved_groups:
        raise ValueError(
            f"the checkpoint {str(path)!r} holds no optimizer state (it was saved without an "
            "optimizer): load it with optimizer=None, or with load_stage_checkpoint, where "
            "every trainable parameter starts fresh"
        )
    groups: list[dict[str, Any]] = optim_state["param_groups"]
    now = [name for group in groups for name in group["params"]]
    then = [name for group in saved_groups for name in group]
    new, gone = sorted(set(now) - set(then)), sorted(set(then) - set(now))
    if new or gone or len(groups) != len(saved_groups):
        raise ValueError(
            f"the checkpoint {str(path)!r} was saved by an optimizer of other parameters "
            f"(trainable now, not then: {_names_text(tuple(new))}; then, not now: "
            f"{_names_text(tuple(gone))}; parameter groups: {len(saved_groups)} then, "
            f"{len(groups)} now); load_checkpoint resumes the same run: to start a new "
            "training stage from it, use load_stage_checkpoint"
        )


def _saved_param_groups(path: PathLike, count: int) -> list[list[str]]:
    """The parameter names of each saved optimizer group (small pickled lists)."""
    if not count:
        return []
    groups: list[dict[str, Any]] = [{"params": []} for _ in range(count)]
    dcp_load({"optim": {"param_groups": groups}}, checkpoint_id=path)
    return [list(group["params"]) for group in groups]


def _load(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    stage: bool,
    timeout: float | timedelta | None,
) -> StageLoadReport:
    name = "load_stage_checkpoint" if stage else "load_checkpoint"
    ranks = whole_world_ranks(model, name, _STAGES)
    with enter_collective(name, ranks=ranks, timeout=timeout) as call:
        model_state = call.run(lambda: get_model_state_dict(model), step="collecting the state")
        optim_state: dict[str, Any] | None = (
            None
            if optimizer is None
            else call.run(
                lambda: dict(get_optimizer_state_dict(model, optimizer)),
                step="collecting the optimizer state",
            )
        )
        contents = call.run(lambda: _contents(path), step=f"finding the checkpoint {str(path)!r}")
        call.run(
            lambda: check_model_matches(contents, model_state, path),
            step="comparing the model with the checkpoint",
        )
        selection = call.run(
            lambda: _select(contents, optim_state, path),
            step="comparing the optimizer with the checkpoint",
        )
        if optim_state is not None and not stage:
            saved_groups = call.run(
                lambda: _saved_param_groups(path, contents.param_groups),
                step=f"reading the optimizer's parameter groups from {str(path)!r}",
            )
            call.run(
                lambda: _check_same_run(path, optim_state, saved_groups),
                step="comparing the optimizer with the checkpoint",
            )
        request: dict[str, Any] = {"model": model_state}
        if optim_state is not None:
            optim: dict[str, Any] = {
                "state": {key: optim_state["state"][key] for key in selection.restored}
            }
            if not stage:  # a resume loads the saved hyperparameters too
                optim["param_groups"] = optim_state["param_groups"]
            request["optim"] = optim
        if contents.has_step:
            request["step"] = torch.tensor(-1, dtype=torch.int64)
        call.run(lambda: dcp_load(request, checkpoint_id=path), step=f"reading {str(path)!r}")
        set_model_state_dict(model, model_state)
        if optimizer is not None and optim_state is not None:
            # Not strict: the parameters without loaded state get none (they start fresh).
            loaded = {
                "state": request["optim"]["state"],
                "param_groups": request["optim"].get("param_groups", optim_state["param_groups"]),
            }
            set_optimizer_state_dict(
                model, optimizer, loaded, options=StateDictOptions(strict=False)
            )
        # No checkpoint holds non-persistent buffers: after to_empty() they are undefined.
        call.run(lambda: refill_unset_buffers(model), step="recomputing buffers")
    step = int(request["step"].item()) if "step" in request else -1
    return replace(selection, step=None if step < 0 else step)


def load_checkpoint_unsharded(
    path: PathLike, model: nn.Module, *, timeout: float | timedelta | None = None
) -> None:
    """Load the model part of a sharded checkpoint into a plain model in one process
    (under a process group DCP reads collectively: every rank must call it).

    Args:
        path: a directory ``save_checkpoint`` wrote.
        model: a plain (unsharded) model, filled in place.
        timeout: the arrival check's timeout under a process group.
    """
    with enter_collective(
        "load_checkpoint_unsharded", ranks=group_ranks(model=model), timeout=timeout
    ) as call:
        call.run(lambda: _check_readable(path), step=f"finding the checkpoint {str(path)!r}")
        state = {"model": model.state_dict()}

        def read() -> None:
            with warnings.catch_warnings():
                # DCP warns that it "assumes" a single process: that is exactly the intent.
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_load(state, checkpoint_id=path, no_dist=not dist.is_initialized())

        call.run(read, step=f"reading {str(path)!r}")
        model.load_state_dict(state["model"])


def export_full_state_dict(
    model: nn.Module, *, timeout: float | timedelta | None = None
) -> dict[str, torch.Tensor]:
    """Full tensors with the original parameter names, on CPU, on rank 0 (empty elsewhere).

    In the stored dtypes. Collective: call it on every rank, not under ``if rank == 0``.

    Args:
        model: the sharded model.
        timeout: the arrival check's timeout.

    Returns:
        ``{name: full CPU tensor}`` on rank 0, ``{}`` on the others.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with enter_collective(
        "export_full_state_dict", ranks=group_ranks(model=model), timeout=timeout
    ):
        state = get_model_state_dict(model, options=options)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
