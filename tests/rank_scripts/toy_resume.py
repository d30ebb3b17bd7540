"""Exact resume in a fresh process (tests/test_checkpoint.py): phase 'first' trains straight to STEPS
(straight.pt) and stops a second run at SAVE_AT (step_*.pt); phase 'second', in a new process, resumes that
checkpoint to STEPS with and without the RNG states (resumed.pt, resumed_norng.pt).

    python tests/rank_scripts/toy_resume.py OUT --steps 12 --save-at 5 --phase first|second
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from accelhelpers import checkpoint as ck
from accelhelpers.session import seed_everything

TOTAL_STEPS = 100


def toy_state(seed: int = 0) -> dict[str, Any]:
    """A seeded setup using every piece of resumable state: dropout (torch RNG), AdamW, one-cycle schedule, a CPU
    GradScaler, and minibatches drawn with torch, NumPy and Python RNGs."""
    seed_everything(seed)
    g = torch.Generator().manual_seed(123)
    x, y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=TOTAL_STEPS)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    return {"x": x, "y": y, "model": model, "opt": opt, "sched": sched, "scaler": scaler}


def toy_steps(s: dict[str, Any], start: int, stop: int) -> None:
    """Train from step `start` to `stop`, consuming all three RNGs every step."""
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


def save(s: dict[str, Any], path: Path, step: int) -> None:
    """Checkpoint the whole setup."""
    ck.save_checkpoint(path, s["model"], s["opt"], s["sched"], s["scaler"], step=step)


def main() -> None:
    """Run one phase."""
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-at", type=int, default=5)
    p.add_argument("--phase", choices=["first", "second"], default="first")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if a.phase == "first":
        s = toy_state()
        toy_steps(s, 0, a.steps)
        save(s, a.out / "straight.pt", a.steps)
        s = toy_state()
        toy_steps(s, 0, a.save_at)
        save(s, ck.checkpoint_path(a.out, a.save_at), a.save_at)
        return
    for name, restore in (("resumed.pt", True), ("resumed_norng.pt", False)):
        s = toy_state()
        start = ck.load_checkpoint(ck.checkpoint_path(a.out, a.save_at), s["model"], s["opt"], s["sched"],
                                   s["scaler"], restore_rng=restore)
        toy_steps(s, start, a.steps)
        save(s, a.out / name, a.steps)


if __name__ == "__main__":
    main()
