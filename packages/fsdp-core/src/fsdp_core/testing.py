"""Helpers for tests that need process groups, for this project and downstream ones.

- :func:`fake_process_group`: FSDP2 in one process with exact collective
  counts and bytes (numbers computed under it are meaningless).
- :func:`run_on_gloo_ranks`: run a picklable function on N CPU ranks.
- :func:`run_torchrun`: launch a script under torchrun with a hard timeout, so
  a hang fails the test instead of stalling CI.
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "TORCHRUN_ENV",
    "ExampleRun",
    "fake_process_group",
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


@contextlib.contextmanager
def fake_process_group(world_size: int, *, rank: int = 0) -> Iterator[None]:
    """Initialise the single-process ``fake`` backend for the duration of the block."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid fake group: rank {rank} of world size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; destroy it first")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
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
        dist.destroy_process_group()


def run_on_gloo_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    ``fn`` must be importable (a module-level function). A rank that raises
    makes this raise; collectives time out after ``timeout_s`` instead of hanging.
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

    Raises ``AssertionError`` with the combined output when the job fails or
    runs past ``timeout_s`` (the whole process group is killed then).
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
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
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
    """The bodies of the fenced ```python blocks of a Markdown text, in order."""
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
    a one-process group), and a process group the example leaves behind is
    destroyed (and reported). Raises ``LookupError`` when the file has no such block.
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
            dist.destroy_process_group()
    return ExampleRun(namespace=namespace, left_process_group=left)
