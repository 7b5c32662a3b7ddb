"""Sharded checkpoints with torch.distributed.checkpoint (DCP), resharding on load.

A checkpoint saved on N ranks loads on M ranks, or into an unsharded model in
one process, with every tensor in the dtype it was saved in (fp32 norm
islands stay fp32) and with replicated (FSDP-ignored) parameters included.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

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


def save_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
) -> None:
    """Save model (and optimizer) shards of every rank into the directory ``path``."""
    state = _state(model, optimizer)
    if step is not None:
        state["step"] = torch.tensor(step, dtype=torch.int64)
    dcp_save(state, checkpoint_id=path)
    logger.info("saved checkpoint to %s", path)


def load_checkpoint(
    path: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> int | None:
    """Load ``path`` into a (sharded) model and optimizer in place; returns the saved step."""
    state = _state(model, optimizer)
    state["step"] = torch.tensor(-1, dtype=torch.int64)
    dcp_load(state, checkpoint_id=path)
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    step = int(state["step"].item())
    return None if step < 0 else step


def load_checkpoint_unsharded(path: PathLike, model: nn.Module) -> None:
    """Load the model part of a sharded checkpoint into a plain model in one process."""
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        # DCP warns that it "assumes" a single process: that is exactly the intent here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    model.load_state_dict(state["model"])


def export_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors with the original parameter names, on CPU, on rank 0 (empty elsewhere).

    For export (``torch.save``, safetensors, a Hugging Face checkpoint): dtypes
    are the stored ones, so fp32 islands stay fp32.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
