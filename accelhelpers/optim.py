"""Optimizers built from small step callbacks (SGD, momentum, RMSProp, Adam, decoupled weight decay), the
exponentially weighted average, the one-cycle schedule (as an `on_step` for `train.fit`), an LR finder, and
fastai's loop with the statistics chapter 03 compares."""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from .data import fastai_patches
from .metrics import max_abs_diff
from .train import FitHistory

StepCallback = Callable[..., "dict[str, Any] | None"]

# ---------------------------------------------------------------------------------------------------------
# Step callbacks. Each receives the parameter `p`, its (possibly modified) gradient `grad`, the group's
# hyper-parameters and the parameter's state as keyword arguments, and returns the entries it changes.


def l2_penalty(p: torch.Tensor, grad: torch.Tensor, wd: float = 0.0, **_: Any) -> dict[str, Any]:
    """L2 regularisation: add `wd * p` to the gradient (what torch's SGD/Adam `weight_decay` means)."""
    return {"grad": grad.add(p, alpha=wd)} if wd else {}


def decoupled_wd(p: torch.Tensor, lr: float, wd: float = 0.0, **_: Any) -> dict[str, Any]:
    """Decoupled weight decay: shrink `p` by `lr * wd` outside the gradient (AdamW, fastai's default)."""
    if wd:
        p.mul_(1 - lr * wd)
    return {}


def average_grad(grad: torch.Tensor, mom: float, grad_avg: torch.Tensor | None = None, dampen: bool = False,
                 **_: Any) -> dict[str, Any]:
    """Momentum: running average `mom * avg + grad` (`+ (1 - mom) * grad` if `dampen`), kept as `grad_avg`."""
    avg = torch.zeros_like(grad) if grad_avg is None else grad_avg
    avg.mul_(mom).add_(grad, alpha=(1 - mom) if dampen else 1.0)
    return {"grad_avg": avg}


def average_sqr_grad(grad: torch.Tensor, sqr_mom: float, sqr_avg: torch.Tensor | None = None,
                     **_: Any) -> dict[str, Any]:
    """RMSProp/Adam's second moment: running average of squared gradients, kept as `sqr_avg`."""
    avg = torch.zeros_like(grad) if sqr_avg is None else sqr_avg
    avg.mul_(sqr_mom).addcmul_(grad, grad, value=1 - sqr_mom)
    return {"sqr_avg": avg}


def count_steps(step: int = 0, **_: Any) -> dict[str, Any]:
    """Count the steps taken (Adam's bias correction needs the true step number)."""
    return {"step": step + 1}


def sgd_step(p: torch.Tensor, grad: torch.Tensor, lr: float, **_: Any) -> dict[str, Any]:
    """Plain SGD: `p -= lr * grad`."""
    p.add_(grad, alpha=-lr)
    return {}


def momentum_step(p: torch.Tensor, lr: float, grad_avg: torch.Tensor, **_: Any) -> dict[str, Any]:
    """SGD with momentum: step along the averaged gradient."""
    p.add_(grad_avg, alpha=-lr)
    return {}


def rmsprop_step(p: torch.Tensor, grad: torch.Tensor, lr: float, sqr_avg: torch.Tensor, eps: float,
                 grad_avg: torch.Tensor | None = None, **_: Any) -> dict[str, Any]:
    """RMSProp: divide the (averaged) gradient by the root of the averaged squared gradient."""
    p.addcdiv_(grad if grad_avg is None else grad_avg, sqr_avg.sqrt().add_(eps), value=-lr)
    return {}


def adam_step(p: torch.Tensor, lr: float, mom: float, sqr_mom: float, eps: float, step: int,
              grad_avg: torch.Tensor, sqr_avg: torch.Tensor, **_: Any) -> dict[str, Any]:
    """Adam: both averages divided by (1 - beta**step), their bias at step `step`, then an RMSProp step."""
    unbias1, unbias2 = 1 - mom**step, 1 - sqr_mom**step
    denom = (sqr_avg / unbias2).sqrt_().add_(eps)
    p.addcdiv_(grad_avg, denom, value=-lr / unbias1)
    return {}


