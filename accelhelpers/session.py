"""The setup every chapter starts with: seed, choose the device, announce the hardware and the profile."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from .device import best_device, choose_profile, format_report, hardware_report
from .results import set_chapter

T = TypeVar("T")


def progress(items: Iterable[T], desc: str | bool | None = None, **kw: Any) -> Iterable[T]:
    """`items` with a progress bar (tqdm.auto: a widget in Jupyter, text in a terminal) when `desc` is truthy;
    plain `items` otherwise. The bar redraws at most twice a second and disappears when done. Set the
    environment variable TQDM_DISABLE=1 to silence every bar (`make test` does, so CI logs stay clean)."""
    if not desc:
        return items
    from tqdm.auto import tqdm

    label = desc if isinstance(desc, str) else None
    return tqdm(items, desc=label, leave=False, mininterval=0.5, **kw)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) so a run can be repeated."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Setup:
    """What a chapter needs to know about where it runs."""

    chapter: str
    device: torch.device
    profile: str
    report: dict

    @property
    def quick(self) -> bool:
        """True in the quick (CPU, minutes) profile."""
        return self.profile == "quick"

    def pick(self, value: T | None, quick: T, full: T) -> T:
        """`value` when a parameter set it (papermill `-p`), else the profile's default: `quick` or `full`."""
        if value is not None:
            return value
        return quick if self.quick else full


def setup(chapter: str, seed: int = 0, device: str | None = None, verbose: bool = True,
          profile: str | None = None) -> Setup:
    """Start a chapter: seed, pick the device (announcing a CPU fallback), print the hardware report.

    `profile` ('quick' or 'full') comes from the notebook's `PROFILE` parameter; None means ACCEL_PROFILE,
    else 'quick' on a CPU and 'full' on an accelerator."""
    set_chapter(chapter)
    seed_everything(seed)
    dev = best_device(device)
    prof = choose_profile(profile)
    report = hardware_report()
    report["profile"] = prof
    if verbose:
        print(format_report(report))
        if dev.type == "cpu":
            print("\nNo GPU or TPU found: running on the CPU. Every cell still runs; sizes follow the "
                  f"'{prof}' profile (set ACCEL_PROFILE=full for the original sizes).")
        else:
            print(f"\nUsing {dev} with the '{prof}' profile.")
    return Setup(chapter, dev, prof, report)
