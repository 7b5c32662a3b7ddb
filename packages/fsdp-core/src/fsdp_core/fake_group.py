"""The single-process ``fake`` process group, as a product feature.

Under it FSDP2 shards as on a real job and issues the same collectives with the same
bytes, in one process (the numbers it computes are meaningless): the product measures a
plan's collectives and memory without a cluster
([`multimodal_fsdp.measure.comm`][multimodal_fsdp.measure.comm],
[`multimodal_fsdp.measure.memory`][multimodal_fsdp.measure.memory]); tests check layouts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from fsdp_core.internals.torch_modules import fake_store

__all__ = ["fake_process_group", "current_or_fake_group"]


@contextlib.contextmanager
def fake_process_group(world_size: int, *, rank: int = 0) -> Iterator[None]:
    """Initialise the single-process ``fake`` backend for the duration of the block.

    Args:
        world_size: how many ranks the group pretends to have.
        rank: the rank this process plays.

    Raises:
        ValueError: ``rank`` is not within ``world_size``.
        RuntimeError: a process group is already initialised.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid fake group: rank {rank} of world size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; destroy it first")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def current_or_fake_group(world_size: int) -> Iterator[None]:
    """The initialised process group (of ``world_size`` ranks) when there is one, else a
    fake group of that size: measurements run the same on real ranks and in one process.

    Args:
        world_size: the number of ranks measured.

    Raises:
        ValueError: an initialised group has another size.
    """
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(
            f"world_size={world_size} does not match the initialised process group "
            f"({dist.get_world_size()} ranks)"
        )
    with contextlib.nullcontext() if dist.is_initialized() else fake_process_group(world_size):
        yield
