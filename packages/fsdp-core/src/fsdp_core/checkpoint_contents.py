"""What a DCP checkpoint holds, read from its metadata, compared with a model and optimizer.

Reading only ``.metadata`` decides, on every rank alike and before any tensor is read,
which optimizer states to load and whether a shape changed: DCP's own errors for those
come late, inside a ``CheckpointException``, and name a missing key, not the cause.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_core.rank_wait import names_text

__all__ = ["CheckpointContents", "check_model_matches"]

_LISTED = 8


@dataclass(frozen=True)
class CheckpointContents:
    """The keys and shapes of one checkpoint (see the module docstring)."""

    #: Model tensor name -> its full shape.
    model_shapes: Mapping[str, tuple[int, ...]]
    #: Parameter name -> the optimizer state fields saved for it (``step``, ``exp_avg``, ...).
    optimizer_state: Mapping[str, frozenset[str]]
    #: How many optimizer parameter groups were saved (0: saved without optimizer).
    param_groups: int
    #: Whether ``save_checkpoint(..., step=...)`` recorded a step.
    has_step: bool

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> CheckpointContents:
        """Read ``path``'s ``.metadata`` (the caller checked that it exists).

        Args:
            path: the checkpoint directory.

        Returns:
            The shapes and optimizer state it records.
        """
        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
        model: dict[str, tuple[int, ...]] = {}
        for key, value in metadata.items():
            if key.startswith("model.") and isinstance(value, TensorStorageMetadata):
                model[key.removeprefix("model.")] = tuple(value.size)
        state: dict[str, set[str]] = {}
        groups: set[str] = set()
        for key in metadata:
            if key.startswith("optim.state."):
                name, field = _split_state_key(key.removeprefix("optim.state."), model)
                state.setdefault(name, set()).add(field)
            elif key.startswith("optim.param_groups."):
                groups.add(key.removeprefix("optim.param_groups.").split(".", 1)[0])
        return cls(
            model_shapes=model,
            optimizer_state={name: frozenset(fields) for name, fields in state.items()},
            param_groups=len(groups),
            has_step="step" in metadata,
        )


def _split_state_key(key: str, names: Iterable[str]) -> tuple[str, str]:
    """``"a.b.weight.exp_avg"`` -> ``("a.b.weight", "exp_avg")``: by the longest model name."""
    best = ""
    for name in names:
        if key.startswith(name + ".") and len(name) > len(best):
            best = name
    if best:
        return best, key[len(best) + 1 :]
    name, _, field = key.rpartition(".")
    return name, field


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def check_model_matches(
    contents: CheckpointContents, model_state: Mapping[str, Any], path: str | os.PathLike[str]
) -> None:
    """Raise ``ValueError`` when a model tensor changed shape since the save (its name,
    both shapes), or when the checkpoint has no value for one (their names).

    Args:
        contents: what the checkpoint holds.
        model_state: the model's state dict (names and tensors).
        path: the checkpoint, for the message.

    Raises:
        ValueError: a tensor's shape changed, or the checkpoint lacks one.
    """
    changed = []
    for name, value in model_state.items():
        shape = _shape(value)
        saved = contents.model_shapes.get(name)
        if shape is not None and saved is not None and shape != saved:
            changed.append(f"{name}: {saved} saved, {shape} here")
    if changed:
        raise ValueError(
            f"{len(changed)} tensors of the model changed shape since the checkpoint "
            f"{str(path)!r} was saved ({names_text(changed, _LISTED, show=str)}); a "
            "checkpoint loads into the shapes it was saved from: load it into a model of "
            "those shapes, then resize (e.g. resize_token_embeddings), or load the tensors "
            "that match yourself"
        )
    missing = sorted(
        name
        for name, value in model_state.items()
        if _shape(value) is not None and name not in contents.model_shapes
    )
    if missing:
        raise ValueError(
            f"the checkpoint {str(path)!r} has no value for {len(missing)} tensors of the "
            f"model ({names_text(missing, _LISTED, show=str)}); it was saved from a model "
            "without them"
        )
