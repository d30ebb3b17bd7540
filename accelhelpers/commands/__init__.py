"""The course's commands: `course` (run, report, readme, device-check), `bench fullbatch` and `reproduce
udlbook-20.2`, run by `python -m accelhelpers ...` (accelhelpers/__main__.py).

No notebook and no lesson module imports this package (tests/test_layout.py keeps it so): the commands sit on top of
the package and nothing below them reaches up. Its modules load on first use (`ah.commands.course`), like the
package's own.
"""

import importlib
from typing import Any


class CommandError(ValueError):
    """Bad input to one of the package's commands (course, bench, reproduce): the CLI prints its message, which
    names the fix, as one line and exits with status 2. Any other exception is a bug and keeps its traceback."""


def __getattr__(name: str) -> Any:
    """Load a command module such as `ah.commands.course` on first access."""
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{name}":
            raise AttributeError(f"module {__name__!r} has no attribute or submodule {name!r}") from None
        raise
