"""Chapter 12's jobs on a live Slurm (accelhelpers.slurm starts a one-node cluster on this machine): submission and
output, the same training on 1 and 2 tasks, preemption + requeue resuming bit-identically, a killed rank failing the
job; and with fake GPUs (a GPU GRES of character devices), the GPU template's tasks each given the
CUDA_VISIBLE_DEVICES a GPU cluster gives them, and every rank's device and backend decided from that. The scripts are
the chapter's own `%%writefile` cells. Where Slurm cannot run the tests skip with the reason, except with
ACCEL_REQUIRE_SLURM=1 (CI), where that is a failure."""

import json
import os
import re
import shutil
import signal
import stat
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


@pytest.mark.slow
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
    assert "SlurmdParameters" not in conf and "SlurmdParameters=config_overrides" in ah.slurm.config(
        tmp_path, "node1", 64, 7001, 7002, overrides=True)  # more CPUs than the machine: slurmd must not check
    assert "TaskPlugin=task/none" in conf and f"StateSaveLocation={tmp_path}/state" in conf
    assert ah.slurm.fields("JobId=3 JobState=FAILED ExitCode=1:0") == {"JobId": "3", "JobState": "FAILED",
                                                                       "ExitCode": "1:0"}


def test_config_with_gpus_adds_a_gres_and_leaves_the_cpu_config_alone(tmp_path):
    conf = ah.slurm.config(tmp_path, "node1", 4, 7001, 7002, gpus=4)
    assert "GresTypes=gpu" in conf and "SlurmdParameters=config_overrides" in conf
    assert "NodeName=node1 CPUs=4 Gres=gpu:4 State=UNKNOWN" in conf
    assert ah.slurm.gres_config(tmp_path, 4) == f"AutoDetect=off\nName=gpu File={tmp_path}/dev/nvidia[0-3]\n"
    plain = ah.slurm.config(tmp_path, "node1", 4, 7001, 7002)
    assert "Gres" not in plain and "SlurmdParameters" not in plain and "NodeName=node1 CPUs=4 State=UNKNOWN" in plain
    with pytest.raises(ValueError, match="0 or more GPUs"):
        ah.slurm.start(tmp_path, gpus=-1)


def test_without_mknod_the_gpus_are_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(ah.slurm, "_capable", lambda cap: False)
    assert ah.slurm.unavailable() is None  # without GPUs nothing is missing
    reason = ah.slurm.unavailable(gpus=4)
    assert reason and "\n" not in reason and "CAP_MKNOD" in reason and "start(gpus=0)" in reason


def test_tasks_on_node_reads_uneven_layouts():
    """SLURM_TASKS_PER_NODE compresses repeats: "2(x3),1" is three nodes of 2 tasks, then one of 1. The first
    count alone (what train.py read before) is wrong on the last node."""
    layout = "2(x3),1"
    assert [ah.slurm.tasks_on_node(layout, n) for n in range(4)] == [2, 2, 2, 1]
    assert [ah.slurm.tasks_on_node("8,4", n) for n in (0, 1)] == [8, 4] and ah.slurm.tasks_on_node("2", 0) == 2
    for bad, node in (("2(x3),1", 4), ("two", 0)):
        with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
            ah.slurm.tasks_on_node(bad, node)


