"""Every attribute of transformers and peft objects that the checkpoint I/O relies on.

They are implementation details of those libraries (most carry an underscore),
not an API: naming them in this one module keeps the dependence visible and
makes a rename upstream a one-line change. A test checks that no other module
of ``fsdp_core`` spells them.
"""

from __future__ import annotations

from typing import Final

#: Set by transformers on a module whose weights its own init already filled.
IS_HF_INITIALIZED: Final = "_is_hf_initialized"
#: A transformers sub-model's method that initialises one module's weights.
INIT_WEIGHTS: Final = "_init_weights"
#: transformers' flag for "a peft adapter was loaded into this model".
HF_PEFT_CONFIG_LOADED: Final = "_hf_peft_config_loaded"
#: Class patterns of checkpoint keys a transformers model declines on load.
KEYS_TO_IGNORE_ON_LOAD_UNEXPECTED: Final = "_keys_to_ignore_on_load_unexpected"
#: transformers' per-rank hook asked by ``save_pretrained`` whether to write.
SHOULD_SAVE_ON_THIS_RANK: Final = "should_save_on_this_rank"
#: The module global of transformers' ``save_pretrained`` holding its logging helpers.
LOGGING_GLOBAL: Final = "logging"
#: transformers' instance flag "sharded when loaded" (``from_pretrained(distributed_config=)``),
#: read through the ``is_distributed_loading_by_transformers`` property; its ``Trainer`` then
#: neither moves nor wraps the model in DDP.
IS_DISTRIBUTED_LOADING: Final = "_is_distributed_loading_by_transformers"
#: The module whose ``Trainer.__init__`` tests that flag.
TRAINER_MODULE: Final = "transformers.trainer"

ALL: Final = (
    IS_HF_INITIALIZED,
    INIT_WEIGHTS,
    HF_PEFT_CONFIG_LOADED,
    KEYS_TO_IGNORE_ON_LOAD_UNEXPECTED,
    SHOULD_SAVE_ON_THIS_RANK,
    IS_DISTRIBUTED_LOADING,
)
