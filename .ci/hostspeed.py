"""How fast this host is right now, so that stage times from different days can be compared: one thread's fp32
matmul GFLOP/s (a cache-resident kernel), a full-batch training step of udlbook's depth-1 MLP (4000 x 298
activations: it lives in the shared L3 cache and memory, which neighbours on the host contend for), a 64-MB copy and
the interpreter's loop rate; medians (and ranges) of 7 repeats of ah.timing.benchmark. The same VM type has run the
suite anywhere from 12.5 to 15 minutes on different days, and chapter 02's depth-1 step at less than half its
earlier speed on a day the matmul read within 20 % of its usual figure: these say which kind of day it was."""

import torch

import accelhelpers as ah

torch.set_num_threads(1)
a, b = torch.randn(512, 512), torch.randn(512, 512)
src = torch.randn(16 * 2**20)
dst = torch.empty_like(src)
data = ah.data.mnist1d()
model = ah.udlbook.model_for(1)
opt = torch.optim.SGD(model.parameters(), lr=ah.udlbook.LR)


def udlbook_step() -> None:
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(data.x_train), data.y_train).backward()
    opt.step()


def additions() -> None:
    s = 0
    for i in range(1_000_000):
        s += i


for name, unit, timing, work in (
        ("fp32 matmul, 1 thread", "GFLOP/s", ah.timing.benchmark(lambda: torch.mm(a, b)), 2 * 512**3 / 1e9),
        ("udlbook depth-1 step, fp32, eager, 1 thread", "steps/s", ah.timing.benchmark(udlbook_step), 1.0),
        ("64-MB copy, 1 thread", "GB/s", ah.timing.benchmark(lambda: dst.copy_(src)), 2 * 4 * src.numel() / 1e9),
        ("Python loop", "M additions/s", ah.timing.benchmark(additions, warmup=1), 1.0)):
    rates = sorted(work / t for t in timing.times)
    print(f"=== host speed: {name}: {work / timing.median:.1f} {unit} "
          f"({len(rates)} repeats, {rates[0]:.1f} to {rates[-1]:.1f})")
# Time the tests spend waiting for the disk (this VM pages out cold page cache, so files are read again): the share
# of the last 5 minutes in which every task waited on I/O (Linux's pressure stall information), where the kernel has it.
try:
    full = next(line for line in open("/proc/pressure/io") if line.startswith("full"))
    print(f"=== host speed: I/O stalls over the last 5 minutes: {float(full.split('avg300=')[1].split()[0]):.0f} % "
          "of the time every task waited on the disk")
except (OSError, StopIteration, IndexError, ValueError):
    print("=== host speed: I/O stalls: not reported by this kernel")
