"""Every call the package makes into a private API of torch, torch_xla or accelerate, gathered here.

Private APIs change without notice between releases; keeping them in one module means one place to fix when they
do. Each function names the public alternative, and why the course does not use it (yet).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # public alternative: none; torch's docs teach this class

__all__ = ["TorchDispatchMode", "compiled_original", "dynamo_explain", "inductor_compile_threads",
           "mark_static_address", "quiet_dynamo_logs", "reset_accelerate_state", "xla_pending_ir",
           "xla_runtime_started"]


def mark_static_address(t: torch.Tensor) -> None:
    """Tell torch.compile that `t` keeps its address (CUDA graphs need not copy it in).
    Public alternative: none in torch 2.9; `torch.compile(mode="reduce-overhead")` copies inputs it cannot trust."""
    torch._dynamo.mark_static_address(t)


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Tell torch.compile that `t`'s dimension `dim` varies, so one compiled graph serves every size of it
    (public alternative: `torch.compile(dynamic=True)` makes every dimension dynamic, not just this one)."""
    torch._dynamo.mark_dynamic(t, dim)


def compiled_original(model: Any) -> Any:
    """The module a `torch.compile` wrapper (OptimizedModule) holds, or None for any other object.
    Public alternative: keep a reference to the module you compiled; a checkpoint helper handed only the wrapper
    cannot, so it reads `_orig_mod` (the state-dict keys of a compiled module start with `_orig_mod.`)."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


def dynamo_explain(fn: Callable[..., Any], *args: Any) -> Any:
    """Trace `fn(*args)` with Dynamo and return its graphs and graph breaks without compiling.
    Public alternative: `TORCH_LOGS=graph_breaks` prints the same breaks while compiling, but cannot be counted."""
    return torch._dynamo.explain(fn)(*args)


def quiet_dynamo_logs() -> None:
    """Silence torch.compile's informational warnings (no CUDA runtime, profiler hooks) on a CPU-only machine.
    Public alternative: the environment variable `TORCH_LOGS=-dynamo`, which must be set before torch starts."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    torch._logging.set_logs(dynamo=logging.ERROR)


@contextmanager
def inductor_compile_threads(n: int) -> Iterator[None]:
    """Let inductor compile with `n` worker processes inside the block (on a small CPU a pool costs more than it
    saves). Public alternative: the environment variable `TORCHINDUCTOR_COMPILE_THREADS`, read when torch starts."""
    import torch._inductor.config as config

    before = config.compile_threads
    config.compile_threads = n
    try:
        yield
    finally:
        config.compile_threads = before


def xla_runtime_started() -> bool:
    """Whether torch_xla's runtime has started (after which its device choice is fixed for the process).
    Public alternative: none; `torch_xla.runtime` exposes no such query in 2.9."""
    import torch_xla

    return bool(torch_xla._XLAC._xla_runtime_is_initialized())


def xla_pending_ir(*tensors: torch.Tensor) -> str:
    """The lazy IR graph XLA has recorded, not yet executed, for `tensors`.
    Public alternative: `torch_xla.debug.metrics` counts executions but does not print the graph."""
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_text(list(tensors))


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide singletons, so a second `Accelerator` in the same process starts fresh.
    Public alternative: one Accelerator per process (a script), which a notebook that builds several cannot do."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
