"""`python -m accelhelpers bench fullbatch`: chapter 02's loops side by side in one process.

JSON schema ("accel-course/bench-fullbatch/2"):
  created            ISO date and time of the run
  hardware           the hardware report (accelhelpers.device.hardware_report)
  load               the 1-minute load average before and after the run (other processes' CPU use)
  rounds, round_s    interleaved rounds (every variant once per round, in order) and seconds per variant-round
  workload           {"model": "udlbook MLP 4x63", "sizes": [...], "batch": 4000, "lr": 0.0025,
                      "train_flops_per_model_step": int}
  peak_gflops        measured fp32 matmul peak of this device (GFLOP/s; the best round of a 1024^2 matmul timed
                     in the interleaved rounds on a CPU, 8192^2 on a GPU, unless given)
  variants           one object per loop, in ablation order, with
      name, description     short id and what changed
      n_models              models trained by one step
      steps_per_s           training steps per second: the MEDIAN over the rounds (one step trains n_models models)
      steps_per_s_range     [lowest, highest] round
      model_steps_per_s     steps_per_s * n_models
      gflops                model_steps_per_s * train FLOPs per model step / 1e9 (training FLOPs only)
      fraction_of_peak      gflops / peak_gflops
      speedup_vs_naive      median over the rounds of (this row / the naive row, same round): a ratio inside one
                            process, so a burst of load elsewhere hits both sides of it alike
      speedup_range         [lowest, highest] of those per-round ratios
      original_experiment_h projected hours for udlbook's 1.1 million model-epochs at this rate
      warmup_s              seconds of the untimed warm-up (includes torch.compile's compile time)
      timed_steps           steps timed over all rounds (--steps per round, or as many as fill round_s)
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from . import train
from .course import CommandError
from .data import Split, mnist1d
from .device import best_device, hardware_report, sync
from .models import udl_mlp, udl_sizes
from .results import atomic_write_text
from .timing import hours, interleaved, load_average, mlp_flops

SCHEMA = "accel-course/bench-fullbatch/2"
ORIGINAL_MODEL_EPOCHS = 3 * 200_000 + 500_000  # udlbook: depths 2-4 for 200k epochs, depth 1 for 500k
DEPTH, LR = 4, 0.0025
WARMUP_STEPS = 5


@dataclass
class Variant:
    """One loop of the comparison: `make()` builds it, returning a function that trains n epochs."""

    name: str
    description: str
    n_models: int
    make: Callable[[], Callable[[int], object]]


def _fastai_runner(data: Split) -> Callable[[int], object]:
    """fastai's Learner.fit on the full-batch workload, without progress bars or logging."""
    learn = train.fastai_learner(udl_mlp(DEPTH, seed=0).to(data.device), data, LR)

    def fit(n: int) -> None:
        with learn.no_bar(), learn.no_logging():
            learn.fit(n, LR)
    return fit


