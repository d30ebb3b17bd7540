"""Mixed precision: number-format facts, a device-aware autocast policy, loss-scaling and memory tools, fastai glue."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .internals import TorchDispatchMode
from .timing import interleaved
from .train import minibatch_step

PREFERENCES = ("bf16", "fp16", "fp32")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}

# name -> (torch dtype or None, exponent bits, mantissa bits, storage bits)
FORMATS: dict[str, tuple[torch.dtype | None, int, int, int]] = {
    "fp32": (torch.float32, 8, 23, 32),
    "tf32": (None, 8, 10, 32),  # a tensor-core compute mode, stored in 32 bits; no torch dtype
    "fp16": (torch.float16, 5, 10, 16),
    "bf16": (torch.bfloat16, 8, 7, 16),
    "fp8_e4m3fn": (torch.float8_e4m3fn, 4, 3, 8),
    "fp8_e5m2": (torch.float8_e5m2, 5, 2, 8),
}


# ---------------------------------------------------------------- number formats

def ieee_facts(exp_bits: int, man_bits: int) -> dict[str, float]:
    """Largest value, smallest normal/subnormal and epsilon of an IEEE-style format (top exponent kept for inf/NaN)."""
    if exp_bits < 2 or man_bits < 1:
        raise ValueError(f"need exp_bits >= 2 and man_bits >= 1, got {exp_bits}, {man_bits}")
    bias = 2 ** (exp_bits - 1) - 1
    emin = 1 - bias
    return {"max": (2 - 2.0**-man_bits) * 2.0**bias, "smallest_normal": 2.0**emin,
            "smallest_subnormal": 2.0 ** (emin - man_bits), "eps": 2.0**-man_bits}


def format_facts(name: str) -> dict[str, Any]:
    """Bits, range and precision of one format: from `torch.finfo` when torch has the dtype, else by the formula."""
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}: choose one of {', '.join(FORMATS)}")
    dtype, e, m, bits = FORMATS[name]
    row: dict[str, Any] = {"format": name, "bits": bits, "exponent": e, "mantissa": m}
    if dtype is None:
        row.update(ieee_facts(e, m), source="formula")
        return row
    fi = torch.finfo(dtype)
    row.update(max=float(fi.max), smallest_normal=float(fi.smallest_normal),
               smallest_subnormal=float(fi.smallest_normal) * float(fi.eps), eps=float(fi.eps), source="torch.finfo")
    return row


def format_table(names: Iterable[str] = FORMATS) -> list[dict[str, Any]]:
    """`format_facts` for several formats (all of FORMATS by default), one row each."""
    return [format_facts(n) for n in names]


def spacing(x: torch.Tensor, name: str) -> torch.Tensor:
    """Gap between |x| and the next larger representable number of format `name` (its resolution at x)."""
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}: choose one of {', '.join(FORMATS)}")
    _, e, m, _ = FORMATS[name]
    ax = x.double().abs()
    emin = 2 - 2 ** (e - 1)
    expo = torch.floor(torch.log2(ax.clamp_min(2.0**emin))).clamp_min(emin)
    return torch.exp2(expo - m)


def representable(dtype: torch.dtype) -> torch.Tensor:
    """Every finite, non-negative value of an 8- or 16-bit float dtype, sorted (by enumerating its bit patterns)."""
    bits = torch.finfo(dtype).bits if dtype.is_floating_point else 0
    if bits not in (8, 16):
        raise ValueError(f"representable() enumerates 8- and 16-bit float dtypes, not {dtype}; "
                         "use spacing() for wider formats")
    ints = torch.arange(2**bits, dtype=torch.int32)
    pattern = ints.to(torch.uint8) if bits == 8 else ints.to(torch.int16)
    vals = pattern.view(dtype).double()
    return torch.unique(vals[torch.isfinite(vals) & (vals >= 0)])


def cast_report(values: torch.Tensor, dtype: torch.dtype = torch.float16, scale: float = 1.0) -> dict[str, float]:
    """Shares of the non-zero `values`, multiplied by `scale`, that a cast to `dtype` flushes to zero, leaves
    subnormal (precision lost) or overflows to inf: what happens to gradients stored in that format."""
    if not dtype.is_floating_point or scale <= 0:
        raise ValueError(f"cast_report needs a floating dtype and scale > 0, got {dtype} and {scale}")
    v = values.detach().flatten().double()
    v = v[v != 0]
    if v.numel() == 0:
        raise ValueError("cast_report got no non-zero values: pass real gradients, not zeros")
    c = (v * scale).to(dtype)
    tiny = torch.finfo(dtype).smallest_normal
    return {"zero": (c == 0).double().mean().item(),
            "subnormal": ((c != 0) & (c.abs() < tiny)).double().mean().item(),
            "overflow": torch.isinf(c).double().mean().item(), "count": v.numel()}


# ---------------------------------------------------------------- policy

@dataclass(frozen=True)
class Policy:
    """What mixed precision to use on one device: autocast dtype (None: plain fp32), whether to scale the loss, why."""

    device_type: str
    dtype: torch.dtype | None
    scaler: bool
    reason: str

    @property
    def name(self) -> str:
        """'bf16', 'fp16' or 'fp32'."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[self.dtype]

    def autocast(self) -> AbstractContextManager:
        """The `torch.autocast` context for this policy (a disabled one for fp32)."""
        return torch.autocast(self.device_type, dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None)

    def grad_scaler(self, **kwargs: Any) -> torch.amp.GradScaler:
        """A `torch.amp.GradScaler` for this device, enabled only when the policy scales the loss (fp16)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.scaler, **kwargs)

    def __str__(self) -> str:
        scaler = " + GradScaler" if self.scaler else ""
        return f"{self.device_type}: {self.name}{scaler} ({self.reason})"


def auto_choice(kind: str, report: dict[str, Any]) -> tuple[str, str]:
    """The preferred format on a device kind given the hardware report (`ah.device.hardware_report()`), and why."""
    if kind == "cuda":
        cc = str(report.get("compute_capability") or "0.0")
        if int(cc.split(".")[0]) >= 8:
            return "bf16", f"compute capability {cc} has bf16 tensor cores; fp32 range, no scaler needed"
        return "fp16", f"compute capability {cc} has no fast bf16; fp16 tensor cores need loss scaling"
    if kind == "xla":
        return "bf16", "TPUs compute in bf16 natively; fp32 range, no scaler needed"
    if kind == "mps":
        return "fp16", "fp16 is Apple GPUs' fast type (bf16 autocast needs macOS 14+); scaler for its range"
    if kind == "cpu":
        if report.get("cpu_bf16_native"):
            return "bf16", "CPU has AVX512-BF16/AMX: oneDNN runs bf16 matmuls natively"
        return "bf16", "CPU lacks AVX512-BF16/AMX: bf16 is emulated and may be slower than fp32 (prefer='fp32')"
    raise ValueError(f"no precision policy for device type {kind!r}: use cuda, xla, mps or cpu")


def policy_for(device: torch.device | str, prefer: str | None = None,
               report: dict[str, Any] | None = None) -> Policy:
    """The mixed-precision policy for `device`: CUDA bf16 where supported else fp16 + scaler, CPU bf16, XLA bf16,
    MPS fp16 + scaler (from `report`, default the hardware report); `prefer` ('bf16', 'fp16', 'fp32') overrides,
    with a clear error where it cannot work."""
    kind = torch.device(device).type
    if prefer is not None and prefer not in PREFERENCES:
        raise ValueError(f"prefer={prefer!r} is not a precision: choose one of {', '.join(PREFERENCES)}")
    if kind not in ("cuda", "xla", "mps", "cpu"):
        raise ValueError(f"no precision policy for device type {kind!r}: use cuda, xla, mps or cpu")
    if prefer:
        name, reason = prefer, "asked for"
    else:
        from .device import hardware_report

        name, reason = auto_choice(kind, hardware_report() if report is None else report)
    if kind == "cuda" and name == "bf16" and prefer and not torch.cuda.is_bf16_supported():
        raise ValueError("this CUDA GPU does not support bf16: use prefer='fp16' (with the scaler) or 'fp32'")
    if kind == "xla" and name == "fp16":
        raise ValueError("XLA autocast runs in bf16: use prefer='bf16' or 'fp32' on a TPU")
    return Policy(kind, _DTYPES[name], name == "fp16", reason)


# ---------------------------------------------------------------- what autocast does

class _OpLog(TorchDispatchMode):
    """Records each aten op below autocast with its tensor input dtypes and output dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[str, ...], str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        ins = tuple(_short(a.dtype) for a in _tensors((args, kwargs)))
        outs = _tensors(out)
        self.ops.append((func.overloadpacket.__name__, ins, _short(outs[0].dtype) if outs else "-"))
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts, in order (an op's arguments or results)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    return []


def _short(dtype: torch.dtype) -> str:
    """'float32' for torch.float32, etc."""
    return str(dtype).removeprefix("torch.")


def op_dtypes(fn: Callable[[], Any]) -> list[tuple[str, tuple[str, ...], str]]:
    """(aten op, input dtypes, output dtype) of every op `fn()` runs, as kernels see them (after autocast casts)."""
    with _OpLog() as log:
        fn()
    return log.ops


# ---------------------------------------------------------------- gradients and loss scaling

def gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None = None,
              scale: float = 1.0) -> dict[str, torch.Tensor]:
    """One cross-entropy backward (under autocast to `dtype` if given, the loss multiplied by `scale`): the flattened
    parameter gradients and the gradients of every Linear/Conv output (what flows through 16-bit kernels under
    autocast), as float32 divided by `scale` again, as `GradScaler.unscale_` does."""
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    acts: list[torch.Tensor] = []

    def keep(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda g: acts.append(g.detach().float().flatten() / scale))

    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    if not layers:
        raise ValueError("gradients() found no Linear/Conv layer to watch in this model")
    handles = [m.register_forward_hook(keep) for m in layers]
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        (loss * scale).backward()
    finally:
        for h in handles:
            h.remove()
    params = torch.cat([p.grad.detach().flatten() / scale for p in model.parameters() if p.grad is not None])
    return {"parameters": params, "activations": torch.cat(acts)}


