"""Data parallelism on N processes: gradients all-reduced by hand and by DDP, the workers chapter 06 launches
(through `launch`), fastai's and accelerate's distributed paths made to run on CPU (gloo), and the
batch-size/learning-rate experiment.

Workers run as `torchrun --nproc-per-node=2 -m accelhelpers.parallel NAME OUT ...` (a function defined in a
notebook cell cannot be pickled into another process, so every worker lives here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import checkpoint as ck
from . import launch, metrics, session, timing, train
from .device import cpu_requested
from .faults import finish_distributed, init_distributed
from .models import count_params, mlp
from .results import atomic_write_text

WORKERS = ("equivalence", "ddp_train", "fastai_train", "accelerate_launchers", "techniques")


# --- launching ---------------------------------------------------------------------------------------------------

def rank_device(nproc: int | None = None) -> str:
    """'cuda' when each of `nproc` ranks (default: WORLD_SIZE) can have a GPU of its own, else 'cpu'.

    nccl refuses two ranks on one GPU ("Duplicate GPU detected"), so with fewer GPUs than ranks (one Colab GPU,
    two ranks) the ranks run on the CPU with gloo; ACCEL_DEVICE=cpu asks for the CPU on any machine."""
    n = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if cpu_requested():
        return "cpu"
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= n else "cpu"


def rank_env(nproc: int) -> dict[str, str]:
    """Environment for `nproc` launched ranks: the GPUs hidden when they cannot have one each (see rank_device)."""
    return {"CUDA_VISIBLE_DEVICES": ""} if rank_device(nproc) == "cpu" and torch.cuda.is_available() else {}


def setup_rank(timeout_s: float = 60.0, announce: bool = True) -> tuple[int, int, torch.device]:
    """Join torchrun's process group with what this rank's hardware wants: `nccl` and GPU number LOCAL_RANK when
    every rank on this node can have a GPU of its own, else `gloo` on the CPU; rank 0 says which.
    Returns (rank, world_size, device): put the model on `device` and give DDP `device_ids=[device.index]` on a GPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if rank_device(local_world) == "cuda":
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    rank, world = init_distributed(backend, timeout_s)
    if announce and rank == 0:
        print(f"[rank0] {world} ranks, backend {backend}, "
              f"{'one GPU per rank' if device.type == 'cuda' else 'on the CPU'}", flush=True)
    return rank, world, device


def torchrun(worker: str, *args: object, nproc: int = 2, timeout_s: float = 120.0, echo: bool = True,
             check: bool = True) -> launch.Run:
    """Launch a worker of this module on `nproc` ranks (`torchrun --standalone`), streaming its logs."""
    if worker not in WORKERS:
        raise ValueError(f"unknown worker {worker!r}: choose one of {', '.join(WORKERS)}")
    cmd = launch.torchrun_cmd("accelhelpers.parallel", worker, *args, nproc=nproc)
    return launch.launch(cmd, timeout_s, echo, check, env=rank_env(nproc))


# --- data parallelism from first principles ----------------------------------------------------------------------

