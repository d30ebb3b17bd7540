"""Faults on 2 gloo ranks (tests/test_faults.py), run under torchrun:

    torchrun --standalone --nproc-per-node=2 tests/rank_scripts/ddp_faults.py nonfinite|peer|train OUT [options]

nonfinite: only one rank sees a NaN loss, every rank must stop at that step; peer: rank 1 exits, hangs or is
killed before an all-reduce and rank 0 must get a PeerFailure within the timeout; train: checkpoint every step and
resume after rank 1 SIGKILLs itself on the first attempt (torchrun --max-restarts restarts the group).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accelhelpers import checkpoint as ck
from accelhelpers import faults


def write_json(path: Path, obj: Any) -> None:
    """A small result file for the test to read."""
    path.write_text(json.dumps(obj))


def nonfinite(out: Path, steps: int, bad_rank: int, bad_step: int, timeout_s: float) -> None:
    """DDP where only `bad_rank` sees a NaN loss at `bad_step`: check_finite agrees, all ranks stop."""
    rank, _ = faults.init_distributed("gloo", timeout_s)
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
            faults.check_finite(loss, step=step)
        except faults.NonFiniteError as e:
            result.update(stopped_at=step, error=str(e))
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
        result["completed"] = step + 1
    write_json(out / f"rank{rank}.json", result)
    faults.finish_distributed()


def peer(out: Path, fault: str, timeout_s: float) -> None:
    """Rank 1 fails ('exit', 'hang', 'kill') before an all-reduce; rank 0 records its PeerFailure, exits 3."""
    rank, _ = faults.init_distributed("gloo", timeout_s)
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
        with faults.peer_guard("all_reduce of the gradients"):
            torch.distributed.all_reduce(t)
    except faults.PeerFailure as e:
        write_json(out / "rank0.json", {"error": str(e), "seconds": time.perf_counter() - t0})
        os._exit(3)
    write_json(out / "rank0.json", {"error": None, "seconds": time.perf_counter() - t0})


def train(out: Path, steps: int, crash_at: int, timeout_s: float) -> None:
    """DDP that checkpoints every step (rank 0 writes, all wait) and resumes from the newest good checkpoint; on
    the first attempt rank 1 SIGKILLs itself at `crash_at`, for torchrun to restart the group."""
    rank, _ = faults.init_distributed("gloo", timeout_s)
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
    faults.finish_distributed()


def main() -> None:
    """Dispatch by name."""
    p = argparse.ArgumentParser()
    p.add_argument("name", choices=["nonfinite", "peer", "train"])
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--bad-rank", type=int, default=1)
    p.add_argument("--bad-step", type=int, default=3)
    p.add_argument("--fault", choices=["exit", "hang", "kill"], default="exit")
    p.add_argument("--crash-at", type=int, default=-1)
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.name == "nonfinite":
        nonfinite(a.out, a.steps, a.bad_rank, a.bad_step, a.timeout)
    elif a.name == "peer":
        peer(a.out, a.fault, a.timeout)
    else:
        train(a.out, a.steps, a.crash_at, a.timeout)


if __name__ == "__main__":
    main()
