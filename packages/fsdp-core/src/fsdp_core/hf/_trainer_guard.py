"""An unmodified transformers ``Trainer`` refuses a sharded model before any step.

Given a model the library sharded, ``Trainer`` would wrap it in
``DistributedDataParallel`` through accelerate and fail deep in DTensor. Applying a plan
sets transformers' private "sharded when loaded" flag to a value that reads ``False``
everywhere except in ``Trainer.__init__``'s decision, where it raises
[`IntegrationRequiredError`][fsdp_core.integrations.IntegrationRequiredError] naming
``ShardedTrainer`` (on every rank alike, before any collective). ``ShardedTrainer``
builds its base class inside
[`accepting_trainer`][fsdp_core.hf._trainer_guard.accepting_trainer].
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from fsdp_core.hf import _hf_model, _lora
from fsdp_core.hf import _transformers as tf
from fsdp_core.integrations import IntegrationRequiredError

logger = logging.getLogger(__name__)

_ACCEPTING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fsdp_core_accepting_trainer", default=False
)

MESSAGE = (
    "this model is sharded by fsdp-core (FSDP2); transformers' Trainer would wrap it in "
    "DistributedDataParallel, which cannot hold sharded parameters. Use "
    "fsdp_core.integrations.transformers.ShardedTrainer (TRL: "
    "fsdp_core.integrations.trl.ShardedSFTTrainer) with the same arguments: it trains the "
    "sharded model as it is and saves checkpoints and exports through the library"
)


class _ShardedByLibrary:
    """transformers' "sharded when loaded" flag on a model the library sharded."""

    def __bool__(self) -> bool:
        caller = sys._getframe(1).f_globals.get("__name__")
        if caller == tf.TRAINER_MODULE and not _ACCEPTING.get():
            raise IntegrationRequiredError(MESSAGE)
        return False

    def __repr__(self) -> str:
        return "False  # sharded by fsdp-core: use fsdp_core.integrations.transformers"

    def __reduce__(self) -> str:
        return "SHARDED_BY_LIBRARY"  # one instance, also after pickling and deep copies


SHARDED_BY_LIBRARY = _ShardedByLibrary()


def mark_sharded_by_library(model: nn.Module) -> bool:
    """Set the flag on ``model`` (a peft model's base); False when no module declares it."""
    target = _lora.base_model(model)[0]
    if not _hf_model.is_hf_model(target) or not hasattr(type(target), tf.IS_DISTRIBUTED_LOADING):
        return False
    setattr(target, tf.IS_DISTRIBUTED_LOADING, SHARDED_BY_LIBRARY)
    logger.debug("transformers' Trainer is refused for %s", type(target).__name__)
    return True


def is_guarded(model: nn.Module) -> bool:
    """Whether applying a plan set the flag on ``model`` (or a peft model's base)."""
    return vars(_lora.base_model(model)[0]).get(tf.IS_DISTRIBUTED_LOADING) is SHARDED_BY_LIBRARY


@contextmanager
def accepting_trainer() -> Iterator[None]:
    """Within: the flag reads ``False`` in ``Trainer.__init__`` too (``ShardedTrainer``)."""
    token = _ACCEPTING.set(True)
    try:
        yield
    finally:
        _ACCEPTING.reset(token)
