"""A real Slurm on this one machine (Debian's slurm-wlm: slurmctld + slurmd, with munge), for the cluster chapter and
its tests: written configuration, started in seconds, stopped and its folder left for reading. Needs root and the
packages (`make slurm` installs them where apt-get can); anywhere else `unavailable()` says why in one line.
`start(gpus=4)` gives the node a GPU GRES of four fake GPUs (character devices made in the cluster's folder), so that
--gpus-per-task, --gpus-per-node and --gpu-bind set each task's CUDA_VISIBLE_DEVICES as on a GPU cluster."""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from . import launch, results
from .device import Hardware as _Hardware

BINARIES = ("sbatch", "srun", "scontrol", "sinfo", "slurmctld", "slurmd", "munged")
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
GPU_MAJOR = 195  # the NVIDIA driver's /dev/nvidia0, /dev/nvidia1, ... (Linux's devices.txt: 195 char, Nvidia graphics)
CAP_MKNOD = 27   # the capability mknod(2) of a device file needs (linux/capability.h)
# What a fake GPU stands for: an A100 80GB (compute capability 8.0, https://developer.nvidia.com/cuda-gpus; 80 GB,
# NVIDIA's A100 datasheet), the GPU of tests/test_hardware.py's 8-GPU node.
FAKE_GPU = {"gpu": "NVIDIA A100-SXM4-80GB", "capability": (8, 0), "gpu_memory_gb": 80.0}
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
        "DEADLINE")


class SlurmUnavailable(RuntimeError):
    """No Slurm can run here (not Linux, not root, or the packages are missing); the message says what to do."""


class SlurmError(RuntimeError):
    """A Slurm command failed or a job did not reach the expected state in time."""


def unavailable(gpus: int = 0) -> str | None:
    """Why a local Slurm (with `gpus` fake GPUs) cannot run here, in one line; None when it can (ACCEL_SLURM=off: as
    if it could not)."""
    if os.environ.get("ACCEL_SLURM") == "off":
        return "ACCEL_SLURM=off asks to run without Slurm"
    if not sys.platform.startswith("linux"):
        return f"Slurm runs on Linux; this is {sys.platform}"
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): on Debian/Ubuntu as root, "
                "`apt-get install slurm-wlm munge` (or `make slurm`)")
    if os.geteuid() != 0:
        return "a local slurmctld/slurmd needs root (they start jobs as any user); run as root, or on a real cluster"
    if gpus and not _capable(CAP_MKNOD):
        return ("the fake GPUs are device files, and making one needs CAP_MKNOD, which this root lacks (a container "
                "without it?); start(gpus=0) runs without GPUs")
    return None


