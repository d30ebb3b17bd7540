"""`python -m accelhelpers bench fullbatch`: chapter 02's ablation (accelhelpers.fullbatch, exported from the
chapter's cells) in a process of its own, with torch's default thread count.

JSON schema ("accel-course/bench-fullbatch/3"):
  created            ISO date and time of the run
  hardware           the hardware report (accelhelpers.device.hardware_report)
  load               the 1-minute load average before and after the run (other processes' CPU use)
  threads            torch's thread count the rows (and the peak) ran at
  rounds, round_s    interleaved rounds (every variant once per round, in order) and seconds per variant-round
  min_steps          fewest steps a variant runs in one round
  workload           {"model": "udlbook MLP 4x63", "sizes": [...], "batch": 4000, "lr": 0.0025,
                      "train_flops_per_model_step": int}
  peak_gflops        measured fp32 matmul peak of this device at `threads` (GFLOP/s; the best repeat of a 1024^2
                     matmul on a CPU, 8192^2 on a GPU)
  peak_gflops_bf16   the same for a bf16 matmul, where a bf16 row ran (else null)
  variants           one object per loop, in ablation order, with
      name, description     short id and what changed
      n_models              models trained by one step
      steps_per_s           training steps per second: the MEDIAN over the rounds (one step trains n_models models)
      steps_per_s_range     [lowest, highest] round
      model_steps_per_s     steps_per_s * n_models
      gflops                model_steps_per_s * train FLOPs per model step / 1e9 (training FLOPs only)
      precision             fp32, or bf16 for the row under bf16 autocast
      fraction_of_peak      gflops / the peak of the row's precision
      speedup_vs_naive      median over the rounds of (this row / the naive row, same round): a ratio inside one
                            process, so a burst of load elsewhere hits both sides of it alike
      speedup_range         [lowest, highest] of those per-round ratios
      original_experiment_h projected hours for udlbook's 1.1 million model-epochs at this rate
      warmup_s              seconds of the untimed warm-up (includes torch.compile's compile time)
      steps_per_round       steps in each round (at least min_steps, or as many as fill round_s)
      full_collections      the garbage collector's full (generation-2) passes during the variant's rounds
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import fullbatch
from ..data import mnist1d
from ..device import best_device
from . import CommandError


def main(args: Any) -> int:
    """CLI entry: check the flags, run the ablation, print the table, write JSON if asked."""
    for flag, value in (("--models", args.models or 8), ("--rounds", args.rounds), ("--min-steps", args.min_steps)):
        if value < 1:
            raise CommandError(f"{flag} must be at least 1, got {value}")
    if args.round_s is not None and not args.round_s > 0:
        raise CommandError(f"--round-s must be positive, got {args.round_s}")
    if args.json is not None and args.json.exists() and args.json.is_dir():
        raise CommandError(f"--json {args.json} is a folder: give a file path such as build/bench.json")
    result = fullbatch.run_fullbatch(mnist1d(best_device()), n_models=args.models or 8, rounds=args.rounds,
                                     round_s=args.round_s or 1.0, min_steps=args.min_steps)
    print(fullbatch.table(result))
    if args.json is not None:
        from ..results import atomic_write_text

        atomic_write_text(Path(args.json), json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0
