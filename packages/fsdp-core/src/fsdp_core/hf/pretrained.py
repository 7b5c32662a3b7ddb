"""Pretrained weights in, trained weights out: Hugging Face checkpoint directories.

[`load_pretrained`][fsdp_core.hf.pretrained.load_pretrained] fills a model built on
``meta`` and sharded from a ``save_pretrained`` directory: every rank reads only the
slices of its own shards (``safe_open(...).get_slice``, memory mapped), with no
communication. [`save_pretrained`][fsdp_core.hf.pretrained.save_pretrained] gathers the
trained model into the same layout on rank 0, one output file at a time. Needs the
``safetensors`` package (the ``fsdp-core[hf]`` extra); transformers is never imported.
"""

from __future__ import annotations

from fsdp_core.hf._load import PretrainedLoad, load_pretrained
from fsdp_core.hf._save import save_pretrained
from fsdp_core.hf._slots import KeyMapping

# The implementation lives in private modules: _load (load_pretrained), _save (the model
# and adapter exports), _slots and _shard_read (what both read and write).
__all__ = ["KeyMapping", "PretrainedLoad", "load_pretrained", "save_pretrained"]
