"""Exercise checks: the cell under a chapter's exercise calls `check("04.2", name=answer, ...)` and is told whether the
answer holds, with a hint when it does not. A check recomputes its reference on the learner's own machine (with the
package's copy of the chapter's code, or with the library the chapter compares against) and compares with the
tolerance the course's tests use, so a right answer holds on any CPU or GPU. An answer left as `...` is "not answered
yet", which is how every check cell reads in the committed chapters (the negative control `tests/test_exercises.py`
runs). Worked solutions are in `solutions/`, executed by the same test. Exercises without a check are open questions,
marked so in the chapter, with a worked discussion in `solutions/`.

Why not otter-grader or nbgrader: both grade a class's submissions (otter's `grader.check("q1")` runs OK-format test
files shipped beside the notebook; nbgrader generates a student version with hidden tests and collects submissions).
This course has no instructor in the loop and ships one notebook to learners and CI alike; a check here is a call into
the installed package, so it works on Colab and Kaggle without test files next to the notebook, and the same check runs
in CI against the worked solution and against the unanswered cell.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import accelhelpers as ah

__all__ = ["Check", "Result", "check", "checks", "exercise"]


@dataclass(frozen=True)
class Result:
    """What a check found: `holds` is True (the answer holds), False (it does not: `message` gives the hint) or None
    (not answered yet). Shown in a notebook as its message; true in an `if` only when the answer holds."""

    exercise: str
    holds: bool | None
    message: str

    def __bool__(self) -> bool:
        return self.holds is True

    def __repr__(self) -> str:
        return self.message


@dataclass(frozen=True)
class Check:
    """One exercise's check: the names the learner answers, a hint, a wrong answer it must reject (the negative control
    the tests run), and `judge(**answers, **context)`, which returns (holds, what it found)."""

    exercise: str
    answers: tuple[str, ...]
    hint: str
    judge: Callable[..., tuple[bool, str]]
    wrong: Mapping[str, Any] = field(default_factory=dict)


_CHECKS: dict[str, Check] = {}


def exercise(
    name: str, answers: tuple[str, ...], hint: str, wrong: Mapping[str, Any]
) -> Callable[[Callable[..., tuple[bool, str]]], Callable[..., tuple[bool, str]]]:
    """Register the decorated `judge` as exercise `name`'s check ('04.2': chapter 04, exercise 2)."""

    def register(judge: Callable[..., tuple[bool, str]]) -> Callable[..., tuple[bool, str]]:
        if name in _CHECKS:
            raise ValueError(f"exercise {name} has two checks")
        _CHECKS[name] = Check(name, tuple(answers), hint, judge, dict(wrong))
        return judge

    return register


def checks() -> dict[str, Check]:
    """Every exercise that has a check, by its name."""
    return dict(_CHECKS)


def check(name: str, **given: Any) -> Result:
    """Check the answers to exercise `name`: keyword arguments are the answers (and any setting of the chapter the
    check needs to recompute its reference). An answer left as `...` is not answered yet."""
    if name not in _CHECKS:
        known = ", ".join(sorted(_CHECKS)) or "none"
        raise ValueError(f"no exercise {name!r} has a check (those that do: {known})")
    c = _CHECKS[name]
    missing = [a for a in c.answers if a not in given]
    if missing:
        raise TypeError(f"exercise {name} needs the answer(s) {', '.join(missing)}: pass them as keywords")
    open_ = [a for a in c.answers if given[a] is Ellipsis]
    if open_:
        return Result(name, None, f"Exercise {name}: not answered yet (set {', '.join(open_)} in place of the ...).")
    try:
        holds, found = c.judge(**given)
    except Exception as e:  # a learner's function that raises is an answer that does not hold, said in one line
        holds, found = False, f"your answer raised {type(e).__name__}: {e}"
    if holds:
        return Result(name, True, f"Exercise {name} holds: {found}")
    return Result(name, False, f"Exercise {name} does not hold yet: {found}. Hint: {c.hint}")


# ---- the checks, chapter by chapter


# ---- chapter 01's exercises (notebooks/01_*.ipynb)
@exercise(
    "01.1",
    answers=("flattens_at",),
    hint="go through section 4a's rows (n, GFLOP/s, timing) from the smallest n and stop at the first whose GFLOP/s "
    "is at least 0.9 x PEAK_GFLOPS (None if no size gets there)",
    wrong={"flattens_at": 16, "rows": [(16, 1.0, None), (256, 95.0, None), (1024, 99.0, None)], "peak": 100.0},
)
def _ch01_1_matmul_flattens(flattens_at, rows, peak, share=0.9):
    """The smallest matmul size of the sweep whose GFLOP/s reaches `share` of the measured peak."""
    reached = [n for n, gflops, *_ in rows if gflops >= share * peak]
    ref = reached[0] if reached else None
    if flattens_at == ref:
        where = f"n={ref} is the first size at {share:.0%} of the {peak:.1f} GFLOP/s peak" if ref else "no size does"
        return True, f"{where} on this sweep"
    if flattens_at is not None and flattens_at not in reached:
        gf = {n: g for n, g, *_ in rows}.get(flattens_at)
        got = f"{gf / peak:.0%} of the peak" if gf is not None else "not a size of the sweep"
        return False, f"n={flattens_at} is {got}, not {share:.0%}"
    return False, f"{flattens_at} is not the smallest size at {share:.0%} of the peak"


@exercise(
    "01.3",
    answers=("sync_calls", "changes_on_cpu"),
    hint="benchmark syncs once after the warm-up, once per calibration attempt (min_time=0 stops after the first) "
    "and once per repeat; on the CPU sync returns at once",
    wrong={"sync_calls": 7, "changes_on_cpu": True},
)
def _ch01_3_sync_count(sync_calls, changes_on_cpu, repeats=7):
    """Count the package's benchmark's calls of sync with the chapter's settings (warmup=3, min_time=0)."""
    calls: list[Any] = []
    real = ah.timing.sync

    def counting(device):
        calls.append(device)
        real(device)

    ah.timing.sync = counting  # benchmark looks sync up in its module: count its calls there
    try:
        ah.timing.benchmark(lambda: None, "cpu", warmup=3, repeats=repeats, min_time=0)
    finally:
        ah.timing.sync = real
    cpu_waits = torch.device("cpu").type in ("cuda", "mps", "xla")  # sync's branches: nothing runs for the CPU
    ok = sync_calls == len(calls) and bool(changes_on_cpu) == cpu_waits
    if ok:
        return True, f"benchmark(..., repeats={repeats}, min_time=0) calls sync {len(calls)} times, a no-op on the CPU"
    if sync_calls != len(calls):
        return False, f"the count of {sync_calls} sync calls is not what benchmark makes with repeats={repeats}"
    return False, "the CPU queues nothing, so sync has nothing to wait for there"


class _ch01_OpBytes(TorchDispatchMode):
    """Records each aten op that runs, with the bytes its tensor inputs and outputs hold (an out= tensor once)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a for a in (*args, *(v for k, v in kwargs.items() if k != "out")) if isinstance(a, torch.Tensor)]
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        self.ops.append((str(func), sum(t.numel() * t.element_size() for t in ins + outs)))
        return out


def _ch01_ops_and_mb(fn, mb: float) -> tuple[int, float]:
    """Number of aten ops and MB moved by `fn(x, y)` on an fp32 tensor of `mb` MB (meta tensors: nothing is
    allocated or computed, only dispatched)."""
    n = int(mb * 2**20 / 4)
    x, y = torch.empty(n, device="meta"), torch.empty(n, device="meta")
    with _ch01_OpBytes() as rec:
        fn(x, y)
    return len(rec.ops), sum(b for _, b in rec.ops) / 2**20


@exercise(
    "01.4",
    answers=("kernels_expr", "mb_expr", "mb_add_out"),
    hint="in eager mode x * 2 + 1 is a multiply and then an add, each reading one tensor and writing a new one; "
    "torch.add(x, 1, out=y) reads x and writes y once",
    wrong={"kernels_expr": 1, "mb_expr": 128, "mb_add_out": 128, "mb": 64},
)
def _ch01_4_bytes_moved(kernels_expr, mb_expr, mb_add_out, mb=64):
    """Count the ops and the bytes they move with a dispatch mode, for x * 2 + 1 and for torch.add(..., out=)."""
    k_expr, ref_expr = _ch01_ops_and_mb(lambda x, y: x * 2 + 1, mb)
    _, ref_out = _ch01_ops_and_mb(lambda x, y: torch.add(x, 1, out=y), mb)
    close = lambda a, b: a is not None and abs(a - b) <= 0.01 * b
    if kernels_expr == k_expr and close(mb_expr, ref_expr) and close(mb_add_out, ref_out):
        return True, (
            f"x * 2 + 1 runs {k_expr} kernels moving {ref_expr:.0f} MB, torch.add(out=) moves {ref_out:.0f} MB: "
            f"{ref_expr / ref_out:.0f}x the bytes"
        )
    if kernels_expr != k_expr:
        return False, f"x * 2 + 1 does not run {kernels_expr} kernel(s) in eager PyTorch"
    wrong = "x * 2 + 1's" if not close(mb_expr, ref_expr) else "torch.add(out=)'s"
    return False, f"{wrong} bytes moved for a {mb} MB tensor are off by more than 1 %"


@exercise(
    "01.5",
    answers=("leaves_at",),
    hint="go through section 4c's rows (batch, Timing) in order and stop at the first whose median is at least twice "
    "the batch-1 median (None if none is)",
    wrong={
        "leaves_at": 64,
        "rows": [(1, ah.timing.Timing([1e-4])), (64, ah.timing.Timing([1.5e-4])), (256, ah.timing.Timing([3e-4]))],
    },
)
def _ch01_5_leaves_overhead(leaves_at, rows):
    """The first batch of the overhead sweep whose median forward time is at least 2x the batch-1 median."""
    one = rows[0][1].median
    left = [bs for bs, t in rows if t.median >= 2 * one]
    ref = left[0] if left else None
    if leaves_at == ref:
        return True, (
            f"batch {ref} is the first at 2x the batch-1 time ({one * 1e6:.1f} µs)" if ref else "no batch reaches 2x"
        )
    times = {bs: t.median for bs, t in rows}
    if leaves_at in times and times[leaves_at] < 2 * one:
        return False, f"batch {leaves_at} takes {times[leaves_at] / one:.1f}x the batch-1 time, under 2x"
    return False, f"batch {leaves_at} is not the first of the sweep at 2x the batch-1 time"


# ---- chapter 02's exercises (notebooks/02_*.ipynb)
def _ch02_many_activation_bytes(k: int, rows: int) -> int:
    """Bytes of one hidden layer's activations [K, rows, width] of the many-models step (padded 4 x 63 MLPs)."""
    many = ah.fullbatch.ManyMLP([ah.fullbatch.pad_mlp(ah.models.udl_mlp(4, seed=i)) for i in range(k)])
    k_, _, width = many.weights[0].shape
    return k_ * rows * width * many.weights[0].element_size()


