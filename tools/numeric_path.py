"""A second numeric path on this CPU, for `make test`: other vector kernels (ATEN_CPU_CAPABILITY one level below this
CPU's, MKL held to AVX2), so nbval checks on one machine that the chapters' compared outputs hold on another CPU.
Prints the environment as `NAME=value ...` on one line (with an inductor cache of its own: torch 2.9's does not key on
ATEN_CPU_CAPABILITY, and a kernel compiled for AVX-512 loaded under avx2 killed a Jupyter kernel), after checking that
it really changes a training run's bits here (200 SGD steps of a small MLP, in a child process under each
environment); if it does not, the check would prove nothing: it says so on stderr and exits 1."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN = """
import hashlib, torch
torch.manual_seed(0); torch.set_num_threads(1)
m = torch.nn.Sequential(torch.nn.Linear(40, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.SGD(m.parameters(), lr=0.05)
x, y = torch.randn(512, 40), torch.randint(0, 10, (512,))
for _ in range(200):
    opt.zero_grad(); torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step()
bits = b"".join(p.detach().numpy().tobytes() for p in m.parameters())
print(torch.backends.cpu.get_cpu_capability(), hashlib.sha256(bits).hexdigest()[:16])
"""


def second_path(capability: str) -> dict[str, str]:
    """The environment of a numeric path other than this CPU's own (`capability`: torch's name for its kernels)."""
    below = {"AVX512": "avx2", "AVX512_BF16": "avx2", "AVX2": "default"}.get(capability.upper(), "default")
    cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_aten-{below}_mkl-avx2"
    return {"ATEN_CPU_CAPABILITY": below, "MKL_ENABLE_INSTRUCTIONS": "AVX2", "TORCHINDUCTOR_CACHE_DIR": str(cache)}


def train(extra: dict[str, str]) -> tuple[str, str]:
    """(kernel capability, weight digest) of the reference training run in a child process under `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
    out = subprocess.run([sys.executable, "-c", TRAIN], env={**env, **extra}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], out[1]


def main() -> int:
    here_cap, here_bits = train({})
    env = second_path(here_cap)
    other_cap, other_bits = train(env)
    if other_bits == here_bits:
        print(f"numeric path {env} gives the same weight bits as this CPU's own ({here_cap}): a second path here "
              "would prove nothing", file=sys.stderr)
        return 1
    print(f"this CPU: {here_cap} kernels, weights {here_bits}; second path: {other_cap} kernels, weights "
          f"{other_bits}", file=sys.stderr)
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