def scaler_trace(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, *, lr: float = 1e-3,
                 init_scale: float = 2.0**24, growth_interval: int = 20) -> list[dict[str, float]]:
    """Train `model` with fp16 autocast and a dynamic `torch.amp.GradScaler`, recording each step's scale, whether
    the scaler skipped the step (inf/NaN gradients: the scale is halved) and the loss."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    policy = Policy(x.device.type, torch.float16, True, "scaler_trace")
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    scaler = policy.grad_scaler(init_scale=init_scale, growth_interval=growth_interval)
    trace = []
    for step in range(steps):
        before = scaler.get_scale()
        loss = minibatch_step(model, opt, x, y, policy, scaler)
        trace.append({"step": step, "scale": before, "skipped": scaler.get_scale() < before, "loss": loss.item()})
    return trace


# ---------------------------------------------------------------- measurements

def train_eval(split: Any, sizes: Sequence[int], policy: Policy, seed: int, epochs: int = 10,
               batch_size: int = 256, lr: float = 3e-3) -> dict[str, float]:
    """Train an MLP of `sizes` with Adam under `policy` (autocast, scaler if fp16) on a Split with `train.fit`;
    test accuracy and test loss (the loss shows that runs differ even when the accuracy agrees)."""
    from .models import mlp
    from .session import seed_everything
    from .train import fit

    seed_everything(seed)
    model = mlp(list(sizes)).to(split.device)
    hist = fit(model, split, torch.optim.Adam(model.parameters(), lr=lr), epochs, batch_size, seed=seed,
               policy=policy)
    return {"accuracy": hist.acc[-1], "loss": hist.loss[-1]}


def matmul_precision(n: int = 1024, device: torch.device | str = "cpu",
                     min_time: float = 0.05) -> list[dict[str, Any]]:
    """fp32 matmul speed (GFLOP/s, best of interleaved rounds) and relative error against float64 under each
    `torch.set_float32_matmul_precision` setting ('high' allows TF32 on Ampere+ GPUs); restores the setting."""
    settings = ("highest", "high", "medium")
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device) for _ in range(2))
    ref = a.double() @ b.double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch 2.9 warns that the getter's old API will change
        old = torch.get_float32_matmul_precision()

    def run(setting: str) -> torch.Tensor:
        torch.set_float32_matmul_precision(setting)
        return a @ b

    try:
        err = {s: (run(s).double() - ref).abs().max().item() / ref.abs().max().item() for s in settings}
        t = interleaved({s: partial(run, s) for s in settings}, device, rounds=3, min_time=min_time)
    finally:
        torch.set_float32_matmul_precision(old)
    return [{"setting": s, "gflops": 2 * n**3 / t[s].best / 1e9, "rel_error": err[s]} for s in settings]


def ratio(a: float, b: float) -> float:
    """a / b, with a clear error for a zero or negative denominator (speed-ups and memory ratios)."""
    if b <= 0 or not math.isfinite(b):
        raise ValueError(f"ratio needs a positive finite denominator, got {b}")
    return a / b


# ---------------------------------------------------------------- fastai

def to_mixed(learn: Any, prefer: str | None = None, **scaler_kwargs: Any) -> Any:
    """Put a fastai Learner in the device's mixed precision (`policy_for(learn.dls.device, prefer)`), replacing
    fastai's `to_fp16()`/`to_bf16()`, which autocast for CUDA only; fp32 removes mixed precision."""
    from fastai.callback.fp16 import MixedPrecision

    class PolicyMixedPrecision(MixedPrecision):
        """fastai's MixedPrecision, with autocast and GradScaler on the policy's device and dtype."""

        def __init__(self, policy: Policy, **kwargs: Any) -> None:
            super().__init__(amp_mode="fp16" if policy.dtype == torch.float16 else "bf16", **kwargs)
            self.policy = policy

        def before_fit(self) -> None:
            self.autocast = self.policy.autocast()
            self.learn.scaler = self.policy.grad_scaler(**self.kwargs)
            self.scales = []

    policy = policy_for(learn.dls.device or "cpu", prefer)
    learn.remove_cbs([cb for cb in learn.cbs if isinstance(cb, MixedPrecision)])
    if policy.dtype is not None:
        learn.add_cb(PolicyMixedPrecision(policy, **scaler_kwargs))
    learn.precision_policy = policy
    return learn