class CallbackOptimizer(torch.optim.Optimizer):
    """An optimizer whose step runs a list of small callbacks per parameter; hyper-parameters live in
    `param_groups` (so schedules can change them) and per-parameter tensors in `state`."""

    def __init__(self, params: Iterable[Any], cbs: Sequence[StepCallback], **hypers: Any) -> None:
        if not cbs:
            raise ValueError("CallbackOptimizer needs at least one step callback, e.g. [sgd_step]")
        h = hypers
        if not isinstance(h.get("lr"), (int, float)) or h["lr"] <= 0:
            raise ValueError(f"learning rate must be a positive number, got lr={h.get('lr')!r}")
        for name in ("mom", "sqr_mom"):
            if name in h and not 0 <= h[name] < 1:
                raise ValueError(f"{name} must be in [0, 1) (an averaging coefficient such as 0.9), got {h[name]}")
        if h.get("wd", 0) < 0 or h.get("eps", 1) <= 0:
            raise ValueError(f"need wd >= 0 and eps > 0, got wd={h.get('wd')}, eps={h.get('eps')}")
        super().__init__(params, hypers)
        self.cbs = list(cbs)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run every callback, in order, on every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hypers = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                ctx = {**hypers, **state, "grad": p.grad}
                for cb in self.cbs:
                    changes = cb(p=p, **ctx) or {}
                    ctx.update(changes)
                    state.update({k: v for k, v in changes.items() if k != "grad"})
        return loss


def sgd(params: Iterable[Any], lr: float, mom: float = 0.0, wd: float = 0.0,
        decouple_wd: bool = False) -> CallbackOptimizer:
    """SGD (with momentum if `mom` > 0): equals torch.optim.SGD(lr, momentum=mom, weight_decay=wd)."""
    cbs = [decoupled_wd if decouple_wd else l2_penalty] + ([average_grad, momentum_step] if mom else [sgd_step])
    return CallbackOptimizer(params, cbs, lr=lr, mom=mom, wd=wd)


def rmsprop(params: Iterable[Any], lr: float = 1e-2, sqr_mom: float = 0.99, eps: float = 1e-8, mom: float = 0.0,
            wd: float = 0.0, decouple_wd: bool = False) -> CallbackOptimizer:
    """RMSProp: equals torch.optim.RMSprop(lr, alpha=sqr_mom, eps) without momentum, fastai's RMSProp with it."""
    cbs = [decoupled_wd if decouple_wd else l2_penalty] + ([average_grad] if mom else [])
    cbs += [average_sqr_grad, rmsprop_step]
    return CallbackOptimizer(params, cbs, lr=lr, mom=mom, sqr_mom=sqr_mom, eps=eps, wd=wd)


def adam(params: Iterable[Any], lr: float = 1e-3, mom: float = 0.9, sqr_mom: float = 0.999, eps: float = 1e-8,
         wd: float = 0.0, decouple_wd: bool = True) -> CallbackOptimizer:
    """Adam with bias correction; decoupled `wd` makes it AdamW. Defaults are torch's (fastai: sqr_mom=0.99,
    eps=1e-5, wd=0.01)."""
    first_moment = partial(average_grad, dampen=True)  # Adam's: the gradient average with dampening 1 - mom
    cbs = [decoupled_wd if decouple_wd else l2_penalty, first_moment, average_sqr_grad, count_steps, adam_step]
    return CallbackOptimizer(params, cbs, lr=lr, mom=mom, sqr_mom=sqr_mom, eps=eps, wd=wd)


def max_param_gap(model_fn: Callable[[], nn.Module], make_a: Callable[[list[nn.Parameter]], Any],
                  make_b: Callable[[list[nn.Parameter]], Any], batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                  loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy, same_grads: bool = True) -> float:
    """Step two copies of `model_fn()` (it must seed its init) with two optimizers over `batches` and return the
    largest parameter difference. With `same_grads` both get the gradients of the first copy, so the result
    measures the update rules alone: training itself amplifies float rounding exponentially."""
    a, b = model_fn(), model_fn()
    if any(not torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True)):
        raise ValueError("model_fn returned two differently initialised models; seed inside it "
                         "(e.g. torch.manual_seed(0) before building the model)")
    opt_a, opt_b = make_a(list(a.parameters())), make_b(list(b.parameters()))
    for xb, yb in batches:
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            if not same_grads or model is a:
                loss_fn(model(xb), yb).backward()
        if same_grads:
            for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
                pb.grad = pa.grad.clone()
        opt_a.step()
        opt_b.step()
    return max_abs_diff(list(a.parameters()), list(b.parameters()))  # parameters only: b runs no forward


def set_hypers(opt: torch.optim.Optimizer, **hypers: float) -> None:
    """Set hyper-parameters (lr, mom, ...) in every parameter group: how a schedule drives an optimizer."""
    for group in opt.param_groups:
        group.update(hypers)


