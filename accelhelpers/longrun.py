"""Chapter 09's long run in miniature (`make_run`: every kind of state a resume needs), and the processes the
chapter starts, kills, preempts and restarts: `python -m accelhelpers.longrun NAME OUT ...` runs one worker in a
fresh process (a function defined in a notebook cannot be started that way), launched by `start` or `torchrun`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from . import checkpoint, faults, launch, results
from .session import seed_everything

LEAVE_OUT = ("optimizer", "scheduler", "python", "numpy", "torch", "loader")
WORKER = "accelhelpers.longrun"  # the module every worker runs (python -m / torchrun -m)
ENV = {"TQDM_DISABLE": "1"}  # on top of launch.ENV (one thread per process, no XLA, unbuffered output)


@dataclass
class Run:
    """A small training run and the position it has reached (`batches` iterates over the current epoch)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    loader: DataLoader
    gen: torch.Generator
    seed: int
    step: int = 0
    epoch_rng: torch.Tensor | None = None
    batches_done: int = 0
    batches: Iterator | None = None


def make_run(seed: int = 0, total_steps: int = 64, rows: int = 256, batch: int = 32) -> Run:
    """A seeded run of `total_steps` minibatch steps on fixed random data (rows // batch steps per epoch)."""
    seed_everything(seed)
    g = torch.Generator().manual_seed(1234)
    x, y = torch.randn(rows, 16, generator=g), torch.randint(0, 4, (rows,), generator=g)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=total_steps)
    gen = torch.Generator().manual_seed(seed + 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=gen)
    return Run(model, opt, sched, loader, gen, seed)


def train_step(run: Run, xb: torch.Tensor, yb: torch.Tensor,
               backward: Callable[[torch.Tensor], Any] | None = None) -> float:
    """One training step that draws from all three global RNGs (Python scale, NumPy noise, torch dropout);
    `backward` replaces `loss.backward()` (accelerate's `accelerator.backward`, say)."""
    noise = torch.from_numpy(np.random.standard_normal(xb.shape).astype(np.float32))
    xb = xb * (1 + 0.1 * random.random()) + 0.01 * noise
    loss = F.cross_entropy(run.model(xb), yb)
    run.opt.zero_grad()
    (backward or torch.Tensor.backward)(loss)
    run.opt.step()
    run.sched.step()
    return loss.item()


def _start_epoch(run: Run) -> None:
    """Begin an epoch: remember the loader generator's state, then let the loader draw this epoch's order."""
    run.epoch_rng = run.gen.get_state()
    run.batches, run.batches_done = iter(run.loader), 0


def train(run: Run, stop: int, after_step: Callable[[Run], bool] | None = None) -> Run:
    """Train from `run.step` to `stop`, epoch after epoch; `after_step` returning True stops early."""
    run.model.train()
    while run.step < stop:
        if run.batches is None:
            _start_epoch(run)
        for xb, yb in run.batches:
            train_step(run, xb, yb)
            run.step, run.batches_done = run.step + 1, run.batches_done + 1
            if (after_step is not None and after_step(run)) or run.step >= stop:
                return run
        run.batches = None  # the loader drew once more from its generator when the epoch ended
    return run


def save(run: Run, path: str | Path, keep: int | None = None) -> Path:
    """Checkpoint the run atomically: model, optimizer, scheduler, RNGs, and where the loader is in its epoch."""
    loader = {"epoch_rng": run.epoch_rng, "batches_done": run.batches_done} if run.epoch_rng is not None else None
    return checkpoint.save_checkpoint(path, run.model, run.opt, run.sched, step=run.step, keep=keep,
                                      extra={"loader": loader})


def restore_loader(run: Run, state: dict[str, Any] | None) -> None:
    """Rewind the loader generator to the saved epoch's start and replay the batches that epoch had served."""
    if state is None:
        return
    run.gen.set_state(state["epoch_rng"])
    _start_epoch(run)
    for _ in itertools.islice(run.batches, state["batches_done"]):
        run.batches_done += 1


def resume(run: Run, path: str | Path, leave_out: str | None = None) -> Run:
    """Load a checkpoint into a fresh `run`; `leave_out` (one of LEAVE_OUT) skips that one state, as a resume
    that forgot it would."""
    if leave_out is not None and leave_out not in LEAVE_OUT:
        raise ValueError(f"leave_out must be None or one of {', '.join(LEAVE_OUT)}, got {leave_out!r}")
    run.step = checkpoint.load_checkpoint(path, run.model, None if leave_out == "optimizer" else run.opt,
                                          None if leave_out == "scheduler" else run.sched)
    reseed = {"python": random.seed, "numpy": np.random.seed, "torch": torch.manual_seed}
    if leave_out in reseed:
        reseed[leave_out](run.seed)  # where a fresh start leaves that generator
    if leave_out != "loader":
        restore_loader(run, checkpoint.read_checkpoint(path)["extra"]["loader"])
    return run


