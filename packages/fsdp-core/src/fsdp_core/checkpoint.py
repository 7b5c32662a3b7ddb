"""Sharded checkpoints with torch.distributed.checkpoint (DCP), resharding on load.

A checkpoint saved on N ranks loads on M ranks, or into an unsharded model in
one process, with every tensor in the dtype it was saved in (fp32 norm
islands stay fp32) and with replicated (FSDP-ignored) parameters included.

Every function here is collective: it first checks that every rank of the
model's mesh arrived (``fsdp_core.collective_entry``; ``timeout=``, default the
process group's timeout), agrees on its preconditions (the directory readable
for a load, writable for a save) and raises a failure of any rank on every
rank. DCP's own save writes into the directory in place (a failure midway
leaves new shard files next to the old ``.metadata``), so ``save_checkpoint``
writes into a sibling directory that every rank sees and swaps it in, as
``save_pretrained`` does: the directory holds the old checkpoint or the new one.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fsdp_core import _export_swap
from fsdp_core.collective_entry import CollectiveCall, enter_collective, group_ranks
from fsdp_core.weights_check import refill_unset_buffers

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "load_checkpoint_unsharded",
    "export_full_state_dict",
]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


_METADATA = ".metadata"


def _is_dcp_file(name: str) -> bool:
    """What a DCP save writes (replaced by the next save; other files are kept)."""
    return name == _METADATA or name.endswith(".distcp")


def _work_dir(root: Path) -> Path:
    """The sibling every rank writes the new checkpoint into (one name, no exchange)."""
    return root.parent / f".{root.name}.saving-checkpoint"


def _prepare_save(root: Path, main: bool) -> None:
    """Fail, on the rank that cannot, before anything is written; rank ``main`` makes
    the empty sibling (a stale one from a crashed save is removed)."""
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

    Collective: call it on every rank (it waits at most ``timeout``, default the
    process group's timeout, and names the ranks that did not arrive). The new
    checkpoint is written into a sibling of ``path`` and swapped in only when
    every rank wrote its part, so a failed save leaves the previous checkpoint
    in ``path`` loadable; other files in ``path`` are kept.
    """
    root = _export_swap.destination(path)
    with enter_collective(
        "save_checkpoint", ranks=group_ranks(model=model), timeout=timeout
    ) as call:
        main = _is_main(call)
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


def _is_main(call: CollectiveCall) -> bool:
    return call.rank == (call.ranks[0] if call.active else call.rank)


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


def _saved_keys(path: PathLike) -> set[str]:
    """The top-level keys a checkpoint holds (``model``, ``optim``, ``step``), from its
    metadata; fails as ``_check_readable`` does on a directory without one."""
    _check_readable(path)
    metadata = FileSystemReader(path).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    timeout: float | timedelta | None = None,
) -> int | None:
    """Load ``path`` into a (sharded) model and optimizer in place; returns the saved step.

    Collective, with the arrival check and agreement of ``save_checkpoint``: a
    checkpoint missing or unreadable on any rank fails on every rank before
    anything is read. Non-persistent buffers are in no checkpoint: those that
    ``to_empty()`` left undefined after a ``meta`` build are recomputed for
    transformers models (as ``load_pretrained`` does); others must be set by hand.
    """
    with enter_collective(
        "load_checkpoint", ranks=group_ranks(model=model), timeout=timeout
    ) as call:
        state = call.run(lambda: _state(model, optimizer), step="collecting the state")
        saved = call.run(lambda: _saved_keys(path), step=f"finding the checkpoint {str(path)!r}")
        state["step"] = torch.tensor(-1, dtype=torch.int64)
        if "step" not in saved:  # saved without step=: DCP would refuse the missing key
            del state["step"]
        call.run(lambda: dcp_load(state, checkpoint_id=path), step=f"reading {str(path)!r}")
        set_state_dict(
            model,
            optimizer if optimizer is not None else [],
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
        )
        # No checkpoint holds non-persistent buffers: after to_empty() they are undefined.
        call.run(lambda: refill_unset_buffers(model), step="recomputing buffers")
    step = int(state["step"].item()) if "step" in state else -1
    return None if step < 0 else step


def load_checkpoint_unsharded(
    path: PathLike, model: nn.Module, *, timeout: float | timedelta | None = None
) -> None:
    """Load the model part of a sharded checkpoint into a plain model in one process.

    Under a process group DCP reads collectively: then every rank must call it
    (arrival check and agreement as ``load_checkpoint``).
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

    For export (``torch.save``, safetensors, a Hugging Face checkpoint): dtypes
    are the stored ones, so fp32 islands stay fp32. Collective (every rank
    gathers): call it on every rank, not under ``if rank == 0``.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with enter_collective(
        "export_full_state_dict", ranks=group_ranks(model=model), timeout=timeout
    ):
        state = get_model_state_dict(model, options=options)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
