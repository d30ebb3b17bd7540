"""The technique is the cell: the package's lesson modules are exported from the chapters (nbdev 3), never
hand-edited copies, and no chapter prints package source back instead of defining the code in a cell."""

import ast
import json
import shutil
from pathlib import Path

import pytest

from tools import nbexport

ROOT = nbexport.ROOT
NOTEBOOKS = nbexport.chapters()


def test_every_generated_module_matches_its_notebook(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "accelhelpers").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for nb in NOTEBOOKS:
        shutil.copy(nb, tmp_path / "notebooks")
    nbexport.export(tmp_path)
    fresh, committed = nbexport.generated(tmp_path), nbexport.generated(ROOT)
    assert sorted(committed) == sorted(fresh), "a generated module without its notebook, or one not exported yet"
    stale = [m for m in fresh if (tmp_path / "accelhelpers" / m).read_text() != (ROOT / "accelhelpers" / m).read_text()]
    assert stale == [], f"edited by hand or not re-exported (run `make export`): {stale}"


def test_the_export_check_sees_a_hand_edit(tmp_path):
    """Negative control: a module edited by hand no longer matches its notebook's export."""
    committed = nbexport.generated(ROOT)
    assert committed, "no module is exported from a notebook"
    module = sorted(committed)[0]
    (tmp_path / "notebooks").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    nb = ROOT / "notebooks" / Path(committed[module]).name
    shutil.copy(nb, tmp_path / "notebooks")
    nbexport.export(tmp_path, [tmp_path / "notebooks" / nb.name])
    exported = (tmp_path / "accelhelpers" / module).read_text()
    assert exported == (ROOT / "accelhelpers" / module).read_text()
    assert exported + "\nX = 1\n" != (ROOT / "accelhelpers" / module).read_text()
    assert nbexport.MARK in exported and nb.name in exported  # says it is generated, and from which notebook


def print_backs(sources: list[str]) -> list[str]:
    """Cells that print the package's own source (inspect.getsource of `ah.` or accelhelpers objects)."""
    found = []
    for src in sources:
        for node in ast.walk(ast.parse(src)):
            if (isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "getsource" and node.args
                    and ast.unparse(node.args[0]).startswith(("ah.", "accelhelpers."))):
                found.append(ast.unparse(node))
    return found


def _code(nb: Path) -> list[str]:
    cells = json.loads(nb.read_text())["cells"]
    return [nbexport.python_of("".join(c["source"])) for c in cells if c["cell_type"] == "code"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_no_chapter_prints_package_source_back(nb):
    assert print_backs(_code(nb)) == []


def test_the_print_back_check_catches_it():
    bad = ["import inspect\nprint(inspect.getsource(ah.timing.benchmark))",
           "from inspect import getsource\ngetsource(ah.optim.CallbackOptimizer.step)",
           "print(inspect.getsource(accelhelpers.train.fit).split('x')[0])"]
    assert all(print_backs([b]) for b in bad)
    assert print_backs(["import inspect\nfrom fastai.callback.training import GradientAccumulation\n"
                        "print(inspect.getsource(GradientAccumulation))"]) == []  # a library's source is fine


STRAY = ("0%|", "ERROR:", "ProcessGroupGloo", "[Gloo]")


def stored_problems(nb: Path) -> list[str]:
    """What a committed notebook must not hold: timestamps, widget state or views, progress bars, library logs."""
    data = json.loads(nb.read_text())
    found = ["widget state in the metadata"] if "widgets" in data["metadata"] else []
    for i, cell in enumerate(data["cells"]):
        if "execution" in cell.get("metadata", {}):
            found.append(f"cell {i}: execution timestamps")
        for out in cell.get("outputs", []):
            if "application/vnd.jupyter.widget-view+json" in out.get("data", {}):
                found.append(f"cell {i}: a widget (a progress bar frozen where the run left it)")
            text = "".join(out.get("text", ""))
            found += [f"cell {i}: {s!r} in an output" for s in STRAY if s in text]
    return found


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_committed_notebooks_are_clean(nb):
    assert stored_problems(nb) == [], "run `make notebooks` (it executes without bars and cleans)"


def test_the_cleanliness_check_sees_each_problem(tmp_path):
    nb = {"metadata": {"widgets": {}}, "nbformat": 4, "nbformat_minor": 5, "cells": [
        {"cell_type": "code", "id": "a", "metadata": {"execution": {"iopub.status.busy": "2026"}}, "source": "",
         "execution_count": 1, "outputs": [
             {"output_type": "display_data", "metadata": {}, "data": {"application/vnd.jupyter.widget-view+json": {}}},
             {"output_type": "stream", "name": "stderr", "text": "bar:   0%|          | 0/7\n"},
             {"output_type": "stream", "name": "stderr", "text": "ERROR:2026-12-01 gpuGetDeviceCount failed\n"}]}]}
    path = tmp_path / "99_x.ipynb"
    path.write_text(json.dumps(nb))
    assert len(stored_problems(path)) == 5
    assert nbexport.clean(path) and len(stored_problems(path)) == 2  # cleaning drops timestamps and widgets
