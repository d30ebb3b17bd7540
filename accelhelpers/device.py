"""Devices: pick the best one, describe the hardware (`Hardware`, what the device, dtype, attention and placement
decisions are functions of; `hardware_report`, what a result was measured on), choose the run profile, and tell an
out-of-memory error from any other and free what it left (`oom_kind`, `free_memory`)."""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEVICE_KINDS = ("cuda", "xla", "mps", "cpu")
PROFILES = ("quick", "full", "smoke")  # smoke: the full profile's code paths, a few steps of each (Setup.pick)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # cpuinfo flags of a CPU that runs bf16 matmuls in hardware
ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
             "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "sve")


class DeviceUnavailable(RuntimeError):
    """A device that was asked for is not present on this machine."""


def in_colab() -> bool:
    """True inside Google Colab, whose kernel imports `google.colab` before the first cell (never raises, unlike
    find_spec("google.colab") where no `google` package is installed)."""
    return "google.colab" in sys.modules


def xla_installed() -> bool:
    """True when torch_xla can be imported (without importing it: that is slow and grabs devices)."""
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):
        return False


def cpu_requested() -> bool:
    """True when ACCEL_DEVICE asks for the CPU (the notebook tests set ACCEL_DEVICE=cpu on every machine)."""
    return os.environ.get("ACCEL_DEVICE", "").lower().startswith("cpu")


def xla_version() -> str | None:
    """torch_xla's version from its package metadata (without importing it), or None where it has none."""
    try:
        return importlib.metadata.version("torch_xla")
    except importlib.metadata.PackageNotFoundError:
        return None


# torch_xla finds TPU chips on the PCI bus: Google's vendor id and one device id per TPU generation
# (torch_xla/_internal/tpu.py, `num_available_chips`; tests/test_device.py keeps this list equal to it).
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = ("0x0027", "0x005e", "0x0063", "0x006f", "0x0056", "0x0062", "0x0076")
# the generations its comments name beside those ids
TPU_GENERATIONS = {"0x0027": "v2/v3", "0x005e": "v4", "0x0063": "v5e", "0x006f": "v6e", "0x0076": "7x"}


def tpu_chips(pci_root: str | os.PathLike = "/sys/bus/pci/devices") -> int:
    """TPU chips attached to this host, counted on the PCI bus the way torch_xla counts them."""
    chips = 0
    for vendor in Path(pci_root).glob("*/vendor"):
        try:
            if vendor.read_text().strip() == GOOGLE_PCI_VENDOR and \
                    (vendor.parent / "device").read_text().strip() in TPU_PCI_DEVICES:
                chips += 1
        except OSError:
            continue
    return chips


def tpu_generation(pci_root: str | os.PathLike = "/sys/bus/pci/devices") -> str | None:
    """The generation of the first TPU chip on the PCI bus ('v5e' on Colab's TPU runtime), or None."""
    for vendor in sorted(Path(pci_root).glob("*/vendor")):
        try:
            if vendor.read_text().strip() == GOOGLE_PCI_VENDOR:
                gen = TPU_GENERATIONS.get((vendor.parent / "device").read_text().strip())
                if gen:
                    return gen
        except OSError:
            continue
    return None


def tpu_present() -> bool:
    """True on a TPU host: TPU chips on the PCI bus (v2 to v6e alike), or PJRT_DEVICE=TPU set by the user."""
    return os.environ.get("PJRT_DEVICE", "").upper().startswith("TPU") or tpu_chips() > 0


def available_devices() -> list[str]:
    """The device kinds usable here, best first (cpu is always last and always present)."""
    kinds = []
    if torch.cuda.is_available():
        kinds.append("cuda")
    if xla_installed() and tpu_present():
        kinds.append("xla")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        kinds.append("mps")
    kinds.append("cpu")
    return kinds


