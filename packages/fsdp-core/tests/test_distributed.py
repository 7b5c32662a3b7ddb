"""fsdp_core.distributed: process-group set-up from the torchrun environment."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fsdp_core import distributed
from fsdp_core.distributed import (
    VALID_BACKENDS,
    DistributedContext,
    destroy_distributed,
    device_type_for_backend,
    init_distributed,
)
from fsdp_core.testing import free_port


@pytest.fixture
def teardown() -> Iterator[None]:
    """Destroy whatever group the test initialised, even when it fails."""
    try:
        yield
    finally:
        destroy_distributed()


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


# DistributedContext and device_type_for_backend --------------------------------------------------


def test_context_properties() -> None:
    ctx = DistributedContext(
        rank=0, world_size=2, local_rank=0, local_world_size=2, backend="gloo",
        device=torch.device("cpu"),
    )  # fmt: skip
    assert ctx.device_type == "cpu"
    assert ctx.is_main
    other = DistributedContext(1, 2, 1, 2, "nccl", torch.device("cuda", 1))
    assert other.device_type == "cuda"
    assert not other.is_main


@pytest.mark.parametrize(
    ("backend", "device"),
    [
        ("nccl", "cuda"),
        ("gloo", "cpu"),
        ("fake", "cpu"),
        ("GLOO", "cpu"),
        ("cpu:gloo,cuda:nccl", "cuda"),
        ("cuda:nccl", "cuda"),
    ],
)
def test_device_type_for_backend(backend: str, device: str) -> None:
    assert device_type_for_backend(backend) == device


@pytest.mark.parametrize("backend", ["mpi", "ucc", "", "cuda"])
def test_device_type_for_unknown_backend(backend: str) -> None:
    with pytest.raises(ValueError, match=r"no mesh device known for backend .*valid backends"):
        device_type_for_backend(backend)


def test_device_type_for_device_qualified_gloo() -> None:
    # torch reports the backend as 'cpu:gloo' for init_process_group('cpu:gloo').
    assert device_type_for_backend("cpu:gloo") == "cpu"


def test_valid_backends() -> None:
    assert VALID_BACKENDS == ("nccl", "gloo", "fake")
    for backend in VALID_BACKENDS:
        device_type_for_backend(backend)


# init_distributed --------------------------------------------------------------------------------


def test_single_process_gloo_without_torchrun(
    clean_env: pytest.MonkeyPatch, teardown: None, caplog: pytest.LogCaptureFixture
) -> None:
    _no_cuda(clean_env)
    with caplog.at_level(logging.INFO, logger="fsdp_core.distributed"):
        ctx = init_distributed()
    assert dist.is_initialized()
    assert ctx == DistributedContext(
        rank=0, world_size=1, local_rank=0, local_world_size=1, backend="gloo",
        device=torch.device("cpu"),
    )  # fmt: skip
    assert ctx.is_main
    assert ctx.device_type == "cpu"
    assert "initialised gloo process group: rank 0 of 1" in caplog.text
    # The group works.
    value = torch.ones(2)
    dist.all_reduce(value)
    assert value.tolist() == [1.0, 1.0]


def test_second_call_returns_the_same_context(
    clean_env: pytest.MonkeyPatch, teardown: None
) -> None:
    _no_cuda(clean_env)
    first = init_distributed(timeout=timedelta(seconds=30))
    assert init_distributed() == first
    # The same backend named explicitly (any case) is accepted too.
    assert init_distributed(backend=" GLOO ") == first


def test_second_call_refuses_another_backend(clean_env: pytest.MonkeyPatch, teardown: None) -> None:
    _no_cuda(clean_env)
    init_distributed(backend="gloo")
    with pytest.raises(
        ValueError,
        match=r"already initialised with backend 'gloo'; cannot switch to 'fake' "
        r"\(call destroy_distributed\(\) first\)",
    ):
        init_distributed(backend="fake")
    assert dist.get_backend() == "gloo"


def test_fake_backend_uses_env_rank_and_world_size(
    clean_env: pytest.MonkeyPatch, teardown: None
) -> None:
    clean_env.setenv("WORLD_SIZE", "4")
    clean_env.setenv("RANK", "2")
    clean_env.setenv("LOCAL_RANK", "0")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    ctx = init_distributed(backend="fake")
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (2, 4, 0, 2)
    assert ctx.backend == "fake"
    assert ctx.device == torch.device("cpu")
    assert not ctx.is_main


def test_local_world_size_defaults_to_world_size(
    clean_env: pytest.MonkeyPatch, teardown: None
) -> None:
    clean_env.setenv("WORLD_SIZE", "3")
    clean_env.setenv("RANK", "1")
    ctx = init_distributed(backend="fake")
    assert ctx.local_world_size == 3
    assert ctx.local_rank == 0


def test_master_addr_uses_env_rendezvous(clean_env: pytest.MonkeyPatch, teardown: None) -> None:
    _no_cuda(clean_env)
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    clean_env.setenv("WORLD_SIZE", "1")
    clean_env.setenv("RANK", "0")
    ctx = init_distributed(timeout=timedelta(seconds=30))
    assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, "gloo")


def test_unknown_backend(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ValueError, match=r"unknown backend 'mpi'; valid backends: \('nccl', 'gloo', 'fake'\)"
    ):
        init_distributed(backend="mpi")
    assert not dist.is_initialized()


def test_backend_must_be_a_string(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match=r"backend must be a str or None, got int"):
        init_distributed(backend=1)  # type: ignore[arg-type]


def test_backend_type_checked_when_group_exists(
    clean_env: pytest.MonkeyPatch, teardown: None
) -> None:
    init_distributed(backend="fake")
    with pytest.raises(TypeError, match=r"backend must be a str or None"):
        init_distributed(backend=1)  # type: ignore[arg-type]


def test_timeout_must_be_a_timedelta(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match=r"timeout must be a datetime.timedelta, got int"):
        init_distributed(timeout=60)  # type: ignore[arg-type]


def test_nccl_refused_without_cuda(clean_env: pytest.MonkeyPatch) -> None:
    _no_cuda(clean_env)
    with pytest.raises(ValueError, match=r"backend 'nccl' needs CUDA, which is not available"):
        init_distributed(backend="nccl")
    assert not dist.is_initialized()


def test_nccl_refused_with_too_few_gpus(clean_env: pytest.MonkeyPatch) -> None:
    _fake_cuda(clean_env, count=1)
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"needs one GPU per local rank: 2 local ranks but 1 GPUs"):
        init_distributed(backend="nccl")
    assert not dist.is_initialized()


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_cuda(monkeypatch)
    assert distributed._choose_backend(None, 1) == "gloo"
    _fake_cuda(monkeypatch, count=2)
    assert distributed._choose_backend(None, 2) == "nccl"
    assert distributed._choose_backend(None, 4) == "gloo"
    assert distributed._choose_backend("Fake", 4) == "fake"


@pytest.mark.parametrize(("rank", "world_size"), [("2", "2"), ("-1", "2"), ("0", "0")])
def test_rank_outside_world_size(clean_env: pytest.MonkeyPatch, rank: str, world_size: str) -> None:
    clean_env.setenv("RANK", rank)
    clean_env.setenv("WORLD_SIZE", world_size)
    with pytest.raises(ValueError, match=rf"RANK={rank} is outside WORLD_SIZE={world_size}"):
        init_distributed(backend="fake")
    assert not dist.is_initialized()


def test_multi_process_without_master_addr(clean_env: pytest.MonkeyPatch) -> None:
    _no_cuda(clean_env)
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "0")
    with pytest.raises(
        ValueError, match=r"WORLD_SIZE=2 but MASTER_ADDR is not set; launch with torchrun"
    ):
        init_distributed()
    assert not dist.is_initialized()


@pytest.mark.parametrize("name", ["WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"])
def test_env_must_hold_integers(clean_env: pytest.MonkeyPatch, name: str) -> None:
    clean_env.setenv(name, "two")
    with pytest.raises(ValueError, match=rf"environment variable {name}='two' is not an integer"):
        init_distributed(backend="fake")
    assert not dist.is_initialized()


def test_empty_env_values_mean_defaults(clean_env: pytest.MonkeyPatch, teardown: None) -> None:
    clean_env.setenv("WORLD_SIZE", "")
    clean_env.setenv("RANK", "")
    ctx = init_distributed(backend="fake")
    assert (ctx.rank, ctx.world_size) == (0, 1)


# destroy_distributed -----------------------------------------------------------------------------


def test_destroy_twice_is_safe(clean_env: pytest.MonkeyPatch) -> None:
    init_distributed(backend="fake")
    destroy_distributed()
    assert not dist.is_initialized()
    destroy_distributed()
    assert not dist.is_initialized()


def test_destroy_without_group_is_a_no_op() -> None:
    destroy_distributed()
    assert not dist.is_initialized()


def test_exit_rank_flushes_output_and_exits_with_the_code() -> None:
    import subprocess
    import sys

    code = (
        "from fsdp_core import exit_rank, init_distributed\n"
        "init_distributed(backend='gloo')\n"
        "print('done', end='')\n"
        "exit_rank(3)\n"
    )
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK")
    }
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 3, result.stderr
    assert result.stdout == "done"


# Leaving the process after gloo work ----------------------------------------------------------
#: One rank of a 2-rank gloo job whose gloo worker thread still has Python work to finish
#: (a completed collective's callback, then the release of its tensors) when the main
#: thread reaches the end of the script: the state in which Python 3.11's interpreter
#: teardown kills the worker thread ("terminate called without an active exception",
#: SIGABRT). A job holds its group through FSDP and DeviceMesh as ``KEEP`` does, so the
#: group's threads outlive ``destroy_process_group``. The callback blocks until the end of
#: the script and the main thread keeps the GIL (a long switch interval), which makes the
#: otherwise rare timing certain.
_LATE_GLOO_WORK = """
import sys, threading
import torch
import torch.distributed as dist
from fsdp_core import destroy_distributed, init_distributed

