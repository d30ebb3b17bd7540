"""The course's commands: `course` (run, report, readme, device-check), `bench fullbatch` and `reproduce
udlbook-20.2`, run by `python -m accelhelpers ...` (accelhelpers/__main__.py).

No notebook and no lesson module imports this package (tests/test_layout.py keeps it so): the commands sit on top of
the package and nothing below them reaches up. Its modules load on first use (`ah.commands.course`), like the
package's own.
"""

from .. import lazy_submodules


class CommandError(ValueError):
    """Bad input to one of the package's commands (course, bench, reproduce): the CLI prints its message, which
    names the fix, as one line and exits with status 2. Any other exception is a bug and keeps its traceback."""


__getattr__ = lazy_submodules(__name__)  # `ah.commands.course` loads on first use