@exercise(
    "02.1",
    answers=("act_bytes_2", "act_bytes_32"),
    hint="a hidden layer's activations in the many row are [K, rows, 64] fp32 (the widths are padded 63 -> 64): "
    "K x rows x 64 x 4 bytes",
    wrong={"act_bytes_2": 2 * 4000 * 63 * 4, "act_bytes_32": 32 * 4000 * 63 * 4, "rows": 4000},
)
def _ch02_1_activation_bytes(act_bytes_2, act_bytes_32, rows=4000):
    """One hidden layer's activation bytes for 2 and 32 models, from ManyMLP's padded shapes."""
    ref = {2: _ch02_many_activation_bytes(2, rows), 32: _ch02_many_activation_bytes(32, rows)}
    got = {2: act_bytes_2, 32: act_bytes_32}
    bad = [k for k in ref if got[k] != ref[k]]
    if not bad:
        return True, (
            f"one hidden layer of {rows} rows is {ref[2] / 2**20:.2f} MiB for 2 models and {ref[32] / 2**20:.2f} MiB "
            f"for 32: compare with the L2 and L3 sizes lscpu prints"
        )
    return False, f"the bytes for {bad[0]} models are not those of ManyMLP's hidden activations"


def _ch02_pinned_here() -> bool:
    """Whether a DataLoader with pin_memory=True over CPU tensors returns a pinned batch on this machine."""
    loader = DataLoader(TensorDataset(torch.zeros(8, 4), torch.zeros(8)), batch_size=8, pin_memory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without an accelerator it warns that it will not pin
        x, _ = next(iter(loader))
    return x.is_pinned()


@exercise(
    "02.2",
    answers=("pinned_here", "copies_per_step"),
    hint="pinning only speeds up host-to-device copies, and only where an accelerator exists: print "
    "next(iter(loader))[0].is_pinned() for a loader over CPU tensors, and ask where the chapter's data live",
    wrong={"pinned_here": None, "copies_per_step": 1},
)
def _ch02_2_pin_memory(pinned_here, copies_per_step):
    """pin_memory pins only where an accelerator exists; the chapter's data already live on `device`."""
    ref = _ch02_pinned_here()
    if pinned_here is ref and copies_per_step == 0:
        return True, (
            f"a pin_memory loader {'pins' if ref else 'does not pin'} here, and the naive loop copies nothing from "
            "host to device (its data already live on the device): nothing for pinning to speed up"
        )
    if copies_per_step != 0:
        return (
            False,
            f"{copies_per_step} host-to-device copies per step: check where data.x_train and data.y_train live",
        )
    return False, f"pinned_here={pinned_here!r} is not what a pin_memory loader returns on this machine"


def _ch02_zero_layer_keeps_model() -> bool:
    """Whether inserting a hidden layer of zero weights and biases into depth 1 keeps its outputs."""
    model = ah.models.udl_mlp(1, seed=0)
    first, relu, last = model
    zero = nn.Linear(last.in_features, last.in_features)
    nn.init.zeros_(zero.weight)
    nn.init.zeros_(zero.bias)
    deeper = nn.Sequential(first, relu, zero, nn.ReLU(), last)
    x = torch.randn(16, 40, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return torch.allclose(model(x), deeper(x))


def _ch02_common_shape_flops_ratio(rows: int = 4000) -> float:
    """Training FLOPs of the four depths padded to one shape (the widest width, the deepest depth) over their own."""
    depths = (1, 2, 3, 4)
    widest = max(max(ah.models.udl_sizes(d)[1:-1]) for d in depths)
    common = [40] + [widest] * max(depths) + [10]
    own = sum(ah.timing.mlp_flops(ah.models.udl_sizes(d), rows) for d in depths)
    return len(depths) * ah.timing.mlp_flops(common, rows) / own


@exercise(
    "02.3",
    answers=("flops_ratio", "zero_layer_keeps_model"),
    hint="the common shape is [40, 298, 298, 298, 298, 10] for all four (ah.timing.mlp_flops at batch 4000, against "
    "the sum over ah.models.udl_sizes(1..4)); and a layer of zeros outputs relu(0) = 0 whatever comes in",
    wrong={"flops_ratio": 1.0, "zero_layer_keeps_model": True},
)
def _ch02_3_common_shape(flops_ratio, zero_layer_keeps_model):
    """The padded common shape's FLOPs against the four models' own; a zero layer does not keep a model."""
    ref, keeps = _ch02_common_shape_flops_ratio(), _ch02_zero_layer_keeps_model()
    ratio_ok = isinstance(flops_ratio, (int, float)) and abs(flops_ratio - ref) <= 0.005 * ref
    if ratio_ok and bool(zero_layer_keeps_model) == keeps:
        return True, (
            f"one common shape costs {ref:.1f}x the four models' own FLOPs, and a zero layer "
            f"{'keeps' if keeps else 'changes'} a model: they cannot share a step as they are"
        )
    if not ratio_ok:
        return False, f"{flops_ratio} is not the common shape's FLOPs over the four models' own (within 0.5 %)"
    return False, "compare a depth-1 model's outputs with and without a zero hidden layer inserted"


@exercise(
    "02.4",
    answers=("forward_bc", "loss_bc"),
    hint="keep mlp_forward_t's loop, end with torch.addmm(params[-1], h, params[-2].T) for [batch, classes], and "
    "return (F.cross_entropy(logits, y), logits) from the loss",
    wrong={"forward_bc": ah.fullbatch.mlp_forward_t, "loss_bc": ah.fullbatch.loss_t},
)
def _ch02_4_batch_classes_layout(forward_bc, loss_bc):
    """The [batch, classes] forward and loss against the chapter's [classes, batch] ones: values and gradients."""
    model = ah.fullbatch.pad_mlp(ah.models.udl_mlp(4, seed=0))
    params = [t.detach() for lin in ah.fullbatch.mlp_linears(model, "check") for t in (lin.weight, lin.bias)]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 40, generator=g), torch.randint(0, 10, (64,), generator=g)
    ref_logits = ah.fullbatch.mlp_forward_t(params, x).T
    logits = forward_bc(params, x)
    if tuple(logits.shape) != tuple(ref_logits.shape):
        return (
            False,
            f"forward_bc returns shape {tuple(logits.shape)}, not [batch, classes] = {tuple(ref_logits.shape)}",
        )
    if not torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-6):
        return False, "forward_bc's logits differ from the chapter's (transposed) by more than rtol 1e-5"
    ref_grads, (ref_loss, _) = torch.func.grad_and_value(ah.fullbatch.loss_t, has_aux=True)(params, x, y)
    grads, (loss, aux) = torch.func.grad_and_value(loss_bc, has_aux=True)(params, x, y)
    if tuple(aux.shape) != tuple(ref_logits.shape):
        return False, f"loss_bc's second value has shape {tuple(aux.shape)}: return the [batch, classes] logits"
    if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6):
        return False, f"loss_bc gives {loss.item():.6f}, the chapter's loss_t {ref_loss.item():.6f}"
    if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grads, ref_grads, strict=True)):
        return False, "loss_bc's gradients (torch.func.grad_and_value) differ from loss_t's by more than rtol 1e-5"
    return True, "same logits (transposed), loss and gradients as the chapter's [classes, batch] step"


# ---- chapter 03's exercises (notebooks/03_*.ipynb)
_CH03_INF = math.inf
# sweeps of epochs to the target per seed (math.inf: never reached), and the rate the fewest-epochs rule picks
_CH03_EPOCH_SWEEPS = [
    ({0.01: [5, 7], 0.03: [4, 6], 0.1: [3, _CH03_INF]}, 0.03),  # a seed that never got there counts against its rate
    ({0.1: [4, 4], 0.3: [4, 4]}, 0.1),  # a tie: the smaller rate, as best_lr breaks ties
    ({0.05: [3, 3, 9], 0.1: [4, 4, 4]}, 0.05),  # the median, not the mean (5 vs 4)
    ({0.1: [_CH03_INF, _CH03_INF], 1.0: [_CH03_INF, _CH03_INF]}, 0.1),  # none reached: the smaller rate
    ({0.3: [2, 3, 2], 0.1: [6, 5, 6], 1.0: [_CH03_INF, 2, _CH03_INF]}, 0.3),  # rates not in order
]


@exercise(
    "03.1",
    answers=("best_lr_epochs",),
    hint="turn best_lr round: the smallest median number of epochs wins (math.inf counts as slowest), and a tie goes "
    "to the smaller rate",
    wrong={"best_lr_epochs": ah.optim.best_lr},
)
def _ch03_1_fewest_epochs(best_lr_epochs):
    """The learner's pick by fewest median epochs to the target, on sweeps with ties, infinities and medians."""
    for scores, ref in _CH03_EPOCH_SWEEPS:
        got = best_lr_epochs({lr: list(v) for lr, v in scores.items()})
        if got != ref:
            return False, f"on the sweep {scores} it picks {got}, not {ref} (fewest median epochs, ties to the smaller)"
    return True, f"it picks the fewest median epochs to the target on all {len(_CH03_EPOCH_SWEEPS)} test sweeps"


def _ch03_batches(steps: int = 20, rows: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, 40, generator=g), torch.randint(0, 10, (rows,), generator=g)) for _ in range(steps)]


@exercise(
    "03.3",
    answers=("make_nesterov",),
    hint="keep average_grad's buffer (mom * buf + grad) and step along grad + mom * buffer, as the algorithm box "
    "of torch.optim.SGD's documentation writes nesterov",
    wrong={"make_nesterov": lambda p, lr, mom: ah.optim.sgd(p, lr, mom=mom)},
)
def _ch03_3_nesterov(make_nesterov):
    """The learner's Nesterov optimizer against torch.optim.SGD(nesterov=True), max_param_gap below 1e-5."""
    model_fn = lambda: ah.models.udl_mlp(2, seed=0)
    gaps = {}
    for lr, mom in ((0.05, 0.9), (0.1, 0.5)):
        gaps[lr, mom] = ah.optim.max_param_gap(
            model_fn,
            lambda p, lr=lr, mom=mom: make_nesterov(p, lr, mom),
            lambda p, lr=lr, mom=mom: torch.optim.SGD(p, lr, momentum=mom, nesterov=True),
            _ch03_batches(),
        )
    worst = max(gaps, key=gaps.get)
    if gaps[worst] < 1e-5:
        return True, f"20 steps against torch.optim.SGD(nesterov=True): largest weight gap {gaps[worst]:.1e}"
    return False, f"at lr {worst[0]}, momentum {worst[1]} the weights end {gaps[worst]:.1e} apart (more than 1e-5)"