def best_device(prefer: str | None = None) -> torch.device:
    """The best device here (cuda > xla/TPU > mps > cpu), or the one `prefer` / ACCEL_DEVICE asks for (one not
    present raises DeviceUnavailable naming those that are)."""
    want = prefer or os.environ.get("ACCEL_DEVICE") or None
    have = available_devices()
    index = ""
    if want is None:
        kind = have[0]
    else:
        if not isinstance(want, str):
            raise DeviceUnavailable(f"device must be a name such as 'cpu' or 'cuda:0', got {want!r}")
        kind, colon, index = want.lower().partition(":")
        if kind not in DEVICE_KINDS:
            raise DeviceUnavailable(f"unknown device {want!r}: choose one of {', '.join(DEVICE_KINDS)} "
                                    f"(present here: {', '.join(have)})")
        if colon and not index.isdigit():
            raise DeviceUnavailable(f"bad device {want!r}: write 'kind' or 'kind:N' with N >= 0, e.g. 'cuda:1'")
        if kind not in have and not (kind == "xla" and xla_installed()):
            raise DeviceUnavailable(f"device {want!r} is not present on this machine; present here: "
                                    f"{', '.join(have)}. Unset ACCEL_DEVICE or pass one of those.")
    if kind == "xla":
        import torch_xla

        return torch_xla.device()
    return torch.device(kind, int(index)) if index else torch.device(kind)


@dataclass(frozen=True)
class Hardware:
    """What the device, backend, dtype and attention decisions depend on, as plain facts: the decisions are functions
    of this description, so tests can hand them real machines' profiles (tests/test_hardware.py)."""

    kind: str = "cpu"                          # the device kind this process computes on: cuda, xla, mps or cpu
    gpu: str | None = None                     # the first visible GPU's name
    capability: tuple[int, int] | None = None  # its CUDA compute capability (major, minor)
    gpu_memory_gb: float | None = None         # its memory in GiB
    gpus: int = 0                              # GPUs this process sees (after CUDA_VISIBLE_DEVICES)
    gpus_per_task: bool = False                # the launcher bound each task its own GPU(s): Slurm --gpus-per-task
    cpu_bf16: bool = False                     # the CPU has avx512_bf16 or amx_bf16
    tpu: str | None = None                     # the TPU generation, e.g. 'v5e'

    @property
    def sm80(self) -> bool:
        """A CUDA GPU of compute capability 8.0 (Ampere) or newer."""
        return self.kind == "cuda" and self.capability is not None and self.capability >= (8, 0)

    @property
    def bf16_native(self) -> bool:
        """bf16 runs in hardware: CUDA from sm 8.0 (torch.cuda.is_bf16_supported counts emulation by default: True
        on a T4), TPUs, CPUs with AVX512-BF16/AMX."""
        return self.sm80 or self.kind == "xla" or (self.kind == "cpu" and self.cpu_bf16)

    @property
    def flash_attention(self) -> bool:
        """PyTorch's FlashAttention kernel runs here: CUDA from sm 8.0 (check_flash_attention_hardware_support)."""
        return self.sm80

    @classmethod
    def here(cls, device: torch.device | str | None = None, env: Mapping[str, str] | None = None) -> Hardware:
        """This process's hardware, computing on `device` (default: the kind best_device would pick); Slurm's binding
        read from `env` (default: os.environ; another task's environment, for a table of what Slurm gave each)."""
        have = available_devices()
        want = os.environ.get("ACCEL_DEVICE", "").lower().partition(":")[0]
        kind = torch.device(device).type if device is not None else (want if want in have else have[0])
        # Slurm bound GPUs to tasks: an allocation's --gpus-per-task (SLURM_GPUS_PER_TASK before Slurm 23.11,
        # SLURM_TRES_PER_TASK since), or a binding srun alone asked for (--gpus-per-task, --gpu-bind), which shows only
        # as slurmd's SLURMD_TRES_BIND=gpu:... (seen on Slurm 22.05, tests/test_slurm.py)
        env = os.environ if env is None else env
        bound = ("SLURM_GPUS_PER_TASK" in env or "gres/gpu" in env.get("SLURM_TRES_PER_TASK", "")
                 or env.get("SLURMD_TRES_BIND", "").startswith("gpu:"))
        facts: dict[str, Any] = {"gpus_per_task": bound,
                                 "cpu_bf16": any(f in _cpu_info()[1] for f in BF16_FLAGS)}
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            facts.update(gpu=p.name, capability=(p.major, p.minor), gpu_memory_gb=round(p.total_memory / 2**30, 1),
                         gpus=torch.cuda.device_count())
        if kind == "xla":
            facts["tpu"] = tpu_generation()
        return cls(kind, **facts)


