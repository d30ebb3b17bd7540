"""Timing done right: warm-up, device sync, repeats, robust statistics, FLOP counts and measured peaks."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .device import sync


@dataclass
class Timing:
    """Seconds per call over repeated measurements, with the statistics a benchmark should report."""

    times: list[float] = field(repr=False)
    calls_per_repeat: int = 1

    def __post_init__(self) -> None:
        """Refuse a Timing without measurements."""
        if not self.times:
            raise ValueError("Timing needs at least one measurement in times")

    @property
    def median(self) -> float:
        """Median seconds per call (robust to the odd slow repeat)."""
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        """Fastest seconds per call (what the hardware can do when nothing interferes)."""
        return min(self.times)

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median: how noisy the measurement is."""
        if len(self.times) < 4:
            return (max(self.times) - min(self.times)) / self.median
        q = statistics.quantiles(self.times, n=4)
        return (q[2] - q[0]) / self.median

    def __str__(self) -> str:
        return f"{_fmt_seconds(self.median)} median, {_fmt_seconds(self.best)} best, ±{self.spread:.0%} IQR"


def _fmt_seconds(s: float) -> str:
    """Seconds with a unit that keeps 3 significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def benchmark(fn: Callable[[], object], device: torch.device | str = "cpu", *, warmup: int = 3,
              repeats: int = 7, min_time: float = 0.05, max_calls: int = 1_000_000) -> Timing:
    """Time `fn()` properly: warm up, calibrate calls per repeat to last `min_time`, sync the device around
    each repeat, and return per-call times of `repeats` repeats."""
    if repeats < 1 or warmup < 0 or min_time < 0:
        raise ValueError("benchmark needs repeats >= 1, warmup >= 0 and min_time >= 0")
    for _ in range(warmup):
        fn()
    sync(device)
    calls = 1
    while True:  # calibrate: double the calls until one repeat lasts min_time
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time or calls >= max_calls:
            break
        calls = min(max_calls, calls * 2 if elapsed <= 0 else max(calls * 2, int(calls * min_time / elapsed)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) / calls)
    return Timing(times, calls)


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device | str = "cpu", rounds: int = 5,
                min_time: float = 0.05) -> dict[str, Timing]:
    """Time several functions in alternating rounds, so that background load hits all of them alike; a Timing each."""
    if not fns or rounds < 1:
        raise ValueError("interleaved needs at least one function and rounds >= 1")
    calls = {k: benchmark(fn, device, warmup=2, repeats=1, min_time=min_time).calls_per_repeat
             for k, fn in fns.items()}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls[k]):
                fn()
            sync(device)
            times[k].append((time.perf_counter() - t0) / calls[k])
    return {k: Timing(v, calls[k]) for k, v in times.items()}


def round_ratios(slow: Timing, fast: Timing) -> tuple[float, float, float]:
    """Speed-up of `fast` over `slow`, one ratio per interleaved round: (median, lowest, highest); a range that
    crosses 1.0 is no reliable difference."""
    if len(slow.times) != len(fast.times) or len(slow.times) < 3:
        raise ValueError(f"need the same number (>= 3) of interleaved rounds for both, got {len(slow.times)} and "
                         f"{len(fast.times)}: time them together with timing.interleaved(..., rounds=3 or more)")
    ratios = [a / b for a, b in zip(slow.times, fast.times)]
    return statistics.median(ratios), min(ratios), max(ratios)


@dataclass
class Noise:
    """How quiet the machine was while a chapter measured: load average and a reference kernel before and after."""

    load: tuple[float, float]
    reference_s: tuple[float, float]
    cores: int

    @property
    def drift(self) -> float:
        """Relative change of the reference kernel's time between before and after."""
        return abs(self.reference_s[1] / self.reference_s[0] - 1)

    @property
    def noisy(self) -> bool:
        """True when other work loaded the CPU (load average above its cores) or the reference moved by > 25 %."""
        return max(self.load) > self.cores or self.drift > 0.25

    def verdict(self) -> str:
        """One line for the chapter and the report."""
        state = "TOO NOISY to trust small differences" if self.noisy else "quiet enough"
        ref = f"{self.reference_s[0] * 1e3:.3g} -> {self.reference_s[1] * 1e3:.3g} ms"
        return (f"{state}: load average {self.load[0]:.1f} -> {self.load[1]:.1f} on {self.cores} cores, reference "
                f"matmul {ref} ({self.drift:.0%} drift)")


