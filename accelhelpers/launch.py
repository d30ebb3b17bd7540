"""Starting processes from a notebook: free ports, torchrun command lines (a module's worker or a script), output
streamed into the cell as it arrives, and a deadline that kills the whole process group, so a stuck rank never
hangs the kernel. `parallel` (chapter 06) and `xla` (chapter 07) launch through here; so can tests."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import cells

# every child: accelerate kept off XLA, output unbuffered, one torch thread per process (ranks share the cores)
ENV = {"USE_TORCH_XLA": "0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@dataclass
class Completed:
    """What a launch returned: exit status (None when stopped at a marker or the deadline), output, wall time."""

    returncode: int | None
    output: str
    seconds: float


# gloo's connection log, one line per rank: "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected
# peer ranks is : 1". With unbuffered output (ENV) each rank writes it in pieces, so two ranks' pieces can interleave
# and split across lines ("[Gloo] Rank [Gloo] Rank 0 is connected ...", then "1 is connected ..."). It is kept in
# Completed.output; what `echo` shows is the output without it (GlooFilter).
GLOO_CONNECTED = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                            r"Expected number of connected peer ranks is : \d+")
GLOO_PIECE = re.compile(r"\[Gloo\] Rank |is connected to|peer ranks\.|Expected number of connected peer ranks is :")


class GlooFilter:
    """What to echo of a child's output, line by line: the line without gloo's connection log, or None when nothing
    else is left. The pieces of a message split across lines leave bare numbers and newlines behind; in the few
    lines after a piece, a leading number before a log line ("1[rank0] ...") and an empty line are dropped too."""

    def __init__(self) -> None:
        self.tail = 0  # lines left in which the rest of a split message may still turn up

    def __call__(self, line: str) -> str | None:
        if GLOO_PIECE.search(line):
            line = GLOO_PIECE.sub("", GLOO_CONNECTED.sub("", line))
            self.tail = 3
        elif self.tail:
            self.tail -= 1
            line = re.sub(r"^\d+(?=\[|\s*$)", "", line)
        else:
            return line
        if not line.strip(" \t\r\n0123456789"):
            return None
        return line if line.endswith("\n") else line + "\n"


def free_port() -> int:
    """A TCP port nobody listens on now (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_target(target: str | Path) -> list[str]:
    """How Python runs `target`: a script path (ending in .py) as itself, anything else as `-m module`."""
    return [str(target)] if str(target).endswith(".py") else ["-m", str(target)]


def torchrun_cmd(target: str | Path, *args: object, nproc: int = 2, nnodes: int = 1, node_rank: int = 0,
                 rdzv_endpoint: str | None = None, max_restarts: int = 0) -> list[str]:
    """The torchrun command line that starts `target` (a module or a .py script) on `nproc` processes per node."""
    if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes or max_restarts < 0:
        raise ValueError(f"need nproc >= 1, nnodes >= 1, 0 <= node_rank < nnodes and max_restarts >= 0, got "
                         f"nproc={nproc}, nnodes={nnodes}, node_rank={node_rank}, max_restarts={max_restarts}")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("several nodes need rdzv_endpoint='HOST:PORT' (the same on every node)")
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv_endpoint}", "--rdzv-id=accel-course"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    return cmd + python_target(target) + [str(a) for a in args]


def start(cmd: list[str], env: dict[str, str | None] | None = None) -> subprocess.Popen:
    """Start `cmd` in its own process group, output merged, with `env` over os.environ and ENV (None: unset). From a
    Jupyter kernel, the process also gets the export cells the kernel has run (`cells.launch_env`): a worker that
    imports accelhelpers runs the chapter's cells as the learner left them."""
    merged = {**os.environ, **ENV, **cells.launch_env(), **(env or {})}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={k: v for k, v in merged.items() if v is not None}, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`'s whole process group (torchrun's ranks included) and reap it; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def read_lines(proc: subprocess.Popen, deadline: float, echo: bool = False,
               stop_on: str | None = None) -> tuple[list[str], str]:
    """A started child's output lines (`deadline`: a `time.monotonic()` time) until its output ends ('eof'), a line
    holds `stop_on` ('marker': the rest of the output is left unread, for the caller) or the deadline passes
    ('deadline'); `echo` prints each line as it arrives. The one reader of a child's output against a deadline: `finish`
    and chapter 09's `wait_for` use it."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:  # a thread, so that this reader can keep the deadline
        for line in iter(proc.stdout.readline, ""):
            lines.put(line)
            if stop_on and stop_on in line:
                return  # the marker: what follows is the caller's to read
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    out: list[str] = []
    visible = GlooFilter()
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            return out, "deadline"
        if line is None:
            return out, "eof"
        out.append(line)
        shown = visible(line)
        if echo and shown is not None:
            print(shown, end="", flush=True)
        if stop_on and stop_on in line:
            return out, "marker"
        if time.monotonic() > deadline:
            return out, "deadline"


def finish(proc: subprocess.Popen, timeout_s: float = 120.0, echo: bool = True, check: bool = True,
           stop_on: str | None = None, stop_ok: bool = False) -> Completed:
    """Stream a child's output to its exit; kill its group at a `stop_on` line (returncode None) or past
    `timeout_s` (TimeoutError, or returncode None with `stop_ok`); a nonzero exit with `check`: RuntimeError."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    t0 = time.monotonic()
    out, why = read_lines(proc, t0 + timeout_s, echo, stop_on)
    if why == "eof":
        try:
            proc.wait(timeout=max(t0 + timeout_s - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:  # closed its output but kept running
            why = "deadline"
    if why != "eof":
        kill(proc)
    run = Completed(proc.returncode if why == "eof" else None, "".join(out), time.monotonic() - t0)
    if why == "deadline" and not stop_ok:
        name = " ".join(map(str, proc.args[1:6])) if isinstance(proc.args, list) else str(proc.args)
        raise TimeoutError(f"{name}... ran past {timeout_s} s and was killed (a rank is stuck or the machine is "
                           f"overloaded); last output:\n{run.output[-2000:]}")
    if check and run.returncode not in (0, None):
        raise RuntimeError(f"command failed with exit status {run.returncode}; last output:\n{run.output[-3000:]}")
    return run


def launch(cmd: list[str], timeout_s: float = 120.0, echo: bool = True, check: bool = True,
           env: dict[str, str | None] | None = None, stop_on: str | None = None, stop_ok: bool = False) -> Completed:
    """Run `cmd` (e.g. torchrun_cmd(...)) to the end, printing its output as it arrives (see `finish`)."""
    if timeout_s <= 0:  # before anything starts
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    return finish(start(cmd, env), timeout_s, echo, check, stop_on, stop_ok)
