"""What the ``balance_media`` hook plans, as data below the hook: its members and sizes.

The hook ([`multimodal_fsdp.runtime.balance_media`][multimodal_fsdp.runtime.balance_media],
which publishes these types) and the estimates both need them, so they live below both;
``BalancePlanned`` is what the estimates read of a planned hook without importing it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_core.containers import is_under
from fsdp_core.parallel_dims import holds_same_batch
from multimodal_fsdp.balance.layouts import CallSpec
from multimodal_fsdp.balance.traffic import exchange_traffic

if TYPE_CHECKING:
    from multimodal_fsdp.balance._step_media import StepMedia

__all__ = [
    "AUTO_GROUP_RANKS",
    "BALANCE_MEDIA",
    "DECISION_BYTES",
    "BalancePlanned",
    "BalancedTower",
    "JoinedModule",
    "Removable",
    "auto_group_size",
    "blob_words",
    "group_size",
    "sharded_on_data_group",
]

#: The hook's name in plans, ``disabled_hooks=`` and ``installed_hooks``.
BALANCE_MEDIA: Final = "balance_media"

#: Bytes of the decision all_reduce per joined layer and forward (4 int64).
DECISION_BYTES: Final = 32


def blob_words(blob_bytes: int) -> int:
    """int64 words of the all_reduce that carries a call's description."""
    return math.ceil(blob_bytes / 8)


@dataclass(frozen=True)
class BalancedTower:
    """One balanced tower as planned: its module path (an encoder inside the discovered
    tower when the tower's calls cannot be cut by item), its layout's name, whether it
    owns FSDP units (then a rank with nothing to encode runs a placeholder), whether it
    is trainable (its output gradients go back through the exchange)."""

    path: str
    layout: str
    run_when_empty: bool
    trainable: bool
    #: What the plan-time probe found for the layout (``LayoutChoice.describe``).
    probe: str = ""

    def collectives_per_call(self) -> dict[str, int]:
        """The collectives of one call that moves items, as
        [`exchange_traffic`][multimodal_fsdp.balance.traffic.exchange_traffic] counts them
        (inputs that need a gradient add one more).

        Returns:
            ``{"phase kind": count}``, e.g. ``"forward all_to_all"``.
        """
        moved = [[1, 1], []]  # two items on one rank: one of them moves
        rounds = exchange_traffic(
            moved,
            rank=0,
            spec=CallSpec(fields=("pixel_values",)),
            input_bytes=moved,
            output_bytes=moved,
            output_grad_bytes=moved if self.trainable else None,
            output_tensors=1,
        )
        counts: dict[str, int] = {}
        for collective in rounds:
            key = f"{collective.phase} {collective.kind}"
            counts[key] = counts.get(key, 0) + 1
        return counts


@dataclass(frozen=True)
class JoinedModule:
    """A module with FSDP units that only ranks with media call (a projector with
    layers): its calls go through the rounds unbalanced, and a rank without the call runs
    it on a placeholder in the same round, so its units' collectives match."""

    path: str
    trainable: bool


#: ``balance_media_group="auto"`` balances within blocks of at most this many
#: data-parallel ranks: a call's host work grows with its group (docs/benchmark.md 8b).
AUTO_GROUP_RANKS: Final = 64


def auto_group_size(ranks: int) -> int:
    """The block size ``"auto"`` balances within on ``ranks`` data-parallel ranks: all up
    to ``AUTO_GROUP_RANKS``; above, the largest divisor up to it when at least half of it,
    else the smallest divisor above it (equal blocks, never under half the bound)."""
    if ranks <= AUTO_GROUP_RANKS:
        return ranks
    below = max(d for d in range(1, AUTO_GROUP_RANKS + 1) if ranks % d == 0)
    if 2 * below >= AUTO_GROUP_RANKS:
        return below
    return next(d for d in range(AUTO_GROUP_RANKS + 1, ranks + 1) if ranks % d == 0)


def group_size(group: str | int, world_size: int, dp_replicate: int = 1) -> int:
    """The ranks of one balance group (``"auto"``, ``"all"``, ``"shard"``, ``"replicate"``
    or a block size) on a mesh of ``world_size`` ranks with ``dp_replicate`` replicas."""
    if group == "auto":
        return auto_group_size(world_size)
    if group == "all":
        return world_size
    if group == "shard":
        return world_size // dp_replicate
    if group == "replicate":
        return dp_replicate
    if not isinstance(group, int) or world_size % group:
        raise ValueError(f"balance_media_group={group!r} must divide the {world_size} ranks")
    return group


def sharded_on_data_group(model: nn.Module, paths: Sequence[str]) -> tuple[str, ...]:
    """Of ``paths``, those with a DTensor parameter on a mesh dimension whose ranks hold
    the same batch (tensor-parallelised): their TP collectives need the same items on a
    data group's ranks, so the group cannot share their encoding.

    Args:
        model: the planned model.
        paths: module paths in ``model``.

    Returns:
        The paths sharded on a data-group dimension, in the given order.
    """
    sharded = [
        name
        for name, param in model.named_parameters()
        if isinstance(param, DTensor)
        and any(holds_same_batch(dim) for dim in param.device_mesh.mesh_dim_names or ())
    ]
    return tuple(path for path in paths if any(is_under(name, path) for name in sharded))


class Removable(Protocol):
    """Something installed on a module that can be taken off again."""

    def remove(self) -> None: ...


@runtime_checkable
class BalancePlanned(Protocol):
    """What the estimates read of a planned ``balance_media`` hook: its plan data, and the
    joined layers replayed on a one-process copy of the model."""

    @property
    def towers(self) -> tuple[BalancedTower, ...]: ...

    @property
    def joined(self) -> tuple[JoinedModule, ...]: ...

    @property
    def layers(self) -> tuple[str, ...]: ...

    @property
    def group(self) -> str | int: ...

    @property
    def sharded_on_data_group(self) -> tuple[str, ...]:
        """The members sharded on a data-group dimension (``sharded_on_data_group``)."""
        ...

    def replay_layers(self, model: nn.Module, media: StepMedia) -> Removable | None:
        """The joined layers on ``model`` (an unsharded copy), decisions read from
        ``media``; ``None`` when nothing needs replaying."""
        ...