def _ch03_adam_no_bias_reference(grads: list[torch.Tensor], p0: torch.Tensor, lr: float) -> torch.Tensor:
    """Adam with torch's constants and no bias correction, written out: the averages start at 0 and are used as is."""
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    for g in grads:
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        p = p - lr * m / (v.sqrt() + 1e-8)
    return p


def _ch03_steps_of(make_opt, grads: list[torch.Tensor], p0: torch.Tensor, lr: float) -> torch.Tensor:
    p = torch.nn.Parameter(p0.clone())
    opt = make_opt([p], lr)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@exercise(
    "03.4",
    answers=("adam_no_bias", "first_step_ratio"),
    hint="without count_steps there is no step count: write an adam_step that divides grad_avg by "
    "sqr_avg.sqrt() + eps as they are; at step 1 they hold (1 - 0.9) g and (1 - 0.999) g^2",
    wrong={"adam_no_bias": lambda p, lr: ah.optim.adam(p, lr), "first_step_ratio": 1.0},
)
def _ch03_4_no_bias_correction(adam_no_bias, first_step_ratio):
    """The learner's Adam without bias correction against the formula written out, and its first step's size."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(50, generator=g)
    grads = [torch.randn(50, generator=g) for _ in range(5)]
    ours = _ch03_steps_of(adam_no_bias, grads, p0, 1e-3)
    ref = _ch03_adam_no_bias_reference(grads, p0, 1e-3)
    if not torch.allclose(ours, ref, rtol=1e-5, atol=1e-7):
        gap = (ours - ref).abs().max().item()
        return False, f"after 5 steps its weights are {gap:.1e} from Adam without bias correction"
    first = (_ch03_adam_no_bias_reference(grads[:1], p0, 1e-3) - p0).abs()
    corrected = (_ch03_steps_of(lambda p, lr: ah.optim.adam(p, lr), grads[:1], p0, 1e-3) - p0).abs()
    ratio = float(np.median((first / corrected).numpy()))
    if not isinstance(first_step_ratio, (int, float)) or abs(first_step_ratio - ratio) > 0.01 * ratio:
        return False, f"the optimizer holds, but {first_step_ratio} is not its first step over Adam's (within 1 %)"
    return True, f"no bias correction: the first step is {ratio:.2f}x Adam's, (1 - 0.9) / sqrt(1 - 0.999)"


# ---- chapter 04's exercises (notebooks/04_*.ipynb)
def _ch04_pretrained_flush(device, steps: tuple[int, ...]) -> tuple[dict[int, float], torch.nn.Module]:
    """Section 2's pretraining (udlbook 4x63 MLP, full-batch Adam, lr 3e-3, seed 0) on MNIST-1D: the share of the
    activation gradients fp16 flushes to zero without a loss scale after each of `steps`, and the trained MLP."""
    data = ah.data.mnist1d(device)
    ah.session.seed_everything(0)
    mlp = ah.models.udl_mlp(4, seed=0).to(device)
    opt = torch.optim.Adam(mlp.parameters(), lr=3e-3)
    flushed = {}
    for step in range(1, max(steps) + 1):
        loss = F.cross_entropy(mlp(data.x_train), data.y_train)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step in steps:  # gradients() runs one more backward and takes no step: training goes on unchanged
            acts = ah.precision.gradients(mlp, data.x_train, data.y_train)["activations"]
            flushed[step] = ah.precision.cast_report(acts, torch.float16, 1.0)["zero"]
    return flushed, mlp


def _ch04_no_scaler_gap(mlp, device, fp16_steps: int) -> float:
    """Section 4's comparison from `mlp`'s weights: training loss of fp16 without a scaler minus fp16 with one, after
    `fp16_steps` more full-batch Adam steps (the chapter's `behind`)."""
    data = ah.data.mnist1d(device)
    start = {k: v.clone() for k, v in mlp.state_dict().items()}
    after = {}
    for scaled in (False, True):
        mlp.load_state_dict(start)
        pol = ah.precision.Policy(torch.device(device).type, torch.float16, scaled, "exercise 4.1")
        adam, scaler = torch.optim.Adam(mlp.parameters(), lr=3e-3), pol.grad_scaler()
        for _ in range(fp16_steps):
            ah.precision.minibatch_step(mlp, adam, data.x_train, data.y_train, pol, scaler)
        with torch.no_grad():
            after[scaled] = F.cross_entropy(mlp(data.x_train), data.y_train).item()
    return after[False] - after[True]


@exercise(
    "04.1",
    answers=("flushed_20", "flushed_300", "keeps_up"),
    hint="run section 2 with PRETRAIN_STEPS = 20 and = 300 and read the 'activations, 2^0, -> zero' row as a fraction "
    "(0.38% is 0.0038); then section 4: fp16 keeps up when it ends at most 0.01 above the GradScaler run in loss",
    wrong={"flushed_20": 0.0038, "flushed_300": 0.0038, "keeps_up": False, "fp16_steps": 10},
)
def _ch04_1_flush_grows(flushed_20, flushed_300, keeps_up, device="cpu", fp16_steps=10):
    """Recompute section 2's flushed share after 20 and 300 pretraining steps, and section 4's gap after 300."""
    flushed, mlp = _ch04_pretrained_flush(device, (20, 300))
    behind = _ch04_no_scaler_gap(mlp, device, fp16_steps)
    close = lambda a, ref: isinstance(a, (int, float)) and abs(a - ref) <= max(1e-4, 0.02 * ref)
    ref_keeps = behind <= 0.01
    found = (
        f"fp16 flushes {flushed[20]:.2%} of the activation gradients after 20 steps, {flushed[300]:.2%} after 300; "
        f"without a scaler it ends {behind:+.4f} in loss against with one"
    )
    if not close(flushed_20, flushed[20]):
        return False, f"after 20 steps the flushed share is not {flushed_20} (2% tolerance)"
    if not close(flushed_300, flushed[300]):
        return False, f"after 300 steps the flushed share is not {flushed_300} (2% tolerance)"
    if bool(keeps_up) != ref_keeps:
        return False, f"fp16 without a scaler ends {behind:+.4f} in loss against with one after 300 steps"
    return True, found


@exercise(
    "04.2",
    answers=("final_scale", "any_step_skipped"),
    hint="call scaler_trace as the chapter does with init_scale=2.0**10 and read the last row's 'scale' and whether "
    "any row has 'skipped' True",
    wrong={"final_scale": 1024.0, "any_step_skipped": True, "rows": 250, "steps": 30},
)
def _ch04_2_scaler_from_2_10(final_scale, any_step_skipped, rows=250, steps=30, device="cpu"):
    """Recompute the chapter's GradScaler trace (growth interval 10) from a scale of 2^10."""
    data = ah.data.mnist1d(device)
    trace = ah.precision.scaler_trace(
        ah.models.udl_mlp(4, seed=0).to(device),
        data.x_train[:rows],
        data.y_train[:rows],
        steps,
        init_scale=2.0**10,
        growth_interval=10,
    )
    ref_scale, ref_skipped = trace[-1]["scale"], any(t["skipped"] for t in trace)
    skipped = sum(t["skipped"] for t in trace)
    found = f"the trace ends at scale {ref_scale:.0f} with {skipped} of {steps} steps skipped"
    if final_scale != ref_scale:
        return False, f"the last row's scale is not {final_scale}"
    if bool(any_step_skipped) != ref_skipped:
        return False, f"{skipped} of {steps} steps were skipped"
    return True, found


def _ch04_step_without_update(model, opt, xb, yb, policy, scaler):
    """minibatch_step with its scaler.update() removed (exercise 4.3's edit)."""
    with policy.autocast():
        loss = F.cross_entropy(model(xb), yb)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    return loss


def _ch04_first_failing_call(policy, calls: int = 3) -> tuple[int | None, str | None]:
    """Run the edited step `calls` times under `policy`: the number (from 1) of the first call that raises, and the
    exception's type name; (None, None) if none raises."""
    data = ah.data.mnist1d()
    model = ah.models.udl_mlp(4, seed=0)
    opt, scaler = torch.optim.Adam(model.parameters(), lr=1e-3), policy.grad_scaler()
    for call in range(1, calls + 1):
        try:
            _ch04_step_without_update(model, opt, data.x_train[:64], data.y_train[:64], policy, scaler)
        except Exception as e:  # what torch raises is the answer
            return call, type(e).__name__
    return None, None


@exercise(
    "04.3",
    answers=("fp16_call_that_raises", "exception", "bf16_raises"),
    hint="GradScaler.step records that it stepped this optimizer, and only update() clears that record; a policy "
    "without a scaler hands out a disabled GradScaler, whose step() just calls optimizer.step()",
    wrong={"fp16_call_that_raises": None, "exception": None, "bf16_raises": True},
)
def _ch04_3_no_update(fp16_call_that_raises, exception, bf16_raises):
    """Run minibatch_step without scaler.update() under fp16 + GradScaler and under bf16, on the CPU."""
    fp16 = ah.precision.Policy("cpu", torch.float16, True, "exercise 4.3")
    bf16 = ah.precision.Policy("cpu", torch.bfloat16, False, "exercise 4.3")
    call, name = _ch04_first_failing_call(fp16)
    bf16_call, _ = _ch04_first_failing_call(bf16)
    raised = f"call {call} raises {name}" if call else "no call raises"
    found = f"with fp16 + GradScaler {raised}; with bf16 " + ("a call raises" if bf16_call else "every call runs")
    if fp16_call_that_raises != call:
        return False, f"with fp16 + GradScaler it is not call {fp16_call_that_raises} that raises first"
    if exception != name:
        return False, f"the exception is not {exception!r} (give the class name as a string)"
    if bool(bf16_raises) != (bf16_call is not None):
        return False, "with bf16 " + ("a call raises" if bf16_call else "no call raises")
    return True, found


_CH04_T4 = ah.device.Hardware("cuda", "Tesla T4", (7, 5), 15.0, 1)  # tests/test_hardware.py's Colab T4
_CH04_A100 = ah.device.Hardware("cuda", "NVIDIA A100-SXM4-40GB", (8, 0), 40.0, 1)
_CH04_L4 = ah.device.Hardware("cuda", "NVIDIA L4", (8, 9), 22.5, 1)


@exercise(
    "04.4",
    answers=("t4_precision", "t4_scaler", "a100_precision", "l4_precision"),
    hint="call policy_for('cuda', hw=...) with a Hardware description per GPU (T4: compute capability (7, 5); "
    "A100: (8, 0); L4: (8, 9)) and read .name and .scaler",
    wrong={"t4_precision": "bf16", "t4_scaler": False, "a100_precision": "bf16", "l4_precision": "bf16"},
)
def _ch04_4_policy_on_gpus(t4_precision, t4_scaler, a100_precision, l4_precision):
    """policy_for('cuda') on descriptions of a Colab T4, an A100 and an L4 (no GPU needed)."""
    t4, a100, l4 = (ah.precision.policy_for("cuda", hw=hw) for hw in (_CH04_T4, _CH04_A100, _CH04_L4))
    found = f"a T4 gets {t4.name}{' + GradScaler' if t4.scaler else ''}, an A100 {a100.name}, an L4 {l4.name}"
    if t4_precision != t4.name or bool(t4_scaler) != t4.scaler:
        return False, f"on the T4 the policy is not {t4_precision!r} with scaler={t4_scaler}"
    if a100_precision != a100.name:
        return False, f"on the A100 the policy is not {a100_precision!r}"
    if l4_precision != l4.name:
        return False, f"on the L4 the policy is not {l4_precision!r}"
    return True, found


_CH04_NO_COMPUTE = {
    "_to_copy",
    "detach",
    "view",
    "t",
    "alias",
    "_unsafe_view",
    "reshape",
    "expand",
    "squeeze",
    "unsqueeze",
    "transpose",
    "permute",
    "as_strided",
}


@exercise(
    "04.5",
    answers=("fp32_ops",),
    hint="log cnn2d's forward and loss with op_dtypes under policy.autocast() and keep the ops whose output dtype is "
    "float32, leaving out _to_copy (autocast's casts) and detach, view and t (they compute nothing)",
    wrong={"fp32_ops": {"convolution", "addmm"}},
)
def _ch04_5_cnn_fp32_ops(fp32_ops, policy=None, device="cpu"):
    """The ops autocast runs in fp32 for ah.models.cnn2d on a batch of digits images, under the chapter's policy."""
    policy = policy if policy is not None else ah.precision.policy_for(device)
    imgs = ah.data.digits(device=device, images=True)
    torch.manual_seed(0)
    net = ah.models.cnn2d().to(device)
    xb, yb = imgs.x_train[:8], imgs.y_train[:8]

    def forward_loss():
        with policy.autocast():
            return F.cross_entropy(net(xb), yb)

    ref = {op for op, _, out in ah.precision.op_dtypes(forward_loss) if out == "float32"} - _CH04_NO_COMPUTE
    given = set(fp32_ops) if isinstance(fp32_ops, (set, frozenset, list, tuple)) else None
    found = (
        f"under {policy.name} autocast on {policy.device_type} cnn2d runs {', '.join(sorted(ref)) or 'no op'} in fp32"
    )
    if given is None:
        return False, "give the op names as a set of strings, e.g. {'addmm'}"
    if given != ref:
        extra, missing = sorted(given - ref), sorted(ref - given)
        parts = ([f"not in fp32: {', '.join(extra)}"] if extra else []) + (
            [f"{len(missing)} fp32 op(s) missing"] if missing else []
        )
        return False, "; ".join(parts)
    return True, found


# ---- chapter 05's exercises (notebooks/05_*.ipynb)
def _ch05_ranges(trace: Path) -> dict[str, list[tuple[float, float]]]:
    """The CPU ranges a Chrome trace holds (record_function's 'user_annotation' events), by name: (start, end) in µs."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    ranges: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("ph") == "X":
            ranges.setdefault(e["name"], []).append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
    return {k: sorted(v) for k, v in ranges.items()}


@exercise(
    "05.3",
    answers=("data_ranges", "model_ranges", "enclosing", "first"),
    hint="in Perfetto each profiled step is a 'train_step' bar with a 'data' and a 'model' bar under it: count the "
    "bars of each name and see which of the two starts first in a step",
    wrong={"data_ranges": 1, "model_ranges": 1, "enclosing": "model", "first": "model", "trace": "no-such-trace.json"},
)
def _ch05_3_trace_ranges(data_ranges, model_ranges, enclosing, first, trace=None):
    """Read the chapter's Chrome trace: how many 'data' and 'model' ranges, inside which range, which comes first."""
    trace = Path(trace) if trace is not None else ah.results.build_dir() / "traces" / "05_train_step.json"
    if not trace.exists():
        return False, f"there is no trace at {trace}: run section 4's profiling cell first"
    r = _ch05_ranges(trace)
    data, model = r.get("data", []), r.get("model", [])
    outer = {
        name
        for s, e in data + model
        for name, spans in r.items()
        if name not in ("data", "model") and any(a <= s and e <= b for a, b in spans)
    }
    ref_enclosing = outer.pop() if len(outer) == 1 else None
    order = {"data" if d[0] < m[0] else "model" for d, m in zip(data, model)}
    ref_first = order.pop() if len(order) == 1 else "mixed"
    found = (
        f"the trace holds {len(data)} 'data' and {len(model)} 'model' ranges, each inside a '{ref_enclosing}' range, "
        f"'{ref_first}' first"
    )
    if (data_ranges, model_ranges) != (len(data), len(model)):
        return False, f"the trace does not hold {data_ranges} 'data' and {model_ranges} 'model' ranges"
    if enclosing != ref_enclosing:
        return False, f"the ranges do not sit inside {enclosing!r}"
    if first != ref_first:
        return False, f"{first!r} is not the range that starts first in each step"
    return True, found


def _ch05_bn_net(norm: nn.Module) -> nn.Sequential:
    """Section 7a's caveat network with `norm` after its convolution."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), norm, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)
    )


@exercise(
    "05.5",
    answers=("gn_net", "exact_again"),
    hint="build section 7a's caveat network with nn.GroupNorm(4, 16) where nn.BatchNorm2d(16) was, and compare "
    "accumulated_grads(gn_net, xa, ya, micro_bs=64) with full_batch_grads(gn_net, xa, ya): exact means a relative "
    "difference below 1e-4",
    wrong={"gn_net": _ch05_bn_net(nn.BatchNorm2d(16)), "exact_again": True},
)
def _ch05_5_groupnorm_accumulates(gn_net, exact_again, x=None, y=None, micro_bs=64):
    """Accumulate over micro-batches with the learner's GroupNorm network and compare with one batch (tolerance 1e-4,
    the chapter's)."""
    if not isinstance(gn_net, nn.Module):
        return False, "gn_net is not a torch module (build the network, not a description of it)"
    kinds = {type(m) for m in gn_net.modules()}
    if nn.GroupNorm not in kinds or any(issubclass(k, nn.modules.batchnorm._BatchNorm) for k in kinds):
        return False, "gn_net must have a GroupNorm and no BatchNorm"
    if x is None:  # the chapter's batch: 256 augmented digits
        torch.manual_seed(0)
        images, labels = ah.pipeline.digits_uint8()
        x, y = ah.pipeline.augment_batch(images[:256], 32), labels[:256]
    device = next(gn_net.parameters()).device
    x, y = x.to(device), y.to(device)
    d = ah.metrics.rel_diff(
        ah.pipeline.accumulated_grads(gn_net, x, y, micro_bs), ah.pipeline.full_batch_grads(gn_net, x, y)
    )
    ref_exact = d < 1e-4
    found = f"with GroupNorm, {len(x) // micro_bs} x {micro_bs} accumulated differs from 1 x {len(x)} by {d:.1e}"
    if bool(exact_again) != ref_exact:
        return False, found
    return True, found + (" (exact up to float rounding)" if ref_exact else "")


def _ch05_largest(optimizer_states: int, size: int, budget_mb: float, limit: int) -> int:
    """The largest batch of cnn2d steps on `size` x `size` images within `budget_mb` MiB, counted on the CPU."""
    torch.manual_seed(0)
    fits = ah.pipeline.memory_fits(
        ah.models.cnn2d(), torch.zeros(1, 1, size, size), int(budget_mb * 2**20), optimizer_states
    )
    return ah.pipeline.largest_batch(fits, limit=limit)


@exercise(
    "05.6",
    answers=("largest_adam", "largest_sgd"),
    hint="build the test as section 6 does, memory_fits(model, sample, CPU_BUDGET_MB * 2**20, optimizer_states=k), "
    "with k = 2 for Adam and k = 1 for the chapter's SGD with momentum, and run largest_batch on each",
    wrong={"largest_adam": 163, "largest_sgd": 326, "size": 32, "budget_mb": 32, "limit": 4096},
)
def _ch05_6_finder_adam(largest_adam, largest_sgd, size=32, budget_mb=32, limit=4096):
    """The batch-size finder with Adam's two states against SGD-with-momentum's one, on the CPU under a budget."""
    adam, sgd = (_ch05_largest(k, size, budget_mb, limit) for k in (2, 1))
    found = f"within {budget_mb} MiB the largest batch is {adam} with Adam and {sgd} with SGD + momentum"
    if (largest_adam, largest_sgd) != (adam, sgd):
        wrong = "Adam" if largest_adam != adam else "SGD + momentum"
        return False, f"the largest batch with {wrong} is not {largest_adam if wrong == 'Adam' else largest_sgd}"
    return True, found


@exercise(
    "05.7",
    answers=("fixed_bytes", "bytes_per_sample"),
    hint="step_memory(model, x, optimizer_states=1) at two batch sizes: the difference divided by the difference in "
    "batch is the bytes per sample, and what is left at batch 0 the fixed part (parameters, gradients, one state)",
    wrong={"fixed_bytes": 0, "bytes_per_sample": 102528, "size": 32},
)
def _ch05_7_memory_line(fixed_bytes, bytes_per_sample, size=32):
    """section 6's step memory of cnn2d on the CPU (saved-tensor count): a fixed part plus a part per sample."""
    torch.manual_seed(0)
    model = ah.models.cnn2d()
    mem = {b: ah.pipeline.step_memory(model, torch.zeros(b, 1, size, size), optimizer_states=1) for b in (1, 2, 64)}
    per = mem[2] - mem[1]
    fixed = mem[1] - per
    linear = mem[64] == fixed + 64 * per
    found = f"a step of cnn2d on {size}x{size} images holds {fixed:,} bytes plus {per:,} per sample"
    if not linear:
        return False, "this machine's step memory is not a straight line in the batch (not the CPU count?)"
    if bytes_per_sample != per:
        return False, f"the step does not hold {bytes_per_sample} bytes per sample"
    if fixed_bytes != fixed:
        return False, f"the fixed part is not {fixed_bytes} bytes"
    return True, found


# ---- chapter 06's exercises (notebooks/06_*.ipynb)
def _ch06_grad_numel(width: int) -> int:
    """Gradient entries of ddp_train.py's MLP, ah.models.mlp([40, width, width, 10])."""
    return ah.models.count_params(ah.models.mlp([40, width, width, 10]))


@exercise(
    "06.2",
    answers=("fp32_bytes", "bf16_bytes"),
    hint="the all-reduced buffer holds one entry per parameter (ah.models.count_params of ddp_train.py's MLP): 4 bytes "
    "each in fp32; bf16_compress_hook casts the bucket to bf16 before the all-reduce",
    wrong={"fp32_bytes": 315432, "bf16_bytes": 315432, "width": 256},
)
def _ch06_2_compressed_bytes(fp32_bytes, bf16_bytes, width=256):
    """Bytes of gradient each rank all-reduces per step, with DDP's default and with bf16_compress_hook."""
    n = _ch06_grad_numel(width)
    ref32 = n * torch.finfo(torch.float32).bits // 8
    ref16 = n * torch.finfo(torch.bfloat16).bits // 8
    found = f"the MLP of width {width} has {n:,} gradient entries: {ref32:,} bytes in fp32, {ref16:,} in bf16"
    if fp32_bytes != ref32:
        return False, f"{fp32_bytes} is not the fp32 gradient's size in bytes"
    if bf16_bytes != ref16:
        return False, f"{bf16_bytes} is not the size in bytes of the gradient cast to bf16"
    return True, found


def _ch06_first(sampler: DistributedSampler, epoch: int | None, k: int = 4) -> list[int]:
    """The first `k` indices the sampler yields, after set_epoch(epoch) if epoch is given."""
    if epoch is not None:
        sampler.set_epoch(epoch)
    return list(sampler)[:k]


@exercise(
    "06.3",
    answers=("epoch0_first", "epoch1_first_without", "epoch1_first_with"),
    hint="build the sampler of ddp_data.py (the loader ddp_train.py trains from) for rank 0 without a process group, "
    "DistributedSampler(range(n), num_replicas=NPROC, rank=0, shuffle=True, seed=0) with n the MNIST-1D training "
    "rows, and list it: once, once more without set_epoch, and after set_epoch(1)",
    wrong={"epoch0_first": [0, 1, 2, 3], "epoch1_first_without": [0, 1, 2, 3], "epoch1_first_with": [0, 1, 2, 3]},
)
def _ch06_3_set_epoch(epoch0_first, epoch1_first_without, epoch1_first_with, world=2):
    """Rank 0's first four indices of ddp_data.py's DistributedSampler (ddp_train.py's loader) in epochs 0 and 1,
    with and without set_epoch (no process group: rank and world are given)."""
    n = len(ah.data.mnist1d().x_train)
    new = lambda: DistributedSampler(range(n), num_replicas=world, rank=0, shuffle=True, seed=0)
    sampler = new()
    e0, e1_without = _ch06_first(sampler, None), _ch06_first(sampler, None)
    e1_with = _ch06_first(new(), 1)
    found = (
        f"rank 0 of {world} starts epoch 0 with {e0}, epoch 1 with {e1_without} without set_epoch, {e1_with} with it"
    )
    given = [
        list(a) if isinstance(a, (list, tuple)) else a for a in (epoch0_first, epoch1_first_without, epoch1_first_with)
    ]
    for name, got, ref in zip(
        ("epoch 0", "epoch 1 without set_epoch", "epoch 1 with set_epoch(1)"), given, (e0, e1_without, e1_with)
    ):
        if got != ref:
            return False, f"rank 0's first four indices of {name} are not {got}"
    return True, found


@exercise(
    "06.4",
    answers=("lr", "steps_per_epoch", "warmup_steps"),
    hint="the linear rule multiplies the baseline rate by k; train_mnist1d drops the last partial batch, so an epoch "
    "has len(x_train) // batch steps, and warm-up over 1 epoch lasts that many steps",
    wrong={"lr": 0.02, "steps_per_epoch": 125, "warmup_steps": 125, "b0": 32, "lr0": 0.01},
)
def _ch06_4_k32(lr, steps_per_epoch, warmup_steps, b0=32, lr0=0.01, k=32, warmup_epochs=1.0):
    """Section 3's linear rule at k = 32: the rate, the steps per epoch and the warm-up in steps (train_mnist1d's)."""
    n = len(ah.data.mnist1d().x_train)
    batch = k * b0
    ref_lr, ref_steps = k * lr0, n // batch
    ref_warm = max(1, round(warmup_epochs * ref_steps))
    found = (
        f"k = {k}: batch {batch}, lr {ref_lr:g}, {ref_steps} steps per epoch over {n} rows, warm-up {ref_warm} steps"
    )
    if not isinstance(lr, (int, float)) or abs(lr - ref_lr) > 1e-9 * ref_lr:
        return False, f"{lr} is not the linear rule's rate for k = {k}"
    if steps_per_epoch != ref_steps:
        return False, f"an epoch of batch {batch} does not have {steps_per_epoch} steps"
    if warmup_steps != ref_warm:
        return False, f"a warm-up of {warmup_epochs:g} epoch does not last {warmup_steps} steps"
    return True, found


@exercise(
    "06.5",
    answers=("grad_bytes", "buckets"),
    hint="add up 4 bytes per parameter of ah.models.mlp([40, 1024, 1024, 10]); DDP fills buckets from the last "
    "layer's gradients backwards, closing the first once it holds dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) or more "
    "and the next ones at the bucket cap (25 MiB)",
    wrong={"grad_bytes": 4407336, "buckets": 1},
)
def _ch06_5_buckets(grad_bytes, buckets, width=1024):
    """The gradient bytes of the full profile's MLP and the number of buckets DDP's rebuilt bucketing gives it
    (DDP's own assignment function, on the parameters in the order their gradients are ready: last layer first)."""
    params = list(ah.models.mlp([40, width, width, 10]).parameters())
    ref_bytes = sum(p.numel() * p.element_size() for p in params)
    cap = 25 * 2**20  # DDP's default bucket_cap_mb
    assignment, _ = dist._compute_bucket_assignment_by_size(params[::-1], [dist._DEFAULT_FIRST_BUCKET_BYTES, cap])
    found = f"width {width}: {ref_bytes:,} bytes of gradients, {len(assignment)} bucket(s) after DDP's first iteration"
    if grad_bytes != ref_bytes:
        return False, f"the MLP of width {width} does not hold {grad_bytes} bytes of gradients"
    if buckets != len(assignment):
        return False, f"{ref_bytes:,} bytes do not fill {buckets} bucket(s)"
    return True, found


# ---- chapter 07's exercises (notebooks/07_*.ipynb)
def _ch07_bucket(length: int, buckets) -> int:
    """The bucket pad_to_bucket pads `length` up to (the chapter's rule: the smallest bucket that holds it)."""
    return int(ah.xla.pad_to_bucket(torch.zeros(1, length), buckets).shape[-1])


@exercise(
    "07.1",
    answers=("compiles_per_length", "compiles_bucketed"),
    hint="one XLA graph per distinct shape the loop meets: count the distinct lengths in step_lengths (not in "
    "LENGTHS), and the distinct buckets they pad up to",
    wrong={"compiles_per_length": 21, "compiles_bucketed": 2, "step_lengths": [20, 33, 20, 40], "buckets": [32, 40]},
)
def _ch07_1_compiles_per_length(compiles_per_length, compiles_bucketed, step_lengths, buckets):
    lengths = [int(n) for n in step_lengths]
    distinct = len(set(lengths))
    padded = len({_ch07_bucket(n, buckets) for n in lengths})
    ok = compiles_per_length == distinct and compiles_bucketed == padded
    return ok, (
        f"the {len(lengths)} steps meet {distinct} distinct lengths, so {distinct} compiles without buckets, and "
        f"{padded} with buckets {sorted(buckets)}"
    )


@exercise(
    "07.2",
    answers=("quiet_run",),
    hint="pass the Counted your fit_xla returned: no .item() inside the step, one after each epoch; an accumulator "
    "made with torch.zeros at the start of an epoch is a graph of its own that the loader's first sync runs, so start "
    "the sum from the epoch's first loss.detach()",
    wrong={
        "quiet_run": ah.xla.Counted(ah.xla.XlaCounts(compiles=1, executions=48, to_host=24), 1.0),
        "epochs": 3,
        "steps": 24,
    },
)
def _ch07_2_one_execution_per_step(quiet_run, epochs, steps=None):
    steps = getattr(quiet_run, "steps", steps)
    d = getattr(quiet_run, "delta", None)
    if d is None or not steps:
        return False, "that is not the Counted of a fit_xla run (it needs .delta and .steps)"
    ok = d.executions == steps and d.to_host == epochs
    return ok, (
        f"{d.executions} executions for {steps} steps ({d.executions / steps:g} per step) and {d.to_host} "
        f"device-to-host transfers for {epochs} epochs"
    )


@exercise(
    "07.5",
    answers=("odd_execution", "pending_variable"),
    hint="list the Graph Hash of each 'Execution Analysis' the bf16 run logged, in order: which one differs, "
    "and which tensor of section 5's first lines was still waiting to be computed when fit_xla started?",
    wrong={"odd_execution": 2, "pending_variable": "loss_bf16"},
)
def _ch07_5_odd_graph(odd_execution, pending_variable):
    name = str(pending_variable).strip().strip("'\"` ")
    ok = odd_execution == 1 and name == "out"
    return ok, (
        "the first execution (the loader's sync before the first batch) has its own hash: it computes `out`, the "
        "autocast forward that loss_bf16.item() left pending"
        if ok
        else f"execution {odd_execution} and {name!r} is not what the log shows"
    )


# ---- chapter 08's exercises (notebooks/08_*.ipynb)
def _ch08_ort_per_channel(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """ONNX Runtime's dynamic int8, per_channel=True, on one MatMul + Add layer (built with onnx.helper: no export)."""
    ah.tools.require("onnx", "onnxruntime")
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization import QuantType, quantize_dynamic

    n_out, n_in = weight.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "wt"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n_out])],
        initializer=[numpy_helper.from_array(np.ascontiguousarray(weight.T), "wt"), numpy_helper.from_array(bias, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "linear.onnx", Path(tmp) / "linear_int8.onnx"
        onnx.save(model, src)
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True)
        return ah.deploy.ort_run(ah.deploy.ort_session(dst, threads=1), x)


def _ch08_per_tensor(x, weight, bias=None):
    return ah.deploy.int8_linear(x, weight, bias)


@exercise(
    "08.1",
    answers=("int8_linear_per_channel",),
    hint="one QParams per row of the weight (qparams(row.min(), row.max(), signed=True, symmetric=True)), "
    "accumulate in int32 as before, then multiply column j of the accumulator by float32(x scale * row j's scale)",
    wrong={"int8_linear_per_channel": _ch08_per_tensor},
)
def _ch08_1_per_channel(int8_linear_per_channel):
    rng = np.random.default_rng(8)
    n_in, n_out = 24, 12
    row_size = np.geomspace(0.05, 2.0, n_out, dtype=np.float32)[:, None]  # rows of very different ranges
    weight = (rng.standard_normal((n_out, n_in)) * row_size).astype(np.float32)
    bias = (0.1 * rng.standard_normal(n_out)).astype(np.float32)
    x = (1.5 * rng.standard_normal((64, n_in))).astype(np.float32)
    mine = int8_linear_per_channel(x, weight, bias)
    mine = np.asarray(mine["y"] if isinstance(mine, dict) else mine, dtype=np.float32)
    ort = _ch08_ort_per_channel(x, weight, bias)
    if mine.shape != ort.shape:
        return False, f"your output has shape {mine.shape}, ONNX Runtime's {ort.shape}"
    same = bool(np.array_equal(mine, ort))
    return same, (
        "bit for bit ONNX Runtime's per-channel dynamic int8 on a 24 -> 12 layer"
        if same
        else f"max |difference| {np.abs(mine - ort).max():.3g} from ONNX Runtime's per-channel dynamic int8"
    )


def _ch08_reference_fixed(x, precision):
    """ap_fixed<W,I,AP_RND,AP_SAT>: round half up to the grid (AP_RND adds half a step, then truncates), saturate to
    [-2^(I-1), 2^(I-1) - 2^-F] (Vitis HLS user guide UG1399, 'Arbitrary Precision Fixed-Point Data Types')."""
    width, integer = ah.deploy.parse_fixed(precision)
    frac = width - integer
    q = np.floor(np.asarray(x, dtype=np.float64) * 2.0**frac + 0.5)
    q = np.clip(q, -(2.0 ** (width - 1)), 2.0 ** (width - 1) - 1)
    return q / 2.0**frac


@exercise(
    "08.3",
    answers=("to_fixed_modes",),
    hint="AP_RND adds half a step before truncating (np.floor(x * 2**F + 0.5)); AP_SAT clips the integer to "
    "[-2**(W-1), 2**(W-1) - 1] instead of wrapping; the default AP_TRN/AP_WRAP must still behave as to_fixed does",
    wrong={"to_fixed_modes": ah.deploy.to_fixed},
)
def _ch08_3_round_and_saturate(to_fixed_modes):
    step = 2.0**-6  # ap_fixed<10,4>: 6 fraction bits, range [-8, 8)
    grid = np.arange(-9.0, 9.0, step / 4)  # every quarter step: exactly halfway points included
    x = np.concatenate([grid, [7.99, 8.0, 9.5, -8.0, -8.01, -9.5, 0.3, -0.3, step / 2, -step / 2]])
    for precision in ("ap_fixed<10,4,AP_RND,AP_SAT>", "ap_fixed<8,3,AP_RND,AP_SAT>", "ap_fixed<16,6,AP_RND,AP_SAT>"):
        got = np.asarray(to_fixed_modes(x, precision), dtype=np.float64)
        want = _ch08_reference_fixed(x, precision)
        if got.shape != want.shape or not np.array_equal(got, want):
            bad = int(np.argmax(got != want)) if got.shape == want.shape else 0
            return False, f"{precision}: {x[bad]!r} gives {got.ravel()[bad]!r}, AP_RND/AP_SAT give {want[bad]!r}"
    for precision in ("ap_fixed<10,4>", "ap_fixed<8,4,AP_TRN,AP_WRAP>"):
        if not np.array_equal(np.asarray(to_fixed_modes(x, precision)), ah.deploy.to_fixed(x, precision)):
            return False, f"{precision} (truncate and wrap) no longer matches the chapter's to_fixed"
    return True, "round half up and saturation on every quarter step of [-9, 9), and truncate/wrap unchanged"


@exercise(
    "08.4",
    answers=("multipliers_r1", "multipliers_r16", "fits_fully_parallel"),
    hint="sum ceil(n_in * n_out / R) over the Linear layers of ah.models.udl_mlp(depth=4) (40 -> 63 x 4 -> 10), and "
    "compare the R = 1 total with the part's DSP slices",
    wrong={"multipliers_r1": 78336, "multipliers_r16": 4896, "fits_fully_parallel": True, "dsp_slices": 12_288},
)
def _ch08_4_udl_multipliers(multipliers_r1, multipliers_r16, fits_fully_parallel, dsp_slices):
    model = ah.models.udl_mlp(depth=4, seed=0)
    total = {r: sum(layer["multipliers"] for layer in ah.deploy.multipliers(model, r)) for r in (1, 16)}
    fits = total[1] <= dsp_slices
    ok = multipliers_r1 == total[1] and multipliers_r16 == total[16] and bool(fits_fully_parallel) == fits
    sizes = " -> ".join(str(s) for s in ah.models.udl_sizes(4))
    return ok, (
        f"the {sizes} MLP needs {total[1]} multipliers at R = 1 and {total[16]} at R = 16; the part has {dsp_slices} "
        f"DSP slices, so fully parallel it {'fits' if fits else 'does not fit'}"
    )


# ---- chapter 09's exercises (notebooks/09_*.ipynb)
@contextlib.contextmanager
def _ch09_own_rngs_and_threads(threads: int = 1):
    """Run a check's training without moving the learner's global generators or thread count."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        torch.set_num_threads(saved[3])


def _ch09_cut_and_resume(steps: int, every: int, die_at: int, resume_threads: int = 1) -> tuple[int, bool]:
    """train.py's experiment in this process: an uninterrupted run, a run saving every `every` steps (keeping two)
    that stops after `die_at`, and a resume of its newest good checkpoint to `steps` on `resume_threads` threads.
    Returns (the step the resume began at, whether it ends bit-identical to the uninterrupted run)."""
    lr = ah.longrun
    folder = Path(tempfile.mkdtemp(prefix="accel_ex09_"))
    try:
        with _ch09_own_rngs_and_threads(1):
            reference = lr.weights(lr.train(lr.make_run(total_steps=steps), steps))

            def save_then_maybe_die(run):
                if run.step % every == 0:
                    lr.save(run, lr.checkpoint_path(folder, run.step), keep=2)
                return run.step == die_at  # train.py's SIGKILL after this step: nothing after it runs

            lr.train(lr.make_run(total_steps=steps), steps, save_then_maybe_die)
            newest = lr.latest_good_checkpoint(folder)
            run = lr.make_run(total_steps=steps)
            if newest is not None:  # no checkpoint yet: train.py starts from step 0
                lr.resume(run, newest)
            began = run.step
            torch.set_num_threads(resume_threads)
            final = lr.weights(lr.train(run, steps))
        same = all(torch.equal(reference[k], final[k]) for k in reference)
        return began, same
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@exercise(
    "09.1",
    answers=("resume_step", "bit_identical"),
    hint="train.py saves after every step that is a multiple of EVERY and keeps the newest two; the kill comes after "
    "step DIE_AT, so the resume begins at the last multiple of EVERY at or before DIE_AT",
    wrong={"resume_step": 23, "bit_identical": True, "every": 5, "die_at": 23, "steps": 64},
)
def _ch09_1_resume_step(resume_step, bit_identical, every, die_at, steps):
    if not 0 < die_at < steps:
        return False, f"the check needs 0 < DIE_AT < STEPS (got DIE_AT={die_at}, STEPS={steps})"
    began, same = _ch09_cut_and_resume(steps, every, die_at)
    ok = resume_step == began and bool(bit_identical) == same
    return ok, (
        f"with EVERY={every} and DIE_AT={die_at} the resume begins at step {began} and ends "
        f"{'bit-identical to' if same else 'different from'} the uninterrupted run"
    )


@exercise(
    "09.2",
    answers=("bit_identical_with_2_threads",),
    hint="resume the same checkpoint with torch.set_num_threads(2) and compare the final weights with the "
    "uninterrupted 1-thread run bit for bit (digest, or torch.equal on every tensor)",
    wrong={"bit_identical_with_2_threads": "maybe", "every": 8, "die_at": 29, "steps": 64},
)
def _ch09_2_two_threads(bit_identical_with_2_threads, every, die_at, steps):
    if not isinstance(bit_identical_with_2_threads, bool):
        return False, "answer True or False"
    _, same = _ch09_cut_and_resume(steps, every, die_at, resume_threads=2)
    ok = bit_identical_with_2_threads == same
    verdict = "bit-identical to" if same else "different from"
    return ok, f"resumed on 2 threads, this CPU ends {verdict} the 1-thread run"


class _Ch09OutOfMemory(RuntimeError):
    """What torch raises when the CPU allocator fails (ah.device.oom_kind recognises the message)."""


def _ch09_step_that_fits(largest: int):
    """A training step that runs out of memory above `largest` rows; records every batch size tried."""
    tried: list[int] = []

    def step(batch_size: int) -> str:
        tried.append(batch_size)
        if batch_size > largest:
            raise _Ch09OutOfMemory(
                f"[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to "
                f"allocate {batch_size * 4096 * 4} bytes"
            )
        return f"trained at {batch_size}"

    return step, tried


@exercise(
    "09.5",
    answers=("backoff",),
    hint="halve until a size fits, then bisect between the last size that failed and the last that fit until they "
    "are 1 apart; return (fn's result, the largest size that fit); re-raise out of memory at min_batch_size and "
    "let any other error through",
    wrong={"backoff": ah.longrun.with_batch_backoff},
)
def _ch09_5_binary_search(backoff):
    freed = []
    original = ah.device.free_memory
    ah.device.free_memory = lambda: freed.append(1)  # gc.collect() in a kernel with torch loaded is slow
    try:
        counts = {}
        for start, largest, floor in ((65536, 3000, 1), (65536, 40000, 1), (4096, 4096, 1), (1000, 37, 8)):
            step, tried = _ch09_step_that_fits(largest)
            result, size = backoff(step, start, floor)
            want = max(floor, min(start, largest))
            if size != want or result != f"trained at {size}":
                return False, f"from {start} with steps fitting up to {largest} rows it returned {size}, not {want}"
            bound = 2 * max(1, start // floor).bit_length() + 1
            if len(tried) > bound:
                return False, f"from {start} to {largest} it tried {len(tried)} sizes: a binary search needs <= {bound}"
            counts[start, largest] = len(tried)
        step, _ = _ch09_step_that_fits(3)
        try:
            backoff(step, 64, 8)
            return False, "a step that does not fit even at min_batch_size returned instead of raising"
        except RuntimeError as e:
            if ah.device.oom_kind(e) is None:
                return False, f"at min_batch_size it raised {type(e).__name__}, not the out-of-memory error"

        def broken(batch_size):
            raise ValueError("a bug, not memory")

        try:
            backoff(broken, 64, 1)
            return False, "a ValueError from the step was swallowed"
        except ValueError:
            pass
    finally:
        ah.device.free_memory = original
    tries = counts[65536, 3000]
    return True, f"largest fitting size found every time; from 65536 to 3000 in {tries} tries ({len(freed)} frees)"


def _ch09_resume_without_loader(stop, own_generator, save_at=None, resume_at=None, folder=None, steps=64):
    """The wrong answer, without accelerate: every state resumed but the loader's position, so the epoch's order
    restarts from the generator's seed (what the chapter's accelerate_run does with a loader of its own generator)."""
    lr = ah.longrun
    run = lr.make_run(total_steps=steps)
    if resume_at is not None:
        lr.resume(run, Path(folder) / "state.pt", leave_out="loader")

    def save_at_step(r):
        if r.step == save_at:
            lr.save(r, Path(folder) / "state.pt")
        return False

    return lr.weights(lr.train(run, stop, save_at_step))


@exercise(
    "09.3",
    answers=("exact_accelerate_run",),
    hint="note run.gen.get_state() when each epoch's iterator is created and save it with the batches served; on "
    "resume set it back, create the iterator (the same order is drawn) and pass over the served batches",
    wrong={"exact_accelerate_run": _ch09_resume_without_loader, "steps": 64, "per_epoch": 8},
)
def _ch09_3_accelerate_mid_epoch(exact_accelerate_run, steps, per_epoch):
    folder = Path(tempfile.mkdtemp(prefix="accel_ex09_acc_"))
    try:
        with _ch09_own_rngs_and_threads(1):
            uninterrupted = exact_accelerate_run(steps, True, folder=folder / "unused")
            found = {}
            for at in (2 * per_epoch + per_epoch // 2, 2 * per_epoch):
                exact_accelerate_run(at, True, save_at=at, folder=folder / str(at))
                resumed = exact_accelerate_run(steps, True, resume_at=at, folder=folder / str(at))
                found[at] = all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    mid, end = found.values()
    ok = mid and end
    return ok, (
        f"with the loader's own generator, resumed mid-epoch: {'bit-identical' if mid else 'differs'}; "
        f"at an epoch end: {'bit-identical' if end else 'differs'}"
    )


# ---- chapter 10's exercises (notebooks/10_*.ipynb)
def _quant_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "QuantLinear"]


@exercise(
    "10.1",
    answers=("per_channel_mlp",),
    hint="in brevitas_mlp, use weight_quant=Int8WeightPerChannelFixedPoint (from brevitas.quant.fixed_point) and keep "
    "everything else as it is",
    wrong={"per_channel_mlp": lambda sizes, bits: ah.toolflows.brevitas_mlp(sizes, bits)},
)
def _ch10_1_per_channel(per_channel_mlp, sizes=(40, 64, 64, 10), bits=4):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Brevitas warns about optional kernels it does not need here
        model = per_channel_mlp(list(sizes), bits).eval()
        reference = ah.toolflows.brevitas_mlp(list(sizes), bits)
        if [type(m).__name__ for m in model] != [type(m).__name__ for m in reference]:
            return False, "the layers differ from brevitas_mlp's (QuantIdentity, QuantLinear, QuantReLU, ...)"
        linears = _quant_linears(model)
        for i, layer in enumerate(linears):
            qw = layer.quant_weight()
            scale = qw.scale.detach().flatten()
            if scale.numel() != layer.out_features:
                return False, f"QuantLinear {i} has {scale.numel()} weight scale(s), not one per output channel"
            if not torch.equal(torch.exp2(torch.round(torch.log2(scale))), scale):
                return False, f"QuantLinear {i}'s weight scales are not all powers of two (no ap_fixed type holds them)"
            if int(qw.bit_width) != bits:
                return False, f"QuantLinear {i}'s weights are {int(qw.bit_width)} bits wide, not {bits}"
        with torch.no_grad():
            y = model(torch.randn(8, sizes[0], generator=torch.Generator().manual_seed(0)))
        y = getattr(y, "value", y)
    if tuple(y.shape) != (8, sizes[-1]):
        return False, f"the model maps 8 rows to shape {tuple(y.shape)}"
    return (
        True,
        f"{len(linears)} QuantLinear layers, each with one power-of-two scale per output channel at {bits} bits",
    )


@exercise(
    "10.2",
    answers=("weight_levels", "relu_levels"),
    hint="a signed narrow-range quantizer of b bits has 2**b - 1 values (-(2**(b-1) - 1) to 2**(b-1) - 1), an "
    "unsigned one 2**b; ask brevitas_mlp's layers (weight_quant / act_quant: is_signed, is_narrow_range)",
    wrong={"weight_levels": {3: 8, 2: 4}, "relu_levels": {3: 8, 2: 4}},
)
def _ch10_2_levels(weight_levels, relu_levels, widths=(3, 2)):
    want_w, want_r = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for bits in widths:
            model = ah.toolflows.brevitas_mlp([4, 4, 2], bits)
            wq = _quant_linears(model)[0].weight_quant
            aq = next(m for m in model.modules() if type(m).__name__ == "QuantReLU").act_quant
            for q, out in ((wq, want_w), (aq, want_r)):
                b = int(q.bit_width())
                out[bits] = 2**b - (1 if q.is_signed and q.is_narrow_range else 0)
    got_w = {int(k): int(v) for k, v in dict(weight_levels).items()}
    got_r = {int(k): int(v) for k, v in dict(relu_levels).items()}
    ok = got_w == want_w and got_r == want_r
    return ok, f"Brevitas's quantizers allow {want_w} weight values and {want_r} ReLU output values (bits: values)"


@exercise(
    "10.4",
    answers=("accuracies",),
    hint="for each n in (16, 128, 512): nncf_quantize(paths['fp32'], data.x_train[:n].numpy()), openvino_compile, "
    "then ah.metrics.accuracy(openvino_run(compiled, x_test), y_test)",
    wrong={
        "accuracies": {16: 0.0, 128: 0.0, 512: 0.0},
        "onnx_path": None,
        "x_train": None,
        "x_test": None,
        "y_test": None,
    },
)
def _ch10_4_calibration_rows(accuracies, onnx_path, x_train, x_test, y_test, rows=(16, 128, 512)):
    got = {int(k): float(v) for k, v in dict(accuracies).items()}
    if sorted(got) != sorted(rows):
        return False, f"give an accuracy for each of {list(rows)} calibration rows, got {sorted(got)}"
    if onnx_path is None:
        return False, "pass the chapter's fp32 ONNX file as onnx_path to recompute the accuracies"
    tf = ah.toolflows
    x_train = np.asarray(x_train, dtype=np.float32)
    want = {}
    for n in rows:
        compiled = tf.openvino_compile(tf.nncf_quantize(onnx_path, x_train[:n]), threads=1)
        want[n] = ah.metrics.accuracy(tf.openvino_run(compiled, x_test), np.asarray(y_test))
    # one test row either way: the same calibration on the same CPU gives the same model
    ok = all(math.isclose(got[n], want[n], abs_tol=1.5 / len(y_test)) for n in rows)
    said = ", ".join(f"{n} rows {want[n]:.3f}" for n in rows)
    return ok, f"OpenVINO int8 (NNCF) test accuracy, recomputed here: {said}"


# ---- chapter 11's exercises (notebooks/11_*.ipynb)
@exercise(
    "11.2",
    answers=("p_kept_two_seeds", "p_kept_five_seeds"),
    hint="a change that does nothing is faster than the stack on each seed with probability 1/2, and the rule asks "
    "for every seed",
    wrong={"p_kept_two_seeds": 0.5, "p_kept_five_seeds": 0.2},
)
def _ch11_2_null_candidate(p_kept_two_seeds, p_kept_five_seeds):
    # the rule (`helps`): kept only when the per-seed ratio is above 1 on every seed; for a change that does nothing
    # each seed's ratio is a fair coin, so the chance is 1/2 per seed, independently
    want = {2: 0.5**2, 5: 0.5**5}
    got = {2: float(p_kept_two_seeds), 5: float(p_kept_five_seeds)}
    ok = all(abs(got[n] - want[n]) <= 0.2 * want[n] for n in want)
    return ok, f"a do-nothing change is kept with probability {want[2]:g} on 2 seeds and {want[5]:g} on 5"


@exercise(
    "11.4",
    answers=("target",),
    hint="the target is FLOOR_LOSS + TARGET_GAP x (PREV_LOSS - FLOOR_LOSS), with TARGET_GAP = 0.4",
    wrong={"target": 1.758, "vocab": 16, "topics": 4, "context": 32, "n_val": 128},
)
def _ch11_4_harder_target(target, vocab, topics, context, n_val, gap=0.4):
    sr = ah.speedrun
    lang = sr.make_language(vocab, topics, successors=3, seed=0)
    val = sr.sample(lang, n_val, context, seed=2)
    floor, prev = sr.bayes_loss(lang, val), sr.previous_token_loss(lang, val)
    want = floor + gap * (prev - floor)
    ok = abs(float(target) - want) <= 1e-6
    return ok, f"TARGET_GAP = {gap} puts the target at {want:.4f} nats (floor {floor:.4f}, previous token {prev:.4f})"


@exercise(
    "11.5",
    answers=("devices", "ddp_runs"),
    hint="DEVICES is the cores divided by THREADS; `plan` skips a row that needs more devices than there are",
    wrong={"devices": 2, "ddp_runs": True, "rows": None},
)
def _ch11_5_two_threads(devices, ddp_runs, rows, cores=2, threads=2):
    sr = ah.speedrun
    rows = rows if rows is not None else [sr.Row("DDP, 2 ranks", {"world": 2})]  # None: the DDP row alone
    want_devices = cores // threads
    planned = sr.plan(rows, ah.device.Hardware("cpu"), want_devices)
    ddp = [p for p in planned if p.row.change.get("world", 1) > 1]
    want_runs = any(p.skipped is None for p in ddp)
    ok = int(devices) == want_devices and bool(ddp_runs) is want_runs
    why = ddp[0].skipped if ddp and ddp[0].skipped else "runs"
    return ok, f"{cores} cores at {threads} threads are {want_devices} device(s); the DDP row: {why}"


def _counted_per_token(cfg, kind: str) -> float:
    """FlopCounterMode's FLOPs per token for one training step of a GPT of shape `cfg` on the CPU."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gpt = ah.speedrun.GPT(cfg).set_attention(kind)
        xb = torch.randint(0, cfg.vocab, (2, cfg.context + 1))
    with FlopCounterMode(display=False) as counter:
        gpt(xb[:, :-1], xb[:, 1:]).backward()
    return counter.get_total_flops() / xb[:, :-1].numel()


