"""Pretrained weights in, trained weights out: Hugging Face checkpoint directories.

[`load_pretrained`][fsdp_core.hf.pretrained.load_pretrained] fills a model that was built on the
``meta`` device and sharded from a directory written by ``save_pretrained`` (one
``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files with
``model.safetensors.index.json``). Every rank reads only the slices of its own shards
(``safe_open(...).get_slice``), with no communication; parameters that are not sharded (replicated,
FSDP-ignored) and persistent buffers are read whole on every rank. Per rank, host memory holds
one tensor's slice at a time beyond the shards themselves (the files are memory
mapped: their pages sit in the node's shared page cache).

[`save_pretrained`][fsdp_core.hf.pretrained.save_pretrained] gathers the trained model into the same
layout on rank 0, one output file at a time, so that ``transformers`` ``from_pretrained`` loads it.

Needs the ``safetensors`` package (the ``fsdp-core[hf]`` extra); transformers is
never imported: its models are recognised by their ``save_pretrained`` methods.
"""

from __future__ import annotations

from fsdp_core.hf._load import PretrainedLoad, load_pretrained
from fsdp_core.hf._save import save_pretrained
from fsdp_core.hf._slots import KeyMapping

# The implementation lives in private modules: _load (load_pretrained), _save (the model
# and adapter exports), _slots and _shard_read (what both read and write).
__all__ = ["KeyMapping", "PretrainedLoad", "load_pretrained", "save_pretrained"]
