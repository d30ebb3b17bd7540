"""PyTorch/XLA (TPU, or XLA's CPU device): pick PJRT_DEVICE, check versions, count compiles, run launch demos.

Nothing here imports torch_xla at module import: choosing `PJRT_DEVICE` and the debug settings must happen
before torch_xla starts its runtime, so `use_xla()` sets them first and imports torch_xla last.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from . import internals, launch
from .device import cpu_requested, tpu_present, xla_installed, xla_version

INSTALL_FIX = "pip install torch=={v} 'torch_xla[tpu]=={v}'"
# torch_xla's newest release (each one is built against exactly the torch release of the same number).
NEWEST_XLA = "2.9.0"


def base_version(v: str) -> str:
    """'2.9.0+cu128' -> '2.9.0': the release without the local build tag (CUDA/CPU flavour)."""
    return v.split("+")[0].strip()


def version_fix(torch_version: str, xla_version: str | None, on_tpu: bool | None = None) -> str | None:
    """None when torch and torch_xla are the same release (any other gives `_XLAC... undefined symbol` on import);
    else what to do: the pip command, or, without torch_xla and off a TPU host, where chapter 07 runs."""
    if xla_version is None:
        if on_tpu if on_tpu is not None else tpu_present():
            return INSTALL_FIX.format(v=NEWEST_XLA) + "   # torch_xla is not installed; then restart the runtime"
        return ("torch_xla is not installed. On Colab choose Runtime > Change runtime type > TPU (torch_xla comes "
                f"preinstalled); on a Linux x86_64 CPU machine: pip install torch=={NEWEST_XLA} "
                f"torch_xla=={NEWEST_XLA} (its newest release; it needs exactly that torch)")
    if base_version(torch_version) == base_version(xla_version):
        return None
    return INSTALL_FIX.format(v=base_version(xla_version)) + "   # then restart the runtime"


def installed_versions() -> tuple[str, str | None]:
    """(torch version, torch_xla version or None), read from package metadata without importing torch_xla."""
    return torch.__version__, xla_version()


def choose_pjrt_device() -> str:
    """'TPU' on a TPU host, else 'CPU' (XLA's CPU device); an explicit PJRT_DEVICE always wins, and
    ACCEL_DEVICE=cpu (set by the notebook tests on every machine) keeps XLA on its CPU device."""
    if os.environ.get("PJRT_DEVICE"):
        return os.environ["PJRT_DEVICE"]
    if cpu_requested():
        return "CPU"
    return "TPU" if tpu_present() else "CPU"


def runtime_started() -> bool:
    """True once torch_xla's runtime is up (after that PJRT_DEVICE and debug settings no longer take effect)."""
    return "torch_xla" in sys.modules and internals.xla_runtime_started()


def use_xla(debug_file: str | Path | None = None, debug_level: int = 1, verbose: bool = True) -> torch.device:
    """Select PJRT_DEVICE (announced), check torch/torch_xla versions, optionally log compile analyses to
    `debug_file` (PT_XLA_DEBUG_LEVEL), then import torch_xla and return its device."""
    torch_v, xla_v = installed_versions()
    fix = version_fix(torch_v, xla_v)
    if fix and xla_v is None:
        raise RuntimeError(fix)
    if fix:
        raise RuntimeError(f"torch {torch_v} and torch_xla {xla_v} do not match (importing torch_xla would fail "
                           f"with '_XLAC... undefined symbol'). Fix:\n    {fix}")
    started = runtime_started()
    if not started:
        os.environ["PJRT_DEVICE"] = choose_pjrt_device()
    if debug_file is not None:  # read at the first compilation, so this works until something has compiled
        Path(debug_file).parent.mkdir(parents=True, exist_ok=True)
        Path(debug_file).write_text("")
        os.environ["PT_XLA_DEBUG_LEVEL"] = str(debug_level)
        os.environ["PT_XLA_DEBUG_FILE"] = str(debug_file)
    import torch_xla
    import torch_xla.runtime as xr

    dev = torch_xla.device()
    if verbose:
        kind = xr.device_type()
        where = "a TPU" if kind == "TPU" else ("XLA's CPU device (no TPU here: same graphs, compiled for this CPU)"
                                               if kind == "CPU" else f"XLA's {kind} device")
        print(f"torch {torch_v} / torch_xla {xla_v}: versions match.\nPJRT_DEVICE={kind}: running on {where}, "
              f"device {dev}.")
        if started:
            print("(torch_xla's runtime was already running, so PJRT_DEVICE was kept; the debug log only records "
                  "compilations if none has happened yet.)")
    return dev


@dataclass
class XlaCounts:
    """torch_xla's counters and metrics that matter for speed: compiles, executions, host transfers, syncs."""

    compiles: int = 0
    cached_compiles: int = 0
    executions: int = 0
    compile_s: float = 0.0
    execute_s: float = 0.0
    to_host: int = 0
    syncs: int = 0

    def __sub__(self, other: XlaCounts) -> XlaCounts:
        return XlaCounts(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def counts(self) -> dict[str, int]:
        """The integer fields only: stable from run to run, unlike the times."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.type in ("int", int)}


def xla_counts() -> XlaCounts:
    """A snapshot of the counters now (subtract two snapshots for what a block of code did)."""
    import torch_xla.debug.metrics as met

    def metric(name: str) -> tuple[int, float]:  # (samples, total seconds); zeros when it never fired
        data = met.metric_data(name)
        return (0, 0.0) if data is None else (int(data[0]), float(data[1]) / 1e9)

    n_compile, compile_s = metric("CompileTime")
    n_exec, execute_s = metric("ExecuteTime")
    return XlaCounts(compiles=n_compile, cached_compiles=int(met.counter_value("CachedCompile") or 0),
                     executions=n_exec, compile_s=compile_s, execute_s=execute_s,
                     to_host=metric("TransferFromDeviceTime")[0], syncs=int(met.counter_value("MarkStep") or 0))


@dataclass
class Counted:
    """What a `counting()` block did: the counter deltas and the wall-clock seconds."""

    delta: XlaCounts | None = None
    seconds: float = 0.0


@contextmanager
def counting() -> Iterator[Counted]:
    """Measure a block: counter deltas and wall time. Waits for the device before starting and before stopping,
    because executions run asynchronously and would otherwise be counted in the wrong block."""
    import torch_xla.core.xla_model as xm

    result = Counted()
    xm.wait_device_ops()
    before, t0 = xla_counts(), time.perf_counter()
    yield result
    xm.wait_device_ops()
    result.seconds = time.perf_counter() - t0
    result.delta = xla_counts() - before


def pending_ir(*tensors: torch.Tensor) -> str:
    """The recorded-but-not-yet-run graph (lazy IR) behind XLA tensors: what `torch_xla.sync()` would compile."""
    if not tensors or any(t.device.type != "xla" for t in tensors):
        raise ValueError("pending_ir needs XLA tensors: create them on torch_xla.device()")
    return internals.xla_pending_ir(*tensors)


def pad_to_bucket(x: torch.Tensor, buckets: Sequence[int], value: float = 0.0) -> torch.Tensor:
    """Pad the last dimension of `x` with `value` up to the smallest bucket that holds it (so only len(buckets)
    shapes, hence graphs, ever occur)."""
    length, fits = x.shape[-1], [b for b in buckets if b >= x.shape[-1]]
    if length < 1 or not fits:
        raise ValueError(f"length {length} does not fit any bucket {sorted(buckets)}: add a bucket >= {length}")
    return F.pad(x, (0, min(fits) - length), value=value)


def compile_causes(debug_file: str | Path, start: int = 0) -> tuple[list[str], int]:
    """Causes of the compilations logged to a PT_XLA_DEBUG_FILE after byte `start`, and the new end offset."""
    path = Path(debug_file)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass the debug_file given to ah.xla.use_xla()")
    text = path.read_text()
    causes = re.findall(r"Compilation Analysis: Compilation Cause\nCompilation Analysis:\s+(.+)", text[start:])
    return [c.strip() for c in causes], len(text)


def _launch_worker(index: int, all_reduce: bool) -> None:
    """One replica of `launch_demo`: report where it runs, then (optionally) all-reduce a tensor across replicas."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    dev = torch_xla.device()
    rank, world = xr.global_ordinal(), xr.world_size()
    print(f"replica {index}: ordinal {rank} of {world}, device {dev}, process {os.getpid()}", flush=True)
    xm.master_print(f"master_print: printed by the master ordinal only ({world} replicas)", flush=True)
    if all_reduce:
        total = xm.all_reduce(xm.REDUCE_SUM, torch.ones(3, device=dev) * (rank + 1))
        torch_xla.sync()
        print(f"replica {index}: all-reduced sum = {total.cpu().tolist()}", flush=True)


def _launch_main(all_reduce: bool) -> None:
    """Entry point of the launch subprocess (a fresh interpreter: torch_xla.launch needs an unstarted runtime)."""
    import torch_xla

    torch_xla.launch(_launch_worker, args=(all_reduce,), start_method="fork")
    print("launch finished", flush=True)


def launch_demo(devices: int = 2, all_reduce: bool = False, timeout: float = 60.0) -> tuple[int | None, str]:
    """Run `torch_xla.launch` over `devices` XLA CPU devices in a fresh process; returns (exit code, output),
    exit code None when stopped after `timeout` seconds or at a line saying the run "may be stuck"."""
    if devices < 1:
        raise ValueError("launch_demo needs devices >= 1")
    if not xla_installed():
        raise RuntimeError(version_fix(torch.__version__, None))
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "PT_XLA_DEBUG_LEVEL": None,
           "PT_XLA_DEBUG_FILE": None}
    code = f"from accelhelpers.xla import _launch_main; _launch_main({bool(all_reduce)})"
    run = launch.launch([sys.executable, "-c", code], timeout, echo=False, check=False, env=env,
                        stop_on="may be stuck", stop_ok=True)
    return run.returncode, run.output