@exercise(
    "11.6",
    answers=("flops_per_token_causal", "sdpa_counted_per_token"),
    hint="a causal query at position i reads i keys, not the whole context: (T+1)/2 on average; run FlopCounterMode "
    "on an SDPA step (gpt.set_attention('sdpa')) on the CPU and divide by the tokens",
    wrong={
        "flops_per_token_causal": lambda cfg: ah.speedrun.flops_per_token(cfg),
        "sdpa_counted_per_token": 645120,
        "cfg": None,
    },
)
def _ch11_6_causal_flops(flops_per_token_causal, sdpa_counted_per_token, cfg):
    sr = ah.speedrun
    cfg = cfg if cfg is not None else sr.GPTConfig(16, 32, 2, 4, 64)  # None: the quick profile's model
    small = sr.GPTConfig(cfg.vocab, min(cfg.context, 64), min(cfg.n_layer, 2), cfg.n_head, min(cfg.n_embd, 128))
    wrong = []
    for c in (small, sr.GPTConfig(16, 8, 1, 2, 32)):
        # the full count is FlopCounterMode's on the written-out attention; the causal mask removes T(T-1)/2 of the
        # T x T scores per head, in both of attention's matmuls: d (T-1) multiply-adds per token and layer
        full = _counted_per_token(c, "plain")
        want = full - 3 * 2 * c.n_layer * c.n_embd * (c.context - 1)
        if abs(flops_per_token_causal(c) - want) > 0.5:
            wrong.append(f"{flops_per_token_causal(c):,} for {c} (the causal count is {want:,.0f})")
    sdpa = _counted_per_token(cfg, "sdpa")
    if abs(float(sdpa_counted_per_token) - sdpa) > 0.5:
        wrong.append(
            f"FlopCounterMode counts {sdpa:,.0f} FLOPs per token for an SDPA step here, not "
            f"{float(sdpa_counted_per_token):,.0f}"
        )
    if wrong:
        return False, "; ".join(wrong)
    share = 1 - sdpa / sr.flops_per_token(cfg)
    return True, (
        f"the causal count matches the written-out step less its masked scores, and FlopCounterMode counts "
        f"{sdpa:,.0f} per token for SDPA on the CPU ({share:.1%} below the full count)"
    )


