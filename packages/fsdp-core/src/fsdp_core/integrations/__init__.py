"""Adapters to the training frameworks users already run, one module per framework.

The library shards the model; the framework trains it; checkpoints and exports go
through the library's collective, atomic functions
([`fsdp_core.checkpoint`][fsdp_core.checkpoint], [`fsdp_core.hf`][fsdp_core.hf]).
Importing this package imports no framework; each module imports its own (the
Lightning and torchtitan adapters import none), so install the extra of the same name:

- [`fsdp_core.integrations.transformers`][fsdp_core.integrations.transformers]:
  `ShardedTrainer` for transformers' `Trainer` (extra `transformers`);
- [`fsdp_core.integrations.trl`][fsdp_core.integrations.trl]: `ShardedSFTTrainer`
  for TRL's `SFTTrainer` (extra `trl`);
- [`fsdp_core.integrations.accelerate`][fsdp_core.integrations.accelerate]:
  `prepare` for an accelerate loop, with `save_state`/`load_state` routed through the
  library's checkpoints (extra `accelerate`);
- [`fsdp_core.integrations.lightning`][fsdp_core.integrations.lightning]: Lightning's
  `ModelParallelStrategy` (extra `lightning`);
- [`fsdp_core.integrations.torchtitan`][fsdp_core.integrations.torchtitan]:
  torchtitan's `parallelize_fn` (extra `torchtitan`).

The adapters are model-agnostic (any model a `ModelParallelizer` shards; what a
higher layer adds, such as media balancing, works through the runtime hooks the plan
installed), so they live in fsdp-core. A framework that would mishandle a sharded
model on its own (wrap it in `DistributedDataParallel`) stops with
[`IntegrationRequiredError`][fsdp_core.integrations.IntegrationRequiredError], which
names the adapter to use.
"""

from __future__ import annotations

__all__ = ["IntegrationRequiredError"]


class IntegrationRequiredError(RuntimeError):
    """A framework is about to mishandle a model the library sharded (for example wrap it
    in ``DistributedDataParallel``); the message names the integration to use instead."""
