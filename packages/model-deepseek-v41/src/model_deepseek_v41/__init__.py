"""model-deepseek-v41: the DeepSeek-V4.1 FSDP2 parallelizer and a compact reference model."""

from model_deepseek_v41.__about__ import __version__
from model_deepseek_v41.config import DeepseekV41Config
from model_deepseek_v41.fsdp import (
    PARALLELIZER,
    DeepseekV41ModelParallelizer,
    NormGroup,
    find_vision_towers,
    fully_shard_deepseek_v41,
    is_norm_module,
    is_vision_block,
    is_vision_tower,
    plan_fp32_norm_groups,
)
from model_deepseek_v41.modeling import (
    Batch,
    DeepseekV41ForCausalLM,
    RMSNorm,
    build_deepseek_v41,
    init_parameters_,
    iter_initial_parameters,
    make_batch,
    num_image_tokens,
)

__all__ = [
    "PARALLELIZER",
    "Batch",
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "DeepseekV41ModelParallelizer",
    "NormGroup",
    "RMSNorm",
    "__version__",
    "build_deepseek_v41",
    "find_vision_towers",
    "fully_shard_deepseek_v41",
    "init_parameters_",
    "is_norm_module",
    "is_vision_block",
    "is_vision_tower",
    "iter_initial_parameters",
    "make_batch",
    "num_image_tokens",
    "plan_fp32_norm_groups",
]
