"""How fast this host is right now, so that stage times from different days can be compared: one thread's fp32
matmul GFLOP/s and the interpreter's loop rate, medians (and ranges) of 7 rounds. The same VM type has run the suite
anywhere from 12.5 to 15 minutes on different days; these two figures say which kind of day it was."""

import statistics
import time

import torch

torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 512)


def matmul_gflops() -> float:
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b)
    return 20 * 2 * 512**3 / (time.perf_counter() - t0) / 1e9


def loop_mops() -> float:
    t0 = time.perf_counter()
    s = 0
    for i in range(1_000_000):
        s += i
    return 1.0 / (time.perf_counter() - t0)


matmul_gflops(), loop_mops()  # warm up
rounds = [(matmul_gflops(), loop_mops()) for _ in range(7)]
for name, unit, values in (("fp32 matmul, 1 thread", "GFLOP/s", [r[0] for r in rounds]),
                           ("Python loop", "M additions/s", [r[1] for r in rounds])):
    print(f"=== host speed: {name}: {statistics.median(values):.1f} {unit} "
          f"(7 rounds, {min(values):.1f} to {max(values):.1f})")