# ---------------------------------------------------------------------------------------------------------
# Averages and schedules


def ewma(x: Sequence[float] | np.ndarray, beta: float, debias: bool = True) -> np.ndarray:
    """Exponentially weighted moving average `v_t = beta v_{t-1} + (1-beta) x_t` from v_0 = 0, divided by
    (1 - beta**t) at the true step t when `debias` (else it starts biased towards 0)."""
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta}")
    x = np.asarray(x, dtype=np.float64)
    out, v = np.empty_like(x), 0.0
    for t, xt in enumerate(x, start=1):
        v = beta * v + (1 - beta) * xt
        out[t - 1] = v / (1 - beta**t) if debias else v
    return out


def cos_anneal(start: float, end: float, pos: float | np.ndarray) -> float | np.ndarray:
    """Half a cosine from `start` (pos=0) to `end` (pos=1)."""
    return start + (1 + np.cos(np.pi * (1 - np.asarray(pos)))) * (end - start) / 2


def one_cycle(n_steps: int, lr_max: float, div: float = 25.0, div_final: float = 1e5, pct_start: float = 0.25,
              moms: tuple[float, float, float] = (0.95, 0.85, 0.95)) -> tuple[np.ndarray, np.ndarray]:
    """The one-cycle policy (fastai's defaults) as per-step (lrs, moms): cosine warm-up from lr_max/div to
    lr_max over `pct_start` of the steps, then cosine down to lr_max/div_final; momentum does the reverse."""
    if n_steps < 1 or lr_max <= 0 or div <= 0 or div_final <= 0 or not 0 < pct_start < 1:
        raise ValueError(f"one_cycle needs n_steps >= 1, lr_max, div, div_final > 0 and 0 < pct_start < 1; got "
                         f"{n_steps=}, {lr_max=}, {div=}, {div_final=}, {pct_start=}")
    pos = np.arange(n_steps) / n_steps          # fastai evaluates the schedule at i / n_steps
    warm = pos < pct_start
    p1, p2 = pos / pct_start, (pos - pct_start) / (1 - pct_start)
    lrs = np.where(warm, cos_anneal(lr_max / div, lr_max, p1), cos_anneal(lr_max, lr_max / div_final, p2))
    mom = np.where(warm, cos_anneal(moms[0], moms[1], p1), cos_anneal(moms[1], moms[2], p2))
    return lrs, mom


# ---------------------------------------------------------------------------------------------------------
# LR finder


@dataclass
class LRFinderResult:
    """What an LR sweep saw: learning rates, smoothed losses, and the suggestions drawn from them."""

    lrs: np.ndarray
    losses: np.ndarray
    suggestions: dict[str, float] = field(default_factory=dict)

    @property
    def suggestion(self) -> float:
        """The rate to use: the middle of the longest valley of the smoothed loss."""
        return self.suggestions["valley"]


