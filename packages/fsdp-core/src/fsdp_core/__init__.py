"""fsdp-core: the base layer for sharding models with PyTorch FSDP2.

Process-group and mesh set-up, mixed-precision policies, dtype-safe units,
torch capability flags, and the [`ModelParallelizer`][fsdp_core.parallelizer.ModelParallelizer]
strategy base.
"""

from fsdp_core import compat
from fsdp_core.__about__ import __version__
from fsdp_core.accumulation import AccumulationWarmup, install_unshard_warmup
from fsdp_core.checkpoint import (
    export_full_state_dict,
    load_checkpoint,
    load_checkpoint_unsharded,
    save_checkpoint,
)
from fsdp_core.collective_entry import CollectiveCallError
from fsdp_core.comm import CollectiveRecord, CommCounter, collective_kind
from fsdp_core.containers import container_items, is_module_container, iter_layer_items
from fsdp_core.distributed import (
    VALID_BACKENDS,
    DistributedContext,
    destroy_distributed,
    device_type_for_backend,
    exit_rank,
    init_distributed,
)
from fsdp_core.dtype_units import (
    DtypeIsland,
    MixedDtypeError,
    dominant_dtype,
    find_dtype_islands,
    fully_shard_dtype_safe,
    group_islands,
    shard_groups_then_module,
)
from fsdp_core.internals import FSDPInternalsError, check_internals
from fsdp_core.materialize import copy_full_into_, load_full_state_dict, materialize_from_full
from fsdp_core.mesh import MeshShape, build_mesh, resolve_mesh_shape
from fsdp_core.mesh_collectives import all_reduce_max_over_mesh, mesh_device, mesh_groups
from fsdp_core.module_tree import ModuleTreeChangedError, ModuleTreeFingerprint
from fsdp_core.parallelizer import (
    ModelParallelizer,
    PlanContext,
    PlanMismatchError,
    check_applied_units,
    parameter_names,
)
from fsdp_core.plan import (
    ShardCall,
    ShardingPlan,
    UnitPlan,
    format_policy,
    unit_parameters,
)
from fsdp_core.precision import (
    DTYPE_ALIASES,
    compute_dtype,
    default_mp_policy,
    fp32_island_policy,
    island_policy,
    mixed_precision_policy,
    parse_dtype,
)
from fsdp_core.runtime import (
    BackwardWatch,
    HookPlan,
    InstalledHook,
    installed_hooks,
    register_installed_hook,
    remove_runtime_hooks,
)
from fsdp_core.sharding import (
    apply_fully_shard,
    check_reshard_after_forward,
    is_sharded,
    owned_ignored_params,
    shard_group_size,
)
from fsdp_core.sizes import parse_size
from fsdp_core.stale_optimizer import StaleOptimizerError
from fsdp_core.unused_params import UnusedParamsHook, install_unused_params_hook

__all__ = [
    "parse_size",
    "exit_rank",
    "shard_groups_then_module",
    "copy_full_into_",
    "export_full_state_dict",
    "load_checkpoint",
    "load_checkpoint_unsharded",
    "load_full_state_dict",
    "materialize_from_full",
    "save_checkpoint",
    "install_unshard_warmup",
    "AccumulationWarmup",
    "UnusedParamsHook",
    "install_unused_params_hook",
    "HookPlan",
    "InstalledHook",
    "BackwardWatch",
    "installed_hooks",
    "register_installed_hook",
    "remove_runtime_hooks",
    "FSDPInternalsError",
    "check_internals",
    "check_applied_units",
    "PlanMismatchError",
    "ModuleTreeChangedError",
    "ModuleTreeFingerprint",
    "StaleOptimizerError",
    "all_reduce_max_over_mesh",
    "mesh_device",
    "mesh_groups",
    "CollectiveCallError",
    "CollectiveRecord",
    "CommCounter",
    "collective_kind",
    "DTYPE_ALIASES",
    "VALID_BACKENDS",
    "DistributedContext",
    "DtypeIsland",
    "MeshShape",
    "MixedDtypeError",
    "ModelParallelizer",
    "PlanContext",
    "ShardCall",
    "ShardingPlan",
    "UnitPlan",
    "__version__",
    "apply_fully_shard",
    "build_mesh",
    "check_reshard_after_forward",
    "compat",
    "compute_dtype",
    "container_items",
    "default_mp_policy",
    "destroy_distributed",
    "device_type_for_backend",
    "dominant_dtype",
    "find_dtype_islands",
    "format_policy",
    "fp32_island_policy",
    "fully_shard_dtype_safe",
    "group_islands",
    "init_distributed",
    "is_module_container",
    "is_sharded",
    "island_policy",
    "iter_layer_items",
    "mixed_precision_policy",
    "owned_ignored_params",
    "parameter_names",
    "parse_dtype",
    "resolve_mesh_shape",
    "shard_group_size",
    "unit_parameters",
]
