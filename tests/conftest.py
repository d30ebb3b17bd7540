"""Shared fixtures: every test writes its results and cache into a temporary folder."""

import pytest


@pytest.fixture(autouse=True)
def _isolated_outputs(tmp_path, monkeypatch):
    """Keep results and builds of unit tests out of the checkout's build/ (the data cache stays shared)."""
    monkeypatch.setenv("ACCEL_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("ACCEL_BUILD", str(tmp_path / "build"))
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)


# torch 2.14.1 (make test-compat only): a gloo worker sometimes aborts at exit, after its work and its result files
# are done, with "terminate called without an active exception" (seen in about 1 of 5 compat runs, on a different
# multi-process test each time; never with our pinned torch 2.9). Multi-process tests rerun such a launch once in
# the compat environment; the rerun must then pass every check. Any other failure, or this one with our pins,
# fails as before.
TEARDOWN_ABORT = "terminate called without an active exception"


def compat_teardown_abort(output: str) -> bool:
    """True for the known torch 2.14 exit-time abort of a gloo worker, in `make test-compat` only."""
    import os

    return os.environ.get("ACCEL_COMPAT") == "1" and TEARDOWN_ABORT in output


# --- the tiers ------------------------------------------------------------------------------------------------------
# `make test-fast` (the edit-test loop) runs every test not marked slow; `make test` runs them all. Slow: a notebook
# (marked here, since a notebook has no decorator), and each test marked `@pytest.mark.slow` in its file: it starts
# other processes (torchrun, a course run, JupyterLab, Slurm, g++), or uses a module fixture that does, or trains for
# seconds (1.5 s or more in `pytest tests --durations=0` on the 2-core machine).


# `make test` runs on two xdist workers, one file at a time each, in collection order (`--no-loadscope-reorder`:
# xdist would otherwise send the files with the most tests first): the longest files go first, so that the short ones
# fill the end and no worker is left alone with a long file. The seconds are each file's wall time on its worker in
# a fresh clone's `make test` on the 2-core machine (2026-12-02; chapters 02, 03, 11 and 12, test_slurm and
# test_course_runner re-timed from CI's log of 2026-12-03). A file not named here goes after these, in the usual order.
COST = {"11_speedrun": 335, "12_on_a_cluster": 180, "03_momentum_adam_one_cycle": 155, "02_fullbatch_fast_loop": 110,
        "test_slurm": 100, "test_course_runner": 100, "test_course": 96, "06_distributed_data_parallel": 92,
        "test_fullbatch": 85, "test_parallel": 67, "test_reproduce": 67, "08_quantization_onnx_fpga": 56,
        "09_long_runs": 56, "05_input_pipeline": 48, "07_tpus_and_xla": 45, "test_worker_edits": 40,
        "10_deployment_toolflows": 35, "01_hardware_and_timing": 32, "test_browser": 31, "04_mixed_precision": 28,
        "test_toolflows": 16, "test_speedrun": 15, "test_checkpoint": 14, "test_peers": 11, "test_longrun": 10,
        "test_precision": 10, "test_nonfinite": 10, "test_progress": 7, "test_oom": 7, "test_pipeline": 7,
        "test_xla": 6, "test_deploy": 5}
# The website's test builds the site (about 25 s) with .venv-site (which `make test` installs) and opens every page.
COST["test_site"] = 75


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -COST.get(item.path.stem, 0))  # stable: a file's tests keep their order
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)


@pytest.fixture()
def cli_here(capsys):
    """`cli_here(*args, env=None)`: the CLI's `main` in this process (exit status, stdout and stderr, as a
    CompletedProcess): for more error paths of a command once one has gone through `python -m accelhelpers` in a new
    process, without paying another interpreter and torch import for each."""
    import os
    import subprocess
    from unittest import mock

    from accelhelpers.__main__ import main

    def run(*args, env=None) -> subprocess.CompletedProcess:
        capsys.readouterr()
        with mock.patch.dict(os.environ, env or {}):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse: --version, --help and its own usage errors
                code = e.code
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    return run


