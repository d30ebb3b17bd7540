"""`python -m accelhelpers reproduce udlbook-20.2`: udlbook's figure 20.2 in full, resumable, recorded.

The experiment (Prince, *Understanding Deep Learning*, notebook 20.2): four MLPs with 1-4 hidden layers of
298/100/75/63 units (about 15 200 parameters each) trained by full-batch SGD (lr 0.0025, batch = all 4000
MNIST-1D training examples) for 500 000 epochs (1 hidden layer) and 200 000 epochs (2-4 hidden layers).

How it runs: each depth on the fast path (`fullbatch.FullGraphLoop`: one compiled graph per step; depth 4's
hidden widths padded 63 -> 64 with zero units, which changes nothing but speed, see udlbook.PAD). The training error of
EVERY epoch comes from the step's own forward pass (before that step's update, as udlbook records it); the
test error is measured every TEST_EVERY epochs (after that epoch's update). `--jobs N` trains the depths in N
worker processes of one thread each (a tiny model with 2 threads slows 10-100x when another process loads the
CPU).

Files in --out:
  ckpt_depth{d}.pt            atomic checkpoint of one depth (longrun.save_checkpoint) every few minutes and
                              at the end: weights, step, errors so far, seconds, settings
  progress_depth{d}.json      epochs done, for the --jobs parent's progress bar
  udlbook-20.2.json           the result (schema below), written last: its presence marks a completed run
  udlbook-20.2.png            % training error against epoch for the four depths, log x axis
  udlbook-20.2_wrong.npz      per depth, the number of misclassified training examples at every epoch (uint16)

JSON schema ("accel-course/reproduce-udlbook-20.2/1"): schema, experiment, created, started (ISO times),
wall_s (first start to end, interruptions included), hardware, settings {lr, batch, test_every, threads,
compile, jobs, epochs_scale, dataset}, depths: list of {depth, hidden, sizes, params, epochs, seed,
final_train_err (last epoch, %), final_test_err (after the last update, %), min_train_err, first_zero_epoch
(first epoch with 0 % training error, or null), train_s (seconds spent training it, all sessions), sessions,
steps_per_s, curve {epochs, train_err} (a log-spaced grid of 1-based epochs), test {epochs, test_err}}.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import fullbatch, longrun, metrics
from ..data import Split, mnist1d
from ..device import Hardware, cpu_requested, hardware_report, machine_line
from ..models import count_params, udl_mlp, udl_sizes
from ..results import atomic_write_bytes, atomic_write_text
from ..udlbook import EPOCHS, EXPERIMENT, LR, SCHEMA, TEST_EVERY, _paths, figure, model_for
from . import CommandError

CHECKPOINT_S = 180.0
GRID_POINTS = 1500
# Relative seconds per step of each depth at 1 thread on a 2-core AMD EPYC (bf16: 2026-12-01, medians of 5 rounds of
# 400 steps, 250/303/304/311 steps/s for depths 1-4): balances --jobs.
STEP_COST = {"fp32": {1: 1.0, 2: 1.0, 3: 1.25, 4: 1.2}, "bf16": {1: 1.0, 2: 0.82, 3: 0.82, 4: 0.8}}
PRECISIONS = ("fp32", "bf16")


@dataclass
class Settings:
    """How one run trains: what a resumed run must repeat exactly to give the same bits."""

    epochs_scale: float = 1.0
    test_every: int = TEST_EVERY
    threads: int | None = None
    compile: bool = True
    precision: str = "fp32"  # bf16: autocast to bfloat16 where it pays, weights and their updates stay fp32

    def autocast(self, device: torch.device) -> Any:
        """The context the steps run in: bf16 autocast, or nothing for fp32."""
        if self.precision == "fp32":
            return nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def epochs(self, depth: int) -> int:
        """udlbook's length for `depth`, scaled (at least 1 epoch)."""
        return max(1, round(EPOCHS[depth] * self.epochs_scale))


def _ckpt(out: Path, depth: int) -> Path:
    """The checkpoint file of one depth."""
    return out / f"ckpt_depth{depth}.pt"


