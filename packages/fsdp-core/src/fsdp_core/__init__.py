"""fsdp-core: the base layer for sharding models with PyTorch FSDP2.

Process-group and mesh set-up, mixed-precision policies, dtype-safe units,
torch capability flags, and the [`ModelParallelizer`][fsdp_core.parallelizer.ModelParallelizer]
strategy base.
"""

from fsdp_core import compat
from fsdp_core.__about__ import __version__
from fsdp_core.checkpoint import (
    export_full_state_dict,
    load_checkpoint,
    load_checkpoint_unsharded,
    load_stage_checkpoint,
    save_checkpoint,
)
from fsdp_core.collective_count import CommCounter
from fsdp_core.distributed import (
    DistributedContext,
    destroy_distributed,
    exit_rank,
    init_distributed,
)
from fsdp_core.dtype_units import MixedDtypeError
from fsdp_core.internals import FSDPInternalsError
from fsdp_core.materialize import load_full_state_dict, materialize_from_full
from fsdp_core.mesh import build_mesh
from fsdp_core.module_tree import ModuleTreeChangedError
from fsdp_core.parallelizer import ModelParallelizer, PlanMismatchError
from fsdp_core.plan import ShardingPlan
from fsdp_core.precision import fp32_island_policy, mixed_precision_policy
from fsdp_core.rank_agreement import CollectiveCallError
from fsdp_core.stale_optimizer import StaleOptimizerError

__all__ = [
    "__version__",
    "init_distributed",
    "destroy_distributed",
    "exit_rank",
    "DistributedContext",
    "build_mesh",
    "mixed_precision_policy",
    "fp32_island_policy",
    "ModelParallelizer",
    "ShardingPlan",
    "save_checkpoint",
    "load_checkpoint",
    "load_checkpoint_unsharded",
    "load_stage_checkpoint",
    "export_full_state_dict",
    "materialize_from_full",
    "load_full_state_dict",
    "CommCounter",
    "compat",
    "CollectiveCallError",
    "PlanMismatchError",
    "StaleOptimizerError",
    "ModuleTreeChangedError",
    "FSDPInternalsError",
    "MixedDtypeError",
]
