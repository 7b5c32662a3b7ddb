"""Hugging Face checkpoint directories in and out of sharded models.

Kept apart from the core so that ``import fsdp_core`` loads none of it:
[`load_pretrained`][fsdp_core.hf.pretrained.load_pretrained] fills a model
built on ``meta`` from a safetensors directory, and
[`save_pretrained`][fsdp_core.hf.pretrained.save_pretrained] writes a sharded
model back as one. transformers and peft are never imported; their models are
recognised by duck typing, and every private attribute of theirs that is read
is named once, in ``fsdp_core.hf._transformers``.
"""

from fsdp_core.hf.pretrained import KeyMapping, PretrainedLoad, load_pretrained, save_pretrained

__all__ = ["KeyMapping", "PretrainedLoad", "load_pretrained", "save_pretrained"]
