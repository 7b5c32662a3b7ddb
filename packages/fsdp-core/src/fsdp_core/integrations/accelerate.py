"""An accelerate training loop on a model the library sharded: ``prepare``.

``accelerator.prepare(model, ...)`` hands the model to accelerate, which decides by its
distributed type:

- with ``FullyShardedDataParallelPlugin(fsdp_version=2)`` (its FSDP2 path, on GPUs)
  accelerate sees an ``FSDPModule`` and passes it through unchanged; its
  ``save_state``/``load_state`` then write per-rank DCP checkpoints of their own;
- otherwise (no plugin, or any CPU run, where accelerate ignores the plugin) it wraps
  the model in ``DistributedDataParallel``, which cannot hold sharded parameters (the
  library's units refuse it with an error naming this module).

[`prepare`][fsdp_core.integrations.accelerate.prepare] does the right thing in both: on
the FSDP2 path it calls ``accelerator.prepare`` with everything; otherwise it prepares
everything but the model (optimizer, data loaders, schedulers: gradient accumulation,
``accelerator.backward``, ``clip_grad_norm_`` work as usual) and routes
``accelerator.save_state``/``load_state``: the model and the optimizer go through
[`fsdp_core.checkpoint`][fsdp_core.checkpoint] into ``CHECKPOINT_DIR`` of the state
directory (every rank writes its shards, atomically), accelerate saves the rest (its
scheduler, data loader, RNG states and step). accelerate's own optimizer file, which
would hold one rank's shards only (loaded on every rank, it silently corrupts the
optimizer), gets a placeholder instead. ``load_state`` of a directory without
``CHECKPOINT_DIR`` (written by accelerate alone) is refused on every rank before
anything is read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_core.checkpoint import load_checkpoint, save_checkpoint
from fsdp_core.integrations import IntegrationRequiredError

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
    import accelerate

    parts = accelerate.__version__.split(".")
    release = tuple(int(p) if p.isdigit() else 0 for p in [*parts, "0"][:2])
    if not (1, 16) <= release < (2, 0):
        raise ImportError(
            f"fsdp_core.integrations.accelerate supports accelerate{SUPPORTED_ACCELERATE}, found "
            f"{accelerate.__version__}"
        )


_check_release()


def _is_fsdp2(accelerator: Accelerator) -> bool:
    return bool(getattr(accelerator, "is_fsdp2", False))


class ShardedState:
    """The model and optimizer of an accelerate run, saved and loaded by the library.

    Registered by ``prepare`` (``accelerator.register_for_checkpointing``) with a save
    and a load pre-hook of the accelerator; not meant to be built by hand.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self._saving = False
        self._loading: Path | None = None

    # --- the accelerator's pre-hooks: before accelerate writes or reads anything
    def before_save(self, models: list[nn.Module], weights: list[Any], output_dir: str) -> None:
        save_checkpoint(Path(output_dir) / CHECKPOINT_DIR, self.model, self.optimizer)
        self._saving = True  # accelerate's optimizer file gets the placeholder

    def before_load(self, models: list[nn.Module], input_dir: str) -> None:
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

    # --- the optimizer's own hooks: accelerate's optimizer file is a placeholder
    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any] | None:
        if not self._saving:
            return None
        return {_PLACEHOLDER: CHECKPOINT_DIR, "state": {}, "param_groups": []}

    def optimizer_load_state_dict(
        self, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        if _PLACEHOLDER in state_dict:
            return optimizer.state_dict()  # read from CHECKPOINT_DIR by load_state_dict below
        return None

    # --- a checkpointed object of the accelerator: after its optimizers, on every rank
    def state_dict(self) -> dict[str, str]:
        self._saving = False
        return {"format": "fsdp_core.checkpoint", "directory": CHECKPOINT_DIR}

    def load_state_dict(self, state: Mapping[str, str]) -> None:
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

    Returns ``(model, *prepared objects)`` in the order given. Collective, like
    ``accelerator.prepare``. At most one optimizer may be given (it is checkpointed with
    the model).
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
    if _is_fsdp2(accelerator):
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
    accelerator.register_for_checkpointing(state)
    logger.info(
        "accelerate prepared everything but the sharded model; save_state/load_state keep "
        "the model and optimizer in %s/",
        CHECKPOINT_DIR,
    )
    return (model, *prepared)
