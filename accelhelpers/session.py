"""The setup every chapter starts with: seed, choose the device, announce the hardware and the profile."""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from . import device as devices
from . import results

T = TypeVar("T")


def progress(items: Iterable[T], desc: str | bool | None = None, **kw: Any) -> Iterable[T]:
    """`items` with a progress bar (tqdm.auto: a widget in Jupyter, text in a terminal) when `desc` is truthy,
    plain `items` otherwise; TQDM_DISABLE=1 silences every bar (`make test` sets it)."""
    if not desc or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes"):
        return items  # tqdm.notebook sets disable=False explicitly, so tqdm's own TQDM_DISABLE never reaches it
    from tqdm.auto import tqdm

    label = desc if isinstance(desc, str) else None
    return tqdm(items, desc=label, leave=False, mininterval=0.5, **kw)


@contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run the block with `n` CPU threads for torch (None: leave them as they are), then restore the count.
    Tiny models often run fastest on one thread: every op is too small to share, and on a busy machine each
    hand-off between threads waits for a core."""
    if n is not None and n < 1:
        raise ValueError(f"threads needs n >= 1 (or None), got {n}")
    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) so a run can be repeated."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def trust_cpu_flags() -> None:
    """Let torch.compile's CPU code generator take the vector instructions (AVX2, AVX-512) from the CPU's flags.
    Unset, Inductor's first compile in every process builds a test library per instruction set and loads each in a
    new Python to check it: seconds per process, paid again by every worker, torchrun rank and Slurm job. The
    variable (TORCHINDUCTOR_VEC_ISA_OK=1, read when Inductor's config is first imported) is inherited by every
    process started from here; one already set (to 0, say) is left alone."""
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")


@dataclass
class Setup:
    """What a chapter needs to know about where it runs."""

    chapter: str
    device: torch.device
    profile: str
    report: dict

    @property
    def quick(self) -> bool:
        """True in the quick (CPU, minutes) profile. The smoke profile is not quick: it takes the full profile's
        code paths."""
        return self.profile == "quick"

    def pick(self, value: T | None, quick: T, full: T, smoke: T | None = None) -> T:
        """`value` when a parameter set it (papermill `-p`), else the profile's default: `quick` or `full`. The smoke
        profile takes `full` too (the full profile's code paths, dtypes and lists), except where the chapter gives a
        `smoke` value: a few epochs, steps, rounds or seeds, or a smaller size where one call of the full one costs
        minutes on a CPU. So a CPU checks in minutes that the full profile runs; its figures measure nothing."""
        if value is not None:
            return value
        if self.quick:
            return quick
        return smoke if self.profile == "smoke" and smoke is not None else full


def setup(chapter: str, seed: int = 0, device: str | None = None, verbose: bool = True,
          profile: str | None = None, supports: tuple[str, ...] = ("cuda", "mps", "cpu")) -> Setup:
    """Start a chapter: seed, pick the device, print the hardware report (chapter 01) or its one-line summary.
    `profile`: the notebook's PROFILE (None: `device.choose_profile`); `supports`: the device kinds the chapter is
    written for, where the best device is another kind (a TPU for most chapters) it runs on the CPU, and says so."""
    results.set_chapter(chapter)
    seed_everything(seed)
    trust_cpu_flags()
    note, best = None, devices.available_devices()[0]
    if device is None and not os.environ.get("ACCEL_DEVICE") and best not in supports:
        note = (f"This host's best device is {best}, but chapter {chapter} is written for "
                f"{', '.join(supports)}: it runs on the CPU here (chapter 07 is the TPU/XLA chapter).")
        dev = torch.device("cpu")
    else:
        dev = devices.best_device(device)
    prof = devices.choose_profile(profile, dev.type)
    report = {**devices.hardware_report(), "profile": prof}
    if verbose:  # the whole report where the course teaches reading it (chapter 01), one line in every other chapter
        if chapter == "01":
            print(devices.format_report(report))
        else:
            print(f"This machine: {devices.machine_line(report)} (the whole hardware report: chapter 01, or "
                  "print(ah.device.format_report(S.report)))")
        if note:
            print("\n" + note)
        if dev.type == "cpu":
            print(f"\nRunning on the CPU{'' if note else ' (no GPU or TPU found)'}. Every cell still runs; sizes "
                  f"follow the '{prof}' profile (PROFILE = 'full' or ACCEL_PROFILE=full for the original sizes).")
        else:
            print(f"\nUsing {dev} with the '{prof}' profile.")
        timed = results.recorded_seconds(chapter) if prof == "quick" else None
        if timed:
            seconds, hw, folder = timed
            print(f"This chapter's quick profile took {seconds:.0f} s in the newest recorded course run "
                  f"({devices.machine_line(hw)}; results/{folder.name}/).")
        if prof == "smoke":
            print("The smoke profile: the full profile's code paths and dtypes with a few steps of each, to "
                  "check that it runs. Its figures measure nothing; run PROFILE = 'full' for them.")
    return Setup(chapter, dev, prof, report)


def fit_budget(units: int, seconds_per_unit: float, what: str, limit_s: float | None = None) -> int:
    """How many of `units` (epochs, steps, runs) at a measured `seconds_per_unit` fit in `limit_s` (default:
    ACCEL_BUDGET_S, else 600 s); prints the projected time, and says so when it scales down."""
    if units < 1 or not seconds_per_unit > 0:
        raise ValueError(f"need units >= 1 and seconds_per_unit > 0, got {units} and {seconds_per_unit}")
    limit = float(limit_s if limit_s is not None else os.environ.get("ACCEL_BUDGET_S", 600))
    projected = units * seconds_per_unit
    if projected <= limit:
        print(f"{what}: {units:,} x {seconds_per_unit * 1e3:.3g} ms = {projected:.0f} s projected, within the "
              f"{limit:.0f} s budget")
        return units
    fit = max(1, int(limit / seconds_per_unit))
    print(f"{what}: {units:,} would take {projected / 60:.1f} min (measured {seconds_per_unit * 1e3:.3g} ms each), "
          f"over the {limit:.0f} s budget: running {fit:,} instead (set ACCEL_BUDGET_S to change the budget)")
    return fit
