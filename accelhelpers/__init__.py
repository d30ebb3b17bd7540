"""accelhelpers: the small tested package behind the accel-course notebooks.

One way to use it: `import accelhelpers as ah`, then `ah.<module>.<name>` (`ah.session.setup`, `ah.results.record`,
`ah.timing.benchmark`, ...). Submodules load on first use; importing the package imports nothing else, and every
measurement happens when a function is called. The exception: a process a notebook launched (`ah.launch`) runs the
notebook's export cells over the package as it imports it (`cells`), so its workers run the cells as the learner left
them.
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
