"""How fast this host is right now, so that stage times from different days can be compared: one thread's fp32
matmul GFLOP/s and the interpreter's loop rate, medians (and ranges) of 7 repeats of ah.timing.benchmark. The same
VM type has run the suite anywhere from 12.5 to 15 minutes on different days; these two figures say which kind of
day it was."""

import torch

import accelhelpers as ah

torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 512)


def additions() -> None:
    s = 0
    for i in range(1_000_000):
        s += i


for name, unit, timing, work in (
        ("fp32 matmul, 1 thread", "GFLOP/s", ah.timing.benchmark(lambda: torch.mm(a, b)), 2 * 512**3 / 1e9),
        ("Python loop", "M additions/s", ah.timing.benchmark(additions, warmup=1), 1.0)):
    rates = sorted(work / t for t in timing.times)
    print(f"=== host speed: {name}: {work / timing.median:.1f} {unit} "
          f"({len(rates)} repeats, {rates[0]:.1f} to {rates[-1]:.1f})")
