"""Chapter 09's worker scripts, launched from the tests: the scripts that the chapter's `%%writefile` cells write
(tests/workers.py), so a test runs the code the learner reads and edits, started with Python or under torchrun on
2 ranks, each bounded by a timeout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import accelhelpers as ah
from conftest import compat_teardown_abort
from tests.workers import write_workers

NPROC = 2
ENV = {"TQDM_DISABLE": "1"}


def workers(folder: Path) -> dict[str, Path]:
    """Chapter 09's scripts written into `folder`: {file name: path}."""
    return write_workers("09", folder)


def start(script: Path, *args: object) -> subprocess.Popen:
    """`python SCRIPT ARGS` in its own process group, output piped (ah.launch.start)."""
    return ah.launch.start([sys.executable, str(script), *map(str, args)], env=ENV)


def torchrun_env() -> dict[str, str]:
    """What the chapter's `start` gives its torchrun jobs: the GPUs hidden when the ranks cannot have one each."""
    return {**ENV, **ah.parallel.rank_env(NPROC)}


def torchrun(script: Path, *args: object, restarts: int = 0) -> subprocess.Popen:
    """`torchrun --standalone --nproc-per-node=2 [--max-restarts=N] SCRIPT ARGS` in its own process group."""
    return ah.launch.start(ah.launch.torchrun_cmd(script, *args, nproc=NPROC, max_restarts=restarts),
                           env=torchrun_env())


def finish(proc: subprocess.Popen, timeout: float = 300, rerun: bool = True) -> tuple[int | None, str]:
    """(exit status, output) of a started script; past `timeout` its process group is killed and the test fails.
    A torchrun job that hit the known torch 2.14 exit-time abort (make test-compat only) runs once more."""
    try:
        run = ah.launch.finish(proc, timeout, echo=False, check=False)
    except TimeoutError as e:
        pytest.fail(f"hung for more than {timeout} s: {e}")
    if rerun and run.returncode != 0 and compat_teardown_abort(run.output):
        return finish(ah.launch.start(proc.args, env=torchrun_env()), timeout, rerun=False)
    return run.returncode, run.output


def kill_all(procs) -> None:
    """Kill what a test that failed early left running."""
    for proc in procs:
        if proc.poll() is None:
            ah.launch.kill(proc)


class Jobs:
    """Jobs started together, each one's outcome read once and kept: several tests may ask about one job."""

    def __init__(self, folder: Path, procs: dict[str, subprocess.Popen]) -> None:
        self.folder, self.procs, self.done = folder, procs, {}

    def result(self, name: str, timeout: float = 300) -> tuple[int | None, str]:
        """(exit status, output) of job `name`, waiting for it the first time."""
        if name not in self.done:
            self.done[name] = finish(self.procs[name], timeout)
        return self.done[name]

    def kill(self) -> None:
        """Kill what is still running (after a test that failed early)."""
        kill_all(self.procs.values())