def as_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device, or DeviceUnavailable naming the valid kinds (torch's own error lists 20)."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceUnavailable(f"device={device!r} is not a device: choose one of {', '.join(DEVICE_KINDS)} "
                                "(optionally with ':N')") from e


def choose_profile(asked: str | None = None, device_kind: str | None = None) -> str:
    """The run profile: `asked` (a notebook's PROFILE) if given, else ACCEL_PROFILE if set, else 'quick' when
    `device_kind` (None: the best device here) is the CPU and 'full' on an accelerator."""
    value, origin = (asked, "PROFILE") if asked is not None else (os.environ.get("ACCEL_PROFILE", ""), "ACCEL_PROFILE")
    value = str(value).strip().lower()
    if value:
        if value not in PROFILES:
            raise ValueError(f"{origin}={value!r} is not a profile: choose one of {', '.join(PROFILES)}")
        return value
    return "quick" if (device_kind or available_devices()[0]) == "cpu" else "full"


def _cpu_info() -> tuple[str, list[str]]:
    """CPU model name and the ISA flags of interest (read from /proc/cpuinfo where there is one)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = val.strip()
                elif key in ("flags", "Features"):
                    flags.update(val.split())
    except OSError:
        pass
    return model, [f for f in ISA_FLAGS if f in flags]


def hardware_report() -> dict[str, Any]:
    """What this machine is: versions, CPU model/cores/ISA, GPU, bf16 support, XLA, best device, profile."""
    model, flags = _cpu_info()
    report: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "cuda_build": torch.version.cuda, "platform": f"{platform.system()} {platform.machine()}",
        "cpu": model, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cpu_isa": flags, "cpu_bf16_native": any(f in flags for f in BF16_FLAGS),
        "torch_xla": xla_version(), "colab": in_colab(), "kaggle": "KAGGLE_KERNEL_RUN_TYPE" in os.environ,
        "devices": available_devices(), "tpu_chips": tpu_chips(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        report.update(gpu=p.name, gpu_memory_gb=round(p.total_memory / 2**30, 1),
                      compute_capability=f"{p.major}.{p.minor}", gpu_count=torch.cuda.device_count(),
                      cuda_bf16=Hardware.here("cuda").bf16_native)
    report["best_device"] = report["devices"][0]
    try:
        report["profile"] = choose_profile()
    except ValueError as e:
        report["profile"] = f"invalid ({e})"
    return report


def format_report(report: dict[str, Any] | None = None) -> str:
    """The hardware report as aligned 'key: value' lines for printing."""
    report = hardware_report() if report is None else report
    width = max(len(k) for k in report)
    lines = []
    for k, v in report.items():
        if isinstance(v, list):
            v = " ".join(map(str, v)) or "-"
        lines.append(f"{k:<{width}} : {v}")
    return "\n".join(lines)


def machine_line(hw: dict[str, Any]) -> str:
    """One line naming the hardware a recorded result was measured on (its GPU, CPU, cores, torch, best device)."""
    parts = [f"{hw.get('gpu')} ({hw.get('gpu_memory_gb')} GiB)" if hw.get("gpu") else None,
             f"{hw.get('cpu', 'CPU')}, {hw.get('cpu_cores', '?')} cores",
             f"torch {hw.get('torch', '?')}", f"best device: {hw.get('best_device', '?')}"]
    return " · ".join(p for p in parts if p)


def oom_kind(exc: BaseException) -> str | None:
    """Which memory ran out: 'cuda', 'mps', 'xla' or 'cpu' for an out-of-memory error, None for anything else
    (chapter 05's batch-size finder and chapter 09's batch back-off tell an out-of-memory error from a bug this way)."""
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
