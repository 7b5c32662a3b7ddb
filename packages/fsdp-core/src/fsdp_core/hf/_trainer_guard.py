"""An unmodified transformers ``Trainer`` refuses a sharded model before any step.

Handed a model the library sharded, transformers' ``Trainer`` prepares it through
accelerate, which wraps it in ``DistributedDataParallel``: on CPU that crashes deep in
DTensor (``Cannot flatten unevenly sharded tensor``), on GPUs accelerate refuses the
DTensor parameters with advice about ``device_map``. Neither says what to do. Early in
its ``__init__`` the trainer asks the model whether it was sharded when loaded
(transformers' ``is_distributed_loading_by_transformers``, which reads a private
instance flag). Applying a plan sets that flag on the transformers model to a value
that reads ``False`` everywhere, as transformers' own default does, except in that
decision of ``Trainer.__init__``, where it raises
[`IntegrationRequiredError`][fsdp_core.integrations.IntegrationRequiredError] naming
``ShardedTrainer``. Every rank builds its trainer alike, so every rank raises, before
any collective. ``ShardedTrainer`` builds its base class inside
[`accepting_trainer`][fsdp_core.hf._trainer_guard.accepting_trainer], where the flag
reads ``False`` there too. Only transformers releases whose model classes have the flag
get it (the value is set where the class declares it).
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
    target = _lora.base_model(model)[0] if _lora.is_peft_model(model) else model
    if not _hf_model.is_hf_model(target) or not hasattr(type(target), tf.IS_DISTRIBUTED_LOADING):
        return False
    setattr(target, tf.IS_DISTRIBUTED_LOADING, SHARDED_BY_LIBRARY)
    logger.debug("transformers' Trainer is refused for %s", type(target).__name__)
    return True


def is_guarded(model: nn.Module) -> bool:
    """Whether applying a plan set the flag on ``model`` (or a peft model's base)."""
    target = _lora.base_model(model)[0] if _lora.is_peft_model(model) else model
    return vars(target).get(tf.IS_DISTRIBUTED_LOADING) is SHARDED_BY_LIBRARY


@contextmanager
def accepting_trainer() -> Iterator[None]:
    """Within: the flag reads ``False`` in ``Trainer.__init__`` too (``ShardedTrainer``)."""
    token = _ACCEPTING.set(True)
    try:
        yield
    finally:
        _ACCEPTING.reset(token)
