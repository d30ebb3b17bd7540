"""Feeding the accelerator: a dataset with real per-item cost, loader timing, profiling, starvation,
host-device syncs, batch-size search and gradient accumulation (plain torch, fastai, accelerate)."""

from __future__ import annotations

import io
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import metrics
from .device import sync
from .faults import free_memory, oom_kind

HABITS = ("none", "item", "print", "cpu")


# ---------------------------------------------------------------- augmentation: one item or a whole batch

def random_affine(n: int, max_deg: float = 15.0, max_shift: float = 0.1, max_zoom: float = 0.1,
                  device: torch.device | str = "cpu", generator: torch.Generator | None = None) -> torch.Tensor:
    """`n` random affine matrices [n, 2, 3] (rotation, zoom, shift) in `affine_grid`'s normalised coordinates."""
    if n < 0:
        raise ValueError(f"random_affine needs n >= 0, got {n}")
    u = torch.rand(n, 4, device=device, generator=generator) * 2 - 1      # four uniform numbers in [-1, 1]
    ang, zoom = u[:, 0] * math.radians(max_deg), 1 + u[:, 1] * max_zoom
    cos, sin = torch.cos(ang) / zoom, torch.sin(ang) / zoom
    return torch.stack([torch.stack([cos, -sin, u[:, 2] * max_shift], 1),
                        torch.stack([sin, cos, u[:, 3] * max_shift], 1)], 1)


def affine_grid(theta: torch.Tensor, size: int) -> torch.Tensor:
    """`F.affine_grid(theta, [n, c, size, size], align_corners=False)` written with elementwise ops only:
    the library call runs a batched matmul that, for one small image, costs more in thread start-up than in work."""
    if theta.dim() != 3 or theta.shape[1:] != (2, 3) or size < 1:
        raise ValueError(f"affine_grid needs theta [n, 2, 3] and size >= 1; got {tuple(theta.shape)}, {size}")
    c = (torch.arange(size, device=theta.device, dtype=theta.dtype) * 2 + 1) / size - 1   # pixel centres
    bx, by = c[None, None, :], c[None, :, None]
    t = theta[:, :, :, None, None]
    gx = t[:, 0, 0] * bx + t[:, 0, 1] * by + t[:, 0, 2]
    gy = t[:, 1, 0] * bx + t[:, 1, 1] * by + t[:, 1, 2]
    return torch.stack([gx, gy], dim=-1)