def test_a_cluster_echoes_its_commands_as_a_learner_would_type_them(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_run(cmd, **kw):
        calls.append((cmd, kw["cwd"]))
        return subprocess.CompletedProcess(cmd, 0, "7\n", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    c = ah.slurm.Cluster(tmp_path, "node1", 2, echo=True, cwd=tmp_path)
    assert c.sbatch("train job.sbatch", "--job-name", "a", args=("--out", Path("x"))) == 7
    c.run("squeue", echo=False)
    assert capsys.readouterr().out == "$ sbatch --parsable --job-name a 'train job.sbatch' --out x\n"
    assert calls == [(["sbatch", "--parsable", "--job-name", "a", "train job.sbatch", "--out", "x"], tmp_path),
                     (["squeue"], tmp_path)]


def test_a_requeued_job_is_started_in_the_second_after_its_requeue(tmp_path, monkeypatch):
    """slurmd refuses a job's credential created in the second it revoked the last one (the requeue): a requeued job
    that train.py ended at once was started in that second and killed ("Job 9 already killed, do not launch batch
    job"). start_now waits for the next whole second; a fake clock, so no second passes here."""
    clock = [1000.6]
    monkeypatch.setattr(ah.slurm.time, "time", lambda: clock[0])
    monkeypatch.setattr(ah.slurm.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + max(s, 0.0)))
    c = ah.slurm.Cluster(tmp_path, "node1", 2)
    pending = {"JobState": "PENDING", "Restarts": "1", "StartTime": time.strftime("%Y-%m-%dT%H:%M:%S")}
    monkeypatch.setattr(c, "wait", lambda *a, **k: pending)
    updated = []
    monkeypatch.setattr(c, "run", lambda *args, **kw: updated.append((args, clock[0])))
    c.start_now(7)
    assert [args for args, _ in updated] == [("scontrol", "update", "jobid=7", "starttime=now")]
    assert int(updated[0][1]) > int(1000.6)  # not in the second the job was seen back in the queue


def test_a_tasks_hardware_is_its_visible_gpus_and_its_own_binding(monkeypatch):
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "1")  # this process's own Slurm variables are set aside
    hw = ah.slurm.task_hardware({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_GPUS_PER_NODE": "4"})
    assert (hw.kind, hw.gpus, hw.gpus_per_task, hw.capability) == ("cuda", 4, False, (8, 0))
    hw = ah.slurm.task_hardware({"CUDA_VISIBLE_DEVICES": "2", "SLURM_GPUS_PER_TASK": "1"})
    assert (hw.gpus, hw.gpus_per_task) == (1, True)
    assert os.environ["SLURM_GPUS_PER_TASK"] == "1"  # and given back


def live(reason: str | None) -> None:
    """Skip a test that needs a running Slurm where it cannot run (fail instead under ACCEL_REQUIRE_SLURM=1)."""
    if reason:
        if os.environ.get("ACCEL_REQUIRE_SLURM") == "1":
            pytest.fail(f"ACCEL_REQUIRE_SLURM=1 but no Slurm can run here: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("jobs")
    write_workers("12", folder)
    return folder


# Two jobs that mostly wait are submitted as the cluster starts, so that their waits overlap the other tests' jobs:
# the time-limit job (chapter 12's ddp_limit.sbatch: --time=1, --signal=USR1@20) waits 10-40 s for its signal, asleep
# (30 steps of 1.5 s outlast the latest signal; the resumed attempt runs at speed), and the hung-rank job waits for its
# 3-s collective timeout. The node has 6 CPUs on any machine: 2 for each of them, 2 for the other tests' jobs.
BACKGROUND = {
    "limited": ("ddp_limit.sbatch", ("--steps", 30, "--every", 5, "--check-every", 1, "--step-s", 1.5,
                                     "--fast-resume")),
    "hung": ("ddp_tasks.sbatch", ("--steps", 30, "--die-rank", 1, "--die-at", 5, "--hang", "--timeout-s", 3)),
}
SUBMITTED: dict[str, tuple[int, Path]] = {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, jobs):
    live(ah.slurm.unavailable())
    c = ah.slurm.start(tmp_path_factory.mktemp("slurm"), cpus=6)
    for name, (script, args) in BACKGROUND.items():
        SUBMITTED[name] = run(c, jobs, script, name, args=args)
    yield c
    c.stop()


def run(cluster, jobs, script, name, *options, args=(), timeout=180):
    out = jobs / name
    out.mkdir()
    job = cluster.sbatch(jobs / script, "--chdir", str(jobs), "--job-name", name, *options,
                         args=("--out", out, *args))
    return job, out


@pytest.mark.slow
def test_a_job_runs_every_task_and_its_output_comes_back(cluster, jobs):
    job = cluster.sbatch(jobs / "hello.sbatch", "--chdir", str(jobs))
    info = cluster.wait(job, timeout=60)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0"
    out = (jobs / f"hello-{job}.out").read_text()
    assert sorted(line.split(",")[0] for line in out.splitlines() if line.startswith("task ")) == [
        "task 0 of 2", "task 1 of 2"]


def test_the_cluster_schedules_a_batch_job_when_it_is_submitted(cluster):
    """Slurm's default lets the scheduling of a batch job wait up to 3 s (batch_sched_delay, to batch submissions on a
    busy cluster): on this one-node cluster that was 3 s of every job. The running controller reports it off."""
    config = cluster.run("scontrol", "show", "config").stdout
    assert re.search(r"SchedulerParameters\s*=\s*\S*batch_sched_delay=0", config), config


@pytest.mark.slow
def test_one_and_two_tasks_train_the_same_model(cluster, jobs):
    finals = {}
    for n in (1, 2):
        job, out = run(cluster, jobs, "ddp_tasks.sbatch", f"tasks{n}", "--ntasks", str(n), args=("--steps", 12))
        info = cluster.wait(job, timeout=180)
        assert info["JobState"] == "COMPLETED", (out.parent / f"tasks{n}-{job}.out").read_text()
        finals[n] = torch.load(out / "final.pt")
    # float32 summation order only: DDP's average of 2 halves is the 1-task update
    assert ah.metrics.max_abs_diff(finals[1], finals[2]) < 1e-4


@pytest.fixture(scope="module")
def straight(cluster, jobs):
    """The uninterrupted 30-step run that the requeued runs must end on, bit for bit."""
    job, out = run(cluster, jobs, "ddp_tasks.sbatch", "straight", args=("--steps", 30, "--every", 5))
    assert cluster.wait(job, timeout=180)["JobState"] == "COMPLETED"
    return torch.load(out / "final.pt")


@pytest.mark.slow
def test_a_requeued_job_resumes_to_the_same_bits(cluster, jobs, straight):
    args = ("--steps", 30, "--every", 5, "--step-s", 0.05)
    job, out = run(cluster, jobs, "ddp_tasks.sbatch", "requeued", args=args)
    deadline = time.monotonic() + 120
    while not any(ah.longrun.read_checkpoint(p)["step"] >= 10 for p in (out / "ckpt").glob("step_*.pt")):
        assert time.monotonic() < deadline, "no checkpoint of step 10 in time"
        time.sleep(0.1)
    assert cluster.requeue(job) > 0  # Slurm had put the requeued job's begin time in the future
    info = cluster.wait(job, timeout=180)
    log = (jobs / f"requeued-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert "preempted (SIGTERM)" in log and "attempt 2: 2 ranks, starting at step" in log
    b = torch.load(out / "final.pt")
    assert all(torch.equal(straight[k], b[k]) for k in straight)
    states = [h["JobState"] for h in cluster.history() if h["JobId"] == str(job)]
    assert states == ["PENDING", "COMPLETED"]  # one line per attempt in the job history
    sacct = cluster.run("sacct", "-c", "-n", "--format=JobID,State").stdout.split()
    assert [state for jid, state in zip(sacct[::2], sacct[1::2]) if jid == str(job)] == states  # sacct reads the log


@pytest.mark.slow
def test_a_job_near_its_time_limit_saves_requeues_itself_and_resumes_to_the_same_bits(cluster, jobs, straight):
    """The chapter's ddp_limit.sbatch (--time=1, --signal=USR1@20): every task gets SIGUSR1 10-40 s into the job;
    train.py saves and runs `scontrol requeue`; the next attempt resumes. Slurm alone would end the job at its limit
    (TIMEOUT) and never requeue it; a train.py that does not catch SIGUSR1 dies of it (FAILED)."""
    job, out = SUBMITTED["limited"]  # submitted by the cluster fixture
    cluster.start_now(job, restarts=1, timeout=120)  # requeued by train.py: start it without cred_expire's wait
    info = cluster.wait(job, timeout=120)
    log = (jobs / f"limited-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert re.search(r"\[rank0\] SIGUSR1 [\d.]+ s into this attempt: saved step \d+, \$ scontrol requeue", log), log
    assert "attempt 2: 2 ranks, starting at step" in log and "time limit 1:00" in log
    b = torch.load(out / "final.pt")
    assert all(torch.equal(straight[k], b[k]) for k in straight)


@pytest.mark.slow
def test_a_killed_rank_fails_the_job_with_its_reason(cluster, jobs):
    t0 = time.monotonic()
    job, out = run(cluster, jobs, "ddp_tasks.sbatch", "crash", args=("--steps", 30, "--step-s", 0.05,
                                                                     "--die-rank", 1, "--die-at", 5))
    info = cluster.wait(job, timeout=120)
    log = (jobs / f"crash-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["Reason"] == "NonZeroExitCode", log
    assert "killing (SIGKILL) myself at step 5" in log and "task 1: Killed" in log
    assert not (out / "final.pt").exists() and time.monotonic() - t0 < 60  # failed, not hung to a timeout


@pytest.mark.slow
def test_a_hung_rank_is_ended_by_the_collective_timeout(cluster, jobs):
    """Rank 1 stops itself (SIGSTOP): alive, so srun's --kill-on-bad-exit sees nothing; rank 0 waits in the
    all-reduce until the process group's 3-s timeout, raises, exits 1, and only then does srun end the job."""
    job, out = SUBMITTED["hung"]  # submitted by the cluster fixture
    info = cluster.wait(job, timeout=120)
    log = (jobs / f"hung-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and not (out / "final.pt").exists(), log
    stopped = float(re.search(r"\[rank1\] stopping \(SIGSTOP\) myself at step 5, at ([\d.]+)", log)[1])
    ended = time.mktime(time.strptime(info["EndTime"], "%Y-%m-%dT%H:%M:%S"))  # Slurm's record, whole seconds
    assert 3 - 1 <= ended - stopped < 30, log  # not before the timeout, and not PyTorch's default 30 minutes
    assert re.search(r"\[rank0\]: RuntimeError: .*Timed out", log), log
    assert re.search(r"srun: error: \S+: task 0: Exited with exit code 1", log), log  # rank 0's own error


# --- with GPUs: a GPU GRES of fake devices, bound to the tasks by Slurm's own code ----------------------------------
GPUS = 4
SHAPE = ("--nodes=1", f"--ntasks-per-node={GPUS}", "--cpus-per-task=1")  # the template's N x G, for one node


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    live(ah.slurm.unavailable(gpus=GPUS))
    c = ah.slurm.start(tmp_path_factory.mktemp("slurm-gpu"), gpus=GPUS)
    yield c
    c.stop()


def task_envs(folder: Path) -> list[dict[str, str]]:
    """What each task of a step wrote with the chapter's task_env.py, in rank order."""
    envs = [json.loads(p.read_text()) for p in folder.glob("task*.json")]
    return sorted(envs, key=lambda env: int(env["SLURM_PROCID"]))


def decision(env: dict[str, str]) -> tuple[torch.device, str, str]:
    """chapter 06's rank_placement for the task Slurm started with `env` (local world read as train.py reads it),
    and the node's GPU its device is."""
    local_world = ah.slurm.tasks_on_node(env["SLURM_TASKS_PER_NODE"], int(env["SLURM_NODEID"]))
    device, backend = ah.parallel.rank_placement(ah.slurm.task_hardware(env), int(env["SLURM_LOCALID"]), local_world)
    visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",")
    return device, backend, visible[device.index] if device.type == "cuda" else "-"


@pytest.mark.slow
@pytest.mark.parametrize("binding", ["per node", "per task"])
def test_the_gpu_template_gives_every_rank_its_own_gpu(gpu_cluster, jobs, binding):
    """Chapter 12's N x G template on this one node: as written (--gpus-per-node, every task sees every GPU: rank k
    takes cuda:k) and with the line a cluster's docs often give instead (--gpus-per-task=1: task k sees only GPU k,
    so its GPU is cuda:0 and cuda:LOCAL_RANK names a device it cannot see)."""
    template = (jobs / "ddp_gpus.sbatch").read_text()
    assert re.search(r"^#SBATCH --gpus-per-node=\d+", template, re.M) and 'python "$@"' in template
    script, options = jobs / "ddp_gpus.sbatch", (f"--gpus-per-node={GPUS}",)
    if binding == "per task":
        script, options = jobs / "ddp_gpus_per_task.sbatch", ()
        script.write_text(re.sub(r"^#SBATCH --gpus-per-node=.*$", "#SBATCH --gpus-per-task=1", template, flags=re.M))
    out = jobs / f"envs-{binding.replace(' ', '-')}"
    job = gpu_cluster.sbatch(script, "--chdir", str(jobs), "--output", f"{out.name}-%j.out", *SHAPE, *options,
                             args=("task_env.py", out.name))
    info = gpu_cluster.wait(job, timeout=60)
    assert info["JobState"] == "COMPLETED", (jobs / f"{out.name}-{job}.out").read_text()
    envs = task_envs(out)
    assert [env["SLURM_LOCALID"] for env in envs] == ["0", "1", "2", "3"]
    visible = [env["CUDA_VISIBLE_DEVICES"] for env in envs]
    decided = [decision(env) for env in envs]
    if binding == "per task":
        assert visible == ["0", "1", "2", "3"] and all(env["SLURM_GPUS_PER_TASK"] == "1" for env in envs)
        assert [(str(d), b) for d, b, _ in decided] == [("cuda:0", "nccl")] * GPUS
        # the negative control: cuda:LOCAL_RANK is a device ranks 1-3 cannot see
        assert [int(env["SLURM_LOCALID"]) < len(env["CUDA_VISIBLE_DEVICES"].split(",")) for env in envs] == [
            True, False, False, False]
    else:
        assert visible == ["0,1,2,3"] * GPUS and not any("SLURM_GPUS_PER_TASK" in env for env in envs)
        assert [(str(d), b) for d, b, _ in decided] == [(f"cuda:{k}", "nccl") for k in range(GPUS)]
    assert sorted(gpu for _, _, gpu in decided) == ["0", "1", "2", "3"]  # every rank on a GPU of its own


@pytest.mark.slow
@pytest.mark.parametrize("options", [("--gpus-per-task=1",), (f"--gpus-per-node={GPUS}", "--gpu-bind=single:1")],
                         ids=["srun --gpus-per-task=1", "srun --gpu-bind=single:1"])
def test_a_binding_srun_alone_asks_for(gpu_cluster, jobs, options):
    """Slurm binds each task its own GPU here too, but sets SLURM_GPUS_PER_TASK in a task only when the allocation
    (sbatch, salloc) asked --gpus-per-task; a binding srun alone asks for shows only as SLURMD_TRES_BIND=gpu:...,
    which Hardware.here reads: each rank on cuda:0 with nccl (before it did, each saw one GPU for four local ranks
    and went to the CPU)."""
    out = jobs / f"envs-srun-{len(options)}"
    gpu_cluster.run("srun", "--chdir", str(jobs), "-n", str(GPUS), *options, "python", "task_env.py", out.name)
    envs = task_envs(out)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0", "1", "2", "3"]  # Slurm did bind each its own
    assert all("SLURM_GPUS_PER_TASK" not in env and env["SLURMD_TRES_BIND"].startswith("gpu:") for env in envs)
    decided = [(str(d), b, gpu) for d, b, gpu in map(decision, envs)]
    assert decided == [("cuda:0", "nccl", str(k)) for k in range(GPUS)]


@pytest.mark.slow
def test_the_fake_gpus_live_in_the_clusters_folder_and_go_when_it_stops(gpu_cluster):
    """Last of the GPU tests: it stops the cluster."""
    devices = sorted((gpu_cluster.folder / "dev").iterdir())
    assert [p.name for p in devices] == [f"nvidia{k}" for k in range(GPUS)]
    modes = [p.lstat() for p in devices]
    assert all(stat.S_ISCHR(m.st_mode) for m in modes)
    assert [(os.major(m.st_rdev), os.minor(m.st_rdev)) for m in modes] == [(195, k) for k in range(GPUS)]
    assert f"File={gpu_cluster.folder}/dev/nvidia[0-3]" in (gpu_cluster.folder / "gres.conf").read_text()
    assert gpu_cluster.run("sinfo", "-h", "-o", "%G").stdout.strip() == f"gpu:{GPUS}"
    gpu_cluster.stop()
    assert not (gpu_cluster.folder / "dev").exists() and (gpu_cluster.folder / "slurm.conf").exists()


def test_a_stop_signal_during_start_up_waits_for_the_handler_instead_of_killing_the_task(tmp_path):
    """Slurm's warning comes when Slurm's clock says, not when train.py is ready: a SIGTERM (or SIGUSR1) that arrives
    while train.py still imports torch would end the task (their default action; the CI failure of a loaded host).
    train.py blocks both from its first lines, so the signal waits and the loop's handler saves and stops."""
    workers = write_workers("12", tmp_path / "jobs")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(ah.launch.free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(workers["train.py"]), "--out", str(tmp_path / "run"), "--steps", "20",
                             "--check-every", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    time.sleep(0.5)  # past Python's start and train.py's first lines; torch's import takes longer on any machine
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "[rank0] preempted (SIGTERM): saved step 1, exiting" in out, out
