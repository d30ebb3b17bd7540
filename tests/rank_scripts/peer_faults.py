"""A dead or stuck peer on 2 gloo ranks (tests/test_peers.py), run under torchrun:

    torchrun --standalone --nproc-per-node=2 tests/rank_scripts/peer_faults.py OUT --fault exit|hang|kill --timeout 3

Rank 1 exits, hangs or is SIGKILLed before an all-reduce; rank 0 must get a PeerFailure (chapter 09's peer_guard)
within the collective timeout, record it in OUT/rank0.json and exit with status 3. The chapter shows a stranded
peer only through a NaN (nan.py); this script covers the other ways a peer goes away.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

import accelhelpers as ah


def peer(out: Path, fault: str, timeout_s: float) -> None:
    """Rank 1 fails ('exit', 'hang', 'kill') before an all-reduce; rank 0 records its PeerFailure, exits 3."""
    rank, _ = ah.parallel.init_distributed("gloo", timeout_s)
    t = torch.ones(4)
    torch.distributed.all_reduce(t)  # the group works
    if rank == 1:
        if fault == "exit":
            os._exit(0)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)
    t0 = time.perf_counter()
    try:
        with ah.longrun.peer_guard("all_reduce of the gradients"):
            torch.distributed.all_reduce(t)
    except ah.longrun.PeerFailure as e:
        (out / "rank0.json").write_text(json.dumps({"error": str(e), "seconds": time.perf_counter() - t0}))
        os._exit(3)
    (out / "rank0.json").write_text(json.dumps({"error": None, "seconds": time.perf_counter() - t0}))


def main() -> None:
    """Parse the arguments and run."""
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--fault", choices=["exit", "hang", "kill"], default="exit")
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    peer(a.out, a.fault, a.timeout)


if __name__ == "__main__":
    main()