def _reference_kernel() -> float:
    """Median seconds of a fixed 256x256 fp32 matmul on the CPU: the yardstick of the noise check."""
    a = torch.ones(256, 256)
    return benchmark(lambda: a @ a, "cpu", repeats=5, min_time=0.02).median


@contextmanager
def noise_watch() -> Iterator[Noise]:
    """Measure the machine's noise around a block of measurements: `with ah.timing.noise_watch() as noise: ...`,
    then `noise.verdict()` (the reference kernel and load average are read before and after the block)."""
    load0, ref0 = load_average() or 0.0, _reference_kernel()
    noise = Noise((load0, load0), (ref0, ref0), os.cpu_count() or 1)
    yield noise
    noise.load, noise.reference_s = (load0, load_average() or 0.0), (ref0, _reference_kernel())


def record_noise(*noises: Noise) -> Noise:
    """The noisiest of a chapter's noise checks: print its verdict and record it as the chapter's "noise"."""
    from .results import record

    if not noises:
        raise ValueError("record_noise needs at least one noise_watch() result")
    worst = max(noises, key=lambda nz: (nz.noisy, nz.drift))
    print("Timing conditions:", worst.verdict())
    record("noise", worst.drift, "fraction", worst.verdict())
    return worst


def load_average() -> float | None:
    """The 1-minute load average, to 2 decimals (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def hours(h: float) -> str:
    """A duration in hours as a short human string: '40 min', '3.2 h', '5.1 days'."""
    return f"{h * 60:.0f} min" if h < 1 else f"{h:.1f} h" if h < 48 else f"{h / 24:.1f} days"


def time_unsynced(fn: Callable[[], object], calls: int = 10) -> float:
    """Seconds per call measured the wrong way, without a device sync: on a GPU this times the launch only."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def mlp_flops(sizes: Sequence[int], batch: int, *, backward: bool = True) -> int:
    """Multiply-add FLOPs (2 per MAC) of one MLP step over `batch` rows; backward costs 2x forward
    (gradients for inputs and weights), except that the first layer needs no input gradient."""
    if batch <= 0 or len(sizes) < 2 or any(s <= 0 for s in sizes):
        raise ValueError("mlp_flops needs batch > 0 and at least two positive layer sizes")
    macs = [a * b for a, b in zip(sizes[:-1], sizes[1:], strict=False)]
    forward = 2 * batch * sum(macs)
    return forward + (forward + 2 * batch * sum(macs[1:]) if backward else 0)  # weight + input gradients


def matmul_gflops(n: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                  min_time: float = 0.05, repeats: int = 5) -> float:
    """Measured GFLOP/s of an n x n by n x n matmul (best repeat)."""
    if n <= 0:
        raise ValueError(f"n must be a positive matrix size, got {n}")
    a, b, out = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
    t = benchmark(lambda: torch.mm(a, b, out=out), device, min_time=min_time, repeats=repeats)
    return 2 * n**3 / t.best / 1e9


def copy_gbps(n_bytes: int, device: torch.device | str = "cpu", min_time: float = 0.05,
              repeats: int = 5) -> float:
    """Measured GB/s of copying an `n_bytes` fp32 buffer (a read and a write per byte counted)."""
    if n_bytes <= 0:
        raise ValueError(f"n_bytes must be positive, got {n_bytes}")
    src = torch.randn(max(1, n_bytes // 4), device=device)
    dst = torch.empty_like(src)
    t = benchmark(lambda: dst.copy_(src), device, min_time=min_time, repeats=repeats)
    return 2 * 4 * src.numel() / t.best / 1e9


def measure_peaks(device: torch.device | str = "cpu", quick: bool = True) -> dict[str, float]:
    """The machine's measured fp32 matmul peak (GFLOP/s, best over sizes) and large-copy bandwidth (GB/s)."""
    sizes = (512, 1024, 2048) if quick else (1024, 2048, 4096, 8192)
    if torch.device(device).type != "cpu":
        sizes = (2048, 4096, 8192)
    return {"matmul_gflops": max(matmul_gflops(n, device) for n in sizes),
            "copy_gbps": copy_gbps(256 * 2**20 if not quick else 64 * 2**20, device)}


def fraction_of_peak(achieved_gflops: float, peak_gflops: float) -> float:
    """Achieved over peak, a number between 0 and about 1."""
    if peak_gflops <= 0 or achieved_gflops < 0:
        raise ValueError(f"peak_gflops must be positive and achieved_gflops >= 0, got {peak_gflops}, {achieved_gflops}")
    return achieved_gflops / peak_gflops
