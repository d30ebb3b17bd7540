"""A learner's edits reach the processes a chapter launches. The worker scripts of chapters 06, 09 and 11 run in new
processes that import the installed package; a cell edited and re-run in the notebook changes only the kernel. So
every process `ah.launch` starts from a Jupyter kernel (JupyterLab, Colab, Kaggle, papermill, nbval) gets the
`#| export` cells that kernel has run, in the order it ran them, and `import accelhelpers` in that process runs them
over the installed modules: `ah.parallel.setup_rank` in a rank is the cell as the learner left it, with no
`make export` (which is only for keeping the package's files in step with the notebooks)."""

from __future__ import annotations

import hashlib
import importlib
import json
import linecache
import os
import sys
import tempfile
import types
from pathlib import Path

ENV_VAR = "ACCEL_CELLS"  # a launched process's environment: the file of cells to run over the package
EXPORT = ("export", "exports", "exporti")  # nbdev's directives that send a cell to a module


def _directives(source: str) -> list[list[str]]:
    """nbdev's `#| name args` lines of a cell, as [name, args...]."""
    return [line.strip()[2:].split() for line in source.splitlines() if line.strip().startswith("#|")]


def from_history(history: list[str]) -> dict[str, list[str]]:
    """{module: [cell source, ...]}: the cells of `history` (sources in the order they ran) that nbdev would export,
    each to its module (`#| export NAME`, else the last `#| default_exp NAME` run before it). A cell run again keeps
    only its last run; a cell that does not compile is left out (it defined nothing in the kernel either)."""
    module, cells = None, {}
    for source in history:
        for name, *args in filter(None, _directives(source)):
            if name == "default_exp" and args:
                module = args[0]
            elif name in EXPORT and (args[:1] or [module])[0]:
                try:
                    compile(source, "<cell>", "exec")
                except SyntaxError:
                    break
                cells.setdefault(args[0] if args else module, []).append(source)
                break
    return {m: list(dict.fromkeys(reversed(sources)))[::-1] for m, sources in cells.items()}


def from_kernel() -> dict[str, list[str]]:
    """The export cells this Jupyter kernel has run ({} outside one, or when IPython keeps no history)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    return from_history(list(history)) if history else {}


def launch_env() -> dict[str, str]:
    """{ACCEL_CELLS: file} for a process started from here, when this is a kernel that has run export cells; else {}.
    The file (in the temporary folder, named by its content) is written once and never changes."""
    cells = from_kernel()
    if not cells:
        return {}
    text = json.dumps(cells, sort_keys=True)
    folder = Path(tempfile.gettempdir()) / f"accel-cells-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
    path = folder / f"cells-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return {ENV_VAR: str(path)}


def apply(path: str | Path) -> list[str]:
    """Run the cells of `path` (launch_env's file) over the package's modules, in order; a module the package lacks
    (a learner's new `#| default_exp`) is made. A cell that raises is reported in one line and the rest still run, as
    in the kernel. Returns the modules changed."""
    try:
        cells = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{ENV_VAR}={path} cannot be read ({type(e).__name__}): launch the process again from the "
                           f"notebook, or unset {ENV_VAR} to use the installed package") from None
    package = sys.modules[__name__.rpartition(".")[0]]
    for module, sources in cells.items():
        name = f"{package.__name__}.{module}"
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            mod = sys.modules[name] = types.ModuleType(name)
            setattr(package, module, mod)
        for i, source in enumerate(sources):
            filename = f"<notebook cell {i + 1} of {name}>"  # tracebacks show the cell's lines
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
            try:
                exec(compile(source, filename, "exec"), mod.__dict__)
            except Exception as e:
                print(f"{name}: notebook cell {i + 1} raised {type(e).__name__}: {e} (as it did in the notebook); "
                      f"the other cells still apply", file=sys.stderr)
    return list(cells)