def lr_suggestions(lrs: Sequence[float] | np.ndarray, losses: Sequence[float] | np.ndarray, skip_start: int = 10,
                   skip_end: int = 5) -> dict[str, float]:
    """Three picks from a sweep, skipping its noisy first and last points: a tenth of the rate at the minimum
    loss, the steepest descent (most negative d loss / d log lr), and the middle of the longest valley."""
    lr = np.asarray(lrs, float)[skip_start:len(lrs) - skip_end]
    loss = np.asarray(losses, float)[skip_start:len(losses) - skip_end]
    bad = ~np.isfinite(loss)
    if bad.any():  # a diverged sweep: keep what came before the first inf/NaN
        cut = int(np.argmax(bad))
        lr, loss = lr[:cut], loss[:cut]
    if len(lr) < 3:
        raise ValueError(f"an LR sweep needs at least {skip_start + skip_end + 3} finite points to suggest a rate, "
                         f"got {len(lrs)}; use more iterations or a lower start_lr")
    slope = np.diff(loss) / np.diff(np.log(lr))
    length, start = [1] * len(loss), list(range(len(loss)))  # the valley: the longest decreasing subsequence
    for i in range(len(loss)):
        for j in range(i):
            if loss[j] > loss[i] and length[j] + 1 > length[i]:
                length[i], start[i] = length[j] + 1, start[j]
    last = int(np.argmax(length))
    first = start[last]
    return {"minimum": float(lr[np.argmin(loss)] / 10), "steep": float(lr[np.argmin(slope)]),
            "valley": float(lr[(first + last) // 2])}


def lr_find(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            batches: Iterable[tuple[torch.Tensor, torch.Tensor]], opt: torch.optim.Optimizer,
            start_lr: float = 1e-7, end_lr: float = 10.0, num_it: int = 100, beta: float = 0.98,
            stop_factor: float = 4.0) -> LRFinderResult:
    """Train for `num_it` batches with the rate growing exponentially from `start_lr` to `end_lr`, smoothing
    the loss (debiased EWMA); stop when it exceeds `stop_factor` x its minimum. Model and optimizer state
    are restored afterwards."""
    if not 0 < start_lr < end_lr or num_it < 6:
        raise ValueError(f"lr_find needs 0 < start_lr < end_lr and num_it >= 6, got {start_lr}, {end_lr}, {num_it}")
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    lrs, smooth = [], []
    v, best, batch_iter = 0.0, math.inf, itertools.cycle(batches)
    model.train()
    try:
        for i in range(num_it):
            lr = start_lr * (end_lr / start_lr) ** (i / num_it)
            set_hypers(opt, lr=lr)
            xb, yb = next(batch_iter)
            loss = loss_fn(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            v = beta * v + (1 - beta) * loss.item()
            s = v / (1 - beta ** (i + 1))
            lrs.append(lr), smooth.append(s)
            best = min(best, s)
            if not math.isfinite(s) or s > stop_factor * best:
                break
    finally:
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)
    lrs_a, smooth_a = np.array(lrs), np.array(smooth)
    return LRFinderResult(lrs_a, smooth_a, lr_suggestions(lrs_a, smooth_a, skip_start=num_it // 10))


# ---------------------------------------------------------------------------------------------------------
# The acceleration experiment


def one_cycle_on_step(opt: torch.optim.Optimizer, n_steps: int, lr_max: float,
                      **cycle_kw: Any) -> Callable[[int], None]:
    """An `on_step` for `train.fit`: before step `it`, set the optimizer's lr and mom from `one_cycle`
    (n_steps = epochs x batches per epoch)."""
    lrs, moms = one_cycle(n_steps, lr_max, **cycle_kw)

    def on_step(it: int) -> None:
        set_hypers(opt, lr=float(lrs[it]), mom=float(moms[it]))

    return on_step


def fastai_history(learn: Any, epochs: int, lr: float, one_cycle: bool = False) -> FitHistory:
    """Fit a fastai Learner (`fit`, or `fit_one_cycle` with `lr` as lr_max) into a `train.FitHistory`: first metric
    and validation loss per epoch, cumulative training seconds (validation excluded)."""
    if not learn.metrics:
        raise ValueError("fastai_history reads the first metric: build the Learner with metrics=accuracy")
    fastai_patches()
    from fastai.callback.core import Callback

    class _TrainTimer(Callback):
        order = 0

        def before_fit(self) -> None:
            self.seconds, self.total = [], 0.0

        def before_train(self) -> None:
            self.t0 = time.perf_counter()

        def after_train(self) -> None:
            self.total += time.perf_counter() - self.t0
            self.seconds.append(self.total)

    timer = _TrainTimer()
    with learn.no_bar(), learn.no_logging():
        (learn.fit_one_cycle if one_cycle else learn.fit)(epochs, lr, cbs=timer)
    values = learn.recorder.values  # per epoch: [train loss, valid loss, first metric]
    return FitHistory(acc=[float(v[2]) for v in values], loss=[float(v[1]) for v in values], seconds=timer.seconds)


def to_target_stats(histories: Sequence[FitHistory], target: float) -> dict[str, Any]:
    """Epochs and seconds to `target` accuracy over seeds: mean, standard deviation, min, max, and how many got
    there; with the mean final accuracy."""
    hits = [h.to_target(target) for h in histories]
    eps = np.array([e for e, _ in hits if e is not None], float)
    secs = np.array([s for _, s in hits if s is not None], float)
    stats = lambda a: (float(a.mean()), float(a.std()), float(a.min()), float(a.max())) if len(a) else (math.nan,) * 4
    keys = ("mean", "std", "min", "max")
    return {"reached": len(eps), "runs": len(histories), "epochs": dict(zip(keys, stats(eps), strict=True)),
            "seconds": dict(zip(keys, stats(secs), strict=True)),
            "final_acc": float(np.mean([h.acc[-1] for h in histories]))}
