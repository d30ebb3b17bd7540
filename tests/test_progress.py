"""Progress bars: shown on long loops when asked, silenced by TQDM_DISABLE=1 (as `make test` sets), and never
inside a notebook cell whose output nbval compares."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import accelhelpers as ah

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# what draws a bar: tqdm itself, our wrapper, a helper asked for one, fastai's fit/fine_tune, the bench
DRAWS_A_BAR = re.compile(r"\btqdm\(|ah\.progress\(|progress=(?!False)|\.fit(_one_cycle|_flat_cos)?\(|"
                         r"\.fine_tune\(|\.lr_find\(|run_fullbatch\(")
QUIET = ("no_bar()", "progress=False", "# no bar:")


def _train_with_a_bar(disable: bool) -> str:
    """stderr of a fresh process that trains 3 epochs with a progress bar (tqdm reads TQDM_* at import)."""
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"} | ({"TQDM_DISABLE": "1"} if disable else {})
    code = ("import accelhelpers as ah\n"
            "assert ah.session.progress([1], None) == [1] and ah.session.progress([1], False) == [1]\n"
            "ah.fullbatch.FullBatchLoop(ah.models.udl_mlp(1, seed=0), ah.data.mnist1d()).run(3, progress='depth 1')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stderr


@pytest.mark.slow
def test_a_bar_is_drawn_when_asked_and_tqdm_disable_silences_it():
    assert "depth 1:   0%|" in _train_with_a_bar(disable=False)  # the bar, labelled, before the first epoch
    assert "depth 1" not in _train_with_a_bar(disable=True)


@pytest.mark.slow
def test_a_loop_with_a_bar_trains_exactly_as_one_without():
    data = ah.data.mnist1d()
    m = ah.models.udl_mlp(2, seed=4)
    a = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data).run(5)
    b = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data).run(5, progress=True)
    assert (a.loss == b.loss).all()


def _only_defines(src: str) -> bool:
    """Whether a cell only imports and defines (functions, classes, constants): running it draws nothing."""
    try:
        body = ast.parse("\n".join(ln for ln in src.splitlines() if not ln.lstrip().startswith(("%", "!")))).body
    except SyntaxError:
        return False
    kinds = (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.AnnAssign, ast.Assign)
    return bool(body) and all(isinstance(n, kinds) and not (isinstance(n, ast.Assign | ast.AnnAssign)
                                                           and isinstance(n.value, ast.Call)) for n in body)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_cells_that_draw_bars_are_not_compared_by_nbval(nb):
    for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
        src = "".join(cell["source"])
        code = re.sub(r"#.*", "", src)  # comments draw nothing
        if cell["cell_type"] != "code" or not DRAWS_A_BAR.search(code) or any(q in src for q in QUIET):
            continue
        if _only_defines(src):  # a cell of definitions (an exported one is module code) draws nothing when run
            continue
        tags = cell.get("metadata", {}).get("tags", [])
        assert {"nbval-ignore-output", "nbval-skip"} & set(tags), (
            f"{nb.name} cell {i} draws a progress bar but nbval compares its output: tag it nbval-ignore-output")
