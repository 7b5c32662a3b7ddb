"""How often a finished multi-rank job fails on the way out: launch jobs N times, count.

Usage: python benchmarks/exit_check.py [--launches N] [--jobs NAME ...] [--docs PAGE ...]
                                        [--nproc 2] [--out results.json] [--logs DIR]
(or ``nox -s exit_check -- --launches 100``).

Every launch is ``torchrun --standalone --nproc-per-node NPROC`` of a correct job (2
gloo ranks on CPU by default) in a fresh working directory. A launch *fails* when
torchrun exits non-zero; it is an *abort* when a rank died of a signal or the output
shows the interpreter-teardown crash ("terminate called without an active
exception", "Fatal Python error"). Jobs:

- ``lora``: ``exit_jobs/lora_balance_job.py`` (LoRA on a tiny LLaVA with
  ``balance_media=True``, adapter and merged exports, ``generate()``, a DCP checkpoint),
  ending with ``destroy_distributed()``; ``lora-return`` and ``lora-exit_rank`` end by
  returning and with ``exit_rank()``.
- ``late-destroy``, ``late-return``, ``late-exit_rank``: ``exit_jobs/late_collective_job.py``,
  an FSDP step whose last act is an all-reduce of the loss for the log: the timing that
  makes the crash frequent.
- ``docs:PAGE``: a documentation page's python blocks as the docs tests run them
  (``--docs all`` for every page with examples).

Not a CI test (it takes minutes and counts a rare event); the numbers and the command
go to docs/benchmark.md. The exit status is 1 when any launch failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS_DIR = Path(__file__).resolve().parent / "exit_jobs"
#: Output that marks a crash in the interpreter's teardown or a rank killed by a signal.
ABORT = re.compile(
    r"terminate called without an active exception|Fatal Python error"
    r"|exitcode\s*:\s*-(?:6|11)\b|Signal (?:6|11) \(SIG(?:ABRT|SEGV)\)"
)
#: name -> (script, arguments after the output directory or none)
JOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lora": ("lora_balance_job.py", ("{out}", "--ending", "destroy")),
    "lora-return": ("lora_balance_job.py", ("{out}", "--ending", "return")),
    "lora-exit_rank": ("lora_balance_job.py", ("{out}", "--ending", "exit_rank")),
    "late-destroy": ("late_collective_job.py", ("--ending", "destroy")),
    "late-return": ("late_collective_job.py", ("--ending", "return")),
    "late-exit_rank": ("late_collective_job.py", ("--ending", "exit_rank")),
}
DEFAULT_JOBS = ("lora", "late-destroy", "late-return")
DEFAULT_DOCS = ("getting-started.md",)


@dataclass
class Tally:
    """The launches of one job."""

    job: str
    launches: int = 0
    nonzero: int = 0
    aborts: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # "launch i: rc=..., log ..."


def _docs_scripts(pages: list[str]) -> dict[str, str]:
    """``docs:PAGE`` -> the page's script, built as tests/test_docs_examples.py does."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_docs_examples import collect

    found = {page.page: page for page in collect()}
    wanted = sorted(found) if pages == ["all"] else pages
    missing = [p for p in wanted if p not in found]
    if missing:
        raise SystemExit(f"no docs page with python examples: {missing}; pages: {sorted(found)}")
    return {f"docs:{name}": found[name].script() for name in wanted}


def _launch(script: Path, args: list[str], nproc: int, timeout_s: float, cwd: Path) -> tuple:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        env.pop(name, None)
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
        return process.returncode, output, False
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        return None, output, True


def run(args: argparse.Namespace) -> list[Tally]:
    scripts: dict[str, tuple[Path | str, tuple[str, ...]]] = {
        name: (JOBS_DIR / JOBS[name][0], JOBS[name][1]) for name in args.jobs
    }
    scripts.update({name: (text, ()) for name, text in _docs_scripts(args.docs).items()})
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    tallies = []
    for name, (script, job_args) in scripts.items():
        tally = Tally(name)
        for index in range(1, args.launches + 1):
            with tempfile.TemporaryDirectory(prefix="exit-check-") as tmp:
                cwd = Path(tmp)
                if isinstance(script, str):  # a docs page: written as the docs tests do
                    path = cwd / f"docs-{Path(name.removeprefix('docs:')).stem}.py"
                    path.write_text(script, encoding="utf-8")
                else:
                    path = script
                argv = [a.replace("{out}", str(cwd / "out")) for a in job_args]
                start = time.perf_counter()
                code, output, timed_out = _launch(path, argv, args.nproc, args.timeout, cwd)
                tally.seconds += time.perf_counter() - start
            tally.launches += 1
            if code == 0:
                continue
            tally.nonzero += 1
            tally.timeouts += int(timed_out)
            tally.aborts += int(bool(ABORT.search(output)))
            log = logs / f"{name.replace(':', '_').replace('/', '_')}-{index}.log"
            log.write_text(output)
            tally.failures.append(f"launch {index}: rc={code}, log {log}")
            print(f"  {name} launch {index}: rc={code} (log {log})", flush=True)
        print(
            f"{name}: {tally.nonzero} non-zero exits, {tally.aborts} aborts, "
            f"{tally.timeouts} timeouts in {tally.launches} launches "
            f"({tally.seconds / max(tally.launches, 1):.1f} s each)",
            flush=True,
        )
        tallies.append(tally)
    return tallies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--launches", type=int, default=20, help="launches per job")
    parser.add_argument(
        "--jobs", nargs="*", default=list(DEFAULT_JOBS), choices=sorted(JOBS), metavar="JOB"
    )
    parser.add_argument(
        "--docs",
        nargs="*",
        default=list(DEFAULT_DOCS),
        metavar="PAGE",
        help="docs pages to launch (path under docs/, or 'all'); none: --docs",
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--out", default=None, help="write the counts as JSON here")
    parser.add_argument("--logs", default="exit-check-logs", help="logs of failed launches")
    args = parser.parse_args(argv)
    if args.launches < 1:
        parser.error(f"--launches must be >= 1, got {args.launches}")
    import torch

    print(
        f"{args.launches} launches per job, {args.nproc} ranks, torch {torch.__version__}, "
        f"python {sys.version.split()[0]}",
        flush=True,
    )
    tallies = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(t) for t in tallies], indent=2))
    return int(any(t.nonzero for t in tallies))


if __name__ == "__main__":
    raise SystemExit(main())
