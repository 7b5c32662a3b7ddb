"""An accelerate training loop on a model the library sharded: ``prepare``.

On accelerate's FSDP2 path (``FullyShardedDataParallelPlugin(fsdp_version=2)``, GPUs)
accelerate passes an ``FSDPModule`` through unchanged. Otherwise (no plugin, or any CPU
run) it would wrap the model in ``DistributedDataParallel``, which cannot hold sharded
parameters, and its own checkpoint and weight calls would read one rank's shards as
if they were whole. There [`prepare`][fsdp_core.integrations.accelerate.prepare]
prepares everything but the model and routes ``save_state``/``load_state`` (the model
and optimizer through [`fsdp_core.checkpoint`][fsdp_core.checkpoint] into
``CHECKPOINT_DIR``, accelerate's optimizer file a placeholder), ``get_state_dict``
(whole tensors on the main process), ``save_model`` (``fsdp_core.hf.save_pretrained``),
and refuses ``save`` and ``register_for_checkpointing`` of sharded tensors.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_core.checkpoint import export_full_state_dict, load_checkpoint, save_checkpoint
from fsdp_core.hf import save_pretrained
from fsdp_core.hf._save import DEFAULT_MAX_SHARD_SIZE
from fsdp_core.integrations import IntegrationRequiredError, _require_release
from fsdp_core.rank_wait import names_text

try:
    from accelerate import Accelerator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'fsdp_core.integrations.accelerate needs accelerate: pip install "fsdp-core[accelerate]"'
    ) from exc

__all__ = ["CHECKPOINT_DIR", "SUPPORTED_ACCELERATE", "prepare", "ShardedState"]

logger = logging.getLogger(__name__)

#: The accelerate releases this module is written and tested for (its extra's range).
SUPPORTED_ACCELERATE = ">=1.16,<2"
#: The sub-directory of a ``save_state`` directory holding the model and optimizer (DCP).
CHECKPOINT_DIR = "fsdp_checkpoint"
#: Key of the placeholder written instead of accelerate's optimizer file.
_PLACEHOLDER = "fsdp_core_optimizer_state"


def _check_release() -> None:
    _require_release("accelerate", SUPPORTED_ACCELERATE, (1, 16), 2)


_check_release()


class ShardedState:
    """The model and optimizer of an accelerate run, saved and loaded by the library.

    Registered by ``prepare`` with the accelerator's save and load pre-hooks.

    Args:
        model: the sharded model.
        optimizer: its optimizer, checkpointed with it.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._saving = False
        self._loading: Path | None = None

    def before_save(self, models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        """The accelerator's save pre-hook: the library's sharded checkpoint first.

        Args:
            models: accelerate's models (unused: the state holds its own).
            weights: accelerate's weights (unused).
            output_dir: the directory ``save_state`` writes.
        """
        save_checkpoint(Path(output_dir) / CHECKPOINT_DIR, self.model, self.optimizer)
        self._saving = True  # accelerate's optimizer file gets the placeholder

    def before_load(self, models: list[nn.Module], input_dir: str) -> None:
        """The accelerator's load pre-hook: find the library's checkpoint to load.

        Args:
            models: accelerate's models (unused).
            input_dir: the directory ``load_state`` reads.

        Raises:
            IntegrationRequiredError: the directory was written by accelerate's own
                ``save_state`` (its optimizer file holds one rank's shards).
        """
        self._loading = None
        sharded = Path(input_dir) / CHECKPOINT_DIR
        if not sharded.is_dir():
            raise IntegrationRequiredError(
                f"{input_dir} holds no {CHECKPOINT_DIR}/: it was written by accelerate's own "
                "save_state, whose optimizer file has one rank's shards of this sharded model "
                "(loaded on every rank it would corrupt the optimizer). Save states with "
                "fsdp_core.integrations.accelerate.prepare's routing, or load the weights with "
                "fsdp_core.checkpoint / fsdp_core.hf.load_pretrained"
            )
        self._loading = sharded

    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The optimizer's state-dict post-hook: a placeholder instead of shards while saving.

        Args:
            optimizer: the optimizer.
            state_dict: what it would save.

        Returns:
            The placeholder while saving, else None (keep ``state_dict``).
        """
        if not self._saving:
            return None
        return {_PLACEHOLDER: CHECKPOINT_DIR, "state": {}, "param_groups": []}

    def optimizer_load_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """The optimizer's load pre-hook: a placeholder loads nothing (the checkpoint does).

        Args:
            optimizer: the optimizer.
            state_dict: what accelerate read.

        Returns:
            The optimizer's own state for a placeholder, else None.
        """
        if _PLACEHOLDER in state_dict:
            return optimizer.state_dict()  # read from CHECKPOINT_DIR by load_state_dict below
        return None

    def state_dict(self) -> dict[str, str]:
        """Where the state was written (accelerate saves it after the optimizers).

        Returns:
            The checkpoint format and directory name.
        """
        self._saving = False
        return {"format": "fsdp_core.checkpoint", "directory": CHECKPOINT_DIR}

    def load_state_dict(self, state: Mapping[str, str]) -> None:
        """Load the checkpoint ``before_load`` found into the model and optimizer.

        Args:
            state: what ``state_dict`` returned at the save.

        Raises:
            RuntimeError: called outside ``accelerator.load_state``.
        """
        if self._loading is None:
            raise RuntimeError("ShardedState.load_state_dict runs inside accelerator.load_state")
        directory, self._loading = self._loading, None
        load_checkpoint(directory, self.model, self.optimizer)


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer``."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"expected a torch optimizer, got {type(inner).__name__}")
    return inner


def prepare(accelerator: Accelerator, model: nn.Module, *objects: Any) -> tuple[Any, ...]:
    """``accelerator.prepare(model, *objects)`` for a model the library sharded.

    Collective, like ``accelerator.prepare``. Off accelerate's FSDP2 path it also routes
    the accelerator's checkpoint and weight calls (see the module's description).

    Args:
        accelerator: the run's ``Accelerator``.
        model: the sharded model.
        *objects: what else ``accelerator.prepare`` takes (at most one optimizer).

    Returns:
        ``(model, *prepared objects)``.

    Raises:
        TypeError: ``accelerator`` is not an ``Accelerator``.
        ValueError: ``model`` is not sharded by the library, or more than one optimizer
            is given.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {accelerator!r}")
    if not isinstance(model, nn.Module) or not any(
        isinstance(m, FSDPModule) for m in model.modules()
    ):
        raise ValueError(
            "prepare(accelerator, model, ...) needs a model sharded by the library "
            "(ModelParallelizer.parallelize or apply_plan); an unsharded model goes to "
            "accelerator.prepare"
        )
    if getattr(accelerator, "is_fsdp2", False):
        return tuple(accelerator.prepare(model, *objects))
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    if len(optimizers) > 1:
        raise ValueError(
            "prepare takes at most one optimizer (checkpointed with the model), got "
            f"{len(optimizers)}"
        )
    prepared: Any = accelerator.prepare(*objects) if objects else ()
    if len(objects) == 1:
        prepared = (prepared,)
    state = ShardedState(model, optimizers[0] if optimizers else None)
    if optimizers:
        inner = _inner(optimizers[0])
        inner.register_state_dict_post_hook(state.optimizer_state_dict)
        inner.register_load_state_dict_pre_hook(state.optimizer_load_state_dict)
    accelerator.register_save_state_pre_hook(state.before_save)
    accelerator.register_load_state_pre_hook(state.before_load)
    Accelerator.register_for_checkpointing(accelerator, state)
    _route_weight_calls(accelerator)
    logger.info(
        "accelerate prepared everything but the sharded model; save_state/load_state keep "
        "the model and optimizer in %s/",
        CHECKPOINT_DIR,
    )
    return (model, *prepared)