def variants(data: Split, n_models: int = 8, compile: bool = True) -> list[Variant]:
    """The ablation, in order: each row changes one thing relative to the row before it (fastai aside;
    'fullgraph' changes how the step is written, as one function, and 'many' builds on 'padded', without
    compile)."""
    m = lambda: udl_mlp(DEPTH, seed=0).to(data.device)  # noqa: E731
    loop = train.FullBatchLoop
    rows = [
        Variant("naive", "udlbook's loop as written: DataLoader (bs 4000, in order), train error of the step's own "
                "forward pass into NumPy each epoch", 1, lambda: lambda n: train.udlbook_loop(m(), data, n, LR)),
        Variant("naive+eval", "naive + shuffle and a full-set and a test forward pass every epoch (common, not "
                "udlbook's)", 1, lambda: lambda n: train.naive_fullbatch(m(), data, n, LR)),
        Variant("fastai", "fastai Learner.fit, one batch of 4000, SGD", 1, lambda: _fastai_runner(data)),
        Variant("tensors", "device tensors, no DataLoader; still a host sync per epoch", 1,
                lambda: loop(m(), data, LR, host_sync=True, fused=False).run),
        Variant("no_sync", "+ metrics kept on the device, read once at the end", 1,
                lambda: loop(m(), data, LR, fused=False).run),
        Variant("fast", "+ zero_grad(set_to_none=True), foreach SGD", 1, lambda: loop(m(), data, LR).run),
        Variant("padded", "+ hidden widths padded 63 -> 64 with zero units (same model)", 1,
                lambda: loop(train.pad_mlp(m()), data, LR).run),
    ]
    if compile:
        rows.append(Variant("compiled", "+ torch.compile of the whole step", 1,
                            lambda: loop(train.pad_mlp(m()), data, LR, compile=True).run))
        rows.append(Variant("fullgraph", "+ the step as one graph (torch.func), logits laid out [classes, batch]", 1,
                            lambda: train.FullGraphLoop(train.pad_mlp(m()), data, LR).run))
        rows.append(Variant("test/100", "+ the test error every 100 epochs, not every step (udlbook measures none)",
                            1, lambda: train.FullGraphLoop(train.pad_mlp(m()), data, LR, test_every=100).run))
    models = lambda: [train.pad_mlp(udl_mlp(DEPTH, seed=i)) for i in range(n_models)]  # noqa: E731
    rows.append(Variant("many", f"padded, {n_models} models in one step (batched matmuls)", n_models,
                        lambda: train.ManyModelsLoop(models(), data, LR).run))
    return rows


def prepare(variant: Variant, device: torch.device, steps: int | None, round_s: float
            ) -> tuple[Callable[[], object], float, int]:
    """Build one variant and warm it up (this is where torch.compile compiles); return (one call of `steps` steps,
    warm-up seconds, steps per call): `steps`, or about half a round's worth, timed after the warm-up (the
    interleaved timer then repeats the call until a round lasts `round_s`)."""
    t0 = time.perf_counter()
    run = variant.make()
    run(WARMUP_STEPS)
    sync(device)
    warm = time.perf_counter() - t0
    if steps is None:
        t0 = time.perf_counter()
        run(WARMUP_STEPS)
        sync(device)
        per_step = (time.perf_counter() - t0) / WARMUP_STEPS
        steps = int(min(1_000_000, max(1, round_s / 2 / per_step)))
    return partial(run, steps), warm, steps


PEAK = "peak matmul"  # the peak's key among the interleaved functions (never a variant's name)


def run_fullbatch(steps: int | None = None, n_models: int = 8, compile: bool = True,
                  data: Split | None = None, peak_gflops: float | None = None, seconds: float | None = None,
                  rounds: int = 5, progress: bool = True, round_s: float | None = None) -> dict[str, Any]:
    """Measure every variant in one process, `rounds` interleaved rounds (ah.timing.interleaved) of `round_s`
    seconds each (default 1 s; or `seconds` per variant in all), on `data`'s device (else the best one), and
    return the JSON-ready result (see the module docstring)."""
    for flag, value in (("--steps", 1 if steps is None else steps), ("--models", n_models), ("--rounds", rounds)):
        if value < 1:
            raise CommandError(f"{flag} must be at least 1, got {value}")
    if round_s is not None and not round_s > 0:
        raise CommandError(f"--round-s must be positive, got {round_s}")
    round_s = round_s or (seconds / rounds if seconds else 1.0)
    data = data if data is not None else mnist1d(best_device())
    dev = data.device
    flops = mlp_flops(udl_sizes(DEPTH), len(data.x_train))
    from tqdm.auto import tqdm

    load_before = load_average()
    vs = variants(data, n_models, compile)
    prepared = {v.name: prepare(v, dev, steps, round_s) for v in tqdm(vs, desc="bench: warm-up", unit="variant",
                                                                       disable=not progress)}
    fns = {name: fn for name, (fn, _, _) in prepared.items()}
    if not peak_gflops:  # one fp32 n x n matmul (1024 on a CPU, 8192 on an accelerator), timed in the rounds
        n = 1024 if dev.type == "cpu" else 8192
        a, b, mm = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev), torch.empty(n, n, device=dev)
        fns[PEAK], peak_flops = (lambda: torch.mm(a, b, out=mm)), 2 * n**3
    # Rounds interleave the variants (and the peak), so a burst of load elsewhere hits all of them alike.
    timings = interleaved(fns, dev, rounds=rounds, min_time=0.0 if steps else round_s)
    peak = peak_gflops or peak_flops / timings[PEAK].best / 1e9
    rates = {name: [n / t for t in timings[name].times] for name, (_, _, n) in prepared.items()}
    naive = rates[vs[0].name]
    rows = [_row(v, prepared[v.name][1], prepared[v.name][2] * timings[v.name].calls_per_repeat * rounds,
                 rates[v.name], naive, flops, peak) for v in vs]
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "hardware": hardware_report(),
            "load": {"before": load_before, "after": load_average()}, "rounds": rounds, "round_s": round_s,
            "workload": {"model": "udlbook MLP 4x63", "sizes": udl_sizes(DEPTH), "batch": len(data.x_train),
                         "lr": LR, "train_flops_per_model_step": flops},
            "peak_gflops": peak, "variants": rows}


