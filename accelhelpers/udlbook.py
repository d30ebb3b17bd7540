"""udlbook's experiment 20.2 as the course records it: each depth's model as the full run trains it, and readers
of recorded runs under results/udlbook-20.2_*.

The experiment (Prince, *Understanding Deep Learning*, notebook 20.2): four MLPs with 1-4 hidden layers of
298/100/75/63 units (about 15 200 parameters each) trained by full-batch SGD (lr 0.0025, batch = all 4000
MNIST-1D training examples) for 500 000 epochs (1 hidden layer) and 200 000 epochs (2-4 hidden layers).
`python -m accelhelpers reproduce udlbook-20.2` runs it in full and writes the files read here (its module
docstring gives their layout and the JSON schema); chapter 02 reads the committed runs through this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import device, fullbatch, models, results

EXPERIMENT = "udlbook-20.2"
SCHEMA = "accel-course/reproduce-udlbook-20.2/1"
EPOCHS = {1: 500_000, 2: 200_000, 3: 200_000, 4: 200_000}
LR = 0.0025
TEST_EVERY = 100
# Hidden widths rounded up to a multiple of PAD[d] with zero units (fullbatch.pad_mlp: same model, other speed).
# Measured on 2-core AMD EPYC, 1 thread, medians of 5 interleaved rounds (steps/s): depth 1 (298) unpadded 232
# vs 304 wide 121; depth 2 (100) 225 vs 189; depth 3 (75) 178 vs 166; depth 4 (63) padded to 64 189 vs 148.
PAD = {1: 1, 2: 1, 3: 1, 4: 16}


class ResultError(ValueError):
    """A recorded run that is missing, damaged or of another kind; the message names the fix (the commands print
    it as one line)."""


def model_for(depth: int) -> torch.nn.Sequential:
    """udlbook's MLP of this depth, seeded with the depth, padded as PAD says."""
    return fullbatch.pad_mlp(models.udl_mlp(depth, seed=depth), PAD[depth])


def figure(result: dict[str, Any], ax: Any = None, label: str | None = None, **style: Any) -> Any:
    """udlbook figure 20.2's plot: % training error against epoch for each depth, log x axis; returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    for i, d in enumerate(result["depths"]):
        c = d["curve"]
        ax.plot(c["epochs"], c["train_err"], color=f"C{i}", lw=1.5, **style,
                label=f"{d['depth']} hidden layer{'s' * (d['depth'] > 1)} ({d['hidden']} units)"
                + (f", {label}" if label else ""))
    ax.set_xscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("% training error")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def _paths(out: Path) -> dict[str, Path]:
    """Where the run's outputs go."""
    return {"json": out / f"{EXPERIMENT}.json", "png": out / f"{EXPERIMENT}.png",
            "npz": out / f"{EXPERIMENT}_wrong.npz"}


def load_result(path: str | Path) -> dict[str, Any]:
    """A completed run's JSON (a folder holding udlbook-20.2.json, or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = _paths(path)["json"]
    if not path.exists():
        raise ResultError(f"no {EXPERIMENT} result at {path}: run `python -m accelhelpers reproduce {EXPERIMENT}`")
    result = results.read_json(path, f"run `python -m accelhelpers reproduce {EXPERIMENT}` into a new --out",
                               ResultError)
    if result.get("schema") != SCHEMA:
        raise ResultError(f"{path} is not a {EXPERIMENT} result (schema {result.get('schema')!r})")
    return result


def results_folder(precision: str = "fp32") -> str:
    """The name a run's folder under results/ starts with: udlbook-20.2_ (fp32), udlbook-20.2-bf16_ (bf16)."""
    return f"{EXPERIMENT}_" if precision == "fp32" else f"{EXPERIMENT}-{precision}_"


def recorded_runs(root: Path | None = None, precision: str = "fp32") -> list[tuple[dict[str, Any], Path]]:
    """Every committed full run in `precision`, results/udlbook-20.2[-bf16]_<hardware>_<date>/ in the checkout,
    oldest finished first."""
    root = root or results.repo_root()
    found = root.glob(f"results/{results_folder(precision)}*/{EXPERIMENT}.json") if root else []
    return sorted(((load_result(p), p.parent) for p in found), key=lambda run: run[0]["created"])


def recorded(root: Path | None = None, precision: str = "fp32") -> tuple[dict[str, Any], Path] | None:
    """The newest committed full run in `precision` (None if absent)."""
    runs = recorded_runs(root, precision)
    return runs[-1] if runs else None


def train_errors(folder: str | Path) -> dict[int, np.ndarray]:
    """Every epoch's % training error per depth of a completed run (from its _wrong.npz)."""
    folder = Path(folder)
    batch = load_result(folder)["settings"]["batch"]
    with np.load(_paths(folder)["npz"]) as f:
        return {int(k.removeprefix("depth")): f[k].astype(np.float64) * (100 / batch) for k in f.files}


def describe(result: dict[str, Any]) -> str:
    """Where and how a run ran, in one line: hardware, date, processes and threads, wall time."""
    s = result["settings"]
    return (f"{device.machine_line(result['hardware'])}, {result['created'][:10]}, {s.get('precision', 'fp32')}, "
            f"{s['jobs']} process(es) x {s['threads'] or 'default'} thread(s), "
            f"wall time {result['wall_s'] / 60:.0f} min")