def _lock(out: Path, depth: int) -> Path:
    """Claim one depth for this process (a pid file); refuse when a live process holds it."""
    path = out / f".lock_depth{depth}"
    if path.exists():
        try:
            pid = int(path.read_text().strip() or 0)
        except ValueError:
            pid = 0
        if pid and pid != os.getpid() and _alive(pid):
            raise CommandError(f"depth {depth} in {out} is being trained by process {pid}: wait for it or stop it "
                             f"(kill -INT {pid}), then --resume")
    atomic_write_text(path, str(os.getpid()))
    return path


def _alive(pid: int) -> bool:
    """Whether a process with this id exists and (where /proc says) is a `reproduce` run, not a reused id."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return b"reproduce" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def _state(out: Path, depth: int, settings: Settings) -> dict[str, Any] | None:
    """The saved state of one depth (None if it has not started); refuses one made with other settings."""
    path = _ckpt(out, depth)
    if not path.exists():
        return None
    st = longrun.read_checkpoint(path)
    saved = st["extra"]["settings"]
    mine = {"epochs": (settings.epochs(depth), "--epochs-scale"), "test_every": (settings.test_every, "--test-every"),
            "compile": (settings.compile, "--no-compile"), "threads": (settings.threads, "--threads"),
            "device": (_device().type, "a machine with the same kind of device"),
            "precision": (settings.precision, "--precision")}
    for key, (value, flag) in mine.items():
        was = saved.get(key, "fp32" if key == "precision" else "cpu")  # runs recorded before --precision: fp32
        if was != value:
            raise CommandError(f"depth {depth} in {out} was started with {key}={was}, not {value}: resume "
                             f"with the same {flag} (another value changes the arithmetic and so the result)")
    return st


def train_depth(depth: int, out: Path, data: Split, settings: Settings, stop: longrun.Preemption, bar: Any,
                checkpoint_s: float) -> dict[str, Any]:
    """Train (or resume) one depth to its full length, checkpointing every `checkpoint_s` and when `stop` is
    requested (then KeyboardInterrupt); returns its state."""
    epochs, k = settings.epochs(depth), settings.test_every
    model = model_for(depth).to(data.device)
    wrong = torch.zeros(epochs, dtype=torch.int32)
    test_err = torch.full((epochs // k,), float("nan"))
    start, spent, sessions, started = 0, 0.0, 0, time.time()
    st = _state(out, depth, settings)
    if st is not None:
        model.load_state_dict(st["model"])
        ex = st["extra"]
        start, wrong, test_err = st["step"], ex["wrong"], ex["test_err"]
        spent, sessions, started = ex["train_s"], ex["sessions"], ex["started"]
    bar.update(start)
    if start >= epochs:
        return st
    loop = fullbatch.FullGraphLoop(model, data, LR, test_every=max(k, 2), compile=settings.compile)

    def save(step: int) -> dict[str, Any]:
        extra = {"wrong": wrong, "test_err": test_err, "train_s": spent + time.perf_counter() - t0,
                 "sessions": sessions + 1, "started": started,
                 "settings": {"epochs": epochs, "test_every": k, "compile": settings.compile,
                              "threads": settings.threads, "depth": depth, "device": data.device.type,
                              "precision": settings.precision}}
        longrun.save_checkpoint(_ckpt(out, depth), model, step=step, extra=extra)
        return {"step": step, "model": model.state_dict(), "extra": extra}

    t0 = last_save = last_note = time.perf_counter()
    x, y, n = data.x_train, data.y_train, len(data.y_train)
    e = start
    with settings.autocast(data.device):  # bf16: autocast in the compiled steps, fp32 weights and updates
        while e < epochs:
            end = min(epochs, (e // k + 1) * k)
            # clone: with CUDA graphs the next replay overwrites a step's outputs (a copy of 4 bytes elsewhere)
            errs = [loop.train_step(x, y)[1].clone() for _ in range(e, end)]
            wrong[e:end] = torch.round(torch.stack(errs) * (n / 100)).to(torch.int32).cpu()
            if end % k == 0:
                test_err[end // k - 1] = loop.test_error().cpu()
            bar.update(end - e)
            e = end
            now = time.perf_counter()
            if now - last_note > 5:
                atomic_write_text(out / f"progress_depth{depth}.json", json.dumps({"epoch": e, "epochs": epochs}))
                last_note = now
            if e < epochs and (stop.requested or now - last_save > checkpoint_s):
                save(e)
                last_save = now
                if stop.requested:
                    raise KeyboardInterrupt
    final = save(epochs)
    atomic_write_text(out / f"progress_depth{depth}.json", json.dumps({"epoch": epochs, "epochs": epochs}))
    return final


def _device() -> torch.device:
    """Where the fast path trains: a CUDA GPU if there is one (CUDA graphs) and ACCEL_DEVICE does not ask for the
    CPU, else the CPU (inductor's C++)."""
    return torch.device("cuda") if torch.cuda.is_available() and not cpu_requested() else torch.device("cpu")


def _grid(epochs: int, points: int = GRID_POINTS) -> np.ndarray:
    """About `points` log-spaced 1-based epochs from 1 to `epochs` (every epoch where they are dense)."""
    return np.unique(np.round(np.logspace(0, math.log10(epochs), points)).astype(np.int64).clip(1, epochs))


def summarize(depth: int, st: dict[str, Any], data: Split) -> dict[str, Any]:
    """One depth's JSON entry from its final state."""
    ex = st["extra"]
    n = len(data.y_train)
    err = ex["wrong"].numpy().astype(np.float64) * (100 / n)
    k, epochs = ex["settings"]["test_every"], ex["settings"]["epochs"]
    grid = _grid(epochs)
    zero = np.flatnonzero(ex["wrong"].numpy() == 0)
    model = model_for(depth)
    model.load_state_dict(st["model"])
    with torch.no_grad():
        final_test = float(metrics.error_percent(model(data.x_test), data.y_test))
    test = ex["test_err"].numpy()
    return {"depth": depth, "hidden": udl_sizes(depth)[1], "sizes": udl_sizes(depth),
            "params": count_params(udl_mlp(depth)), "epochs": epochs, "seed": depth,
            "final_train_err": round(float(err[-1]), 3), "final_test_err": round(final_test, 3),
            "min_train_err": round(float(err.min()), 3),
            "first_zero_epoch": int(zero[0]) + 1 if len(zero) else None,
            "train_s": round(float(ex["train_s"]), 1), "sessions": int(ex["sessions"]),
            "steps_per_s": round(epochs / float(ex["train_s"]), 1),
            "curve": {"epochs": grid.tolist(), "train_err": [round(float(v), 3) for v in err[grid - 1]]},
            "test": {"epochs": list(range(k, k * len(test) + 1, k)),
                     "test_err": [round(float(v), 3) for v in test]}}


def write_outputs(out: Path, states: dict[int, dict[str, Any]], data: Split, settings: Settings,
                  jobs: int) -> dict[str, Any]:
    """Write the NPZ, the figure and finally the JSON (which marks the run complete); returns the result."""
    import io

    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    depths = [summarize(d, states[d], data) for d in sorted(states)]
    started = min(float(states[d]["extra"]["started"]) for d in states)
    hw = hardware_report()
    result = {"schema": SCHEMA, "experiment": EXPERIMENT, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
              "wall_s": round(time.time() - started, 1), "hardware": hw,
              "settings": {"lr": LR, "batch": len(data.y_train), "test_every": settings.test_every,
                           "threads": settings.threads, "compile": settings.compile, "jobs": jobs,
                           "precision": settings.precision,
                           "epochs_scale": settings.epochs_scale, "dataset": "MNIST-1D (mnist1d defaults, seed 42)",
                           "train_err": "every epoch, from the step's own forward pass (before its update)"},
              "depths": depths}
    paths = _paths(out)
    buf = io.BytesIO()
    np.savez_compressed(buf, **{f"depth{d}": states[d]["extra"]["wrong"].numpy().astype(np.uint16) for d in states})
    atomic_write_bytes(paths["npz"], buf.getvalue())
    ax = figure(result)
    ax.set_title(f"udlbook fig. 20.2 reproduced: full-batch SGD on MNIST-1D\n"
                 f"{machine_line(hw)}, {result['created'][:10]}, wall time {result['wall_s'] / 60:.0f} min", fontsize=9)
    buf = io.BytesIO()
    ax.figure.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(ax.figure)
    atomic_write_bytes(paths["png"], buf.getvalue())
    atomic_write_text(paths["json"], json.dumps(result, indent=1))
    return result


def _groups(depths: list[int], jobs: int, settings: Settings) -> list[list[int]]:
    """Split the depths over `jobs` workers, longest first onto the least loaded (balanced by epochs x STEP_COST)."""
    groups: list[list[int]] = [[] for _ in range(min(jobs, len(depths)))]
    load = [0.0] * len(groups)
    cost = STEP_COST[settings.precision]
    for d in sorted(depths, key=lambda d: -settings.epochs(d) * cost[d]):
        i = load.index(min(load))
        groups[i].append(d)
        load[i] += settings.epochs(d) * cost[d]
    return [sorted(g) for g in groups]


def _worker_cmd(out: Path, depths: list[int], settings: Settings, checkpoint_s: float) -> list[str]:
    """The command line of one worker process."""
    cmd = [sys.executable, "-m", "accelhelpers", "reproduce", EXPERIMENT, "--out", str(out), "--resume",
           "--worker", "--depths", ",".join(map(str, depths)), "--threads", str(settings.threads or 1),
           "--epochs-scale", repr(settings.epochs_scale), "--test-every", str(settings.test_every),
           "--checkpoint-every", repr(checkpoint_s), "--precision", settings.precision]
    return cmd + ([] if settings.compile else ["--no-compile"])


class WorkerFailed(RuntimeError):
    """A worker process of `--jobs N` exited with an error (printed above by the worker itself)."""


def _run_jobs(out: Path, depths: list[int], settings: Settings, jobs: int, checkpoint_s: float,
              stop: longrun.Preemption) -> None:
    """Train the depths in `jobs` worker processes (one thread each) and show one progress bar for all."""
    env = dict(os.environ, TQDM_DISABLE="1", OMP_NUM_THREADS=str(settings.threads or 1))
    procs = [subprocess.Popen(_worker_cmd(out, g, settings, checkpoint_s), env=env)
             for g in _groups(depths, jobs, settings)]
    bar = _bar(sum(settings.epochs(d) for d in depths), f"{EXPERIMENT} ({len(procs)} processes)")
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(2)
            bar.update(max(0, sum(_progress_of(out, d) for d in depths) - bar.n))
            if stop.requested:  # a kill or Ctrl-C reached this process: make sure the workers heard it too
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGINT)
                for p in procs:
                    p.wait()
                raise KeyboardInterrupt
    finally:
        bar.close()
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise WorkerFailed(f"a worker process failed (exit {bad[0]}); its error is printed above; fix it and --resume")


