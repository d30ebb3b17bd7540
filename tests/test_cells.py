"""Lesson cells that teach (#40 item 2): a code cell shows one idea in at most 40 non-blank lines (a `%%writefile`
worker at most 60), and no exported cell rebinds a papermill parameter, which would silently undo `papermill -p`
for the rest of the chapter."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.workers import worker_cells, write_workers
from tools import nbexport

NOTEBOOKS = nbexport.chapters()
EXPORT = re.compile(r"^#\|\s*export")  # nbdev's export, exports and exporti
LIMIT, WORKER_LIMIT = 40, 60
Cell = dict[str, Any]

# (chapter, cell id): non-blank lines of a cell allowed over the limit. Empty: every cell is within it. An entry
# may only shrink: a cell may not grow past its entry, and an entry whose cell is back within the limit (or gone)
# must be removed.
ALLOWED: dict[tuple[str, str], int] = {}


def _cells(nb: Path) -> list[Cell]:
    return json.loads(nb.read_text())["cells"]


def _source(cell: Cell) -> str:
    return "".join(cell["source"])


def over_limit(cells: list[Cell]) -> dict[str, int]:
    """{cell id: non-blank lines} of the code cells over their limit (60 for a `%%writefile` cell, else 40)."""
    over = {}
    for c in cells:
        src = _source(c)
        n = sum(1 for line in src.splitlines() if line.strip())
        if c["cell_type"] == "code" and n > (WORKER_LIMIT if src.startswith("%%writefile") else LIMIT):
            over[c["id"]] = n
    return over


def _bound(statements: list[ast.stmt]) -> set[str]:
    """Names the statements bind at module level: assignment, annotated and augmented assignment, for and with
    targets, looking inside if/for/while/with/try blocks but not into functions or classes."""
    names: set[str] = set()
    for st in statements:
        targets: list[ast.expr] = []
        if isinstance(st, ast.Assign):
            targets = st.targets
        elif isinstance(st, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = [st.target]
        elif isinstance(st, (ast.With, ast.AsyncWith)):
            targets = [item.optional_vars for item in st.items if item.optional_vars is not None]
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        for block in ("body", "orelse", "finalbody"):
            names |= _bound(getattr(st, block, []))
        for handler in getattr(st, "handlers", []):
            names |= _bound(handler.body)
    return names


def rebound_parameters(cells: list[Cell]) -> dict[str, set[str]]:
    """{cell id: parameters it rebinds} of the export cells that bind a name the `parameters` cell defines."""
    bound = lambda c: _bound(ast.parse(nbexport.python_of(_source(c))).body)
    params = set().union(*(bound(c) for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])))
    exports = [c for c in cells
               if c["cell_type"] == "code" and any(EXPORT.match(line) for line in _source(c).splitlines()[:2])]
    return {c["id"]: hit for c in exports if (hit := bound(c) & params)}


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_no_export_cell_rebinds_a_parameter(nb: Path) -> None:
    assert rebound_parameters(_cells(nb)) == {}


def test_the_rebinding_check_sees_each_way_of_assigning() -> None:
    code = lambda cid, src, **kw: {"cell_type": "code", "id": cid, "metadata": kw, "source": src}
    params = code("p", "LR = 0.1\nN = 2\n", tags=["parameters"])
    for line in ("LR = 1", "A, LR = 1, 2", "LR: float = 1", "LR += 1", "for LR in []: pass",
                 "with x as (LR, y): pass", "if True:\n    LR = 1"):
        assert rebound_parameters([params, code("e", f"#| export\n{line}\n")]) == {"e": {"LR"}}, line
    fine = ["#| export\ndef f(LR=1):\n    LR = 2\n", "LR = 1\n", "#| export\nclass C:\n    N = 1\n"]
    assert rebound_parameters([params, *(code(str(i), src) for i, src in enumerate(fine))]) == {}


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_no_cell_is_over_the_limit_or_past_its_allowance(nb: Path) -> None:
    over = over_limit(_cells(nb))
    allowed = {cid: n for (chapter, cid), n in ALLOWED.items() if chapter == nb.name[:2]}
    assert {cid: n for cid, n in over.items() if n > allowed.get(cid, 0)} == {}, "over the limit: split the cell"
    assert sorted(set(allowed) - set(over)) == [], "back within the limit (or gone): remove its ALLOWED entry"


def test_the_limit_counts_non_blank_lines_and_gives_workers_more() -> None:
    code = lambda cid, src: {"cell_type": "code", "id": cid, "source": src}
    worker = "%%writefile w.py\n"
    assert over_limit([code("a", "x = 1\n\n" * 40), code("w", worker + "x = 1\n" * 59)]) == {}
    assert over_limit([code("a", "x = 1\n" * 41), code("w", worker + "x = 1\n" * 60)]) == {"a": 41, "w": 61}


# --- one measuring vocabulary (#40 item 1): chapter 01's spread, round_ratios, interleaved and verdict -------------
VOCABULARY = re.compile(r"spread|verdict|says|round_ratio|rounds_of|interleav|fmt_range|median_range")
ROOT = Path(__file__).resolve().parents[1]


def vocabulary_functions(code: str) -> set[str]:
    """Names of the functions and methods defined in `code` that look like a spread, a round loop or a verdict."""
    tree = ast.parse(code)
    defs = (n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return {name for name in defs if VOCABULARY.search(name.lower())}


def test_only_chapter_01_defines_a_spread_a_round_loop_or_a_verdict() -> None:
    """Every other chapter, its workers and the package time and judge through ah.timing (chapter 01's cells)."""
    found = {}
    for nb in NOTEBOOKS:
        if nb.name.startswith("01"):
            continue
        for c in _cells(nb):
            if c["cell_type"] == "code" and (names := vocabulary_functions(nbexport.python_of(_source(c)))):
                found[f"{nb.name[:2]} {c['id']}"] = names
    for module in sorted((ROOT / "accelhelpers").rglob("*.py")):
        if module.name != "timing.py" and (names := vocabulary_functions(module.read_text())):
            found[str(module.relative_to(ROOT))] = names
    assert found == {}, "use ah.timing.spread / round_ratios / interleaved / verdict instead"
    assert {"spread", "round_ratios", "interleaved", "verdict"} <= vocabulary_functions(
        (ROOT / "accelhelpers" / "timing.py").read_text())


def test_the_vocabulary_check_sees_functions_and_methods() -> None:
    code = "def spread(v): pass\nclass S:\n    def verdict(self): pass\ndef run():\n    def rounds_of(): pass\n"
    assert vocabulary_functions(code) == {"spread", "verdict", "rounds_of"}
    assert vocabulary_functions("def ratios(self): pass\ndef helps(t): pass\n") == set()


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_no_compared_cell_relies_on_a_semicolon_to_stay_quiet(nb: Path) -> None:
    """A trailing `;` hid a cell's last value when nbconvert ran the chapter but not under nbval, so the compared cell,
    stored without it, failed (CI, 2026-12-03; IPython decides from its input history, which nbval's runs seem not to
    fill). Such a cell is bookkeeping: tag it nbval-ignore-output, or end it with a statement."""
    loud = [c["id"] for c in _cells(nb) if c["cell_type"] == "code" and _source(c).rstrip().endswith(";")
            and "nbval-ignore-output" not in c.get("metadata", {}).get("tags", [])]
    assert loud == []


def _has_python_workers(nb: Path) -> bool:
    try:
        return any(name.endswith(".py") for name in worker_cells(nb.name[:2]))
    except LookupError:  # a chapter without %%writefile cells
        return False


def pyflakes_errors(folder: Path) -> list[str]:
    """ruff's pyflakes rules (unused imports and variables, undefined names) over the Python files in `folder`."""
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache", "--output-format",
                        "concise", "--isolated", str(folder)], capture_output=True, text=True)
    return [line for line in r.stdout.splitlines() if re.search(r"\.py:\d+:\d+: F\d+", line)]


@pytest.mark.parametrize("nb", [nb for nb in NOTEBOOKS if _has_python_workers(nb)], ids=lambda p: p.name[:2])
def test_the_chapters_workers_import_and_name_only_what_they_use(nb: Path, tmp_path: Path) -> None:
    """`ruff check notebooks` skips a cell that starts with a cell magic: the `%%writefile` workers are linted here."""
    write_workers(nb.name[:2], tmp_path)
    assert pyflakes_errors(tmp_path) == []


def test_the_worker_lint_sees_an_unused_import_and_an_undefined_name(tmp_path: Path) -> None:
    (tmp_path / "w.py").write_text("import os\n\nprint(undefined_name)\n")
    found = pyflakes_errors(tmp_path)
    assert [line.split(": ")[1].split()[0] for line in found] == ["F401", "F821"], found