def toy_data(steps: int, batch: int, d_in: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded regression batches, shape (steps, batch, d_in) and (steps, batch, 1): the global batches."""
    x = torch.randn(steps, batch, d_in, generator=torch.Generator().manual_seed(0))
    return x, x.sum(-1, keepdim=True).sin()


def toy_model(d_in: int = 8, seed: int = 0) -> nn.Sequential:
    """The small seeded MLP the equivalence checks train."""
    torch.manual_seed(seed)
    return mlp([d_in, 32, 32, 1])


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch along dim 1 (each rank gets batch // world rows)."""
    if not 0 <= rank < world or t.shape[1] % world:
        raise ValueError(f"cannot split a global batch of {t.shape[1]} rows into {world} equal shards for rank "
                         f"{rank}: use a batch divisible by the number of processes")
    b = t.shape[1] // world
    return t[:, rank * b:(rank + 1) * b]


def allreduce_gradients(model: nn.Module) -> None:
    """Average every gradient across the process group: an all-reduce (sum) divided by the world size, which is
    what DDP does for you, bucketed and overlapped with the backward pass."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no process group: call accelhelpers.faults.init_distributed() under torchrun first")
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world


def sgd_train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float = 0.05, sync: Any = None) -> nn.Module:
    """Train `model` with SGD + momentum on the batches in x, y (one step per leading index); `sync(model)`, if
    given, runs between backward and step (e.g. allreduce_gradients)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for xb, yb in zip(x, y, strict=True):
        opt.zero_grad()
        F.mse_loss(model(xb), yb).backward()
        if sync is not None:
            sync(model)
        opt.step()
    return model


def equivalence(out: Path, steps: int, batch: int) -> None:
    """Worker: every rank trains the same model on its shard of the same global batches twice, once averaging
    gradients by hand (allreduce_gradients) and once under DDP; rank 0 checkpoints both."""
    rank, world = init_distributed("gloo", 60.0)
    torch.set_num_threads(1)
    x, y = toy_data(steps, batch * world)
    xs, ys = shard(x, rank, world), shard(y, rank, world)
    manual = sgd_train(toy_model(), xs, ys, sync=allreduce_gradients)
    ddp = nn.parallel.DistributedDataParallel(toy_model())
    sgd_train(ddp, xs, ys)
    print(f"[rank{rank}] local batch {xs.shape[1]} of global {x.shape[1]}, {steps} steps done", flush=True)
    if rank == 0:
        ck.save_checkpoint(out / "manual.pt", manual, step=steps)
        ck.save_checkpoint(out / "ddp.pt", ddp, step=steps)
    finish_distributed()


def reference(steps: int, batch: int, world: int = 2) -> nn.Module:
    """One process, global batch world*batch: what `equivalence` on `world` ranks of `batch` must reproduce."""
    x, y = toy_data(steps, batch * world)
    return sgd_train(toy_model(), x, y)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model state a worker checkpointed (verified, loaded with map_location='cpu')."""
    return ck.read_checkpoint(path, map_location="cpu")["model"]


# --- DDP on MNIST-1D: DistributedSampler, rank-0 logging and checkpoints, throughput and communication share --------

def mnist1d_loader(batch: int, seed: int = 0) -> tuple[Any, Any]:
    """MNIST-1D's training set behind a DistributedSampler (rank and world size from the process group):
    each rank sees a disjoint 1/world of the data, reshuffled each epoch only if you call set_epoch."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from .data import mnist1d

    data = mnist1d()
    sampler = DistributedSampler(TensorDataset(data.x_train, data.y_train), shuffle=True, seed=seed)
    return DataLoader(sampler.dataset, batch_size=batch, sampler=sampler, drop_last=True), data


def _time_ddp_steps(ddp: nn.Module, opt: torch.optim.Optimizer, xb: torch.Tensor, yb: torch.Tensor,
                    n: int) -> tuple[float, float]:
    """Median seconds of a DDP training step on (xb, yb) with, and without (ddp.no_sync), the all-reduce, over `n`
    interleaved rounds (one call each, so that every rank makes the same collective calls)."""
    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(ddp(xb), yb).backward()
        opt.step()

    def local_step() -> None:
        with ddp.no_sync():  # the same compute, no all-reduce: what communication costs is the difference
            step()

    t = timing.interleaved({"sync": step, "local": local_step}, rounds=n, min_time=0)
    return t["sync"].median, t["local"].median


def ddp_train(out: Path, epochs: int, batch: int, width: int, bench_steps: int, lr: float = 0.05,
              bench_batches: list[int] | None = None) -> None:
    """Worker: DDP on MNIST-1D with DistributedSampler + set_epoch, rank-0 logs and checkpoints, a barrier, every
    rank reloading the checkpoint (map_location='cpu'), then step time with and without the gradient all-reduce
    for each per-rank batch in `bench_batches` (default: the training batch)."""
    rank, world = init_distributed("gloo", 60.0)
    torch.set_num_threads(1)
    loader, data = mnist1d_loader(batch)
    torch.manual_seed(0)
    model = mlp([40, width, width, 10])
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        for xb, yb in loader:
            opt.zero_grad()
            F.cross_entropy(ddp(xb), yb).backward()
            opt.step()
        if rank == 0:
            acc = metrics.model_accuracy(model, data.x_test, data.y_test)
            print(f"[rank0] epoch {epoch + 1}: test accuracy {acc:.3f}", flush=True)
            ck.save_checkpoint(ck.checkpoint_path(out / "ckpt", epoch + 1), model, opt, step=epoch + 1, keep=1)
        dist.barrier()  # nobody reads the checkpoint before rank 0 has written it
    fresh = mlp([40, width, width, 10])
    ck.load_checkpoint(ck.latest_good_checkpoint(out / "ckpt"), fresh, map_location="cpu", restore_rng=False)
    same = metrics.max_abs_diff(fresh, model) == 0.0
    acc = metrics.model_accuracy(model, data.x_test, data.y_test)
    res = {"world": world, "batch": batch, "width": width, "params": count_params(model),
           "accuracy": acc, "checkpoint_reloads_equal": same, "bench": {}}
    for b in bench_batches or [batch]:
        step_s, local_s = _time_ddp_steps(ddp, opt, data.x_train[:b], data.y_train[:b], bench_steps)
        res["bench"][str(b)] = {"step_s": step_s, "local_step_s": local_s}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        atomic_write_text(out / f"ddp_world{world}.json", json.dumps(everyone))
    finish_distributed()


def scaling_summary(per_rank: list[dict[str, Any]], batch: int | None = None) -> dict[str, float]:
    """Throughput (samples/s over all ranks) and the share of step time spent communicating at per-rank `batch`
    (default: the training batch), from ddp_train's per-rank results (the slowest rank sets the pace)."""
    if not per_rank:
        raise ValueError("no results: pass the list ddp_train wrote to ddp_world*.json")
    batch = per_rank[0]["batch"] if batch is None else batch
    if str(batch) not in per_rank[0]["bench"]:
        raise ValueError(f"no timing for per-rank batch {batch}: ddp_train timed {sorted(per_rank[0]['bench'])}")
    step = max(r["bench"][str(batch)]["step_s"] for r in per_rank)
    local = max(r["bench"][str(batch)]["local_step_s"] for r in per_rank)
    world = per_rank[0]["world"]
    return {"world": world, "samples_per_s": world * batch / step, "step_ms": 1e3 * step,
            "comm_share": max(0.0, (step - local) / step)}


# --- fastai and accelerate on CPU ---------------------------------------------------------------------------------

def _broadcast_any_backend(self: Any, t: list[int], rank: int) -> list[int]:
    """fastai's DistributedDL._broadcast with the tensor on the backend's device (cuda for nccl, cpu for gloo)."""
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor(t, dtype=torch.long, device=device)
    dist.broadcast(t, rank)
    return t.cpu().tolist()


def patch_fastai_for_cpu() -> bool:
    """Make fastai 2.8.12's distributed path run on CPU: DistributedDL._broadcast hard-codes `.cuda()` (nccl
    needs CUDA tensors) and fails without a GPU; the patch puts the tensor where the backend wants it, so it is
    unchanged on GPUs. Applied at run time to this process only; returns True if it changed anything."""
    from fastai.distributed import DistributedDL

    if DistributedDL._broadcast is _broadcast_any_backend:
        return False
    DistributedDL._broadcast = _broadcast_any_backend
    return True


def _fastai_setup_distrib() -> str:
    """fastai's `setup_distrib(rank)` as the DDP guide calls it: on GPU ranks it sets the GPU and makes the nccl
    process group; on CPU ranks it fails at torch.cuda.set_device. Returns what happened, in words."""
    from fastai.distributed import rank_distrib, setup_distrib

    if rank_device() == "cuda":
        return f"setup_distrib -> GPU {setup_distrib(int(os.environ.get('LOCAL_RANK', rank_distrib())))}, nccl"
    try:
        return f"setup_distrib -> {setup_distrib(rank_distrib())}"
    except (RuntimeError, AssertionError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"


def fastai_train(out: Path, epochs: int, batch: int, lr: float, patch: bool) -> None:
    """Worker: fastai's distributed path as its DDP guide writes it: setup_distrib, `bs = batch * num_distrib()`,
    `learn.to_distributed()` (accelerate underneath), rank_distrib() == 0 reports; on MNIST-1D. Rank 0 records
    the accuracy, the batch each rank and all ranks together saw per step, and whether the ranks agree."""
    import fastai.callback.progress  # noqa: F401  (Learner.no_bar)
    from fastai.callback.core import Callback
    from fastai.data.core import DataLoaders
    from fastai.distributed import num_distrib, rank_distrib
    from fastai.learner import Learner
    from fastai.metrics import accuracy as fa_accuracy
    from torch.utils.data import TensorDataset

    from .data import mnist1d

    setup = _fastai_setup_distrib()
    rank, world = init_distributed("gloo", 60.0)  # on CPU ranks: the group setup_distrib could not make
    torch.set_num_threads(1)
    if patch:
        patch_fastai_for_cpu()

    class BatchSizes(Callback):
        def before_fit(self) -> None:
            self.sizes: list[int] = []

        def after_batch(self) -> None:
            if self.training:
                self.sizes.append(len(self.yb[0]))

    bs = batch * num_distrib()  # the guide's line; fastai's bs is per process
    data = mnist1d()
    dls = DataLoaders.from_dsets(TensorDataset(data.x_train, data.y_train), TensorDataset(data.x_test, data.y_test),
                                 bs=bs, device="cpu")
    torch.manual_seed(0)
    sizes = BatchSizes()
    learn = Learner(dls, mlp([40, 128, 128, 10]), loss_func=nn.CrossEntropyLoss(), metrics=fa_accuracy, cbs=sizes)
    # accelerate treats a GPU-less process as not distributed unless told cpu=True (then it uses gloo)
    learn.to_distributed(cpu=rank_device(world) == "cpu")
    with learn.no_bar():
        learn.fit(epochs, lr)
    learn.detach_distributed()
    flat = torch.cat([p.detach().flatten() for p in learn.model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    step_batch = torch.tensor(sizes.sizes[0])
    dist.all_reduce(step_batch)
    if rank_distrib() == 0:
        acc = metrics.model_accuracy(learn.model, data.x_test, data.y_test)
        res = {"world": world, "accuracy": acc, "ranks_equal": all(torch.equal(g, flat) for g in gathered),
               "setup_distrib": setup, "num_distrib": num_distrib(), "bs": bs, "rank_batch": sizes.sizes[0],
               "global_batch": int(step_batch), "steps_per_epoch": len(sizes.sizes) // epochs}
        print(f"[rank0] fastai to_distributed on {world} processes: accuracy {acc:.3f}", flush=True)
        atomic_write_text(out / "fastai.json", json.dumps(res))
    finish_distributed()


def accelerate_worker(out: str, tag: str) -> None:
    """Training function for accelerate's launchers: prepare, train a few steps, report the processes it saw."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=rank_device() == "cpu")
    x, y = toy_data(8, 16)
    model = toy_model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for xb, yb in zip(x, y, strict=True):
        opt.zero_grad()
        acc.backward(F.mse_loss(model(xb), yb))
        opt.step()
    acc.print(f"[{tag}] {acc.num_processes} processes, {acc.distributed_type}, device {acc.device}")
    if acc.is_main_process:
        atomic_write_text(Path(out, f"{tag}.json"), json.dumps({"processes": acc.num_processes,
                                                                 "type": str(acc.distributed_type)}))
    acc.wait_for_everyone()


def accelerate_launchers(out: Path, nproc: int) -> None:
    """Worker (a plain process): accelerate's notebook_launcher (forks; nothing may touch CUDA before it) and
    debug_launcher (CPU processes, for debugging) each run accelerate_worker on `nproc` processes."""
    from accelerate import debug_launcher, notebook_launcher

    notebook_launcher(accelerate_worker, args=(str(out), "notebook_launcher"), num_processes=nproc,
                      use_port=str(launch.free_port()))
    debug_launcher(accelerate_worker, args=(str(out), "debug_launcher"), num_processes=nproc)


# --- beyond data parallel: FSDP2 -------------------------------------------------------------------------------------

def fsdp_vs_ddp(width: int) -> dict[str, Any]:
    """The same MLP under DDP (every rank holds all parameters) and under FSDP2's fully_shard (each rank holds
    1/world), one training step each on the same shard: parameter bytes this rank holds, and the loss after."""
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = toy_data(2, 8 * world, d_in=width)
    xs, ys = shard(x, rank, world), shard(y, rank, world)
    res: dict[str, Any] = {"world": world}
    for kind in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = mlp([width, width, width, 1])
        if kind == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        sgd_train(model, xs[:1], ys[:1])
        loss = F.mse_loss(model(xs[1]), ys[1]).detach()
        dist.all_reduce(loss)
        res[kind] = {"param_bytes": metrics.param_bytes(model),  # FSDP2: this rank's own shard
                     "loss_after_step": float(loss) / world}
    return res


# --- chapter 06's techniques, measured in one launch (each launch costs seconds of start-up) ---------------------

def amp_step(ddp: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, xb: torch.Tensor,
             yb: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """One DDP step under autocast(`dtype`; None: fp32): forward and loss in autocast, backward (DDP's all-reduce)
    and step outside it, through `scaler` (enabled for fp16 only: bf16 has fp32's range and needs no scaling)."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(xb.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = F.cross_entropy(ddp(xb), yb)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss.detach()


def amp_ddp(steps: int, batch: int, width: int, rounds: int) -> dict[str, Any]:
    """DDP on MNIST-1D in fp32 and under autocast (bf16 on CPU ranks, fp16 + GradScaler on GPU ranks): final
    test accuracy of each, the gradients' dtype, and the step time of each (interleaved rounds)."""
    from .data import mnist1d

    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local) if rank_device() == "cuda" else torch.device("cpu")  # one GPU per rank
    low = torch.float16 if dev.type == "cuda" else torch.bfloat16
    data, rank = mnist1d(), dist.get_rank()
    x, y = data.x_train.to(dev), data.y_train.to(dev)
    xb, yb = x[:batch], y[:batch]
    res: dict[str, Any] = {"dtype": str(low).removeprefix("torch."), "device": dev.type}
    steppers = {}
    for name, dtype in (("fp32", None), ("amp", low)):
        torch.manual_seed(0)
        model = mlp([40, width, width, 10]).to(dev)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            idx = torch.randint(0, len(x), (batch,), generator=g).to(dev)
            amp_step(ddp, opt, scaler, x[idx], y[idx], dtype)
        res[name] = {"accuracy": metrics.model_accuracy(model, data.x_test.to(dev), data.y_test.to(dev)),
                     "grad_dtype": str(next(model.parameters()).grad.dtype).removeprefix("torch."),
                     "scaler_enabled": scaler.is_enabled()}
        steppers[name] = (lambda d=ddp, o=opt, s=scaler, t=dtype: amp_step(d, o, s, xb, yb, t))
    times = timing.interleaved(steppers, dev, rounds=rounds, min_time=0)  # min_time=0: the same calls on every rank
    for name, t in times.items():
        res[name]["step_ms"] = 1e3 * t.median
    return res


class TwoHeads(nn.Module):
    """A trunk and two heads; a step uses one head, so the other head's parameters get no gradient."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.trunk = mlp([40, width, width])
        self.heads = nn.ModuleDict({"a": nn.Linear(width, 10), "b": nn.Linear(width, 10)})

    def forward(self, x: torch.Tensor, head: str = "a") -> torch.Tensor:
        return self.heads[head](F.relu(self.trunk(x)))


def _two_head_steps(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, head: str = "a") -> None:
    """`steps` SGD steps through one head of a DDP-wrapped TwoHeads (plain SGD: unused parameters stay put)."""
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x, head), y).backward()
        opt.step()


def unused_parameters(x: torch.Tensor, y: torch.Tensor, rounds: int) -> dict[str, Any]:
    """DDP and a model whose step leaves a head unused: the error without find_unused_parameters, success with it
    or with static_graph, and the step time of each option on a model that uses all its parameters."""
    res: dict[str, Any] = {}
    torch.manual_seed(0)
    try:
        _two_head_steps(nn.parallel.DistributedDataParallel(TwoHeads()), x, y, 2)
        res["default"] = "no error"
    except RuntimeError as e:
        res["default"] = str(e)
    for flag in ("find_unused_parameters", "static_graph"):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(TwoHeads(), **{flag: True})
        _two_head_steps(ddp, x, y, 3)
        res[flag] = "trained 3 steps"
    steppers = {}
    for name, kw in (("default", {}), ("find_unused_parameters", {"find_unused_parameters": True}),
                     ("static_graph", {"static_graph": True})):
        torch.manual_seed(0)
        full = nn.parallel.DistributedDataParallel(mlp([40, 256, 256, 256, 10]), **kw)
        opt = torch.optim.SGD(full.parameters(), lr=0.01)
        steppers[name] = (lambda d=full, o=opt: (o.zero_grad(), F.cross_entropy(d(x), y).backward(), o.step()))
    res["step_ms"] = {k: 1e3 * t.median for k, t in timing.interleaved(steppers, rounds=rounds, min_time=0).items()}
    return res


def allreduce_sweep(sizes: list[int], reps: int) -> dict[str, Any]:
    """Median seconds of an all-reduce (sum, float32) of each message size in bytes, every rank taking part."""
    out = {}
    for n in sizes:
        t = torch.ones(n // 4)
        for _ in range(2):
            dist.all_reduce(t)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out[str(n)] = statistics.median(times)
    return {"world": dist.get_world_size(), "seconds": out}


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in bytes/s of an all-reduce, as nccl-tests define them: algbw = bytes / time;
    busbw = algbw * 2(N-1)/N, the bytes each link carries in a ring, comparable with the link's speed."""
    alg = nbytes / seconds
    return alg, alg * 2 * (world - 1) / world


def ring_allreduce_seconds(nbytes: int, world: int, bandwidth: float, latency: float = 0.0) -> float:
    """A ring all-reduce's time: 2(N-1) steps of nbytes/N each (reduce-scatter, then all-gather) over links of
    `bandwidth` bytes/s, plus a fixed `latency` per call: 2(N-1)/N * nbytes / bandwidth + latency."""
    return 2 * (world - 1) / world * nbytes / bandwidth + latency


def gpipe_step(stage: nn.Module, x: torch.Tensor, micro: int) -> tuple[float, float]:
    """One GPipe step on 2 ranks (rank 0: first stage, rank 1: second stage and the loss): all micro-batches
    forward, then all backward, activations and their gradients sent between the ranks. Returns (wall seconds,
    seconds this rank computed); the rest of the wall time it waited: the bubble."""
    rank, busy = dist.get_rank(), 0.0
    chunks = x.chunk(micro)
    dist.barrier()
    t0 = time.perf_counter()
    outs, ins = [], []
    for c in chunks:  # forward
        if rank == 0:
            t = time.perf_counter()
            a = stage(c)
            busy += time.perf_counter() - t
            dist.send(a.detach(), 1)
            outs.append(a)
        else:
            a = torch.empty_like(c)
            dist.recv(a, 0)
            a.requires_grad_(True)
            t = time.perf_counter()
            outs.append(stage(a).square().mean())
            busy += time.perf_counter() - t
            ins.append(a)
    for i in range(micro):  # backward
        if rank == 1:
            t = time.perf_counter()
            outs[i].backward()
            busy += time.perf_counter() - t
            dist.send(ins[i].grad, 0)
        else:
            g = torch.empty_like(outs[i])
            dist.recv(g, 1)
            t = time.perf_counter()
            outs[i].backward(g)
            busy += time.perf_counter() - t
    dist.barrier()
    return time.perf_counter() - t0, busy


def pipeline_bubble(micro_batches: list[int], batch: int, width: int, depth: int, reps: int) -> dict[str, Any]:
    """For each number of micro-batches m: median wall time of a GPipe step and the fraction of it this rank sat
    idle (measured bubble), to set against the theory (p-1)/(m+p-1) for p = 2 stages."""
    torch.manual_seed(dist.get_rank())  # this rank's stage: `depth` Linear+ReLU layers of `width`
    stage = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(0))
    res = {}
    for m in micro_batches:
        gpipe_step(stage, x, m)  # warm-up
        runs = [gpipe_step(stage, x, m) for _ in range(reps)]
        wall = statistics.median(w for w, _ in runs)
        idle = statistics.median(1 - b / w for w, b in runs)
        res[str(m)] = {"step_ms": 1e3 * wall, "bubble": idle, "theory": 1 / (m + 1)}
    return res


def techniques(out: Path, steps: int, rounds: int, width: int) -> None:
    """Worker: FSDP2's memory against DDP's, AMP inside DDP, find_unused_parameters / static_graph, an all-reduce
    sweep and GPipe micro-batches; rank 0 writes techniques.json (its view; pipeline: both ranks')."""
    from .data import mnist1d

    rank, world = init_distributed("gloo", 120.0)
    torch.set_num_threads(1)
    data = mnist1d()
    res: dict[str, Any] = {"world": world, "fsdp": fsdp_vs_ddp(width)}
    if rank == 0:
        print(f"[rank0] parameter bytes per rank: DDP {res['fsdp']['ddp']['param_bytes']}, "
              f"FSDP2 {res['fsdp']['fsdp']['param_bytes']}", flush=True)
    res["amp"] = amp_ddp(steps, 64, 256, rounds)
    res["unused"] = unused_parameters(data.x_train[:256], data.y_train[:256], rounds)
    res["allreduce"] = allreduce_sweep([4**k for k in range(5, 13)], reps=rounds + 4)
    if world == 2:
        mine = pipeline_bubble([1, 2, 4, 8], batch=512, width=512, depth=4, reps=rounds)
        both: list[Any] = [None] * world
        dist.all_gather_object(both, mine)
        res["pipeline"] = both
    if rank == 0:
        atomic_write_text(out / "techniques.json", json.dumps(res))
        print(f"[rank0] techniques done: FSDP2, AMP {res['amp']['dtype']}, find_unused, all-reduce sweep, pipeline",
              flush=True)
    finish_distributed()


def spawn_hello(rank: int, world: int) -> None:
    """A function mp.spawn can start: it lives in an importable module, so the children can unpickle it."""
    print(f"spawned process {rank} of {world}: found accelhelpers.parallel.spawn_hello", flush=True)


# --- batch size and learning rate ------------------------------------------------------------------------------------

def train_mnist1d(batch: int, lr: float, epochs: int, warmup_epochs: float = 0.0, width: int = 128,
                  seed: int = 0) -> float:
    """Train an MLP on MNIST-1D (SGD + momentum, in memory, reshuffled each epoch) and return test accuracy;
    `warmup_epochs` ramps the learning rate linearly from lr/steps to lr (Goyal et al., 2017)."""
    from .data import mnist1d

    if batch < 1 or lr <= 0 or epochs < 1 or warmup_epochs < 0:
        raise ValueError(f"need batch >= 1, lr > 0, epochs >= 1, warmup_epochs >= 0; got {batch}, {lr}, "
                         f"{epochs}, {warmup_epochs}")
    with session.threads(1):  # steps this small only lose to thread hand-offs, badly so on a busy machine
        torch.manual_seed(seed)
        model = mlp([40, width, width, 10])
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        data = mnist1d()
        warm = max(1, round(warmup_epochs * (len(data.x_train) // batch)))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        train.fit(model, (data.x_train, data.y_train), opt, epochs, batch, seed=seed, scheduler=sched, drop_last=True)
        return metrics.model_accuracy(model, data.x_test, data.y_test)


# --- entry point ----------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    """Dispatch to a worker by name (run under torchrun, except accelerate_launchers)."""
    p = argparse.ArgumentParser(prog="python -m accelhelpers.parallel")
    p.add_argument("name", choices=WORKERS)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--bench-batches", type=lambda v: [int(b) for b in v.split(",")], default=None)
    p.add_argument("--no-patch", action="store_true")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    {"equivalence": lambda: equivalence(a.out, a.steps, a.batch),
     "ddp_train": lambda: ddp_train(a.out, a.epochs, a.batch, a.width, a.steps, a.lr, a.bench_batches),
     "fastai_train": lambda: fastai_train(a.out, a.epochs, a.batch, a.lr, not a.no_patch),
     "accelerate_launchers": lambda: accelerate_launchers(a.out, a.nproc),
     "techniques": lambda: techniques(a.out, a.steps, a.rounds, a.width)}[a.name]()


if __name__ == "__main__":
    main(sys.argv[1:])
