"""fsdp_core.testing: fake groups, gloo ranks and torchrun launches."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_core.fake_group import fake_process_group
from fsdp_core.testing import free_port, run_on_gloo_ranks, run_torchrun

TESTS_DIR = Path(__file__).resolve().parent


def _command_lines(marker: str) -> dict[int, str]:
    """Live (non-zombie) processes whose command line contains ``marker``, by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # the process just ended
            continue
        if marker in cmdline:
            found[int(entry.name)] = cmdline
    return found


def _processes_mentioning(marker: str) -> list[int]:
    return sorted(_command_lines(marker))


def _wait_until_gone(marker: str, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (pids := _processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return pids


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[Path]:
    """A torchrun script that records its pid, detaches from the pipes and sleeps.

    Closing stdout/stderr keeps a surviving worker from holding the parent's
    pipes open. Whatever still runs the script afterwards is killed by pid.
    """
    script = tmp_path / "sleeper_fsdp_core_test.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            from pathlib import Path
            Path(sys.argv[1], f"worker{os.environ['RANK']}.pid").write_text(str(os.getpid()))
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            time.sleep(60)
            Path(sys.argv[1], f"worker{os.environ['RANK']}.finished").write_text("")
            """
        )
    )
    try:
        yield script
    finally:
        for pid in _processes_mentioning(str(script)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_until_gone(str(script), 5.0)


# fake_process_group ------------------------------------------------------------------------------


def _module_list(readme: str) -> dict[str, str]:
    """The README's ``- `module`: what it holds`` entries, continuation lines joined."""
    entries: dict[str, str] = {}
    current = None
    for line in readme.splitlines():
        match = re.match(r"- `(fsdp_core[\w.]*)`: (.*)", line)
        if match:
            current = match[1]
            entries[current] = match[2]
        elif current and line.startswith("  "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_the_fake_group_has_one_public_home() -> None:
    """Users import ``fake_process_group`` from ``fsdp_core.fake_group``, the one module
    that exports it; the README's module list and the testing helpers' docstring send
    them there, not to ``fsdp_core.testing`` (which does not export it)."""
    import fsdp_core.fake_group
    import fsdp_core.testing

    assert "fake_process_group" in fsdp_core.fake_group.__all__
    assert not hasattr(fsdp_core.testing, "fake_process_group")
    assert "re-export" not in (fsdp_core.testing.__doc__ or "")
    readme = (TESTS_DIR.parent / "README.md").read_text(encoding="utf-8")
    homes = [m for m, text in _module_list(readme).items() if "fake process group" in text]
    assert homes == ["fsdp_core.fake_group"]


def test_fake_process_group_lifecycle() -> None:
    with fake_process_group(4, rank=3):
        assert dist.is_initialized()
        assert dist.get_backend() == "fake"
        assert dist.get_world_size() == 4
        assert dist.get_rank() == 3
    assert not dist.is_initialized()


def test_fake_process_group_destroyed_after_an_error() -> None:
    with pytest.raises(KeyError), fake_process_group(2):
        raise KeyError("boom")
    assert not dist.is_initialized()


def test_fake_process_group_refuses_nesting() -> None:
    with fake_process_group(2):
        nested = fake_process_group(2)
        with pytest.raises(RuntimeError, match=r"a process group is already initialised"):
            nested.__enter__()
        assert dist.get_world_size() == 2
    assert not dist.is_initialized()


def test_fake_process_group_tolerates_teardown_inside() -> None:
    from fsdp_core.distributed import destroy_distributed

    try:
        with fake_process_group(2):
            destroy_distributed()
    finally:
        destroy_distributed()
    assert not dist.is_initialized()


@pytest.mark.parametrize(("world_size", "rank"), [(0, 0), (-1, 0), (2, 2), (2, -1), (1, 5)])
def test_fake_process_group_bad_sizes(world_size: int, rank: int) -> None:
    with (
        pytest.raises(
            ValueError, match=rf"invalid fake group: rank {rank} of world size {world_size}"
        ),
        fake_process_group(world_size, rank=rank),
    ):
        pass  # pragma: no cover
    assert not dist.is_initialized()


def test_fake_process_group_collectives_run() -> None:
    with fake_process_group(4):
        value = torch.ones(3)
        dist.all_reduce(value)
        assert value.shape == (3,)
        dist.barrier()


# free_port ---------------------------------------------------------------------------------------


def test_free_port() -> None:
    port = free_port()
    assert isinstance(port, int)
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


# run_on_gloo_ranks -------------------------------------------------------------------------------


def test_run_on_gloo_ranks_bad_world_size() -> None:
    with pytest.raises(ValueError, match=r"world_size must be positive, got 0"):
        run_on_gloo_ranks(print, 0)


@pytest.mark.distributed
def test_run_on_gloo_ranks_all_reduce(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawned children import the function by module name, so its directory must be
    # on sys.path (they inherit the parent's); a test module itself is not importable.
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    import _fsdp_core_rank_fns

    run_on_gloo_ranks(_fsdp_core_rank_fns.all_reduce_rank_sum, 2, str(tmp_path), timeout_s=60)
    results = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert results == ["3.0 gloo", "3.0 gloo"]
    assert not dist.is_initialized()


def test_a_gloo_rank_ends_the_safe_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spawned rank's interpreter exits normally after ``fn``: its group must be torn
    down by ``destroy_distributed`` (which first settles gloo's threads), not by a bare
    ``destroy_process_group`` whose teardown could abort the rank (seen: SIGABRT,
    "terminate called without an active exception", in a passing test's launch)."""
    import fsdp_core.testing as testing

    ended: list[bool] = []

    def recording_destroy() -> None:
        ended.append(True)
        dist.destroy_process_group()

    monkeypatch.setattr(testing, "destroy_distributed", recording_destroy)
    seen: list[int] = []
    testing._rank_entry(
        0, 1, str(tmp_path / "rendezvous"), lambda rank, world: seen.append(world), (), 30.0
    )
    assert seen == [1]
    assert ended == [True]
    assert not dist.is_initialized()


# run_torchrun ------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_run_torchrun_failing_script(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('hello from the worker')\nsys.exit(3)\n")
    with pytest.raises(AssertionError) as info:
        run_torchrun(str(script), nproc=1, timeout_s=60)
    message = str(info.value)
    assert f"torchrun {script} failed with exit code" in message
    assert "--- stdout ---" in message
    assert "hello from the worker" in message
    assert _wait_until_gone(str(script), 5.0) == []


@pytest.mark.distributed
def test_run_torchrun_timeout(tmp_path: Path, sleeper: Path) -> None:
    with pytest.raises(AssertionError, match=r"did not finish within 3 s \(hang\?\)"):
        run_torchrun(str(sleeper), nproc=1, args=[str(tmp_path)], timeout_s=3)
    # The helper returned without waiting for the 60 s sleep: the worker never finished.
    assert not (tmp_path / "worker0.finished").exists()
    # The launcher itself is gone (killed with its process group).
    launchers = [
        pid for pid, cmd in _command_lines(str(sleeper)).items() if "torch.distributed.run" in cmd
    ]
    assert launchers == []


@pytest.mark.distributed
def test_run_torchrun_timeout_kills_workers(tmp_path: Path, sleeper: Path) -> None:
    with pytest.raises(AssertionError, match=r"did not finish within"):
        run_torchrun(str(sleeper), nproc=1, args=[str(tmp_path)], timeout_s=3)
    if not (tmp_path / "worker0.pid").exists():
        pytest.skip("the worker did not start within the timeout")
    assert _wait_until_gone(str(sleeper), 3.0) == []


@pytest.mark.distributed
def test_run_torchrun_success(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    # One os.write per line: the two ranks share the pipe, and print() may split a line.
    script.write_text(
        "import os\n"
        "line = f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} "
        "{os.environ['OMP_NUM_THREADS']} {os.environ['EXTRA']}\\n\"\n"
        "os.write(1, line.encode())\n"
    )
    result = run_torchrun(str(script), nproc=2, timeout_s=60, env={"EXTRA": "yes"})
    assert result.returncode == 0
    assert "rank 0 of 2 1 yes" in result.stdout
    assert "rank 1 of 2 1 yes" in result.stdout