def weights(run_or_path: Run | str | Path) -> dict[str, torch.Tensor]:
    """The model weights of a run, or of a checkpoint file."""
    if isinstance(run_or_path, Run):
        return {k: v.detach().clone() for k, v in run_or_path.model.state_dict().items()}
    return checkpoint.read_checkpoint(run_or_path)["model"]


# --- starting workers from a notebook ---------------------------------------------------------------------------

def start(name: str, *args: object) -> subprocess.Popen:
    """Start `python -m accelhelpers.longrun NAME ARGS` in a fresh process group (`launch.start`), output piped."""
    return launch.start([sys.executable, *launch.python_target(WORKER), name, *map(str, args)], env=ENV)


def torchrun(name: str, *args: object, restarts: int = 0, nproc: int = 2) -> subprocess.Popen:
    """Start `torchrun --standalone --nproc-per-node=NPROC --max-restarts=RESTARTS -m accelhelpers.longrun ...`."""
    return launch.start(launch.torchrun_cmd(WORKER, name, *args, nproc=nproc, max_restarts=restarts), env=ENV)


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    """Wait for a worker (`launch.finish`, silently, any exit status) and return (exit status, output); past
    `timeout` seconds its whole process group is killed and TimeoutError raised."""
    run = launch.finish(proc, timeout, echo=False, check=False)
    return run.returncode, run.output


def wait_for(proc: subprocess.Popen, text: str, timeout: float = 180) -> None:
    """Read a worker's output until a line equal to `text` (a cue such as READY); past `timeout` seconds kill it
    and raise TimeoutError; a worker that ends without the line raises RuntimeError."""
    found, done = [], threading.Event()

    def read() -> None:
        for line in proc.stdout:
            if line.strip() == text:
                found.append(line)
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout):
        launch.kill(proc)
        raise TimeoutError(f"worker {' '.join(map(str, proc.args[3:6]))} printed no {text} within {timeout} s and "
                           "was killed")
    if not found:
        raise RuntimeError(f"worker {' '.join(map(str, proc.args[3:6]))} ended ({exit_reason(proc.wait())}) "
                           f"without printing {text}")