ctx = init_distributed(backend="gloo")
KEEP = dist.distributed_c10d._get_default_group()
store = dist.distributed_c10d._get_default_store()
started, go = threading.Event(), threading.Event()


def hold(_):
    started.set()
    go.wait()


if ctx.rank == 0:
    work = dist.all_reduce(torch.ones(8), async_op=True)
    work.get_future().then(hold)
    store.set("registered", "1")  # rank 1 joins the all-reduce only now
    started.wait()
    del work
else:
    store.wait(["registered"])
    dist.all_reduce(torch.ones(8))
print(f"rank {ctx.rank} finished", flush=True)
sys.setswitchinterval(10.0)
go.set()  # from here on the main thread releases the GIL only where the library does
if "{ending}" == "destroy_distributed":
    destroy_distributed()
elif "{ending}" == "raise" and ctx.rank == 0:
    raise RuntimeError("rank 0 failed on purpose")
"""


def _run_two_ranks(code: str) -> list[tuple[int, str, str]]:
    import os
    import subprocess
    import sys

    from fsdp_core.testing import free_port

    port = str(free_port())
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    }
    procs = []
    for rank in range(2):
        env = dict(
            base,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        results.append((proc.returncode, out, err))
    return results


def test_settle_sees_idle_gloo_threads(clean_env: pytest.MonkeyPatch, teardown: None) -> None:
    """After a collective the worker threads go idle and the wait ends (on Linux it looks
    at them; elsewhere it only releases the GIL briefly)."""
    init_distributed(backend="gloo")
    dist.all_reduce(torch.ones(4))
    assert distributed._settle_collective_threads(timeout_s=60.0)


@pytest.mark.parametrize("ending", ["return", "destroy_distributed"])
def test_rank_exits_cleanly_while_a_gloo_thread_still_needs_python(ending: str) -> None:
    """A finished job ends with status 0 on every rank, whether the script returns after
    ``init_distributed`` or ends with ``destroy_distributed()``."""
    results = _run_two_ranks(_LATE_GLOO_WORK.replace("{ending}", ending))
    for rank, (code, out, err) in enumerate(results):
        assert "terminate called" not in err, f"rank {rank}: {err[-2000:]}"
        assert code == 0, f"rank {rank} exited with {code}: {err[-2000:]}"
        assert f"rank {rank} finished" in out


def test_a_rank_that_raised_still_fails_with_its_traceback() -> None:
    """The exit path hides no failure: the rank that raised exits 1 with its traceback."""
    (code0, _, err0), (code1, _, err1) = _run_two_ranks(
        _LATE_GLOO_WORK.replace("{ending}", "raise")
    )
    assert code0 == 1, err0[-2000:]
    assert "RuntimeError: rank 0 failed on purpose" in err0
    assert "terminate called" not in err0, err0[-2000:]
    assert code1 == 0, err1[-2000:]