def _progress_of(out: Path, depth: int) -> int:
    """Epochs done by one depth, as its worker last wrote them (0 if unknown)."""
    try:
        return int(json.loads((out / f"progress_depth{depth}.json").read_text())["epoch"])
    except (OSError, ValueError, KeyError):
        return 0


def run(out: Path, resume: bool = False, settings: Settings | None = None, depths: list[int] | None = None,
        jobs: int = 1, worker: bool = False, checkpoint_s: float = CHECKPOINT_S) -> dict[str, Any] | None:
    """Run (or resume) the whole experiment into `out`; returns the result (None for a worker process)."""
    settings = settings or Settings()
    depths = sorted(set(depths or EPOCHS))
    _check_args(out, resume, settings, depths, jobs, worker)
    out.mkdir(parents=True, exist_ok=True)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    # Ctrl-C and kill (TERM) set a flag that training reads between chunks, so it saves a consistent checkpoint
    with longrun.Preemption((signal.SIGINT, signal.SIGTERM)) as stop:
        if jobs > 1:
            _run_jobs(out, depths, settings, jobs, checkpoint_s, stop)
        else:
            _train_here(out, depths, settings, checkpoint_s, stop)
    if worker:
        return None
    data = mnist1d("cpu")
    states = {d: _state(out, d, settings) for d in EPOCHS}
    missing = [d for d, st in states.items() if st is None or st["step"] < settings.epochs(d)]
    if missing:
        print(f"depths {missing} are not trained yet in {out}: run them with --resume --depths "
              f"{','.join(map(str, missing))}", file=sys.stderr)
        return None
    return write_outputs(out, states, data, settings, jobs)


