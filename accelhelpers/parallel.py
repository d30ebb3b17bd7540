"""Data parallelism on N processes: gradients all-reduced by hand and by DDP, a torchrun launcher that streams the
ranks' logs into a notebook (bounded by a timeout), the workers it runs, fastai's and accelerate's distributed
paths made to run on CPU (gloo), and the batch-size/learning-rate experiment.

Workers run as `torchrun --nproc-per-node=2 -m accelhelpers.parallel NAME OUT ...` (a function defined in a
notebook cell cannot be pickled into another process, so every worker lives here).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import checkpoint as ck
from .faults import finish_distributed, init_distributed
from .models import mlp

WORKERS = ("equivalence", "ddp_train", "fastai_train", "accelerate_launchers", "fsdp_memory")
ENV = {"USE_TORCH_XLA": "0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


# --- launching ---------------------------------------------------------------------------------------------------

@dataclass
class Run:
    """What a launch returned: exit status, everything the ranks printed, and the wall time it took."""

    returncode: int
    output: str
    seconds: float


def rank_device(nproc: int | None = None) -> str:
    """'cuda' when each of `nproc` ranks (default: WORLD_SIZE) can have a GPU of its own, else 'cpu'.

    nccl refuses two ranks on one GPU ("Duplicate GPU detected"), so with fewer GPUs than ranks (one Colab GPU,
    two ranks) the ranks run on the CPU with gloo; ACCEL_DEVICE=cpu asks for the CPU on any machine."""
    n = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("ACCEL_DEVICE", "").lower().startswith("cpu"):
        return "cpu"
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= n else "cpu"


def rank_env(nproc: int) -> dict[str, str]:
    """Environment for `nproc` launched ranks: the GPUs hidden when they cannot have one each (see rank_device)."""
    return {"CUDA_VISIBLE_DEVICES": ""} if rank_device(nproc) == "cpu" and torch.cuda.is_available() else {}


def free_port() -> int:
    """A TCP port nobody listens on now (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(worker: str, *args: str, nproc: int = 2, nnodes: int = 1, node_rank: int = 0,
                 rdzv_endpoint: str | None = None) -> list[str]:
    """The torchrun command line that starts `worker` on `nproc` processes (one node, or one of `nnodes`)."""
    if worker not in WORKERS:
        raise ValueError(f"unknown worker {worker!r}: choose one of {', '.join(WORKERS)}")
    if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"need nproc >= 1, nnodes >= 1 and 0 <= node_rank < nnodes, got nproc={nproc}, "
                         f"nnodes={nnodes}, node_rank={node_rank}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("several nodes need rdzv_endpoint='HOST:PORT' (the same on every node)")
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=accel-course"]
    return cmd + ["-m", "accelhelpers.parallel", worker, *map(str, args)]


def _pump(stream: Any, lines: queue.Queue) -> None:
    """Copy a child's output lines into a queue (a thread, so the reader can keep a deadline)."""
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def launch(cmd: list[str], timeout_s: float = 120.0, echo: bool = True, check: bool = True,
           env: dict[str, str] | None = None) -> Run:
    """Run `cmd` (e.g. torchrun_cmd(...)) in its own process group, printing its output as it arrives; after
    `timeout_s` kill the whole group and raise TimeoutError, so a stuck rank never hangs the notebook."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV, **(env or {})}, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    out: list[str] = []
    while True:
        left = timeout_s - (time.perf_counter() - t0)
        try:
            line = lines.get(timeout=max(left, 0.01))
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line:
            out.append(line)
            if echo:
                print(line, end="", flush=True)
        if time.perf_counter() - t0 > timeout_s:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"{' '.join(cmd[2:5])}... ran past {timeout_s} s and was killed (a rank is stuck "
                               f"or the machine is overloaded); last output:\n{''.join(out)[-2000:]}")
    try:
        rc = proc.wait(timeout=max(timeout_s - (time.perf_counter() - t0), 0.01))
    except subprocess.TimeoutExpired:  # closed its output but kept running
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise TimeoutError(f"{' '.join(cmd[2:5])}... ran past {timeout_s} s and was killed") from None
    run = Run(rc, "".join(out), time.perf_counter() - t0)
    if check and rc != 0:
        raise RuntimeError(f"command failed with exit status {rc}; last output:\n{run.output[-3000:]}")
    return run


def torchrun(worker: str, *args: str, nproc: int = 2, timeout_s: float = 120.0, echo: bool = True,
             check: bool = True) -> Run:
    """Launch a worker of this module with `torchrun --standalone --nproc-per-node=nproc` and stream its logs."""
    return launch(torchrun_cmd(worker, *args, nproc=nproc), timeout_s, echo, check, env=rank_env(nproc))


def two_nodes(worker: str, *args: str, nproc: int = 1, timeout_s: float = 120.0) -> list[Run]:
    """Two torchrun launchers on this machine acting as nodes 0 and 1 of one job (c10d rendezvous on
    127.0.0.1): the multi-node recipe, run for real. Returns each node's Run."""
    endpoint = f"127.0.0.1:{free_port()}"
    results: list[Any] = [None, None]

    def node(i: int) -> None:
        try:
            results[i] = launch(torchrun_cmd(worker, *args, nproc=nproc, nnodes=2, node_rank=i,
                                             rdzv_endpoint=endpoint), timeout_s, echo=False)
        except Exception as e:  # noqa: BLE001  (handed to the caller below)
            results[i] = e

    threads = [threading.Thread(target=node, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


# --- data parallelism from first principles ----------------------------------------------------------------------

def toy_data(steps: int, batch: int, d_in: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded regression batches, shape (steps, batch, d_in) and (steps, batch, 1): the global batches."""
    if steps < 1 or batch < 1 or d_in < 1:
        raise ValueError(f"steps, batch and d_in must be >= 1, got {steps}, {batch}, {d_in}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, batch, d_in, generator=g)
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


def max_weight_diff(a: nn.Module | dict, b: nn.Module | dict) -> float:
    """Largest absolute difference between two models' (or state dicts') parameters of the same names."""
    sa = a.state_dict() if isinstance(a, nn.Module) else a
    sb = b.state_dict() if isinstance(b, nn.Module) else b
    sa = {k.removeprefix("module."): v for k, v in sa.items()}
    sb = {k.removeprefix("module."): v for k, v in sb.items()}
    if sa.keys() != sb.keys():
        raise ValueError(f"the models differ in parameters: {sorted(sa.keys() ^ sb.keys())[:5]}")
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


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


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of rows of x that `model` classifies as y."""
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _median_step(step: Any, n: int) -> float:
    """Median seconds of n calls of step() (each call timed alone)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _time_ddp_steps(ddp: nn.Module, opt: torch.optim.Optimizer, xb: torch.Tensor, yb: torch.Tensor,
                    n: int) -> tuple[float, float]:
    """Median seconds of a DDP training step on (xb, yb) with, and without (ddp.no_sync), the all-reduce."""
    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(ddp(xb), yb).backward()
        opt.step()

    def local_step() -> None:
        with ddp.no_sync():  # the same compute, no all-reduce: what communication costs is the difference
            step()

    t_sync, t_local = [], []
    for _ in range(3):  # alternate blocks so that background load hits both alike
        t_sync.append(_median_step(step, n))
        t_local.append(_median_step(local_step, n))
    return statistics.median(t_sync), statistics.median(t_local)


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
            print(f"[rank0] epoch {epoch + 1}: test accuracy {accuracy(model, data.x_test, data.y_test):.3f}",
                  flush=True)
            ck.save_checkpoint(ck.checkpoint_path(out / "ckpt", epoch + 1), model, opt, step=epoch + 1, keep=1)
        dist.barrier()  # nobody reads the checkpoint before rank 0 has written it
    fresh = mlp([40, width, width, 10])
    ck.load_checkpoint(ck.latest_good_checkpoint(out / "ckpt"), fresh, map_location="cpu", restore_rng=False)
    same = max_weight_diff(fresh, model) == 0.0
    acc = accuracy(model, data.x_test, data.y_test)
    res = {"world": world, "batch": batch, "width": width, "params": sum(p.numel() for p in model.parameters()),
           "accuracy": acc, "checkpoint_reloads_equal": same, "bench": {}}
    for b in bench_batches or [batch]:
        step_s, local_s = _time_ddp_steps(ddp, opt, data.x_train[:b], data.y_train[:b], bench_steps)
        res["bench"][str(b)] = {"step_s": step_s, "local_step_s": local_s}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        (out / f"ddp_world{world}.json").write_text(json.dumps(everyone))
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


def fastai_train(out: Path, epochs: int, batch: int, lr: float, patch: bool) -> None:
    """Worker: a fastai Learner trained with learn.distrib_ctx() (accelerate underneath) on MNIST-1D; rank 0
    reports the accuracy and whether both ranks ended with identical weights."""
    rank, world = init_distributed("gloo", 60.0)
    torch.set_num_threads(1)
    if patch:
        patch_fastai_for_cpu()
    import fastai.callback.progress  # noqa: F401  (Learner.no_bar)
    from fastai.data.core import DataLoaders
    from fastai.distributed import rank_distrib
    from fastai.learner import Learner
    from fastai.metrics import accuracy as fa_accuracy
    from torch.utils.data import TensorDataset

    from .data import mnist1d

    data = mnist1d()
    dls = DataLoaders.from_dsets(TensorDataset(data.x_train, data.y_train), TensorDataset(data.x_test, data.y_test),
                                 bs=batch, device="cpu")
    torch.manual_seed(0)
    learn = Learner(dls, mlp([40, 128, 128, 10]), loss_func=nn.CrossEntropyLoss(), metrics=fa_accuracy)
    try:
        # accelerate treats a GPU-less process as not distributed unless told cpu=True (then it uses gloo)
        with learn.distrib_ctx(cpu=rank_device(world) == "cpu"), learn.no_bar():
            learn.fit(epochs, lr)
    except Exception as e:
        if rank == 0:
            (out / "fastai.json").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise
    flat = torch.cat([p.detach().flatten() for p in learn.model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    if rank_distrib() == 0:
        acc = accuracy(learn.model, data.x_test, data.y_test)
        res = {"world": world, "accuracy": acc, "ranks_equal": all(torch.equal(g, flat) for g in gathered)}
        print(f"[rank0] fastai distrib_ctx on {world} processes: accuracy {acc:.3f}", flush=True)
        (out / "fastai.json").write_text(json.dumps(res))
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
        Path(out, f"{tag}.json").write_text(json.dumps({"processes": acc.num_processes,
                                                          "type": str(acc.distributed_type)}))
    acc.wait_for_everyone()


def accelerate_launchers(out: Path, nproc: int) -> None:
    """Worker (a plain process): accelerate's notebook_launcher (forks; nothing may touch CUDA before it) and
    debug_launcher (CPU processes, for debugging) each run accelerate_worker on `nproc` processes."""
    from accelerate import debug_launcher, notebook_launcher

    notebook_launcher(accelerate_worker, args=(str(out), "notebook_launcher"), num_processes=nproc,
                      use_port=str(free_port()))
    debug_launcher(accelerate_worker, args=(str(out), "debug_launcher"), num_processes=nproc)


# --- beyond data parallel: FSDP2 -------------------------------------------------------------------------------------

def param_bytes(model: nn.Module) -> int:
    """Bytes of parameters this process holds (a sharded DTensor parameter counts only its local shard)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def fsdp_memory(out: Path, width: int) -> None:
    """Worker: the same MLP under DDP (every rank holds all parameters) and under FSDP2's fully_shard (each rank
    holds 1/world); both take one training step on the same shard and rank 0 records bytes and losses."""
    from torch.distributed.fsdp import fully_shard

    rank, world = init_distributed("gloo", 60.0)
    torch.set_num_threads(1)
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
        res[kind] = {"param_bytes": param_bytes(model), "loss_after_step": float(loss) / world}
    if rank == 0:
        print(f"[rank0] parameter bytes per rank: DDP {res['ddp']['param_bytes']}, "
              f"FSDP2 {res['fsdp']['param_bytes']}", flush=True)
        (out / "fsdp.json").write_text(json.dumps(res))
    finish_distributed()


# --- batch size and learning rate ------------------------------------------------------------------------------------

def train_mnist1d(batch: int, lr: float, epochs: int, warmup_epochs: float = 0.0, width: int = 128,
                  seed: int = 0) -> float:
    """Train an MLP on MNIST-1D (SGD + momentum, in memory, reshuffled each epoch) and return test accuracy;
    `warmup_epochs` ramps the learning rate linearly from lr/steps to lr (Goyal et al., 2017)."""
    from .data import mnist1d

    if batch < 1 or lr <= 0 or epochs < 1 or warmup_epochs < 0:
        raise ValueError(f"need batch >= 1, lr > 0, epochs >= 1, warmup_epochs >= 0; got {batch}, {lr}, "
                         f"{epochs}, {warmup_epochs}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steps this small only lose to thread hand-offs, badly so on a busy machine
    try:
        return _train_mnist1d(mnist1d(), batch, lr, epochs, warmup_epochs, width, seed)
    finally:
        torch.set_num_threads(threads)


def _train_mnist1d(data: Any, batch: int, lr: float, epochs: int, warmup_epochs: float, width: int,
                   seed: int) -> float:
    """The training loop of train_mnist1d."""
    torch.manual_seed(seed)
    model = mlp([40, width, width, 10])
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    per_epoch = len(data.x_train) // batch
    warm = max(1, round(warmup_epochs * per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(data.x_train), generator=g)
        for i in range(per_epoch):
            idx = order[i * batch:(i + 1) * batch]
            opt.zero_grad()
            F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
            opt.step()
            sched.step()
    return accuracy(model, data.x_test, data.y_test)


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
    p.add_argument("--bench-batches", type=lambda v: [int(b) for b in v.split(",")], default=None)
    p.add_argument("--no-patch", action="store_true")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.name == "equivalence":
        equivalence(a.out, a.steps, a.batch)
    elif a.name == "ddp_train":
        ddp_train(a.out, a.epochs, a.batch, a.width, a.steps, a.lr, a.bench_batches)
    elif a.name == "fastai_train":
        fastai_train(a.out, a.epochs, a.batch, a.lr, not a.no_patch)
    elif a.name == "accelerate_launchers":
        accelerate_launchers(a.out, a.nproc)
    else:
        fsdp_memory(a.out, a.width)


if __name__ == "__main__":
    main(sys.argv[1:])
