"""Process-group set-up that works the same under torchrun on GPUs and on CPU-only hosts."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Final, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from fsdp_core.internals import fake_store

__all__ = [
    "VALID_BACKENDS",
    "DistributedContext",
    "init_distributed",
    "destroy_distributed",
    "exit_rank",
    "device_type_for_backend",
]

logger = logging.getLogger(__name__)

#: Backends this library sets up itself; "fake" is the single-process test backend.
VALID_BACKENDS: Final[tuple[str, ...]] = ("nccl", "gloo", "fake")
#: Numbers the default groups this process starts from the torchrun store: each gets
#: its own key prefix, so a group started after ``destroy_distributed`` never reads
#: the keys (the peers' old gloo addresses) of the one before it.
_GENERATIONS = itertools.count()
_DEVICE_FOR_BACKEND: Final[dict[str, str]] = {
    "nccl": "cuda",
    "gloo": "cpu",
    "fake": "cpu",
}


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job and which backend/device it uses."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def device_type_for_backend(backend: str) -> str:
    """The mesh device type that matches ``backend`` (a ``cuda`` mesh never sits on gloo).

    Accepts plain names ("gloo", "nccl", "fake") and torch's device-qualified
    form ("cpu:gloo", "cpu:gloo,cuda:nccl"); the accelerator wins when present.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    devices: list[str] = []
    for part in backend.lower().replace(" ", "").split(","):
        device, _, name = part.rpartition(":")
        if name not in _DEVICE_FOR_BACKEND:
            raise ValueError(
                f"no mesh device known for backend {backend!r}; valid backends: {VALID_BACKENDS}"
            )
        devices.append(device or _DEVICE_FOR_BACKEND[name])
    return "cuda" if "cuda" in devices else devices[0]


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _choose_backend(backend: str | None, local_world_size: int) -> str:
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
        name = backend.strip().lower()
        if name not in VALID_BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; valid backends: {VALID_BACKENDS}")
        if name == "nccl":
            if not torch.cuda.is_available():
                raise ValueError("backend 'nccl' needs CUDA, which is not available; use 'gloo'")
            if torch.cuda.device_count() < local_world_size:
                raise ValueError(
                    f"backend 'nccl' needs one GPU per local rank: {local_world_size} local "
                    f"ranks but {torch.cuda.device_count()} GPUs; use 'gloo' or fewer ranks"
                )
        return name
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def _context_from_group() -> DistributedContext:
    backend = str(dist.get_backend())
    device_type = device_type_for_backend(backend)
    local_rank = _env_int("LOCAL_RANK", 0)
    device = torch.device(device_type, local_rank) if device_type == "cuda" else torch.device("cpu")
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=_env_int("LOCAL_WORLD_SIZE", dist.get_world_size()),
        backend=backend,
        device=device,
    )


def init_distributed(
    *,
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> DistributedContext:
    """Initialise the default process group from the torchrun environment.

    Picks NCCL on CUDA when every local rank has a GPU, otherwise gloo on CPU;
    ``backend`` overrides the choice. Without torchrun variables it starts a
    one-process group, so the same script runs under ``python``. Calling it again
    returns the existing context (and refuses a different explicit backend).
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if dist.is_initialized():
        ctx = _context_from_group()
        if backend is not None and backend.strip().lower() != ctx.backend:
            raise ValueError(
                f"the process group is already initialised with backend {ctx.backend!r}; "
                f"cannot switch to {backend!r} (call destroy_distributed() first)"
            )
        return ctx

    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    chosen = _choose_backend(backend, local_world_size)
    device_type = _DEVICE_FOR_BACKEND[chosen]
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)

    pg_timeout = timeout if timeout is not None else timedelta(minutes=10)
    if chosen == "fake":
        dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    elif "MASTER_ADDR" in os.environ:
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=pg_timeout))
        prefix = f"fsdp_core/default_pg/{next(_GENERATIONS)}"
        store = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        dist.init_process_group(
            chosen, store=store, rank=rank, world_size=world_size, timeout=pg_timeout
        )
    elif world_size == 1:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(chosen, store=store, rank=0, world_size=1, timeout=pg_timeout)
    else:
        raise ValueError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR is not set; launch with torchrun"
        )
    ctx = _context_from_group()
    logger.info(
        "initialised %s process group: rank %d of %d on %s",
        ctx.backend,
        ctx.rank,
        ctx.world_size,
        ctx.device,
    )
    return ctx


def destroy_distributed() -> None:
    """Tear down the default process group if one exists (safe to call twice)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(code: int = 0) -> NoReturn:
    """End a torchrun worker: wait for the others, tear down, exit without interpreter
    teardown.

    With gloo (torch 2.13) a rank whose work is complete occasionally aborts while the
    interpreter shuts down ("terminate called without an active exception"), turning a
    successful job into a failed one; leaving with ``os._exit`` after the barrier and
    the tear-down skips that phase. Output is flushed first.
    """
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError):
            dist.barrier()
        destroy_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
