"""accelhelpers: the small tested package behind the accel-course notebooks.

One way to use it: `import accelhelpers as ah`, then `ah.<module>.<name>` (`ah.session.setup`, `ah.results.record`,
`ah.timing.benchmark`, ...). Submodules load on first use; importing the package imports nothing else, and every
measurement happens when a function is called. The exception: a process a notebook launched (`ah.launch`) runs the
notebook's export cells over the package as it imports it (`cells`), so its workers run the cells as the learner left
them.

The modules in import order: each imports only modules on the lines above it, and `tests/test_layout.py` checks every
line against the real imports (`commands/` and `__main__`, the CLI, come after all of them, and nothing imports them).
A lesson module is exported from its chapter's cells (`#| default_exp`); the floor is hand-written and holds what no
chapter teaches. A `*` marks where the floor, or an earlier chapter, uses a piece a later chapter teaches, and says
which and why: the list is short, and the test fails on any use not named here.

    module     chapter  imports
    cells      floor
    device     floor
    internals  floor
    launch     floor    cells
    longrun    09       device, internals, launch
    results    floor    longrun*  (atomic_write: every result is written the crash-safe way chapter 09 teaches)
    data       floor    device, results
    metrics    floor
    models     floor
    session    floor    device, results
    slurm      floor    device, launch, results
    tools      floor    results
    timing     01       results
    precision  04       device, internals, timing
    train      floor    data, metrics, session, timing*, precision*  (sync from 01; the step is 04's minibatch_step)
    fullbatch  02       device, internals, data, metrics, models, session, timing
    udlbook    floor    device, results, models, fullbatch*  (udlbook's models padded as chapter 02 teaches)
    optim      03       data, metrics, timing, train
    pipeline   05       device, internals, data, metrics, timing
    parallel   06       device, data, metrics, models, session, timing, train
    xla        07       device, internals, launch
    deploy     08       session, train, tools
    toolflows  10       launch, longrun, deploy, tools
    speedrun   11       device, internals, metrics, timing, precision, pipeline
    exercises  floor    device, results, data, metrics, models, session, tools, timing*, precision*, fullbatch*,
                        optim*, pipeline*, xla*, deploy*, longrun*, toolflows*, speedrun*  (the exercises' checks
                        recompute each chapter's reference with the package's copy of that chapter's code)
"""

import importlib
import os
from typing import Any

__version__ = "0.2.0"
__all__ = ["__version__", "lazy_submodules"]


def lazy_submodules(package: str) -> Any:
    """A module `__getattr__` that imports `package`'s submodule `name` on first access (`ah.optim`)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f".{name}", package)
        except ModuleNotFoundError as e:
            if e.name == f"{package}.{name}":
                raise AttributeError(f"module {package!r} has no attribute or submodule {name!r}") from None
            raise

    return __getattr__


__getattr__ = lazy_submodules(__name__)

if os.environ.get("ACCEL_CELLS"):  # started by ah.launch from a notebook: its export cells, as the learner left them
    from . import cells as _cells

    _cells.apply(os.environ["ACCEL_CELLS"])