# accelerate's weight calls, bound to a prepared accelerator off the FSDP2 path; anything
# that holds no sharded tensor goes to accelerate's own method.


def _sharded_module(accelerator: Accelerator, model: object) -> nn.Module | None:
    """The module under accelerate's wrappers if it has FSDP units, else ``None``."""
    if not isinstance(model, nn.Module):
        return None
    inner = Accelerator.unwrap_model(accelerator, model, keep_torch_compile=False)
    if isinstance(inner, nn.Module) and any(isinstance(m, FSDPModule) for m in inner.modules()):
        return inner
    return None


def _sharded_optimizer(obj: object) -> bool:
    """Whether ``obj`` is an optimizer (accelerate's wrapper or torch's) over DTensors."""
    inner = getattr(obj, "optimizer", obj)
    if not isinstance(inner, torch.optim.Optimizer):
        return False
    return any(isinstance(p, DTensor) for group in inner.param_groups for p in group["params"])


def _dtensor_keys(obj: object, path: str = "") -> Iterator[str]:
    """The paths of the DTensors in nested mappings, lists and tuples."""
    if isinstance(obj, DTensor):
        yield path or "<the object>"
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _dtensor_keys(value, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _dtensor_keys(value, f"{path}[{index}]")


def _get_state_dict(self: Accelerator, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
    """A sharded model's as on the FSDP2 path: ``export_full_state_dict`` (collective)."""
    sharded = _sharded_module(self, model)
    if sharded is not None:
        return export_full_state_dict(sharded)
    if _sharded_optimizer(model):
        raise ValueError(
            "accelerator.get_state_dict takes a model; this optimizer holds one rank's shards "
            "of a sharded model. accelerator.save_state keeps it (with the model) in "
            f"{CHECKPOINT_DIR}/, or checkpoint it with fsdp_core.checkpoint.save_checkpoint"
        )
    state: dict[str, Any] = Accelerator.get_state_dict(self, model, unwrap=unwrap)
    return state


def _save_model(
    self: Accelerator,
    model: nn.Module,
    save_directory: str | os.PathLike[str],
    max_shard_size: int | str | None = None,
    safe_serialization: bool = True,
) -> None:
    """A sharded model goes to ``fsdp_core.hf.save_pretrained`` (collective)."""
    sharded = _sharded_module(self, model)
    if sharded is None:
        options: dict[str, Any] = {"safe_serialization": safe_serialization}
        if max_shard_size is not None:
            options["max_shard_size"] = max_shard_size
        Accelerator.save_model(self, model, save_directory, **options)
        return
    if safe_serialization is not True:
        raise ValueError(
            f"accelerator.save_model of a sharded model writes the library's export "
            f"(fsdp_core.hf.save_pretrained), in safetensors files only: "
            f"safe_serialization={safe_serialization!r} is refused (nothing was written). "
            "Leave it out, or gather the tensors with accelerator.get_state_dict(model) and "
            "write them with torch.save on the main process"
        )
    save_pretrained(
        sharded,
        save_directory,
        max_shard_size=DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size,
    )


def _save(
    self: Accelerator, obj: Any, f: str | os.PathLike[str], safe_serialization: bool = False
) -> None:
    """Refused for DTensors: the main process would write its shards as if whole."""
    found = list(_dtensor_keys(obj))
    if found:
        raise ValueError(
            f"accelerator.save of DTensor shards ({names_text(found, show=str)}): the main "
            "process would write its own shards only, in a file that looks whole. Save a "
            "model's weights with accelerator.get_state_dict(model) (whole tensors on the "
            "main process) or accelerator.save_model(model, directory); its optimizer with "
            f"accelerator.save_state (in {CHECKPOINT_DIR}/)"
        )
    Accelerator.save(self, obj, f, safe_serialization=safe_serialization)


def _register_for_checkpointing(self: Accelerator, *objects: Any) -> None:
    """Refused for a sharded model or its optimizer: accelerate would save rank 0's shards."""
    sharded = [
        type(obj).__name__
        for obj in objects
        if _sharded_module(self, obj) is not None or _sharded_optimizer(obj)
    ]
    if sharded:
        raise ValueError(
            f"register_for_checkpointing({', '.join(sharded)}): accelerate would save rank 0's "
            "shards of the sharded model and load them on every rank. accelerator.save_state "
            f"already keeps the model and the optimizer given to prepare in {CHECKPOINT_DIR}/; "
            "checkpoint other sharded objects with fsdp_core.checkpoint"
        )
    Accelerator.register_for_checkpointing(self, *objects)


def _route_weight_calls(accelerator: Accelerator) -> None:
    """Bind ``_save`` as ``accelerator.save`` and so on (a second ``prepare``: the same)."""
    for function in (_get_state_dict, _save_model, _save, _register_for_checkpointing):
        name = function.__name__[1:]
        accelerator.__dict__[name] = types.MethodType(function, accelerator)