def warp(x: torch.Tensor, theta: torch.Tensor, size: int) -> torch.Tensor:
    """Resize images [n, c, h, w] to size x size and apply the affine `theta` in one bilinear resampling."""
    if x.dim() != 4 or theta.shape != (x.shape[0], 2, 3):
        raise ValueError(f"warp needs images [n, c, h, w] and theta [n, 2, 3]; got {tuple(x.shape)} and "
                         f"{tuple(theta.shape)}")
    grid = affine_grid(theta.to(x.dtype), size)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def augment_batch(x: torch.Tensor, size: int = 32, noise: float = 0.05,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Batch transform on the device: uint8/float digits [n, 1, 8, 8] to augmented, normalised [n, 1, size, size]."""
    x = x.float() / 16 if not x.is_floating_point() else x
    out = warp(x, random_affine(len(x), device=x.device, generator=generator), size)
    out = out + noise * torch.randn(out.shape, device=x.device, generator=generator)
    return (out - 0.3) / 0.4


class AugmentedDigits(torch.utils.data.Dataset):
    """scikit-learn `digits` as stored uint8 images, decoded, resized and augmented per item (the usual
    torchvision-style pipeline), so that each item costs real CPU time. Picklable, for DataLoader workers."""

    def __init__(self, images: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor, size: int = 32,
                 augment: bool = True, repeat: int = 1):
        images = torch.as_tensor(np.asarray(images)).to(torch.uint8)
        if images.dim() == 3:
            images = images[:, None]
        if images.dim() != 4 or len(images) != len(labels) or size < 1 or repeat < 1:
            raise ValueError(f"AugmentedDigits needs images [n, (1,) h, w] and n labels, size >= 1 and "
                             f"repeat >= 1; got images {tuple(images.shape)}, {len(labels)} labels, "
                             f"size {size}, repeat {repeat}")
        self.images, self.labels = images, torch.as_tensor(np.asarray(labels)).long()
        self.size, self.augment, self.repeat = size, augment, repeat

    def __len__(self) -> int:
        return len(self.images) * self.repeat

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = i % len(self.images)
        x = self.images[j][None].float() / 16                             # "decode": uint8 -> float in [0, 1]
        if self.augment:
            return augment_batch(x, self.size)[0], self.labels[j]
        return warp(x, torch.eye(2, 3)[None], self.size)[0], self.labels[j]


def digits_uint8(test_size: float = 0.2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The training images of scikit-learn `digits` as uint8 [n, 1, 8, 8] (values 0..16) and their labels."""
    from .data import digits

    split = digits(test_size=test_size, seed=seed, images=True)
    return (split.x_train * 16).round().to(torch.uint8), split.y_train


class NumpyDraws(torch.utils.data.Dataset):
    """`n` items, each one `np.random.random()` drawn when fetched: shows which NumPy seed a DataLoader worker has."""

    def __init__(self, n: int = 4):
        if n < 1:
            raise ValueError(f"NumpyDraws needs n >= 1, got {n}")
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> float:
        return float(np.random.random())


def seed_worker(worker_id: int) -> None:
    """PyTorch's reproducibility recipe for `worker_init_fn`: seed NumPy and `random` in each worker from the seed
    torch gave that worker (set by the DataLoader's `generator`)."""
    import random

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def write_digits_png(root: str | Path, per_class: int | None = None) -> Path:
    """scikit-learn `digits` written as 8x8 grayscale PNG files, `root/<label>/<index>.png` (the folder layout
    `ImageDataLoaders.from_folder` and `parent_label` read); `per_class` images of each digit, or all of them."""
    from PIL import Image
    from sklearn.datasets import load_digits

    if per_class is not None and per_class < 1:
        raise ValueError(f"per_class must be >= 1 or None, got {per_class}")
    root, d = Path(root), load_digits()
    count = dict.fromkeys(range(10), 0)
    for i, (img, label) in enumerate(zip(d.images, d.target, strict=True)):
        if per_class is not None and count[int(label)] >= per_class:
            continue
        count[int(label)] += 1
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((img * 255 / 16).round().astype(np.uint8)).save(folder / f"{i:04d}.png")
    return root


# ---------------------------------------------------------------- loader throughput

@dataclass
class LoaderTiming:
    """Seconds per epoch of a loader (the first pays for starting workers), and items per epoch."""

    epoch_s: list[float]
    items: int

    @property
    def first_s(self) -> float:
        """The first epoch, worker start-up included."""
        return self.epoch_s[0]

    @property
    def best_items_per_s(self) -> float:
        """Items per second of the fastest later epoch: the one least disturbed by other processes."""
        return self.items / min(self.epoch_s[1:] or self.epoch_s)


def compare_loaders(loaders: dict[str, Iterable], device: torch.device | str = "cpu", epochs: int = 3,
                    batch_tfms: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
                    ) -> dict[str, LoaderTiming]:
    """Time several loaders one epoch each in turn, `epochs` rounds (fetch, copy to `device`, batch transform
    there, device sync): on a shared machine a burst of load then hits every loader alike."""
    if epochs < 1 or not loaders:
        raise ValueError("compare_loaders needs at least one loader and epochs >= 1")
    tfms = batch_tfms or {}
    out = {name: LoaderTiming([], 0) for name in loaders}
    for _ in range(epochs):
        for name, loader in loaders.items():
            t0, out[name].items = time.perf_counter(), 0
            for xb, _yb in loader:
                xb = xb.to(device, non_blocking=True)
                out[name].items += len(tfms[name](xb) if name in tfms else xb)
            sync(device)
            out[name].epoch_s.append(time.perf_counter() - t0)
            if out[name].items == 0:
                raise ValueError(f"loader {name!r} yielded no batches: check the dataset length and drop_last")
    return out


# ---------------------------------------------------------------- profiling and starvation

def profile_steps(step: Callable[[], object], steps: int = 5, trace: str | Path | None = None,
                  device: torch.device | str = "cpu") -> torch.profiler.profile:
    """Run `step()` `steps` times under torch.profiler (CPU, plus CUDA when on a GPU); write a Chrome
    trace to `trace` if given (open it in chrome://tracing or https://ui.perfetto.dev)."""
    if steps < 1:
        raise ValueError(f"profile_steps needs steps >= 1, got {steps}")
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("train_step"):
                step()
        sync(device)
    if trace is not None:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    return prof


def top_ops(prof: torch.profiler.profile, n: int = 8, device: bool = False) -> list[tuple[str, float, int]]:
    """The `n` operators with the most self time: (name, self time in µs, calls); `device=True` ranks
    by self time on the GPU instead of the CPU."""
    key = "self_device_time_total" if device else "self_cpu_time_total"
    rows = [(e.key, float(getattr(e, key)), int(e.count)) for e in prof.key_averages()]
    rows = [r for r in rows if r[0] != "train_step" and not r[0].startswith("ProfilerStep")]
    return sorted(rows, key=lambda r: r[1], reverse=True)[:n]


@dataclass
class Starvation:
    """Where a training loop's time went: waiting for the next batch, or in the step itself."""

    wait_s: float
    step_s: float
    steps: int

    @property
    def share(self) -> float:
        """Fraction of the loop spent waiting on data (0: never starved, 1: only waiting)."""
        return self.wait_s / max(self.wait_s + self.step_s, 1e-12)

    def verdict(self) -> str:
        """One line a reader can act on."""
        if self.share > 0.5:
            return (f"starved: {self.share:.0%} of each step waits on data. Move transforms to the device, "
                    f"add workers, or cache decoded data.")
        if self.share > 0.1:
            return f"partly starved: {self.share:.0%} of each step waits on data."
        return f"fed: only {self.share:.0%} of each step waits on data; speed up the step itself."


def data_wait_share(loader: Iterable, step: Callable[[torch.Tensor, torch.Tensor], object],
                    device: torch.device | str = "cpu", max_steps: int | None = None,
                    batch_tfm: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Starvation:
    """Is the accelerator starved? Time `next(batch)` + copy (+ batch transform) against `step(xb, yb)`,
    syncing the device after each so queued work is not misattributed."""
    wait = work = 0.0
    steps, t0 = 0, time.perf_counter()
    for xb, yb in islice(loader, max_steps):  # the wait of each batch runs from t0 through next() to the copy
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        if batch_tfm is not None:
            xb = batch_tfm(xb)
        sync(device)
        t1 = time.perf_counter()
        step(xb, yb)
        sync(device)
        wait, work, steps = wait + t1 - t0, work + time.perf_counter() - t1, steps + 1
        t0 = time.perf_counter()
    if steps == 0:
        raise ValueError("the loader yielded no batches to time")
    return Starvation(wait, work, steps)


# ---------------------------------------------------------------- host-device syncs in the loop

def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               habit: str = "none", log: list | None = None) -> Callable[[], None]:
    """A training step with one of the usual logging habits: 'none', 'item' (loss.item()), 'print'
    (print the loss tensor) or 'cpu' (loss.cpu()); each of the last three waits for the device."""
    if habit not in HABITS:
        raise ValueError(f"unknown habit {habit!r}: choose one of {', '.join(HABITS)}")
    sink, log = io.StringIO(), log if log is not None else []

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if habit == "item":
            log.append(loss.item())
        elif habit == "print":
            print(loss, file=sink)
            sink.seek(0), sink.truncate()
        elif habit == "cpu":
            log.append(loss.detach().cpu())
        else:
            log.append(loss.detach())      # stays on the device: no sync until someone reads it

    return step


# ---------------------------------------------------------------- batch size: memory and the finder

def step_memory(model: nn.Module, x: torch.Tensor, optimizer_states: int = 2) -> int:
    """Bytes one training step needs: parameters, gradients, `optimizer_states` copies (Adam: 2, SGD: 0,
    momentum: 1) and saved activations. On CUDA, measured instead as the peak allocated."""
    if optimizer_states < 0:
        raise ValueError(f"optimizer_states must be >= 0, got {optimizer_states}")
    if x.device.type == "cuda":                 # measured: peak over the step, gradients included
        model.zero_grad(set_to_none=True)
        peak = metrics.peak_memory(lambda: model(x).float().sum().backward(), x.device)
        model.zero_grad(set_to_none=True)
        return int(peak + (1 + optimizer_states) * metrics.param_bytes(model))
    return (2 + optimizer_states) * metrics.param_bytes(model) + metrics.activation_bytes(model, x)


def largest_batch(fits: Callable[[int], bool], start: int = 1, limit: int = 2**20) -> int:
    """The largest batch size in [start, limit] with `fits(bs)` True: double until it fails, then bisect.
    Assumes that what fits at bs also fits below it."""
    if not 1 <= start <= limit:
        raise ValueError(f"largest_batch needs 1 <= start <= limit, got start={start}, limit={limit}")
    if not fits(start):
        raise ValueError(f"batch size {start} does not fit: lower `start`, shrink the model, or raise the budget")
    good = start
    bad = None
    while bad is None:
        nxt = min(good * 2, limit)
        if nxt == good:
            return good
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def memory_fits(model: nn.Module, sample: torch.Tensor, budget_bytes: int | None = None,
                optimizer_states: int = 2) -> Callable[[int], bool]:
    """A `fits(bs)` test for `largest_batch`: runs a step of batch `bs` (shaped like `sample`, on its device);
    out of memory (`faults.oom_kind`) means False (and the memory is freed); with a budget, the step's memory
    (`step_memory`) must also stay within it. On a CPU a budget is required: RAM 'fits' long after it is slow."""
    if budget_bytes is None and sample.device.type != "cuda":
        raise ValueError("on a CPU give budget_bytes (e.g. 2 * 2**30): without one every batch 'fits' until the "
                         "machine swaps")

    def fits(bs: int) -> bool:
        try:
            used = step_memory(model, sample.expand(bs, *sample.shape[1:]).contiguous(), optimizer_states)
        except (RuntimeError, MemoryError) as e:
            if oom_kind(e) is None:
                raise
        else:
            return budget_bytes is None or used <= budget_bytes
        model.zero_grad(set_to_none=True)  # outside the except block: its traceback no longer holds the tensors
        free_memory()
        return False

    return fits


# ---------------------------------------------------------------- gradient accumulation, three ways

def grads(model: nn.Module) -> list[torch.Tensor]:
    """Copies of the model's current gradients (zeros where there is none)."""
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def full_batch_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                     loss_fn: Callable = F.cross_entropy) -> list[torch.Tensor]:
    """Gradients of the mean loss over the whole batch, in one backward pass (the reference)."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    return grads(model)


def accumulated_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_bs: int,
                      loss_fn: Callable = F.cross_entropy) -> list[torch.Tensor]:
    """Plain PyTorch accumulation: backward on each micro-batch's mean loss scaled by its share of the
    batch (loss / k when all k micro-batches are equal), no zero_grad in between."""
    if micro_bs < 1:
        raise ValueError(f"micro_bs must be >= 1, got {micro_bs}")
    model.zero_grad(set_to_none=True)
    for xb, yb in zip(x.split(micro_bs), y.split(micro_bs), strict=True):
        (loss_fn(model(xb), yb) * (len(xb) / len(x))).backward()
    return grads(model)


def _import_accelerate() -> Any:
    """Import accelerate for native PyTorch: USE_TORCH_XLA=0 first, or it picks torch_xla's device."""
    if "accelerate" not in sys.modules:
        os.environ.setdefault("USE_TORCH_XLA", "0")
    import accelerate

    return accelerate


