"""model-deepseek-v41: the DeepSeek-V4.1 FSDP2 parallelizer and a compact reference model."""

from model_deepseek_v41.__about__ import __version__
from model_deepseek_v41.config import DeepseekV41Config
from model_deepseek_v41.fsdp import (
    PARALLELIZER,
    DeepseekV41ModelParallelizer,
    fully_shard_deepseek_v41,
)
from model_deepseek_v41.modeling import DeepseekV41ForCausalLM, build_deepseek_v41, make_batch

__all__ = [
    "__version__",
    "PARALLELIZER",
    "DeepseekV41ModelParallelizer",
    "fully_shard_deepseek_v41",
    "DeepseekV41Config",
    "DeepseekV41ForCausalLM",
    "build_deepseek_v41",
    "make_batch",
]