def _capable(cap: int) -> bool:
    """This process holds Linux capability `cap` (CapEff in /proc/self/status)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return False
    eff = re.search(r"^CapEff:\s*([0-9a-f]+)$", status, re.M)
    return bool(eff and int(eff.group(1), 16) >> cap & 1)


def fake_gpus(folder: Path, n: int) -> list[Path]:
    """`n` character devices like the NVIDIA driver's (major 195, minors 0..n-1) in `folder`/dev, never in /dev:
    Slurm's GPU GRES only names files (gres.conf File=), so these are what it binds to tasks. No GPU is behind them:
    opening one fails."""
    dev = folder / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    paths = [dev / f"nvidia{i}" for i in range(n)]
    for i, path in enumerate(paths):
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(GPU_MAJOR, i))
        except PermissionError:
            raise SlurmUnavailable(f"mknod {path} was refused (it needs root with CAP_MKNOD); start(gpus=0) runs "
                                   "without GPUs") from None
    return paths


def gres_config(folder: Path, gpus: int) -> str:
    """gres.conf naming `gpus` fake GPUs in `folder`/dev, autodetection off (NVML would find no GPU, or real ones)."""
    files = f"nvidia[0-{gpus - 1}]" if gpus > 1 else "nvidia0"
    return f"AutoDetect=off\nName=gpu File={folder}/dev/{files}\n"


def _munge() -> None:
    """Start munged (Slurm's authentication) as the munge user, unless it already runs."""
    if MUNGE_SOCKET.exists() and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return
    MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
    r = subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SlurmUnavailable(f"munged did not start: {r.stderr.strip() or r.stdout.strip()}")


def task_hardware(env: Mapping[str, str]) -> _Hardware:
    """The hardware of a task that Slurm started with environment `env`, each fake GPU an A100 (FAKE_GPU): as many
    GPUs as its CUDA_VISIBLE_DEVICES names, and the per-task binding as Hardware.here reads it from the task's SLURM*
    variables (this process's own set aside). This process's CUDA_VISIBLE_DEVICES is left alone: CUDA reads it once
    per process."""
    hw = _Hardware.here("cpu", env={k: v for k, v in env.items() if k.startswith("SLURM")})
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return replace(hw, kind="cuda", gpus=len(visible), **FAKE_GPU)


def config(folder: Path, node: str, cpus: int, ctld_port: int, d_port: int, gpus: int = 0,
           overrides: bool = False) -> str:
    """slurm.conf for one node with `cpus` CPUs: no cgroups (proctrack/linuxproc, task/none), state under `folder`,
    job completions logged to a text file (`sacct -c` reads it; sacct's database needs slurmdbd), a batch job
    scheduled when it is submitted (batch_sched_delay=0: Slurm's default, 3 s, batches a busy cluster's
    submissions). With `gpus`, a GPU GRES of that many (gres.conf beside it names the devices). With `gpus` or
    `overrides`, slurmd takes the node's CPUs from here, not from the hardware (config_overrides): one task per GPU
    may need more CPUs than this machine has, and jobs that mostly wait can share its cores."""
    gres = "GresTypes=gpu\n" if gpus else ""
    gres += "SlurmdParameters=config_overrides\n" if gpus or overrides else ""
    node_gres = f" Gres=gpu:{gpus}" if gpus else ""
    return f"""# A one-node Slurm for the course (accelhelpers.slurm); every path under {folder}
ClusterName=accel
SlurmctldHost={node}
SlurmUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=10
JobCompType=jobcomp/filetxt
JobCompLoc={folder}/jobcomp.txt
AccountingStorageType=accounting_storage/none
SchedulerParameters=batch_sched_delay=0
{gres}NodeName={node} CPUs={cpus}{node_gres} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """How many tasks Slurm started on node `node_id` of the job, from SLURM_TASKS_PER_NODE ("2(x3),1": three nodes
    of 2, then one of 1): torchrun's LOCAL_WORLD_SIZE for a job of one task per rank, right on uneven layouts too."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r}: expected counts like '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ValueError(f"node {node_id} is not one of the {len(counts)} nodes of "
                         f"SLURM_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node_id]


def fields(line: str) -> dict[str, str]:
    """`Key=Value Key=Value ...` (scontrol -o, the jobcomp log) as a dict."""
    return dict(re.findall(r"(\w+)=(\S*)", line))


@dataclass
class Cluster:
    """A running one-node Slurm: its folder (configuration, state, logs) and the commands to talk to it."""

    folder: Path
    node: str
    cpus: int
    gpus: int = 0
    echo: bool = False  # print each command as `run` runs it (`$ sbatch ...`), as a learner would type it
    cwd: Path | None = None  # the folder commands run in (a login node's working folder); None: this process's

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def env(self) -> dict[str, str]:
        """What a Slurm command needs to find this cluster, and the running Python's folder first on PATH: sbatch
        hands the submitter's environment to the job (`--export=ALL`), so `python` and `torchrun` in a batch script
        are this environment's, as after activating it on a cluster's login node."""
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": path}

    def run(self, *args: str, check: bool = True, timeout: float = 60, echo: bool | None = None
            ) -> subprocess.CompletedProcess:
        """A Slurm command (`sbatch`, `scontrol`, ...) against this cluster, in `cwd`; with `echo` (default: the
        cluster's) printed first as `$ command`."""
        if self.echo if echo is None else echo:
            print("$", shlex.join(str(a) for a in args), flush=True)
        r = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=self.env(), timeout=timeout,
                           cwd=self.cwd)
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(args)} failed: {(r.stderr or r.stdout).strip()}")
        return r

    def sbatch(self, script: str | Path, *options: str, args: tuple[object, ...] = ()) -> int:
        """Submit a batch script with sbatch `options`, passing it `args` (its `$@`); the job id."""
        cmd = ["sbatch", "--parsable", *options, str(script), *(str(a) for a in args)]
        return int(self.run(*cmd).stdout.strip().split(";")[0])

    def job(self, job: int, echo: bool | None = False) -> dict[str, str]:
        """What `scontrol show job` says of `job` (JobState, Reason, Restarts, ExitCode, ...)."""
        return fields(self.run("scontrol", "-o", "show", "job", str(job), echo=echo).stdout)

    def wait(self, job: int, states: tuple[str, ...] = DONE, timeout: float = 120, restarts: int = 0
             ) -> dict[str, str]:
        """Poll `scontrol show job` every 0.2 s (echoed once) until `job` is in one of `states` after at least
        `restarts` requeues (or has ended); its fields then."""
        deadline = time.monotonic() + timeout
        if self.echo:
            print(f"$ scontrol -o show job {job}   # every 0.2 s, until JobState is {'/'.join(states[:3])}"
                  f"{'/...' if len(states) > 3 else ''}{f' after {restarts} restart(s)' if restarts else ''}",
                  flush=True)
        while True:
            info = self.job(job)
            state = info.get("JobState")
            if (state in states and int(info.get("Restarts", 0)) >= restarts) or (restarts and state in DONE):
                return info
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job} still {info.get('JobState')} after {timeout:.0f} s (waiting for "
                                 f"{'/'.join(states)}); read {self.folder}/slurmctld.log")
            time.sleep(0.2)

    def requeue(self, job: int, timeout: float = 60) -> float:
        """Preempt `job` as a scheduler does (`scontrol requeue`: the job's processes get SIGTERM, the job goes back
        to the queue), then let it start again now. Returns how many seconds ahead Slurm had set the requeued job's
        begin time (how long it would have waited without `starttime=now`)."""
        restarts = int(self.job(job).get("Restarts", 0))
        self.run("scontrol", "requeue", str(job))
        return self.start_now(job, restarts + 1, timeout)

    def start_now(self, job: int, restarts: int = 1, timeout: float = 120) -> float:
        """Once `job` is back in the queue after its `restarts`-th requeue, start it now (`scontrol update jobid=N
        starttime=now`): Slurm holds a requeued job for its credential lifetime (AuthInfo cred_expire, 120 s by
        default), though not in the second of the requeue. Returns how many seconds ahead Slurm had set its begin time
        (0 if the job had ended instead)."""
        info = self.wait(job, ("PENDING",), timeout, restarts=restarts)
        if info.get("JobState") != "PENDING":
            return 0.0
        ahead = time.mktime(time.strptime(info["StartTime"], "%Y-%m-%dT%H:%M:%S")) - time.time()
        # slurmd revoked the last attempt's credential at the requeue, and refuses any credential of this job created
        # in that second or before ("Job N already killed, do not launch batch job" in slurmd.log): start it in the next
        time.sleep(math.floor(time.time()) + 1.2 - time.time())
        self.run("scontrol", "update", f"jobid={job}", "starttime=now")
        return ahead

    def history(self) -> list[dict[str, str]]:
        """Every finished job, oldest first, from the job completion log (one line per job end)."""
        log = self.folder / "jobcomp.txt"
        return [fields(line) for line in log.read_text().splitlines()] if log.exists() else []

    def stop(self) -> None:
        """Shut both daemons down; the fake GPUs' device files go, the folder stays with its configuration and logs.
        Stopping a stopped cluster does nothing more."""
        pids = [(self.folder / f).read_text().strip() for f in ("slurmctld.pid", "slurmd.pid")
                if (self.folder / f).exists()]
        running = [pid for pid in pids if pid and Path(f"/proc/{pid}").exists()]
        if running:
            self.run("scontrol", "shutdown", check=False)
        deadline = time.monotonic() + 20
        for pid in running:
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        shutil.rmtree(self.folder / "dev", ignore_errors=True)


