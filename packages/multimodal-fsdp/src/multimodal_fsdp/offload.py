"""CPU offload per part of a vision-language model: towers, projectors, the language model.

A frozen tower needs no gradient or optimizer state, so its shards can wait in host
memory while the language model trains on the device. The planner gives each unit the
policy of the part its parameters belong to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, get_args

from torch.distributed.fsdp import OffloadPolicy

from fsdp_core.plan import format_offload

__all__ = ["OFFLOAD_PARTS", "OffloadPart", "PartOffload"]

#: The parts a model splits into for offloading: discovered towers, discovered projectors,
#: and everything else (the language model, its embeddings and head: the root unit).
OffloadPart = Literal["tower", "projector", "language_model"]

OFFLOAD_PARTS: Final[tuple[OffloadPart, ...]] = get_args(OffloadPart)


@dataclass(frozen=True)
class PartOffload:
    """The offload policy of each part; ``None`` (or FSDP2's plain ``OffloadPolicy()``)
    keeps a part's shards on the device."""

    tower: OffloadPolicy | None = None
    projector: OffloadPolicy | None = None
    language_model: OffloadPolicy | None = None

    def __post_init__(self) -> None:
        for part in OFFLOAD_PARTS:
            value = getattr(self, part)
            if value is not None and not isinstance(value, OffloadPolicy):
                raise TypeError(
                    f"offload[{part!r}] must be an OffloadPolicy or None, "
                    f"got {type(value).__name__} ({value!r})"
                )
            if type(value) is OffloadPolicy:  # FSDP2's own "no offload"
                object.__setattr__(self, part, None)

    @classmethod
    def parse(cls, value: object) -> PartOffload:
        """``offload=`` as given: ``None``, one ``OffloadPolicy`` for every part, a mapping
        from part names to policies, or a ``PartOffload``.

        Args:
            value: the ``offload=`` option.

        Returns:
            The offload of each part.

        Raises:
            ValueError: a mapping names an unknown part (the message lists the valid ones).
            TypeError: anything else, or a mapped value that is not an ``OffloadPolicy``.
        """
        if value is None:
            return cls()
        if isinstance(value, PartOffload):
            return value
        if isinstance(value, OffloadPolicy):
            return cls(tower=value, projector=value, language_model=value)
        if not isinstance(value, Mapping):
            raise TypeError(
                "offload must be an OffloadPolicy, a mapping from parts "
                f"({', '.join(OFFLOAD_PARTS)}) to OffloadPolicy, a PartOffload or None, "
                f"got {type(value).__name__} ({value!r})"
            )
        for part in value:
            if part not in OFFLOAD_PARTS:
                raise ValueError(
                    f"unknown offload part {part!r}; valid parts: {', '.join(OFFLOAD_PARTS)}"
                )
        return cls(**{str(part): policy for part, policy in value.items()})

    def for_part(self, part: OffloadPart) -> OffloadPolicy | None:
        """The policy of ``part`` (``None``: on the device).

        Args:
            part: ``"tower"``, ``"projector"`` or ``"language_model"``.

        Returns:
            Its offload policy.
        """
        policy: OffloadPolicy | None = getattr(self, part)
        return policy

    @property
    def any(self) -> bool:
        """Whether any part is offloaded."""
        return any(self.for_part(part) is not None for part in OFFLOAD_PARTS)

    def label(self) -> str:
        """``tower=cpu, projector=-, language_model=-`` for plan notes and reports.

        Returns:
            The label.
        """
        return ", ".join(f"{part}={_offload_text(self.for_part(part))}" for part in OFFLOAD_PARTS)


def _offload_text(policy: OffloadPolicy | None) -> str:
    return "-" if policy is None else format_offload(policy)
