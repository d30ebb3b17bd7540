"""accelhelpers: the small tested package behind the accel-course notebooks.

Importing it does nothing but import torch; every measurement happens when a function is called.
Submodules (`ah.timing`, `ah.optim`, ...) load on first use.
"""

import importlib
from typing import Any

from .data import Split, digits, mnist1d
from .device import (
    DeviceUnavailable,
    available_devices,
    best_device,
    format_report,
    hardware_report,
    in_colab,
    run_profile,
    sync,
)
from .models import count_params, udl_mlp, udl_sizes
from .results import record, results_dir, save_figure
from .session import Setup, progress, seed_everything, setup
from .timing import Timing, benchmark, fraction_of_peak, measure_peaks, mlp_flops

__version__ = "0.2.0"
__all__ = [
    "DeviceUnavailable", "Setup", "Split", "Timing", "available_devices", "benchmark", "best_device",
    "count_params", "digits", "format_report", "fraction_of_peak", "hardware_report", "in_colab",
    "measure_peaks", "mlp_flops", "mnist1d", "progress", "record", "results_dir", "run_profile",
    "save_figure", "seed_everything", "setup", "sync", "udl_mlp", "udl_sizes",
]


def __getattr__(name: str) -> Any:
    """Load a submodule such as `ah.optim` on first access."""
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{name}":
            raise AttributeError(f"module 'accelhelpers' has no attribute or submodule {name!r}") from None
        raise
