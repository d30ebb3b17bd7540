"""The one minibatch loop every chapter from 03 on uses (`fit`, whose step is chapter 04's `minibatch_step`), and its
history. Chapter 02's full-batch loops are in `fullbatch`, exported from that chapter's cells."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import metrics, precision, timing  # precision: chapter 04 teaches minibatch_step, exported from its cell
from .data import Split as _Split
from .session import progress as _progress


@dataclass
class FitHistory:
    """Per-epoch test accuracy and loss, and cumulative training seconds (evaluation excluded), of one `fit`."""

    acc: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def final(self) -> float:
        """The last epoch's test accuracy (nan when `fit` did not evaluate)."""
        return self.acc[-1] if self.acc else float("nan")

    def to_target(self, target: float) -> tuple[int | None, float | None]:
        """(epochs, seconds) until the test accuracy first reached `target`; (None, None) if it never did."""
        for i, a in enumerate(self.acc):
            if a >= target:
                return i + 1, self.seconds[i]
        return None, None


def fit(model: nn.Module, split: _Split | tuple[torch.Tensor, torch.Tensor], opt: torch.optim.Optimizer, epochs: int,
        bs: int = 64, *, seed: int = 0, policy: Any = None, on_step: Callable[[int], None] | None = None,
        scheduler: Any = None, drop_last: bool = False, progress: str | bool = False,
        step: Callable[..., Any] | None = None) -> FitHistory:
    """Minibatch training with cross-entropy: each epoch a fresh permutation from a CPU generator seeded by `seed`,
    batches of `bs` (the last one short unless `drop_last`). `policy` (precision.Policy) adds autocast and, for
    fp16, a GradScaler; `on_step(it)` runs before step `it` (e.g. to set one-cycle hyper-parameters);
    `scheduler.step()` after each optimizer step; `step(model, opt, x, y, policy, scaler)` is the training step
    (default: the package's copy of chapter 04's `minibatch_step`; a chapter passes its own cell's, so an edit of that
    cell reaches the run). With a Split, the test accuracy and loss after every epoch."""
    x, y = (split.x_train, split.y_train) if isinstance(split, _Split) else split
    if epochs < 1 or bs < 1 or len(x) != len(y):
        raise ValueError(f"fit needs epochs >= 1, bs >= 1 and one label per row, got {epochs=}, {bs=}, "
                         f"{len(x)} rows and {len(y)} labels")
    scaler = policy.grad_scaler() if policy is not None else None
    step = precision.minibatch_step if step is None else step
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hist, elapsed, it = FitHistory(), 0.0, 0
    model.train()
    for _ in _progress(range(epochs), progress, unit="epoch"):
        timing.sync(x.device)
        t0 = time.perf_counter()
        for idx in torch.randperm(len(x), generator=gen).to(x.device).split(bs):
            if drop_last and len(idx) < bs:
                break
            if on_step is not None:
                on_step(it)
            step(model, opt, x[idx], y[idx], policy, scaler)
            if scheduler is not None:
                scheduler.step()
            it += 1
        timing.sync(x.device)
        elapsed += time.perf_counter() - t0
        hist.seconds.append(elapsed)
        if isinstance(split, _Split):  # test accuracy and loss, under the policy's autocast
            model.eval()
            with torch.no_grad(), (policy.autocast() if policy is not None else nullcontext()):
                logits = model(split.x_test).float()
            model.train()
            hist.acc.append(metrics.accuracy(logits, split.y_test))
            hist.loss.append(F.cross_entropy(logits, split.y_test).item())
    return hist