def accelerate_accumulated_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_bs: int,
                                 loss_fn: Callable = F.cross_entropy) -> list[torch.Tensor]:
    """accelerate's way: `Accelerator(gradient_accumulation_steps=k)`, `with accelerator.accumulate(model)`,
    `accelerator.backward(loss)`; returns the gradients at the one real optimizer step."""
    if micro_bs < 1 or len(x) % micro_bs:
        raise ValueError(f"accelerate divides each loss by k: the batch ({len(x)}) must split into equal "
                         f"micro-batches of {micro_bs}")
    accelerate = _import_accelerate()
    from .internals import reset_accelerate_state

    k = len(x) // micro_bs
    reset_accelerate_state()                    # a fresh Accelerator in this process (accelerate keeps singletons)
    acc = accelerate.Accelerator(gradient_accumulation_steps=k, cpu=x.device.type == "cpu")
    if acc.device.type == "xla" and os.environ.get("PJRT_DEVICE") != "TPU":
        raise RuntimeError("accelerate chose the XLA device: set os.environ['USE_TORCH_XLA'] = '0' before the "
                           "first `import accelerate` (restart the kernel if it is already imported)")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = acc.prepare(model, opt)
    opt.zero_grad(set_to_none=True)
    out: list[torch.Tensor] = []
    for xb, yb in zip(x.split(micro_bs), y.split(micro_bs), strict=True):
        with acc.accumulate(model):
            acc.backward(loss_fn(model(xb), yb))        # accelerate divides the loss by k here
            if acc.sync_gradients:
                out = grads(model)
            opt.step()                                  # skipped by accelerate until the k-th micro-batch
            opt.zero_grad()
    reset_accelerate_state()
    return out