def start(folder: str | Path | None = None, cpus: int | None = None, timeout: float = 30, gpus: int = 0) -> Cluster:
    """Configure and start a one-node Slurm in `folder` (default build/slurm) on free ports, with `cpus` CPUs (default:
    this machine's cores; more are allowed); wait until the node is idle. `gpus`: that many fake GPUs as a GRES (the
    node then has at least one CPU per GPU). Raises SlurmUnavailable (one line: why, and what to do) where it cannot
    run."""
    if gpus < 0:
        raise ValueError(f"gpus={gpus}: a node has 0 or more GPUs")
    reason = unavailable(gpus)
    if reason:
        raise SlurmUnavailable(reason)
    folder = Path(folder) if folder else results.build_dir() / "slurm"
    shutil.rmtree(folder, ignore_errors=True)
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True)
    node = socket.gethostname().split(".")[0]
    cluster = Cluster(folder.resolve(), node, max(cpus or os.cpu_count() or 1, gpus), gpus)
    if gpus:
        fake_gpus(cluster.folder, gpus)
        (cluster.folder / "gres.conf").write_text(gres_config(cluster.folder, gpus))
    more = cluster.cpus > (os.cpu_count() or 1)  # more CPUs than this machine has: the node must not check them
    ports = launch.free_port(), launch.free_port()
    cluster.conf.write_text(config(cluster.folder, node, cluster.cpus, *ports, gpus, overrides=more))
    _munge()
    for daemon in ("slurmctld", "slurmd"):
        r = subprocess.run([daemon, "-f", str(cluster.conf)], capture_output=True, text=True, env=cluster.env())
        if r.returncode != 0:
            shutil.rmtree(cluster.folder / "dev", ignore_errors=True)  # the fake GPUs go with a failed start too
            raise SlurmError(f"{daemon} did not start: {(r.stderr or r.stdout).strip()}; read {folder}/{daemon}.log")
    deadline = time.monotonic() + timeout
    while cluster.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() != "idle":
        if time.monotonic() > deadline:
            cluster.stop()
            raise SlurmError(f"the node did not become idle within {timeout:.0f} s; read {folder}/slurmctld.log")
        time.sleep(0.2)
    return cluster
