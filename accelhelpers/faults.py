"""Faults a long training run meets: non-finite losses (agreed across DDP ranks), out-of-memory (classified,
memory released, batch size backed off), dead or stuck peers (a clear error within a timeout, not a hang) and
preemption (SIGTERM turned into a flag the loop checks, so it saves and exits at a step boundary)."""

from __future__ import annotations

import datetime
import gc
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class NonFiniteError(FloatingPointError):
    """The loss or a gradient is NaN or infinite on at least one rank; every rank raises it at the same step."""


class PeerFailure(RuntimeError):
    """A collective failed because another process died, left early or stopped responding."""


def is_finite(loss: torch.Tensor, model: nn.Module | None = None) -> bool:
    """True when `loss` (and every gradient of `model`, if given) is finite on this process."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a tensor, got {type(loss).__name__}")
    flags = [torch.isfinite(loss.detach()).all()]
    if model is not None:
        flags += [torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None]
    return bool(torch.stack(flags).all())


def _distributed() -> bool:
    """True inside an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def bad_ranks(local_bad: bool, group: Any = None) -> list[int]:
    """The ranks that report `local_bad`, agreed by one all-reduce so that every rank gets the same list."""
    if not _distributed():
        return [0] if local_bad else []
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flags = torch.zeros(world, dtype=torch.int32, device=device)
    flags[rank] = int(local_bad)
    with peer_guard("all_reduce of the fault flags"):
        dist.all_reduce(flags, group=group)
    return [i for i, f in enumerate(flags.tolist()) if f]


def check_finite(loss: torch.Tensor, model: nn.Module | None = None, step: int | None = None,
                 group: Any = None) -> None:
    """Raise NonFiniteError on every rank when the loss or a gradient is non-finite on any rank (costs one tiny
    all-reduce and a host sync): ranks that stopped alone would leave the others hanging in the next all-reduce."""
    ranks = bad_ranks(not is_finite(loss, model), group)
    if ranks:
        where = f" at step {step}" if step is not None else ""
        raise NonFiniteError(f"non-finite loss or gradient{where} on rank(s) {ranks}: every rank stops here. "
                             "Lower the learning rate, clip gradients, use loss scaling, or check the data.")


def init_distributed(backend: str = "gloo", timeout_s: float = 60.0) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT) with a collective timeout,
    so a stuck peer becomes an error after `timeout_s` instead of a hang; returns (rank, world_size)."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"not started by torchrun: {', '.join(missing)} unset. Launch with "
                           "`torchrun --nproc-per-node=2 script.py` (or set them yourself).")
    if not _distributed():
        timeout = datetime.timedelta(seconds=timeout_s)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
        # torchrun shares one store across restarts: without a per-restart prefix, restarted workers can read
        # their predecessors' addresses and fail to connect (pytorch/pytorch#135712)
        store = dist.PrefixStore(f"accelhelpers/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def finish_distributed() -> None:
    """Leave the process group together: a barrier (no rank tears down connections a peer still uses: with gloo
    that can abort the peer), then destroy the group. Every rank must be alive, or the barrier waits it out."""
    if _distributed():
        dist.barrier()
        dist.destroy_process_group()


@contextmanager
def peer_guard(what: str = "collective") -> Iterator[None]:
    """Turn the backend's error from a collective whose peer died or timed out into a PeerFailure saying so."""
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as e:
        if isinstance(e, (PeerFailure, NonFiniteError)):
            raise
        rank = dist.get_rank() if _distributed() else 0
        raise PeerFailure(f"rank {rank}: {what} failed: a peer process died, left early or stopped responding "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). Restart all workers "
                          "(torchrun --max-restarts=N) and resume from the last checkpoint.") from e


def oom_kind(exc: BaseException) -> str | None:
    """Which memory ran out: 'cuda', 'mps', 'xla' or 'cpu' for an out-of-memory error, None for anything else."""
    msg = str(exc)
    if isinstance(exc, torch.OutOfMemoryError) or "CUDA out of memory" in msg:
        return "cuda"
    if "MPS backend out of memory" in msg:
        return "mps"
    if "RESOURCE_EXHAUSTED" in msg:
        return "xla"
    if isinstance(exc, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in msg:
        return "cpu"
    return None


def free_memory() -> None:
    """Release what a failed step left behind: collect garbage, then return cached accelerator memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        torch.mps.empty_cache()


def with_batch_backoff(fn: Callable[[int], Any], batch_size: int, min_batch_size: int = 1,
                       on_backoff: Callable[[int, str], None] | None = None) -> tuple[Any, int]:
    """Call `fn(batch_size)`; on out-of-memory free memory, halve the batch and retry down to `min_batch_size`.
    Returns (result, batch size that worked); other errors pass through untouched."""
    if not isinstance(batch_size, int) or not isinstance(min_batch_size, int) or not 1 <= min_batch_size <= batch_size:
        raise ValueError(f"need ints 1 <= min_batch_size <= batch_size, got min_batch_size={min_batch_size!r}, "
                         f"batch_size={batch_size!r}")
    while True:
        try:
            return fn(batch_size), batch_size
        except (RuntimeError, MemoryError) as e:
            kind = oom_kind(e)
            if kind is None:
                raise
            if batch_size == min_batch_size:
                if hasattr(e, "add_note"):
                    e.add_note(f"out of {kind} memory even at min_batch_size={min_batch_size}: use a smaller "
                               "model, mixed precision or gradient accumulation")
                raise
        # outside the except block: the traceback (and the tensors its frames hold) is gone before freeing
        free_memory()
        batch_size = max(min_batch_size, batch_size // 2)
        if on_backoff is not None:
            on_backoff(batch_size, kind)


class Preemption:
    """`with Preemption() as p:` SIGTERM (what SLURM, Kubernetes and cloud spot VMs send before they kill) sets
    `p.requested` to the signal's name (and `p.at` to its `time.monotonic()`) instead of ending the process, so the
    loop saves and exits between steps; the previous handlers come back on exit. Main thread only (Python runs
    signal handlers there)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.signals = tuple(signals)
        self.requested: str | None = None
        self.at: float | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Remember the signal and when it came; the training loop acts on it at the next step boundary."""
        self.requested, self.at = signal.Signals(signum).name, time.monotonic()

    def __enter__(self) -> Preemption:
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError as e:
            self.__exit__()
            raise RuntimeError(f"Preemption must be entered in the main thread ({e})") from e
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
