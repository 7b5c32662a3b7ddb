"""What planning hooks read and return in a
[`ModelParallelizer`][fsdp_core.parallelizer.ModelParallelizer]'s one planning pass: the
[`PlanContext`][fsdp_core.plan_context.PlanContext] and, from ``_plan_additions``, the
[`PlanAdditions`][fsdp_core.plan_context.PlanAdditions] a subclass decides beside the calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from typing_extensions import TypeVar

from fsdp_core.containers import is_under, join_path

__all__ = ["FoundT", "PlanAdditions", "PlanContext"]

#: What a parallelizer finds in a model before planning (``PlanContext.found``): a
#: multimodal parallelizer's ``Discovery``; ``None`` for a plain ``ModelParallelizer``.
FoundT = TypeVar("FoundT", default=None)


@dataclass
class PlanContext(Generic[FoundT]):
    """What planning hooks may read, and the modules already given to a unit."""

    model: nn.Module
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int | None
    ignored_param_names: frozenset[str]
    #: What the parallelizer found in the model before planning (see ``FoundT``).
    found: FoundT
    planned: set[int] = field(default_factory=set)
    #: Parameters kept whole on every rank (``_replicated_param_names``; all ignored).
    replicated_param_names: tuple[str, ...] = ()

    def is_planned(self, module: nn.Module) -> bool:
        """Whether an earlier planning step made ``module`` (part of) a unit.

        Args:
            module: a submodule of the planned model.

        Returns:
            Whether it is planned.
        """
        return id(module) in self.planned

    def mark(self, paths: Iterable[str]) -> None:
        """Record the modules at ``paths`` as planned units, so later steps skip them.

        Args:
            paths: qualified module names.
        """
        for path in paths:
            self.planned.add(id(self.module(path)))

    def module(self, path: str) -> nn.Module:
        """The submodule at ``path`` (the model itself for ``""``).

        Args:
            path: a qualified module name.

        Returns:
            The module.
        """
        return self.model.get_submodule(path) if path else self.model

    def ignored_under(self, paths: Iterable[str]) -> tuple[str, ...]:
        """Ignored parameters of the modules at ``paths``.

        Args:
            paths: qualified module names.

        Returns:
            The ignored parameters' names, sorted.
        """
        roots = tuple(paths)
        names = (n for n in self.ignored_param_names if any(is_under(n, root) for root in roots))
        return tuple(sorted(names))

    def has_unplanned_params(self, path: str) -> bool:
        """Whether a unit at ``path`` would own any parameter (not ignored, not taken).

        Args:
            path: a qualified module name.

        Returns:
            Whether some parameter under it is neither ignored nor in a unit yet.
        """
        parts = path.split(".") if path else []
        for depth in range(len(parts)):
            if self.is_planned(self.module(".".join(parts[:depth]))):
                return False  # an ancestor unit already owns everything below it

        def visit(module: nn.Module, prefix: str) -> bool:
            if self.is_planned(module):
                return False
            own = module.named_parameters(prefix=prefix, recurse=False)
            return any(name not in self.ignored_param_names for name, _ in own) or any(
                visit(child, join_path(prefix, key)) for key, child in module.named_children()
            )

        return visit(self.module(path), path)


@dataclass(frozen=True)
class PlanAdditions:
    """What a subclass decides beside the units, in the same pass: each field is the
    [`ShardingPlan`][fsdp_core.plan.ShardingPlan] field of the same name."""

    replicated_param_dtypes: tuple[tuple[str, torch.dtype], ...] = ()
    backward_free_paths: tuple[str, ...] | None = None
    sync_replicated: bool = True
    records: tuple[object, ...] = ()
