"""A sharded unit refuses ``DistributedDataParallel`` with an error that says what to use.

Frameworks wrap the model they get in DDP (accelerate's ``prepare`` on CPU, Lightning's
DDP strategy), which fails deep in DTensor on FSDP2's sharded parameters. DDP first reads
the names of the parameters to leave alone from the module; every unit the library makes
answers with an object that raises
[`IntegrationRequiredError`][fsdp_core.integrations.IntegrationRequiredError] instead,
on every rank, before any collective.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from fsdp_core import internals
from fsdp_core.integrations import IntegrationRequiredError

__all__ = ["refuse_ddp"]

MESSAGE = (
    "DistributedDataParallel cannot wrap a model sharded by fsdp-core: its FSDP2 units "
    "already hold sharded parameters and reduce their gradients. transformers' Trainer: "
    "use fsdp_core.integrations.transformers.ShardedTrainer (TRL: "
    "fsdp_core.integrations.trl.ShardedSFTTrainer); accelerate: "
    "fsdp_core.integrations.accelerate.prepare(accelerator, model, optimizer, ...), which "
    "prepares everything but the model; a loop of your own: train the sharded model as it is"
)


class _RefuseDDP:
    """DDP's "parameters to ignore" of a sharded unit: iterating it refuses the wrap."""

    def __iter__(self) -> Iterator[str]:
        raise IntegrationRequiredError(MESSAGE)

    def __repr__(self) -> str:
        return "<sharded by fsdp-core: not for DistributedDataParallel>"

    def __reduce__(self) -> str:
        return "REFUSE_DDP"  # one instance, also after pickling and deep copies


REFUSE_DDP = _RefuseDDP()


def refuse_ddp(module: nn.Module) -> None:
    """Make ``DistributedDataParallel(module)`` raise the error above.

    Args:
        module: a sharded unit.
    """
    internals.set_ddp_ignored(module, REFUSE_DDP)
