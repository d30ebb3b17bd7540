"""Worker scripts for the reliability tests and demos, run as `python -m accelhelpers.workers NAME ...` or under
`torchrun -m accelhelpers.workers NAME ...` (functions in a notebook cannot be started in another process)."""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint as ck
from .faults import NonFiniteError, PeerFailure, check_finite, finish_distributed, init_distributed, peer_guard
from .session import seed_everything

TOY_TOTAL_STEPS = 100


def toy_state(seed: int = 0) -> dict[str, Any]:
    """A small seeded training setup that uses every piece of resumable state: dropout (torch RNG), AdamW,
    one-cycle schedule, a CPU GradScaler, and minibatches drawn with torch, NumPy and Python RNGs."""
    seed_everything(seed)
    g = torch.Generator().manual_seed(123)
    x, y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=TOY_TOTAL_STEPS)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    return {"x": x, "y": y, "model": model, "opt": opt, "sched": sched, "scaler": scaler}


def toy_steps(s: dict[str, Any], start: int, stop: int) -> None:
    """Train the toy setup from step `start` to `stop`, consuming all three RNGs every step."""
    for _ in range(start, stop):
        idx = torch.randint(0, len(s["x"]), (32,))
        noise = torch.from_numpy(np.random.standard_normal((32, 16)).astype(np.float32)) * 0.01
        xb = s["x"][idx] * (1 + 0.01 * random.random()) + noise
        loss = F.cross_entropy(s["model"](xb), s["y"][idx])
        s["opt"].zero_grad()
        s["scaler"].scale(loss).backward()
        s["scaler"].step(s["opt"])
        s["scaler"].update()
        s["sched"].step()


def _save_toy(s: dict[str, Any], path: Path, step: int) -> None:
    """Checkpoint the toy setup."""
    ck.save_checkpoint(path, s["model"], s["opt"], s["sched"], s["scaler"], step=step)


def resume(out: Path, steps: int, save_at: int, phase: str) -> None:
    """Phase 'first': a straight run of `steps` (straight.pt) and a run stopped at `save_at` (step_*.pt).
    Phase 'second', in a fresh process: resume that checkpoint to `steps`, with and without the RNG states."""
    torch.set_num_threads(1)
    if phase == "first":
        s = toy_state()
        toy_steps(s, 0, steps)
        _save_toy(s, out / "straight.pt", steps)
        s = toy_state()
        toy_steps(s, 0, save_at)
        _save_toy(s, ck.checkpoint_path(out, save_at), save_at)
        return
    for name, restore in (("resumed.pt", True), ("resumed_norng.pt", False)):
        s = toy_state()
        start = ck.load_checkpoint(ck.checkpoint_path(out, save_at), s["model"], s["opt"], s["sched"], s["scaler"],
                                   restore_rng=restore)
        toy_steps(s, start, steps)
        _save_toy(s, out / name, steps)


def hang_in_save(out: Path, mode: str) -> None:
    """Save a good checkpoint (step 1), then start saving step 2 over it and block half-way ('write') or after
    the temporary file is complete but before the rename ('rename'), printing SAVING so a test can kill us."""
    model = nn.Linear(64, 64)
    target = out / "ckpt.pt"
    ck.save_checkpoint(target, model, step=1)

    def block(*_: Any) -> None:
        print("SAVING", flush=True)
        time.sleep(120)

    if mode == "write":
        def half_write(obj: Any, f: Any) -> None:
            buf = io.BytesIO()
            torch.save(obj, buf)
            f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            f.flush()
            block()

        ck._serialize = half_write
    else:
        ck.os.replace = block  # type: ignore[assignment]  (this process only)
    with torch.no_grad():
        model.weight.add_(1.0)
    ck.save_checkpoint(target, model, step=2)


def _write_json(path: Path, obj: Any) -> None:
    """Write a small JSON result file for the test to read."""
    path.write_text(json.dumps(obj))