def fastai_accumulation(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bs: int,
                        n_acc: int) -> tuple[int, list[torch.Tensor]]:
    """One epoch of fastai `Learner.fit` with `GradientAccumulation(n_acc)` over (x, y) in order, batch `bs`:
    returns the number of optimizer steps taken and the gradients at the first one. `n_acc` counts samples."""
    from fastai.callback.core import Callback
    from fastai.callback.training import GradientAccumulation
    from fastai.learner import Learner
    from fastai.optimizer import SGD

    from .data import Split, fastai_dls

    if bs < 1 or n_acc < 1:
        raise ValueError(f"bs and n_acc must be >= 1, got bs={bs}, n_acc={n_acc}")

    class Recorder(Callback):
        order = GradientAccumulation.order + 1      # runs after GradientAccumulation may cancel the step

        def before_fit(self) -> None:
            self.steps, self.first = 0, None

        def before_step(self) -> None:
            self.steps += 1
            if self.first is None:
                self.first = grads(self.learn.model)

    dls = fastai_dls(Split(x, y, x[:bs], y[:bs]), bs=bs, shuffle=False)     # in order: batch i is rows i*bs...
    rec = Recorder()
    model.zero_grad(set_to_none=True)               # fastai does not clear gradients left from before fit
    learn = Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=SGD, lr=0.0,
                    cbs=[GradientAccumulation(n_acc), rec])
    with learn.no_bar(), learn.no_logging():
        learn.fit(1)
    return rec.steps, rec.first if rec.first is not None else []
