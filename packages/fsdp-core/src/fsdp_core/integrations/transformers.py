"""transformers' ``Trainer`` on a model the library sharded: ``ShardedTrainer``.

Shard the model first (adapters added, ``parallelize``, weights loaded), then give it to
``ShardedTrainer`` with ``Trainer``'s arguments. Against ``Trainer``: no
``DistributedDataParallel`` and no device move; gradient accumulation defers the
reduce-scatter to a step's last micro-batch; ``save_model`` writes the library's export
(``fsdp_core.hf.save_pretrained``); each checkpoint holds the model and optimizer as one
sharded DCP checkpoint in ``CHECKPOINT_DIR``, which resuming and
``load_best_model_at_end`` read back; ``predict()`` leaves media towers' outputs out of
its gathers (they exist only on ranks with media) and every unit is resharded after an
evaluation. The private ``Trainer`` members used are checked at import and construction
(``SUPPORTED_TRANSFORMERS``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_core.checkpoint import load_checkpoint, save_checkpoint
from fsdp_core.hf import _trainer_guard, load_pretrained
from fsdp_core.hf._hf_model import is_hf_model
from fsdp_core.hf._lora import base_model
from fsdp_core.integrations import _require_release

try:
    import transformers
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fsdp_core.integrations.transformers needs transformers: "
        'pip install "fsdp-core[transformers]"'
    ) from exc

__all__ = [
    "CHECKPOINT_DIR",
    "SUPPORTED_TRANSFORMERS",
    "ShardedTrainerMixin",
    "ShardedTrainer",
    "check_sharded_model",
]

logger = logging.getLogger(__name__)

#: The transformers releases this module is written and tested for (its extra's range).
SUPPORTED_TRANSFORMERS = ">=5,<6"
#: The sub-directory of a checkpoint holding the sharded model and optimizer (DCP).
CHECKPOINT_DIR = "fsdp_checkpoint"
#: Trainer's file names for the scheduler and a one-file optimizer state.
_SCHEDULER_FILE = "scheduler.pt"
_OPTIMIZER_FILE = "optimizer.pt"
#: Trainer's attribute for "the model owns its sharding": no DDP, no device move, the
#: non-writer ranks join ``save_pretrained``.
_OWNS_SHARDING = "is_distributed_loading_by_transformers"


def _check_release() -> None:
    _require_release("transformers", SUPPORTED_TRANSFORMERS, (5, 0), 6)


_check_release()


def check_sharded_model(model: object, *, trainer: str = "ShardedTrainer") -> nn.Module:
    """``model`` if it is a transformers or peft model with FSDP units; else a clear error.

    Args:
        model: what the trainer was given.
        trainer: the trainer's name, for the messages.

    Returns:
        ``model``.

    Raises:
        TypeError: ``model`` is a name, not a module, or not a transformers/peft model.
        ValueError: ``model`` has no FSDP unit (not sharded by the library).
    """
    if isinstance(model, str):
        raise TypeError(
            f"{trainer} takes the sharded model, not a name ({model!r}): load it, add "
            "adapters, parallelize it, then pass it"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"{trainer} needs model=, a sharded nn.Module; got {type(model).__name__}")
    if not is_hf_model(base_model(model)[0]):
        raise TypeError(
            f"{trainer} trains transformers and peft models (it exports them with "
            f"save_pretrained); got {type(model).__name__}. Train other models with your own "
            "loop and fsdp_core.checkpoint"
        )
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError(
            f"{trainer} needs a model sharded by the library (ModelParallelizer.parallelize "
            f"or apply_plan); {type(model).__name__} has no FSDP unit. An unsharded model "
            "trains with transformers' Trainer"
        )
    return model


#: Output names of media towers: present only on ranks whose batch has that media.
MEDIA_OUTPUT_PREFIXES = ("image_", "video_", "audio_", "vision_")


class _WithoutMediaOutputs(list[str]):
    """Trainer's ``ignore_keys`` (``key not in ignore_keys + ["loss"]``) plus media outputs."""

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or (
            isinstance(key, str) and key.startswith(MEDIA_OUTPUT_PREFIXES)
        )

    def __add__(self, other: list[str]) -> _WithoutMediaOutputs:  # type: ignore[override]
        return _WithoutMediaOutputs([*self, *other])


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class ShardedTrainerMixin:
    """Makes a ``transformers.Trainer`` subclass train a model the library sharded.

    Put it first among the bases: ``class MyTrainer(ShardedTrainerMixin, SomeTrainer)``.

    Args:
        *args: the trainer's own arguments.
        **kwargs: the trainer's own keyword arguments (``model`` is the sharded model).

    Raises:
        ValueError: ``model_init`` is given (it would build an unsharded model).
        ImportError: this transformers' ``Trainer`` is not one the mixin supports.
    """

    #: Set by ``__init__``: every FSDP unit of the model, for gradient accumulation.
    _sharded_units: list[FSDPModule]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        name = type(self).__name__
        if kwargs.get("model_init") is not None:
            raise ValueError(
                f"{name} trains the model it is given, sharded; model_init would build an "
                "unsharded one per run"
            )
        model = kwargs["model"] if "model" in kwargs else (args[0] if args else None)
        check_sharded_model(model, trainer=name)
        with _trainer_guard.accepting_trainer():
            super().__init__(*args, **kwargs)
        if not hasattr(self, _OWNS_SHARDING):
            raise ImportError(
                f"this transformers ({transformers.__version__}) Trainer has no "
                f"{_OWNS_SHARDING!r}; {name} supports transformers{SUPPORTED_TRANSFORMERS}"
            )
        # Trainer's own path for a model that owns its sharding (no DDP)
        setattr(self, _OWNS_SHARDING, True)
        trainer_model: nn.Module = self.model  # type: ignore[attr-defined]
        self._sharded_units = _units(trainer_model)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """FSDP2 placed the shards; ``.to()`` would fail on offloaded ones."""

    @contextmanager
    def _defer_fsdp_gradient_reduction(self) -> Iterator[None]:
        """No reduce-scatter in a step's non-last micro-batches (Trainer's own reads a
        ``DistributedConfig`` a model the library sharded has not)."""
        for unit in self._sharded_units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in self._sharded_units:
                unit.set_requires_gradient_sync(True, recurse=False)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's loop (``evaluate()``, ``predict()``), then every unit resharded.

        Units that do not reshard after forward (the root) would stay gathered.

        Args:
            *args: as ``Trainer.evaluation_loop`` takes them.
            **kwargs: as ``Trainer.evaluation_loop`` takes them.

        Returns:
            What ``Trainer.evaluation_loop`` returns.
        """
        try:
            return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]
        finally:
            for unit in self._sharded_units:
                unit.reshard()

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> Any:
        """Trainer's step; by default without the outputs of media towers.

        A tower's output (``image_*``, ``video_*``, ``audio_*``, ``vision_*``) exists only
        on ranks with that media, so ``predict()``'s gathers would not match.

        Args:
            model: the model.
            inputs: the batch.
            prediction_loss_only: as in ``Trainer.prediction_step``.
            ignore_keys: output names to leave out (the media outputs if None).

        Returns:
            What ``Trainer.prediction_step`` returns.
        """
        if ignore_keys is None:
            config = getattr(self.model, "config", None)  # type: ignore[attr-defined]
            ignore_keys = _WithoutMediaOutputs(
                getattr(config, "keys_to_ignore_at_inference", ["cache"])
            )
        return super().prediction_step(  # type: ignore[misc]
            model, inputs, prediction_loss_only, ignore_keys=ignore_keys
        )

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Model and optimizer as one sharded DCP checkpoint; the scheduler as Trainer does."""
        state: Any = self.state  # type: ignore[attr-defined]
        save_checkpoint(
            Path(output_dir) / CHECKPOINT_DIR,
            self.model,  # type: ignore[attr-defined]
            self.optimizer,  # type: ignore[attr-defined]
            step=int(state.global_step),
        )
        scheduler = self.lr_scheduler  # type: ignore[attr-defined]
        if self.args.should_save and scheduler is not None:  # type: ignore[attr-defined]
            torch.save(scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_FILE))

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        """Weights from the DCP checkpoint (with the optimizer), else from the export."""
        if (Path(resume_from_checkpoint) / CHECKPOINT_DIR).is_dir():
            return  # read with the optimizer, once it exists
        target = self.model if model is None else model  # type: ignore[attr-defined]
        load_pretrained(target, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        sharded = Path(checkpoint) / CHECKPOINT_DIR
        if not sharded.is_dir():
            if (Path(checkpoint) / _OPTIMIZER_FILE).is_file():
                raise ValueError(
                    f"{checkpoint} holds a one-file optimizer state ({_OPTIMIZER_FILE}), written "
                    "by a trainer that saved one rank's shards; it cannot resume a sharded "
                    f"model. {type(self).__name__} checkpoints keep it in {CHECKPOINT_DIR}/"
                )
            logger.warning(
                "%s has no %s/ (saved with save_only_model=True?): the optimizer starts anew",
                checkpoint,
                CHECKPOINT_DIR,
            )
            return
        load_checkpoint(sharded, self.model, self.optimizer)  # type: ignore[attr-defined]
        scheduler_file = Path(checkpoint) / _SCHEDULER_FILE
        scheduler = self.lr_scheduler  # type: ignore[attr-defined]
        if scheduler is not None and scheduler_file.is_file():
            scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))

    def _load_best_model(self) -> None:
        state: Any = self.state  # type: ignore[attr-defined]
        best = Path(state.best_model_checkpoint)
        if (best / CHECKPOINT_DIR).is_dir():
            load_checkpoint(best / CHECKPOINT_DIR, self.model)  # type: ignore[attr-defined]
        else:
            load_pretrained(self.model, best)  # type: ignore[attr-defined]


def _check_overrides() -> None:
    """Every private Trainer method the mixin overrides exists in this transformers."""
    private = [
        name
        for name, value in vars(ShardedTrainerMixin).items()
        if name.startswith("_") and not name.startswith("__") and callable(value)
    ]
    missing = [name for name in private if not hasattr(Trainer, name)]
    if missing:
        raise ImportError(
            f"this transformers ({transformers.__version__}) Trainer lacks {missing}, which "
            "fsdp_core.integrations.transformers overrides; supported: "
            f"transformers{SUPPORTED_TRANSFORMERS}"
        )


_check_overrides()


class ShardedTrainer(ShardedTrainerMixin, Trainer):  # type: ignore[misc,unused-ignore]
    """``transformers.Trainer`` for a model the library sharded (same arguments)."""
