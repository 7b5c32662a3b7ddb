"""multimodal-fsdp: FSDP2 sharding for vision/audio-language models.

Finds towers and projectors, applies the frozen-tower policy (``root``,
``per_layer``, ``replicate``) and shards layer containers item by item.
"""

from typing import Any

from torch import nn

from multimodal_fsdp.__about__ import __version__
from multimodal_fsdp.discovery.names import (
    MULTIMODAL_MODULE_NAMES,
    MULTIMODAL_PROJECTOR_NAMES,
    MULTIMODAL_TOWER_NAMES,
    is_multimodal_module_name,
)
from multimodal_fsdp.discovery.walk import iter_multimodal_modules, resolve_multimodal_modules
from multimodal_fsdp.estimate import choose as _choose
from multimodal_fsdp.estimate.choose import MemoryBudgetError, PolicyChoice, PolicyPlanner
from multimodal_fsdp.estimate.costs import plan_costs
from multimodal_fsdp.layers import (
    _container_items,
    _is_module_container,
    _shard_layer_containers_recursively,
    shard_multimodal_module,
)
from multimodal_fsdp.measure.comm import measure_plan
from multimodal_fsdp.parallelizer import MultimodalParallelizer
from multimodal_fsdp.policy import (
    VALID_FROZEN_MULTIMODAL_SHARDING,
    FrozenMultimodalSharding,
    ignored_params_for_root,
    module_is_fully_frozen,
    module_parameters,
    normalize_frozen_multimodal_sharding,
)
from multimodal_fsdp.runtime.schedule_check import UnevenMediaError

__all__ = [
    "__version__",
    "_container_items",
    "_is_module_container",
    "_shard_layer_containers_recursively",
    "ignored_params_for_root",
    "is_multimodal_module_name",
    "iter_multimodal_modules",
    "module_is_fully_frozen",
    "module_parameters",
    "normalize_frozen_multimodal_sharding",
    "shard_multimodal_module",
    "FrozenMultimodalSharding",
    "MULTIMODAL_MODULE_NAMES",
    "MULTIMODAL_PROJECTOR_NAMES",
    "MULTIMODAL_TOWER_NAMES",
    "VALID_FROZEN_MULTIMODAL_SHARDING",
    "MultimodalParallelizer",
    "resolve_multimodal_modules",
    "UnevenMediaError",
    "choose_frozen_policy",
    "MemoryBudgetError",
    "plan_costs",
    "measure_plan",
]


def choose_frozen_policy(
    model: nn.Module,
    budget: int | str,
    *,
    parallelizer: PolicyPlanner | None = None,
    **options: Any,
) -> PolicyChoice:
    """[`multimodal_fsdp.estimate.choose.choose_frozen_policy`][multimodal_fsdp.estimate.choose.choose_frozen_policy]
    with a default ``MultimodalParallelizer()``.

    Args:
        model: the model (on ``meta`` is enough).
        budget: the per-rank memory budget, bytes or e.g. ``"40GiB"``.
        parallelizer: the planner of the alternatives (``MultimodalParallelizer()`` if None).
        **options: the chooser's other options.

    Returns:
        The chosen policies, the parallelizer and plan that apply them, and every
        candidate considered.
    """
    planner = MultimodalParallelizer() if parallelizer is None else parallelizer
    return _choose.choose_frozen_policy(model, budget, parallelizer=planner, **options)