# --- one run of chapter 01, shared ------------------------------------------------------------------------------------
# The CLI test, the papermill-parameters test and the report test all read this one run (a course run through the
# CLI, with --param and small sizes), so `make test` executes chapter 01 here once, beside nbval's run and
# JupyterLab's. Under pytest-xdist every worker asks for it: the first makes it under a lock in the session's shared
# temporary folder, the others read it. JupyterLab's run (test_browser.py) uses the same small sizes; nbval runs the
# chapter's own.
CHAPTER_01_PARAMS = ["MATMUL_SIZES=[16, 32]", "ELEMENTWISE_MB=[0.03, 1]", "OVERHEAD_BATCHES=[1, 64]", "MIN_TIME=0.005",
                     "PEAK_RUNS=1"]


@pytest.fixture(scope="session")
def chapter_01_run(tmp_path_factory):
    """(out folder, returncode, stdout + stderr) of `course run --only 01 --param 'MATMUL_SIZES=[16, 32]' …`: small
    sizes (the chapter's own run is nbval's)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    out, done = shared / "chapter_01_run", shared / "chapter_01_run.json"
    with FileLock(str(shared / "chapter_01_run.lock")):
        if not done.exists():
            root = Path(__file__).resolve().parents[1]
            params = [arg for p in CHAPTER_01_PARAMS for arg in ("--param", p)]
            r = subprocess.run([sys.executable, "-m", "accelhelpers", "course", "run", "--only", "1", "--out", str(out),
                                *params], capture_output=True, text=True, cwd=root, timeout=600,
                               env={k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")})
            done.write_text(json.dumps({"returncode": r.returncode, "output": r.stdout + r.stderr}))
    record = json.loads(done.read_text())
    return out, record["returncode"], record["output"]


# --- a clock the test controls ------------------------------------------------------------------------------------
class FakeClock:
    """A clock the test controls: time moves only when a timed function says so (use exact binary fractions of a
    second, so sums compare exactly); every clock read, call and sync goes into `events`, in order."""

    def __init__(self, monkeypatch):
        self.now, self.events, self._mp = 0.0, [], monkeypatch

    def install(self, *modules) -> None:
        """Make `modules`' `time.perf_counter` this clock (each module's `import time`)."""
        for module in modules:
            self._mp.setattr(module, "time", self)

    def perf_counter(self) -> float:
        self.events.append("clock")
        return self.now

    def work(self, seconds: float, name: str = "call"):
        """A timed function that takes `seconds` of this clock."""
        def fn():
            self.events.append(name)
            self.now += seconds
        return fn

    def sync(self, device) -> None:
        self.events.append("sync")

    def unsynced_reads(self) -> int:
        """Clock reads that come straight after a call, with no sync between: a GPU's queued work left out."""
        return sum(a not in ("clock", "sync") and b == "clock" for a, b in zip(self.events, self.events[1:]))


@pytest.fixture()
def clock(monkeypatch):
    """Chapter 01's timing functions on a FakeClock (their `time.perf_counter` and `ah.timing.sync`); `clock.install`
    puts another module on it too."""
    from accelhelpers import timing

    fake = FakeClock(monkeypatch)
    fake.install(timing)
    monkeypatch.setattr(timing, "sync", fake.sync)
    return fake



# --- a trainer whose runs the test decides (chapter 11's keep_what_helps) -------------------------------------------
class StubTrainer:
    """What chapter 11's keep_what_helps needs of a Trainer, on the meta device (warm_up's steps do nothing and
    step_memory measures nothing): the test's `run(trainer, seed)` decides each recipe's time to target."""

    def __init__(self, recipe):
        import torch

        import accelhelpers as ah

        self.recipe, self.world, self.device = recipe, recipe.world, torch.device("meta")
        self.policy = ah.precision.policy_for("cpu", "fp32")

    def next_batch(self):
        return None, None

    def step(self, x, y):
        return None


@pytest.fixture()
def stub_trainer():
    """The StubTrainer class: `keep_what_helps(rows, stub_trainer(Recipe()), stub_trainer, ...)`."""
    return StubTrainer
