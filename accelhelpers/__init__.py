"""accelhelpers: the small tested package behind the accel-course notebooks.

One way to use it: `import accelhelpers as ah`, then `ah.<module>.<name>` (`ah.session.setup`, `ah.results.record`,
`ah.timing.benchmark`, ...). Submodules load on first use; importing the package imports nothing else, and every
measurement happens when a function is called.
"""

import importlib
from typing import Any

__version__ = "0.2.0"
__all__ = ["__version__"]


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
