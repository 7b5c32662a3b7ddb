"""multimodal-fsdp: FSDP2 sharding for vision/audio-language models.

Finds towers and projectors, applies the frozen-tower policy (``root``,
``per_layer``, ``replicate``) and shards layer containers item by item.
"""

from multimodal_fsdp.__about__ import __version__
from multimodal_fsdp.choose import (
    MemoryBudgetError,
    PolicyCandidate,
    PolicyChoice,
    choose_frozen_policy,
)
from multimodal_fsdp.collectives import CommTally
from multimodal_fsdp.conditional import find_media_conditional_layers
from multimodal_fsdp.costs import PlanCosts, UnitCost, inspect_model, plan_costs
from multimodal_fsdp.discovery import (
    MEDIA_FEATURE_INPUTS,
    MEDIA_INPUTS,
    MULTIMODAL_MODULE_NAMES,
    MULTIMODAL_PROJECTOR_NAMES,
    MULTIMODAL_TOWER_NAMES,
    MultimodalModule,
    is_multimodal_module_name,
    iter_multimodal_modules,
    resolve_multimodal_modules,
)
from multimodal_fsdp.layers import (
    _container_items,
    _is_module_container,
    _shard_layer_containers_recursively,
    shard_multimodal_module,
)
from multimodal_fsdp.measure import Comparison, Measurement, compare, measure_plan, measure_step
from multimodal_fsdp.parallelizer import MultimodalParallelizer
from multimodal_fsdp.parts import MultimodalParts, split_frozen_parts
from multimodal_fsdp.policy import (
    VALID_FROZEN_MULTIMODAL_SHARDING,
    FrozenMultimodalSharding,
    FrozenShardingSpec,
    ignored_params_for_root,
    module_is_fully_frozen,
    module_parameters,
    normalize_frozen_multimodal_sharding,
)
from multimodal_fsdp.prefetch import guard_backward_prefetch, remove_backward_prefetch_guard
from multimodal_fsdp.rewrite import ungroup_units
from multimodal_fsdp.uneven import (
    DEFAULT_MEDIA_INPUTS,
    MediaRegion,
    ScheduleCheck,
    ScheduleLayout,
    UnevenMediaError,
    install_schedule_check,
    plan_schedule_layout,
)
from multimodal_fsdp.validation import check_attribute_names, check_module_paths

__all__ = [
    "CommTally",
    "PlanCosts",
    "UnitCost",
    "inspect_model",
    "plan_costs",
    "ungroup_units",
    "Comparison",
    "Measurement",
    "compare",
    "measure_plan",
    "measure_step",
    "guard_backward_prefetch",
    "remove_backward_prefetch_guard",
    "DEFAULT_MEDIA_INPUTS",
    "UnevenMediaError",
    "MediaRegion",
    "ScheduleCheck",
    "ScheduleLayout",
    "install_schedule_check",
    "plan_schedule_layout",
    "find_media_conditional_layers",
    "MEDIA_FEATURE_INPUTS",
    "MEDIA_INPUTS",
    "MULTIMODAL_MODULE_NAMES",
    "MULTIMODAL_PROJECTOR_NAMES",
    "MULTIMODAL_TOWER_NAMES",
    "VALID_FROZEN_MULTIMODAL_SHARDING",
    "FrozenMultimodalSharding",
    "FrozenShardingSpec",
    "MemoryBudgetError",
    "PolicyCandidate",
    "PolicyChoice",
    "choose_frozen_policy",
    "MultimodalModule",
    "MultimodalParallelizer",
    "MultimodalParts",
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
    "resolve_multimodal_modules",
    "shard_multimodal_module",
    "split_frozen_parts",
    "check_attribute_names",
    "check_module_paths",
]
