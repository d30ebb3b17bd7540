"""Chapter 12's jobs on a live Slurm (accelhelpers.slurm starts a one-node cluster on this machine): submission and
output, the same training on 1 and 2 tasks, preemption + requeue resuming bit-identically, a killed rank failing the
job. The scripts are the chapter's own `%%writefile` cells. Where Slurm cannot run the tests skip with the reason,
except with ACCEL_REQUIRE_SLURM=1 (CI), where that is a failure."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import accelhelpers as ah
from tests.workers import write_workers


def test_unavailable_says_why_in_one_line(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    reason = ah.slurm.unavailable()
    assert reason and "\n" not in reason and "apt-get install slurm-wlm munge" in reason


def test_without_slurm_the_chapter_explains_itself_and_runs_to_the_end(tmp_path):
    """Chapter 12 on a machine without Slurm (ACCEL_SLURM=off): one line saying why, every job cell says what it
    would have run, no error."""
    nb = Path(__file__).resolve().parents[1] / "notebooks" / "12_on_a_cluster.ipynb"
    out = tmp_path / "out.ipynb"
    r = subprocess.run([sys.executable, "-m", "papermill", str(nb), str(out), "--cwd", str(nb.parent)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "ACCEL_SLURM": "off", "ACCEL_PROFILE": "quick"})
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "No Slurm here: ACCEL_SLURM=off asks to run without Slurm" in text and "would run: sbatch" in text
    assert '"output_type": "error"' not in text


def test_config_is_one_node_without_cgroups(tmp_path):
    conf = ah.slurm.config(tmp_path, "node1", 4, 7001, 7002)
    assert "NodeName=node1 CPUs=4" in conf and "ProctrackType=proctrack/linuxproc" in conf
    assert "TaskPlugin=task/none" in conf and f"StateSaveLocation={tmp_path}/state" in conf
    assert ah.slurm.fields("JobId=3 JobState=FAILED ExitCode=1:0") == {"JobId": "3", "JobState": "FAILED",
                                                                       "ExitCode": "1:0"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = ah.slurm.unavailable()
    if reason:
        if os.environ.get("ACCEL_REQUIRE_SLURM") == "1":
            pytest.fail(f"ACCEL_REQUIRE_SLURM=1 but no Slurm can run here: {reason}")
        pytest.skip(reason)
    c = ah.slurm.start(tmp_path_factory.mktemp("slurm"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("jobs")
    write_workers("12", folder)
    return folder


def run(cluster, jobs, script, name, *options, args=(), timeout=180):
    out = jobs / name
    out.mkdir()
    job = cluster.sbatch(jobs / script, "--chdir", str(jobs), "--job-name", name, *options,
                         args=("--out", out, *args))
    return job, out


def test_a_job_runs_every_task_and_its_output_comes_back(cluster, jobs):
    job = cluster.sbatch(jobs / "hello.sbatch", "--chdir", str(jobs))
    info = cluster.wait(job, timeout=60)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0"
    out = (jobs / f"hello-{job}.out").read_text()
    assert sorted(line.split(",")[0] for line in out.splitlines() if line.startswith("task ")) == [
        "task 0 of 2", "task 1 of 2"]


def test_one_and_two_tasks_train_the_same_model(cluster, jobs):
    finals = {}
    for n in (1, 2):
        job, out = run(cluster, jobs, "ddp_tasks.sbatch", f"tasks{n}", "--ntasks", str(n), args=("--steps", 12))
        info = cluster.wait(job, timeout=180)
        assert info["JobState"] == "COMPLETED", (out.parent / f"tasks{n}-{job}.out").read_text()
        finals[n] = torch.load(out / "final.pt")
    # float32 summation order only: DDP's average of 2 halves is the 1-task update
    assert ah.metrics.max_abs_diff(finals[1], finals[2]) < 1e-4


def test_a_requeued_job_resumes_to_the_same_bits(cluster, jobs):
    args = ("--steps", 30, "--every", 5, "--step-s", 0.05)
    job, straight = run(cluster, jobs, "ddp_tasks.sbatch", "straight", args=args)
    assert cluster.wait(job, timeout=180)["JobState"] == "COMPLETED"
    job, out = run(cluster, jobs, "ddp_tasks.sbatch", "requeued", args=args)
    deadline = time.monotonic() + 120
    while not any(ah.checkpoint.read_checkpoint(p)["step"] >= 10 for p in (out / "ckpt").glob("step_*.pt")):
        assert time.monotonic() < deadline, "no checkpoint of step 10 in time"
        time.sleep(0.1)
    assert cluster.requeue(job) > 0  # Slurm had put the requeued job's begin time in the future
    info = cluster.wait(job, timeout=180)
    log = (jobs / f"requeued-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert "preempted (SIGTERM)" in log and "attempt 2: 2 ranks, starting at step" in log
    a, b = torch.load(straight / "final.pt"), torch.load(out / "final.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    states = [h["JobState"] for h in cluster.history() if h["JobId"] == str(job)]
    assert states == ["PENDING", "COMPLETED"]  # one line per attempt in the job history


def test_a_killed_rank_fails_the_job_with_its_reason(cluster, jobs):
    t0 = time.monotonic()
    job, out = run(cluster, jobs, "ddp_tasks.sbatch", "crash", args=("--steps", 30, "--step-s", 0.05,
                                                                     "--die-rank", 1, "--die-at", 5))
    info = cluster.wait(job, timeout=120)
    log = (jobs / f"crash-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["Reason"] == "NonZeroExitCode", log
    assert "killing myself at step 5" in log and "task 1: Killed" in log
    assert not (out / "final.pt").exists() and time.monotonic() - t0 < 60  # failed, not hung to a timeout