@exercise(
    "11.7",
    answers=("runs_on_t4", "runs_on_a100", "runs_on_cpu"),
    hint="call plan([Row('cuDNN attention', {'attention': 'sdpa', 'backend': 'cudnn'})], hw, 1) with the T4, A100 "
    "and CPU descriptions and read `skipped`",
    wrong={"runs_on_t4": False, "runs_on_a100": True, "runs_on_cpu": True},
)
def _ch11_7_cudnn_plan(runs_on_t4, runs_on_a100, runs_on_cpu):
    sr, hw = ah.speedrun, ah.device.Hardware
    row = sr.Row("cuDNN attention", {"attention": "sdpa", "backend": "cudnn"})
    machines = {
        "T4": hw("cuda", "Tesla T4", (7, 5), 15.0, 1),
        "A100": hw("cuda", "NVIDIA A100-SXM4-40GB", (8, 0), 40.0, 1),
        "CPU": hw("cpu"),
    }
    want = {name: sr.plan([row], m, 1)[0].skipped is None for name, m in machines.items()}
    got = {"T4": bool(runs_on_t4), "A100": bool(runs_on_a100), "CPU": bool(runs_on_cpu)}
    said = ", ".join(f"{k} {'runs' if v else 'skipped'}" for k, v in want.items())
    return got == want, f"the plan for the cuDNN row: {said}"