def _train_here(out: Path, depths: list[int], settings: Settings, checkpoint_s: float,
                stop: longrun.Preemption) -> None:
    """Train `depths` one after another in this process, with one progress bar and ETA for all of them."""
    data = mnist1d(_device())
    locks = [_lock(out, d) for d in depths]
    bar = _bar(sum(settings.epochs(d) for d in depths), f"{EXPERIMENT} depths {','.join(map(str, depths))}")
    try:
        for d in depths:
            train_depth(d, out, data, settings, stop, bar, checkpoint_s)
    finally:
        bar.close()
        for lock in locks:
            lock.unlink(missing_ok=True)


def _bar(total: int, desc: str) -> Any:
    """A progress bar with an ETA over `total` epochs (tqdm: redrawn every 2 s in a terminal, 30 s in a log file;
    TQDM_DISABLE=1 silences it)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="epoch", unit_scale=True, mininterval=2 if sys.stderr.isatty() else 30)


def _check_args(out: Path, resume: bool, settings: Settings, depths: list[int], jobs: int, worker: bool) -> None:
    """Refuse settings and output folders that would give a wrong or overwritten run, with what to do."""
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out} is a file: give a folder such as build/udlbook-full")
    if not worker and _paths(out)["json"].exists():
        raise CommandError(f"{out} already holds a completed {EXPERIMENT} run: choose another --out or delete it")
    if not resume and any(_ckpt(out, d).exists() for d in EPOCHS):
        raise CommandError(f"{out} holds an unfinished run: add --resume to continue it, or choose another --out")
    if bad := [d for d in depths if d not in EPOCHS]:
        raise CommandError(f"--depths must be among 1,2,3,4, got {bad}")
    if not (0 < settings.epochs_scale <= 1):
        raise CommandError(f"--epochs-scale must be in (0, 1], got {settings.epochs_scale}")
    if settings.test_every < 1:
        raise CommandError(f"--test-every must be at least 1, got {settings.test_every}")
    if settings.threads is not None and settings.threads < 1:
        raise CommandError(f"--threads must be at least 1, got {settings.threads}")
    if jobs < 1:
        raise CommandError(f"--jobs must be at least 1, got {jobs}")
    if settings.precision not in PRECISIONS:
        raise CommandError(f"--precision must be one of {', '.join(PRECISIONS)}, got {settings.precision!r}")
    if settings.precision == "bf16" and _device().type == "cuda" and not Hardware.here("cuda").bf16_native:
        raise CommandError("this GPU has no bf16 (it needs compute capability 8.0 or newer): use --precision fp32")


def main(args: Any) -> int:
    """CLI entry: run or resume the experiment, print where the outputs are and the final errors."""
    threads = args.threads if args.threads is not None else (1 if args.jobs > 1 else None)
    settings = Settings(args.epochs_scale, args.test_every, threads, not args.no_compile, args.precision)
    try:
        result = run(args.out, args.resume, settings, args.depths, args.jobs, args.worker, args.checkpoint_every)
    except WorkerFailed as e:  # the worker printed its own traceback: one line here
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: progress is checkpointed in {args.out}; continue with the same command plus --resume",
              file=sys.stderr)
        return 130
    if result is None:
        return 0
    for d in result["depths"]:
        print(f"depth {d['depth']} ({d['hidden']} units): {d['epochs']} epochs, "
              f"train error {d['final_train_err']:.2f} %, test error {d['final_test_err']:.2f} %, "
              f"{d['train_s'] / 60:.1f} min ({d['steps_per_s']:.0f} steps/s)")
    print(f"wall time {result['wall_s'] / 60:.1f} min; wrote {', '.join(str(p) for p in _paths(args.out).values())}")
    return 0