def ddp_nonfinite(out: Path, steps: int, bad_rank: int, bad_step: int, timeout_s: float) -> None:
    """DDP training on 2+ gloo ranks where only `bad_rank` sees a NaN loss at `bad_step`: every rank must stop
    at that step (check_finite agrees by all-reduce) and record where."""
    rank, _ = init_distributed("gloo", timeout_s)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    result: dict[str, Any] = {"rank": rank, "stopped_at": None, "error": None, "completed": 0}
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        loss = F.mse_loss(model(torch.randn(16, 8, generator=g)), torch.zeros(16, 1))
        if rank == bad_rank and step == bad_step:
            loss = loss * float("nan")
        try:
            check_finite(loss, step=step)
        except NonFiniteError as e:
            result.update(stopped_at=step, error=str(e))
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
        result["completed"] = step + 1
    _write_json(out / f"rank{rank}.json", result)
    finish_distributed()  # every rank stopped at the same step and is alive


def ddp_peer(out: Path, fault: str, timeout_s: float) -> None:
    """Rank 1 fails ('exit': leaves early, 'hang': stops responding, 'kill': SIGKILL) before an all-reduce;
    rank 0 records the PeerFailure it gets and how long it took, then exits with status 3."""
    rank, _ = init_distributed("gloo", timeout_s)
    t = torch.ones(4)
    torch.distributed.all_reduce(t)  # the group works
    if rank == 1:
        if fault == "exit":
            os._exit(0)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)
    t0 = time.perf_counter()
    try:
        with peer_guard("all_reduce of the gradients"):
            torch.distributed.all_reduce(t)
    except PeerFailure as e:
        _write_json(out / "rank0.json", {"error": str(e), "seconds": time.perf_counter() - t0})
        os._exit(3)
    _write_json(out / "rank0.json", {"error": None, "seconds": time.perf_counter() - t0})


def ddp_train(out: Path, steps: int, crash_at: int, timeout_s: float) -> None:
    """DDP training that checkpoints every step (rank 0 writes, all ranks wait) and resumes from the newest good
    checkpoint on start; on the first attempt rank 1 SIGKILLs itself at `crash_at`, for torchrun to restart."""
    rank, _ = init_distributed("gloo", timeout_s)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    folder = out / "ckpt"
    latest = ck.latest_good_checkpoint(folder)
    start = ck.load_checkpoint(latest, model, opt, sched) if latest else 0
    with open(out / f"log_rank{rank}.txt", "a") as log:
        log.write(f"attempt {attempt} start {start}\n")
        for step in range(start, steps):
            if attempt == 0 and rank == 1 and step == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, 8, generator=g)
            loss = F.mse_loss(ddp(x), x.sum(1, keepdim=True).sin())
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            log.write(f"step {step + 1}\n")
            log.flush()
            if rank == 0:
                ck.save_checkpoint(ck.checkpoint_path(folder, step + 1), model, opt, sched, step=step + 1, keep=2)
            torch.distributed.barrier()
    if rank == 0:
        ck.save_checkpoint(out / "final.pt", model, opt, sched, step=steps)
    finish_distributed()


def main(argv: list[str] | None = None) -> None:
    """Dispatch to a worker by name."""
    p = argparse.ArgumentParser(prog="python -m accelhelpers.workers")
    p.add_argument("name", choices=["resume", "hang_in_save", "ddp_nonfinite", "ddp_peer", "ddp_train"])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-at", type=int, default=5)
    p.add_argument("--phase", choices=["first", "second"], default="first")
    p.add_argument("--mode", choices=["write", "rename"], default="write")
    p.add_argument("--bad-rank", type=int, default=1)
    p.add_argument("--bad-step", type=int, default=3)
    p.add_argument("--fault", choices=["exit", "hang", "kill"], default="exit")
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.name == "resume":
        resume(a.out, a.steps, a.save_at, a.phase)
    elif a.name == "hang_in_save":
        hang_in_save(a.out, a.mode)
    elif a.name == "ddp_nonfinite":
        ddp_nonfinite(a.out, a.steps, a.bad_rank, a.bad_step, a.timeout)
    elif a.name == "ddp_peer":
        ddp_peer(a.out, a.fault, a.timeout)
    else:
        ddp_train(a.out, a.steps, a.crash_at, a.timeout)


if __name__ == "__main__":
    main(sys.argv[1:])
