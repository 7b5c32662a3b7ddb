"""TRL's ``SFTTrainer`` on a model the library sharded: ``ShardedSFTTrainer``.

``SFTTrainer`` with the behaviour of
[`ShardedTrainer`][fsdp_core.integrations.transformers.ShardedTrainer]. The model
arrives sharded, its adapters already in it (``peft.get_peft_model`` before sharding):
an adapter added after sharding would sit outside FSDP.
"""

from __future__ import annotations

from typing import Any

from fsdp_core.integrations import _require_release
from fsdp_core.integrations.transformers import ShardedTrainerMixin

try:
    from trl.trainer.sft_trainer import SFTTrainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError('fsdp_core.integrations.trl needs TRL: pip install "fsdp-core[trl]"') from exc

__all__ = ["SUPPORTED_TRL", "ShardedSFTTrainer"]

#: The TRL releases this module is written and tested for (its extra's range).
SUPPORTED_TRL = ">=1.16,<2"


def _check_release() -> None:
    _require_release("trl", SUPPORTED_TRL, (1, 16), 2)


_check_release()


class ShardedSFTTrainer(ShardedTrainerMixin, SFTTrainer):  # type: ignore[misc,unused-ignore]
    """``trl.SFTTrainer`` for a model the library sharded (same arguments, no ``peft_config``).

    Args:
        *args: ``SFTTrainer``'s arguments.
        **kwargs: ``SFTTrainer``'s keyword arguments, without ``peft_config``.

    Raises:
        ValueError: ``peft_config`` is given (add adapters before sharding).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("peft_config") is not None:
            raise ValueError(
                "ShardedSFTTrainer got peft_config=, but the model is already sharded: adapters "
                "added now would sit outside FSDP. Add them before sharding "
                "(peft.get_peft_model(model, config), then parallelize) and pass the PeftModel"
            )
        super().__init__(*args, **kwargs)
