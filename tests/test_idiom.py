"""Every notebook imports the package one way: `import accelhelpers as ah`, then `ah.<module>.<name>`."""

import ast
import json
import re
from pathlib import Path

import pytest

from tools import nbexport

ROOT = Path(__file__).parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# ah.<module>: the package's modules and its sub-packages (folders with an __init__.py, such as commands/)
MODULES = {p.stem for p in (ROOT / "accelhelpers").glob("[a-z]*.py")} | \
    {p.parent.name for p in (ROOT / "accelhelpers").glob("[a-z]*/__init__.py")}


def _code(nb: Path) -> list[str]:
    """The notebook's code cells, IPython magics and shell lines removed so that `ast` can read them."""
    cells = json.loads(nb.read_text())["cells"]
    return [nbexport.python_of("".join(c["source"])) for c in cells if c["cell_type"] == "code"]


def problems(sources: list[str]) -> list[str]:
    """Where the cells leave the one import idiom."""
    found = []
    for src in sources:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accelhelpers"):
                found.append(f"from {node.module} import ...: use ah.<module>.<name>")
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("accelhelpers") and (a.name, a.asname) != ("accelhelpers", "ah"):
                        found.append(f"import {a.name} as {a.asname}: use `import accelhelpers as ah`")
                    if a.asname == "F" and a.name != "torch.nn.functional":
                        found.append(f"import {a.name} as F: F is torch.nn.functional")
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ah"
                    and node.attr not in MODULES and node.attr != "__version__"):
                found.append(f"ah.{node.attr}: name its module, ah.<module>.{node.attr}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute | ast.Name):
                value = ast.unparse(node.value)
                for t in node.targets:
                    name = ast.unparse(t)
                    module = value == "ah" or (value.startswith("ah.") and value[3:] in MODULES)
                    if module and re.fullmatch(r"\w", name):
                        found.append(f"{name} = {value}: no single-letter aliases")
                    if name == "F":
                        found.append(f"F = {value}: F is torch.nn.functional")
    return found


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_notebook_uses_the_one_import_idiom(nb):
    sources = _code(nb)
    assert any("import accelhelpers as ah" in s for s in sources), f"{nb.name} never imports accelhelpers as ah"
    assert problems(sources) == []


def test_the_checker_catches_each_departure():
    bad = ["ah.record('x', 1)", "from accelhelpers.optim import train", "import accelhelpers.parallel as par",
           "P = ah.parallel",
           "import fastai.optimizer as F", "F = ah.optim"]
    assert len(problems(bad)) == 7  # "F = ah.optim" breaks two rules
    good = ["import accelhelpers as ah", "import torch.nn.functional as F", "S = ah.session.setup('01')",
            "x = ah.data.mnist1d", "ah.udlbook.recorded()", "ah.commands.course.TITLES"]
    assert problems(good) == []
