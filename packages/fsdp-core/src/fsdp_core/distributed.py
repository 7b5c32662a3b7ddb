"""Process-group set-up that works the same under torchrun on GPUs and on CPU-only hosts."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from fsdp_core.internals.torch_modules import fake_store

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
#: Store keys of ``_fresh_group_prefix``'s handshake, and the prefix the groups' keys go under.
_JOIN_PREFIX: Final = "fsdp_core/join"
_GROUP_PREFIX: Final = "fsdp_core/default_pg"
#: How long rank 0 sleeps at most between two looks at the other ranks' join keys.
_JOIN_POLL_S: Final[float] = 0.05
#: Name prefixes (``/proc``, at most 15 characters) of the torch threads that take the GIL
#: from C++ after a collective or a backward: gloo's workers (dropping a finished
#: collective's tensors, running its future's callbacks) and autograd's device threads.
_GIL_TAKING_THREADS: Final[tuple[str, ...]] = ("pt_gloo_runloop", "pt_autograd_")
#: How long the exit path waits for those threads to go idle before it gives up.
_SETTLE_TIMEOUT_S: Final[float] = 5.0
#: Consecutive looks (the GIL released in between) that must find them all blocked.
_SETTLED_LOOKS: Final[int] = 3
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

    Args:
        backend: a backend name as ``dist.get_backend()`` reports it, plain (``"gloo"``)
            or device-qualified (``"cpu:gloo,cuda:nccl"``: the accelerator wins).

    Returns:
        ``"cuda"`` or ``"cpu"`` (or the accelerator the backend names).

    Raises:
        TypeError: ``backend`` is not a string.
        ValueError: the backend is unknown.
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
    enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size
    return "nccl" if enough_gpus else "gloo"


def _group_backend() -> str:
    """The default group's backend, or for one started without (accelerate on CPU:
    ``get_backend()`` reads ``'undefined'``) the form torch chose for it (``'cpu:gloo'``)."""
    backend = str(dist.get_backend())
    try:
        device_type_for_backend(backend)
    except ValueError:
        configured = str(dist.get_backend_config())
        logger.debug("process group backend %r; using its configuration %r", backend, configured)
        return configured
    return backend


def _context_from_group() -> DistributedContext:
    backend = _group_backend()
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
    returns the existing context (and refuses a different explicit backend). Each start
    keys its store entries under a fresh prefix, so a job torchrun restarts on its failed
    attempt's store never reads the old entries.

    Args:
        backend: ``"nccl"``, ``"gloo"``, ... instead of the automatic choice.
        timeout: the process group's collective timeout (torch's default if None).

    Returns:
        The rank, world size, backend and device of this process.

    Raises:
        TypeError: ``backend`` or ``timeout`` has the wrong type.
        ValueError: the torchrun environment is inconsistent, or a group with another
            backend is already initialised.
        RuntimeError: rank 0 did not answer the start-up exchange in time.
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    _register_exit_hook()
    if dist.is_initialized():
        ctx = _context_from_group()
        running = {part.rpartition(":")[2] for part in ctx.backend.split(",")}
        if backend is not None and backend.strip().lower() not in running | {ctx.backend}:
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
        prefix = _fresh_group_prefix(store, rank, world_size, pg_timeout)
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


def _fresh_group_prefix(store: Any, rank: int, world_size: int, timeout: timedelta) -> str:
    """A store key prefix that no earlier start of a group on ``store`` used, the same on
    every rank.

    Why: torchrun restarts a failed job on the failed attempt's store, whose keys (dead
    gloo addresses, agreement keys) a group keyed as before would read ("Gloo
    connectFullMesh failed ... Connection refused", or a hang). The restart count cannot
    name the attempt: the nodes count their own workers' failures and disagree.

    So rank 0 draws a random token; every other rank writes a random nonce under
    ``rank/<rank>`` and waits for ``ack/<nonce>``, which no earlier attempt can have
    written. Rank 0 answers each nonce it reads with the token (a dead attempt's in
    vain) until every rank has confirmed under a key named by the token.
    """
    join = dist.PrefixStore(_JOIN_PREFIX, store)  # type: ignore[attr-defined]
    if rank != 0:
        nonce = uuid.uuid4().hex
        join.set(f"rank/{rank}", nonce)
        try:
            join.wait([f"ack/{nonce}"], timeout)
        except RuntimeError:  # DistStoreError
            raise RuntimeError(
                f"init_distributed: rank {rank} got no answer from rank 0 within "
                f"{timeout.total_seconds():g} s; rank 0 did not start or is stuck"
            ) from None
        token = join.get(f"ack/{nonce}").decode()
        join.add(f"{token}/joined", 1)
        return f"{_GROUP_PREFIX}/{token}"
    token = uuid.uuid4().hex
    unwritten = [f"rank/{other}" for other in range(1, world_size)]
    present: list[str] = []  # a key once written is never removed
    answered: set[str] = set()
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.001
    while (joined := join.add(f"{token}/joined", 0)) < world_size - 1:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"init_distributed: {world_size - 1 - joined} of the {world_size - 1} other "
                f"ranks did not join rank 0 within {timeout.total_seconds():g} s; a rank did "
                "not start, or stopped"
            )
        written = {key for key in unwritten if join.check([key])}
        present += sorted(written)
        unwritten = [key for key in unwritten if key not in written]
        for raw in join.multi_get(present) if present else []:
            nonce = raw.decode()
            if nonce not in answered:
                join.set(f"ack/{nonce}", token)
                answered.add(nonce)
        time.sleep(pause)
        pause = min(2 * pause, _JOIN_POLL_S)
    return f"{_GROUP_PREFIX}/{token}"


def destroy_distributed() -> None:
    """Tear down the default process group if one exists (safe to call twice).

    First lets torch's collective threads finish their Python work, so that the
    interpreter's teardown cannot abort the process. Local (no rank waits for another),
    so safe in ``finally`` blocks and after a failure.
    """
    _settle_collective_threads()
    if dist.is_initialized():
        dist.destroy_process_group()


def _settle_collective_threads(timeout_s: float = _SETTLE_TIMEOUT_S) -> bool:
    """Release the GIL until torch's gloo worker (and autograd device) threads are idle.

    Why: a gloo worker drops a finished collective's tensors after the caller moved on,
    which may need the GIL; if the main thread holds it into interpreter shutdown,
    Python 3.11 ends that thread inside C++ and the process aborts ("terminate called
    without an active exception"). ``True`` once every such thread was seen blocked
    ``_SETTLED_LOOKS`` times in a row, ``False`` if one still runs after ``timeout_s``;
    without ``/proc`` it sleeps 50 ms and returns ``True``.
    """
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        time.sleep(0.05)
        return True
    deadline = time.monotonic() + timeout_s
    looks = 0
    while looks < _SETTLED_LOOKS:
        time.sleep(0.001)  # releases the GIL: a thread waiting for it takes it now
        looks = looks + 1 if not _running_gil_threads(tasks) else 0
        if looks < _SETTLED_LOOKS and time.monotonic() > deadline:
            logger.warning(
                "torch collective threads %s still running after %.1f s; the "
                "interpreter's teardown may abort this process",
                _running_gil_threads(tasks),
                timeout_s,
            )
            return False
    return True


def _running_gil_threads(tasks: str) -> list[str]:
    """The GIL-taking torch threads of this process that are running or runnable."""
    running = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as comm:
                name = comm.read().strip()
            if not name.startswith(_GIL_TAKING_THREADS):
                continue
            with open(f"{tasks}/{tid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # the thread ended while we looked
            continue
        if state == "R":
            running.append(f"{name} ({tid})")
    return running


@functools.cache
def _register_exit_hook() -> None:
    """Settle the collective threads at exit, also when the script just returns
    (``atexit`` runs before the teardown that kills late threads); local only."""
    atexit.register(_settle_at_exit)


def _settle_at_exit() -> None:
    with contextlib.suppress(Exception):  # never turn an exit into a new failure
        _settle_collective_threads()


def exit_rank(code: int = 0) -> NoReturn:
    """End a torchrun worker: wait for the others, tear down, exit without interpreter
    teardown.

    For a worker whose exit status is its own result (a test or benchmark driver):
    after the barrier and ``destroy_distributed()`` it flushes logging and the standard
    streams and leaves with ``os._exit(code)`` (no ``atexit`` handlers). Not for a
    failure path: the barrier waits for every rank.

    Args:
        code: the process's exit status.
    """
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError):
            dist.barrier()
        destroy_distributed()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
