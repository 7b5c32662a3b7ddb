"""Helpers for tests that need process groups, for this project and downstream ones.

[`run_torchrun`][fsdp_core.testing.run_torchrun] has a hard timeout, so a hang fails the
test instead of stalling CI. [`emulate_data_parallel`][fsdp_core.testing.emulate_data_parallel]
emulates each rank's arithmetic (compute-dtype parameters, fp32-averaged gradients) in one
process: compared with "the same model on one GPU", which only agrees to the compute
dtype's rounding, a real bug (a wrong shard, a lost reduction) stands out by orders of
magnitude. The fake process group is in [`fsdp_core.fake_group`][fsdp_core.fake_group].
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fsdp_core.distributed import destroy_distributed

__all__ = [
    "ReferenceResult",
    "emulate_data_parallel",
    "TORCHRUN_ENV",
    "ExampleRun",
    "free_port",
    "python_blocks",
    "run_markdown_example",
    "run_on_gloo_ranks",
    "run_torchrun",
]

#: Variables that make ``init_distributed`` expect a torchrun launch.
TORCHRUN_ENV: tuple[str, ...] = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now.

    Returns:
        The port number (another process may take it before it is used).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_entry(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_s: float,
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        # The safe ending (settle gloo's threads, then tear down): after ``fn`` the
        # spawned interpreter exits normally, and its teardown must not abort the rank.
        destroy_distributed()


def run_on_gloo_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; a rank
    that raises makes this raise, and collectives time out after ``timeout_s``.

    Args:
        fn: a module-level function taking ``(rank, world_size, *args)``.
        world_size: how many ranks to spawn.
        *args: picklable arguments passed to every rank.
        timeout_s: the process group's timeout.

    Raises:
        ValueError: ``world_size`` is not positive.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _rank_entry,
            args=(world_size, init_file, fn, args, timeout_s),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )


def _stop(process: subprocess.Popen[str]) -> tuple[str, str]:
    """End a torchrun job: SIGTERM lets torchrun stop its workers (which run in their
    own sessions), SIGKILL follows if it does not finish in time."""
    for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            return process.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return "", "(output lost: torchrun did not stop)"


def run_torchrun(
    script: str,
    *,
    nproc: int,
    args: Sequence[str] = (),
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torchrun --standalone`` and return the finished process.

    Args:
        script: the Python file to run.
        nproc: ranks per node.
        args: the script's command-line arguments.
        timeout_s: the whole job's time limit.
        env: extra environment variables.

    Returns:
        The finished process (its ``stdout`` holds every rank's output).

    Raises:
        AssertionError: the job failed or ran past ``timeout_s`` (then killed), with
            its output.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        script,
        *args,
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(process)
        raise AssertionError(
            f"torchrun {script} did not finish within {timeout_s:.0f} s (hang?)\n"
            f"{stdout[-20000:]}\n{stderr[-20000:]}"
        ) from None
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if result.returncode != 0:
        raise AssertionError(
            f"torchrun {script} failed with exit code {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-20000:]}\n"
            f"--- stderr ---\n{result.stderr[-20000:]}"
        )
    return result


def python_blocks(markdown: str) -> list[str]:
    """The bodies of the fenced ```python blocks of a Markdown text, in order.

    Args:
        markdown: the page's text.

    Returns:
        One string per block.
    """
    return re.findall(
        r"^```python[ \t]*\n(.*?)^```[ \t]*$", markdown, flags=re.DOTALL | re.MULTILINE
    )


@dataclass(frozen=True)
class ExampleRun:
    """What a Markdown example left: its globals, and whether it left a process group."""

    namespace: dict[str, Any]
    left_process_group: bool


def run_markdown_example(
    path: str | os.PathLike[str], *, index: int = 0, module_name: str = "__main__"
) -> ExampleRun:
    """Execute the ``index``-th ```python block of ``path`` as a one-rank program.

    The torchrun variables are hidden while it runs (so ``init_distributed`` starts
    a one-process group); a process group it leaves behind is destroyed and reported.

    Args:
        path: the Markdown file.
        index: which ```python block (0 is the first).
        module_name: the ``__name__`` the block runs under.

    Returns:
        Its globals, and whether it left a process group.

    Raises:
        LookupError: the file has no block ``index``.
        RuntimeError: a process group is already initialised.
    """
    blocks = python_blocks(Path(path).read_text(encoding="utf-8"))
    if index >= len(blocks):
        raise LookupError(f"{path} has {len(blocks)} python blocks, wanted block {index}")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; destroy it first")
    saved = {name: os.environ.pop(name) for name in TORCHRUN_ENV if name in os.environ}
    namespace: dict[str, Any] = {"__name__": module_name}
    left = False
    try:
        exec(compile(blocks[index], str(path), "exec"), namespace)
    finally:
        os.environ.update(saved)
        left = dist.is_initialized()
        if left:
            destroy_distributed()
    return ExampleRun(namespace=namespace, left_process_group=left)


# ------------------------------------------------------- single-process reference
class ReferenceResult(NamedTuple):
    """Per-step losses (mean over ranks), final parameters, first-step averaged gradients."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    first_grads: dict[str, torch.Tensor]


def _never(name: str) -> bool:
    return False


def emulate_data_parallel(
    build: Callable[[], nn.Module],
    batches: list[list[Any]],
    loss_fn: Callable[..., torch.Tensor],
    *,
    compute_dtype: torch.dtype | None,
    lr: float,
    keep_fp32: Callable[[str], bool] = _never,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> ReferenceResult:
    """Emulate data-parallel FSDP training in one process.

    Each "rank" computes its loss and gradients with parameters cast to
    ``compute_dtype`` (except those ``keep_fp32`` selects), gradients are upcast to
    fp32 and averaged over ranks, and the optimizer updates the master copy in its
    storage dtype: FSDP2's arithmetic under ``MixedPrecisionPolicy(param_dtype=
    compute_dtype, reduce_dtype=fp32)``, up to the order of the fp32 additions.

    Args:
        build: makes the model (called once, for the master copy).
        batches: ``batches[step][rank]``, one batch or a list of micro-batches.
        loss_fn: ``loss_fn(model, batch)`` -> a scalar loss.
        compute_dtype: the ranks' compute dtype (None: the parameters' own).
        lr: the SGD learning rate (when ``optimizer`` is None).
        keep_fp32: which parameter names stay fp32 (fp32 islands).
        optimizer: builds the optimizer from the trainable master parameters.

    Returns:
        The per-step mean losses, the final parameters and the first step's
        averaged gradients.
    """
    master = build()
    masters = dict(master.named_parameters())
    trainable = {name: p for name, p in masters.items() if p.requires_grad}
    opt = optimizer(list(trainable.values())) if optimizer is not None else None
    losses: list[float] = []
    first_grads: dict[str, torch.Tensor] = {}
    for step, per_rank in enumerate(batches):
        grads = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in trainable.items()}
        step_losses = []
        for batch in per_rank:
            worker = build()
            with torch.no_grad():
                for name, p in worker.named_parameters():
                    src = masters[name]
                    dtype = src.dtype if compute_dtype is None or keep_fp32(name) else compute_dtype
                    p.data = src.detach().to(dtype)
                    p.requires_grad_(name in grads)
            # A list of micro-batches: one backward each, gradients accumulated in fp32
            # (as FSDP does with an fp32 reduce dtype when it does not sync).
            micro_batches = batch if isinstance(batch, list) else [batch]
            total = 0.0
            for micro in micro_batches:
                loss = loss_fn(worker, micro)
                loss.backward()  # type: ignore[no-untyped-call]
                total += loss.item()
                for name, p in worker.named_parameters():
                    if p.grad is not None:
                        grads[name] += p.grad.float()
                        p.grad = None
            step_losses.append(total)
        losses.append(sum(step_losses) / len(step_losses))
        with torch.no_grad():
            for name, p in trainable.items():
                g = (grads[name] / len(per_rank)).to(p.dtype)
                if step == 0:
                    first_grads[name] = g
                if opt is None:
                    p.add_(g, alpha=-lr)
                else:
                    p.grad = g
        if opt is not None:
            opt.step()
            opt.zero_grad()
    params = {n: p.detach().clone() for n, p in master.named_parameters()}
    return ReferenceResult(losses, params, first_grads)