def _row(v: Variant, warm: float, timed_steps: int, rates: list[float], naive: list[float], flops: int,
         peak: float) -> dict[str, Any]:
    """One row from its per-round rates: medians, ranges, and ratios to the naive row's rate of the same round."""
    sps = statistics.median(rates)
    ratios = [r * v.n_models / b for r, b in zip(rates, naive)]
    msps = sps * v.n_models
    gf = msps * flops / 1e9
    return {"name": v.name, "description": v.description, "n_models": v.n_models, "steps_per_s": sps,
            "steps_per_s_range": (min(rates), max(rates)), "model_steps_per_s": msps, "gflops": gf,
            "fraction_of_peak": gf / peak, "speedup_vs_naive": statistics.median(ratios),
            "speedup_range": (min(ratios), max(ratios)), "original_experiment_h": ORIGINAL_MODEL_EPOCHS / msps / 3600,
            "warmup_s": warm, "timed_steps": timed_steps}


def table(result: dict[str, Any]) -> str:
    """The benchmark as a fixed-width text table: medians over the rounds, with the range of the ratio."""
    head = (f"{'variant':10} {'models':>6} {'steps/s':>9} {'(range)':>13} {'model-steps/s':>13} {'GFLOP/s':>8} "
            f"{'of peak':>8} {'vs naive':>8} {'(range)':>13} {'udlbook run':>12}")
    lines = [head, "-" * len(head)]
    for r in result["variants"]:
        lo, hi = r["steps_per_s_range"]
        rlo, rhi = r["speedup_range"]
        lines.append(f"{r['name']:10} {r['n_models']:6d} {r['steps_per_s']:9.1f} {f'{lo:.0f}-{hi:.0f}':>13} "
                     f"{r['model_steps_per_s']:13.1f} {r['gflops']:8.1f} {r['fraction_of_peak']:8.1%} "
                     f"{r['speedup_vs_naive']:7.1f}x {f'{rlo:.1f}-{rhi:.1f}x':>13} "
                     f"{hours(r['original_experiment_h']):>12}")
    lines.append(f"medians of {result.get('rounds', '?')} interleaved rounds of {result.get('round_s', 0):.1f} s per "
                 f"variant (ranges: lowest-highest round); load average {result.get('load', {}).get('before')} "
                 f"before, {result.get('load', {}).get('after')} after")
    lines.append(f"peak (measured fp32 matmul): {result['peak_gflops']:.1f} GFLOP/s; training FLOPs per model "
                 f"step: {result['workload']['train_flops_per_model_step'] / 1e6:.1f} M")
    return "\n".join(lines)


def main(args: Any) -> int:
    """CLI entry: run the benchmark, print the table, write JSON if asked."""
    if args.json is not None and args.json.exists() and args.json.is_dir():
        raise CommandError(f"--json {args.json} is a folder: give a file path such as build/bench.json")
    result = run_fullbatch(steps=args.steps, n_models=args.models or 8, rounds=args.rounds, round_s=args.round_s)
    print(table(result))
    if args.json is not None:
        atomic_write_text(Path(args.json), json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0
