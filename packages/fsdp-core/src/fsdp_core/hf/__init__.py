"""Hugging Face checkpoint directories in and out of sharded models.

Kept apart from the core so that ``import fsdp_core`` loads none of it; the functions
are [fsdp_core.hf.pretrained][]'s. transformers and peft are never imported: their
models are duck-typed, and their private attributes named once, in ``_transformers``.
"""

from fsdp_core.hf.pretrained import KeyMapping, PretrainedLoad, load_pretrained, save_pretrained

__all__ = ["KeyMapping", "PretrainedLoad", "load_pretrained", "save_pretrained"]