# ---- chapter 12's exercises (notebooks/12_*.ipynb)
def _train_py_setup() -> tuple[torch.Tensor, torch.Tensor, nn.Module, torch.optim.Optimizer]:
    """train.py's data, model and optimizer (chapter 12, section 3), built the same way."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    y = (x[:, :8].sum(1, keepdim=True) - x[:, 8:].sum(1, keepdim=True)).tanh()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    return x, y, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _chunked_mean_loss(model, x, y, rows, rank, world):
    """train.py as written: torch.chunk's share, each rank's mean loss (the wrong answer to exercise 12.1)."""
    mine = rows.chunk(world)[rank]
    return mine, F.mse_loss(model(x[mine]), y[mine])


@exercise(
    "12.1",
    answers=("rows_per_rank", "rank_loss"),
    hint="DDP averages the ranks' gradients: weight each rank's summed loss by world / (rows in the global batch), "
    "and split with torch.tensor_split, which gives every rank a share for any number of ranks",
    wrong={"rows_per_rank": [22, 22, 20], "rank_loss": _chunked_mean_loss},
)
def _ch12_1_uneven_split(rows_per_rank, rank_loss, batch=64):
    want_sizes = [len(c) for c in torch.arange(batch).chunk(3)]
    if [int(n) for n in rows_per_rank] != want_sizes:
        return (
            False,
            f"train.py's rows.chunk(3) gives the ranks {want_sizes} rows of {batch}, not {list(rows_per_rank)}",
        )
    x, y, model, _ = _train_py_setup()
    rows = (torch.arange(batch) + 7 * batch) % len(x)  # step 7's global batch
    ref = torch.autograd.grad(F.mse_loss(model(x[rows]), y[rows]), list(model.parameters()))
    for world in (1, 2, 3, 5, 7):
        grads, seen = [torch.zeros_like(p) for p in model.parameters()], []
        for rank in range(world):
            mine, loss = rank_loss(model, x, y, rows, rank, world)
            seen += [int(r) for r in mine]
            # a rank reads only its own rows: the others are NaN for it, and its gradient must stay finite and equal
            x_nan, y_nan = torch.full_like(x, float("nan")), torch.full_like(y, float("nan"))
            x_nan[mine], y_nan[mine] = x[mine], y[mine]
            g = torch.autograd.grad(rank_loss(model, x_nan, y_nan, rows, rank, world)[1], list(model.parameters()))
            if not all(torch.isfinite(t).all() for t in g):
                return False, f"with {world} ranks, rank {rank}'s loss reads rows other than the ones it says are its"
            grads = [a + b / world for a, b in zip(grads, g)]  # DDP: the mean of the ranks' gradients
        if sorted(seen) != sorted(int(r) for r in rows):
            return False, f"with {world} ranks the shares do not cover the global batch once each"
        worst = max((a - b).abs().max().item() for a, b in zip(grads, ref))
        if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(grads, ref)):
            return False, f"with {world} ranks DDP's averaged gradient is {worst:.1e} from the one-process gradient"
    return True, (
        f"rows.chunk(3) gives {want_sizes}; your loss gives the one-process gradient on 1, 2, 3, 5 and 7 ranks"
    )


def _replay(steps: int, every: int, check_every: int, signal_after: int | None, folder: Path) -> tuple[dict, int]:
    """train.py's loop on one rank, saving only every `every` steps (no save at the signal); with `signal_after`, a
    SIGTERM lands once that many steps are done, the attempt stops at the next flag check, and a second attempt
    resumes from the newest checkpoint. Returns the final weights and the steps computed in all."""
    computed, start, attempts = 0, 0, 0
    while True:
        x, y, model, opt = _train_py_setup()
        newest = ah.longrun.latest_good_checkpoint(folder)
        start = ah.longrun.load_checkpoint(newest, model, opt) if newest else 0
        signalled = signal_after is not None and attempts == 0
        for step in range(start, steps):
            rows = torch.arange(step * 64, (step + 1) * 64) % len(x)
            opt.zero_grad()
            F.mse_loss(model(x[rows]), y[rows]).backward()
            opt.step()
            computed += 1
            done = step + 1
            stop = signalled and done >= signal_after and done % check_every == 0
            if done % every == 0:
                ah.longrun.save_checkpoint(ah.longrun.checkpoint_path(folder, done), model, opt, step=done, keep=2)
            if stop:
                break
        else:
            return {k: v.detach().clone() for k, v in model.state_dict().items()}, computed
        attempts += 1


@exercise(
    "12.2",
    answers=("repeated_steps", "bit_identical"),
    hint="the flag is read only every --check-every steps, and the resumed attempt starts at the newest periodic "
    "checkpoint (a multiple of 20); every state the step depends on is in that checkpoint",
    wrong={"repeated_steps": 13, "bit_identical": False},
)
def _ch12_2_sparse_checkpoints(repeated_steps, bit_identical, steps=40, every=20, check_every=5, signal_after=33):
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        straight, _ = _replay(steps, every, check_every, None, Path(a))
        resumed, computed = _replay(steps, every, check_every, signal_after, Path(b))
    want_repeated = computed - steps
    want_same = all(torch.equal(straight[k], resumed[k]) for k in straight)
    ok = int(repeated_steps) == want_repeated and bool(bit_identical) is want_same
    same = "bit-identical" if want_same else "not bit-identical"
    return ok, f"replayed here: the resumed run repeats {want_repeated} steps and ends {same} to the straight one"