def exit_reason(code: int) -> str:
    """A process exit status in words: 'exit 0', or 'killed by SIGKILL' for a negative status."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


# --- the workers (each runs in its own process) --------------------------------------------------------------------

def work_train(out: Path, steps: int, every: int, die_at: int | None, preemptible: bool) -> None:
    """Train to `steps`, checkpointing every `every` steps into out/ckpt and resuming from the newest good one
    there. `die_at`: SIGKILL ourselves after that step. `preemptible`: a SIGTERM saves and exits at the next step
    boundary; without it SIGTERM ends the process at once. Prints READY after step 10 (a cue for a signal)."""
    folder = out / "ckpt"
    run = make_run(total_steps=max(steps, 1))
    latest = checkpoint.latest_good_checkpoint(folder)
    if latest is not None:
        resume(run, latest)
    with faults.Preemption() if preemptible else contextlib.nullcontext() as preempt:  # no handler: SIGTERM kills

        def after_step(r: Run) -> bool:
            if r.step % every == 0:
                save(r, checkpoint.checkpoint_path(folder, r.step), keep=2)
            if r.step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)  # the machine goes away: no handler, no cleanup runs
            if r.step == 10:
                print("READY", flush=True)
            return preempt is not None and preempt.requested is not None

        started = run.step
        train(run, steps, after_step)
        requested = preempt.requested if preempt is not None else None
        if requested:
            save(run, checkpoint.checkpoint_path(folder, run.step))
            saved_s = time.monotonic() - preempt.at
    results.atomic_write_text(out / "result.json", json.dumps({"started": started, "stopped": run.step,
                              "signal": requested, "signal_to_saved_s": saved_s if requested else None}))
    if run.step == steps:
        save(run, out / "final.pt")


def work_variants(ckpt: Path, out: Path, steps: int) -> None:
    """Resume `ckpt` to `steps` once with every state, then once per state left out: out/final_<name>.pt."""
    for leave_out in (None, *LEAVE_OUT):
        run = resume(make_run(total_steps=steps), ckpt, leave_out)
        train(run, steps)
        save(run, out / f"final_{leave_out or 'all'}.pt")


def work_kill_mid_save(out: Path, way: str, fraction: float = 0.5) -> None:
    """Save a good checkpoint (step 0), train 2 steps, save over it `way` ('torch.save' straight to the file, or
    'atomic'), and SIGKILL ourselves when `fraction` of the new file's bytes are written (1.0: all of them, so an
    atomic save dies between its complete temporary file and the rename)."""
    run = make_run()
    path = out / "model.pt"
    save(run, path)
    train(run, 2)

    def write_then_die(obj: Any, f: Any) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        f.write(buf.getvalue()[: int(len(buf.getvalue()) * fraction)])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    state = {"format": checkpoint.FORMAT, "step": run.step, "model": run.model.state_dict()}
    if way == "atomic":
        checkpoint.atomic_save(state, path, write=write_then_die)
    else:
        with open(path, "wb") as f:  # what torch.save(state, path) does: truncate, then write
            write_then_die(state, f)


def work_oom(out: Path, budget_mb: int, start_batch: int) -> None:
    """Under an address-space limit of `budget_mb` above what is mapped now, train one step at `start_batch`
    three ways: plainly, with faults.with_batch_backoff, and with accelerate's find_executable_batch_size."""
    import resource  # POSIX only

    from accelerate.utils import find_executable_batch_size

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 4096), nn.ReLU(), nn.Linear(4096, 4))  # 64 KiB of activations per row
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tried: dict[str, list[int]] = {"plain": [], "ours": [], "accelerate": []}

    def one_step(bs: int, who: str) -> int:
        tried[who].append(bs)
        loss = F.cross_entropy(model(torch.randn(bs, 16)), torch.zeros(bs, dtype=torch.long))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return bs

    one_step(8, "plain")  # warm-up: the first step imports and allocates what every later step reuses
    tried["plain"].clear()
    t0 = time.perf_counter()
    gc.collect()
    result: dict[str, Any] = {"budget_mb": budget_mb, "gc_s": time.perf_counter() - t0}
    gc.freeze()  # both back-offs run gc.collect() per retry: scan only what was created after start-up
    t0 = time.perf_counter()
    gc.collect()
    result["gc_frozen_s"] = time.perf_counter() - t0
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")  # Linux
    resource.setrlimit(resource.RLIMIT_AS, (mapped + budget_mb * 2**20, hard))
    try:
        one_step(start_batch, "plain")
    except RuntimeError as e:
        result["plain_error"] = str(e).split("\n")[0][:160]
        result["plain_kind"] = faults.oom_kind(e)
    t0 = time.perf_counter()
    _, result["ours"] = faults.with_batch_backoff(lambda bs: one_step(bs, "ours"), start_batch)
    result["ours_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    result["accelerate"] = find_executable_batch_size(lambda batch_size: one_step(batch_size, "accelerate"),
                                                      starting_batch_size=start_batch)()
    result["accelerate_s"] = time.perf_counter() - t0
    (out / "oom.json").write_text(json.dumps({**result, "tried": tried}))


def _ddp_setup(timeout_s: float) -> tuple[int, nn.Module, nn.Module, torch.optim.Optimizer, Any]:
    """Join the torchrun group; a small model, its DDP wrapper, SGD with momentum and a step schedule."""
    rank, _ = faults.init_distributed("gloo", timeout_s)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
    return rank, model, nn.parallel.DistributedDataParallel(model), opt, sched


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `step` on `rank`, drawn from a generator seeded by both: a restart needs no RNG state."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, x.sum(1, keepdim=True).sin()


def work_elastic(out: Path, steps: int, every: int, crash_at: int | None, timeout_s: float) -> None:
    """DDP under torchrun: rank 0 checkpoints every `every` steps (all ranks wait for it), every rank resumes from
    the newest good checkpoint; in the first attempt rank 1 SIGKILLs itself after `crash_at` steps."""
    rank, model, ddp, opt, sched = _ddp_setup(timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    latest = checkpoint.latest_good_checkpoint(out / "ckpt")
    start = checkpoint.load_checkpoint(latest, model, opt, sched, restore_rng=False) if latest else 0
    with open(out / f"log_rank{rank}.txt", "a") as log:
        log.write(f"attempt {attempt} resumed at step {start}\n")
        for step in range(start, steps):
            if attempt == 0 and rank == 1 and step == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = _batch(step, rank)
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            log.write(f"attempt {attempt} step {step + 1}\n")
            log.flush()
            if (step + 1) % every == 0:
                if rank == 0:
                    checkpoint.save_checkpoint(checkpoint.checkpoint_path(out / "ckpt", step + 1), model, opt, sched,
                                               step=step + 1, keep=2)
                torch.distributed.barrier()  # nobody runs ahead of a checkpoint that is not on disk yet
    if rank == 0:
        checkpoint.save_checkpoint(out / "final.pt", model, opt, sched, step=steps)
    faults.finish_distributed()


def _nan_phase(steps: int, bad_step: int, agreed: bool, timeout_s: float) -> dict[str, Any]:
    """DDP steps where rank 1 alone gets a NaN loss at `bad_step`; returns what this rank did and how it stopped."""
    rank, _, ddp, opt, _ = _ddp_setup(timeout_s)
    result: dict[str, Any] = {"rank": rank, "steps_done": 0, "error": None}
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            x, y = _batch(step, rank)
            loss = F.mse_loss(ddp(x), y) * (float("nan") if rank == 1 and step == bad_step else 1.0)
            if agreed:
                faults.check_finite(loss, step=step)
            elif not torch.isfinite(loss):
                raise faults.NonFiniteError(f"non-finite loss at step {step} on rank {rank}")
            opt.zero_grad()
            with faults.peer_guard("all_reduce of the gradients"):
                loss.backward()
            opt.step()
            result["steps_done"] = step + 1
    except (faults.NonFiniteError, faults.PeerFailure) as e:
        result["error"] = f"{type(e).__name__}: {str(e)[:150]}"
    result["seconds"] = time.perf_counter() - t0
    return result


def work_nan(out: Path, steps: int, bad_step: int, timeout_s: float) -> None:
    """Rank 1 alone gets a NaN loss at `bad_step`, twice: first agreed by faults.check_finite (one all-reduce of a
    flag: both ranks stop there and the group stays usable), then with the usual local check (rank 1 stops alone,
    rank 0 waits in the gradient all-reduce until the collective timeout)."""
    for phase in ("agreed", "local"):
        result = _nan_phase(steps, bad_step, phase == "agreed", timeout_s)
        (out / f"nan_{phase}_rank{result['rank']}.json").write_text(json.dumps(result))
    with faults.peer_guard("final barrier"):
        faults.finish_distributed()


def work_fsdp(out: Path, steps: int) -> None:
    """FSDP2 (`fully_shard`) on 2 CPU ranks: train, then save with torch.distributed.checkpoint (each rank writes
    its own shard) and, for comparison, the full weights gathered to rank 0 with torch.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = faults.init_distributed("gloo", 60)
    mesh = init_device_mesh("cpu", (world,))  # explicit: on a GPU machine the default mesh would be CUDA's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    shard = model_sd["0.weight"]
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out / "dcp")
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # a collective: every rank calls it
    if rank == 0:
        torch.save(full, out / "full.pt")
    info = {"type": type(shard).__name__, "local": list(shard.to_local().shape), "global": list(shard.shape)}
    (out / f"fsdp_rank{rank}.json").write_text(json.dumps(info))
    faults.finish_distributed()


def main(argv: list[str] | None = None) -> None:
    """Run one worker by name: python -m accelhelpers.longrun NAME OUT [options]."""
    p = argparse.ArgumentParser(prog="python -m accelhelpers.longrun")
    p.add_argument("name", choices=["train", "variants", "kill_mid_save", "oom", "elastic", "nan", "fsdp"])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--preemptible", action="store_true")
    p.add_argument("--ckpt", type=Path, default=None)
    p.add_argument("--way", choices=["torch.save", "atomic"], default="atomic")
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--budget-mb", type=int, default=256)
    p.add_argument("--start-batch", type=int, default=65536)
    p.add_argument("--bad-step", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    a.out.mkdir(parents=True, exist_ok=True)
    {"train": lambda: work_train(a.out, a.steps, a.every, a.die_at, a.preemptible),
     "variants": lambda: work_variants(a.ckpt, a.out, a.steps),
     "kill_mid_save": lambda: work_kill_mid_save(a.out, a.way, a.fraction),
     "oom": lambda: work_oom(a.out, a.budget_mb, a.start_batch),
     "elastic": lambda: work_elastic(a.out, a.steps, a.every, a.crash_at, a.timeout),
     "nan": lambda: work_nan(a.out, a.steps, a.bad_step, a.timeout),
     "fsdp": lambda: work_fsdp(a.out, a.steps)}[a.name]()


if __name__ == "__main__":
    main(sys.argv[1:])
