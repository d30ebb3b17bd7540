"""Exercises a learner can check (#42 item 2). Every chapter's exercises section has, per exercise, a markdown cell
starting '**Exercise N.k.**' that links to its worked solution in solutions/, followed either by a check cell
(`ah.exercises.check("NN.k", ...)`, whose committed output says it is not answered yet: the negative control, which
nbval compares on every run) or marked as an open question. The worked solutions in solutions/*.md are executed here
and must pass their checks; each check rejects the wrong answer it carries."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import accelhelpers as ah
from tools import nbexport

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = nbexport.chapters()
SOLUTIONS = ROOT / "solutions"
HEADING = re.compile(r"^\*\*Exercise (\d+)\.(\d+)\.\*\*")
CHECK_CALL = re.compile(r"ah\.exercises\.check\(\s*\"(\d\d\.\d+)\"")
OPEN = "*Open question.*"
HEADING_MD = re.compile(r"^## (Exercise \d+\.\d+)\s*$", re.M)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and MyST (myst_heading_anchors) both make it: 'Exercise 4.2' -> 'exercise-42'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchor(name: str) -> str:
    """Exercise '04.2''s anchor in its solutions page."""
    return slug(f"Exercise {int(name[:2])}.{name[3:]}")


def _text(cell: dict[str, Any]) -> str:
    return "".join(cell["source"])


def _outputs(cell: dict[str, Any]) -> str:
    return "".join(
        "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")) for o in cell.get("outputs", [])
    )


def exercises(nb: Path) -> list[dict[str, Any]]:
    """The chapter's exercises in order: name ('04.2'), the markdown, and the check cell under it (or None)."""
    cells = json.loads(nb.read_text())["cells"]
    found = []
    for i, cell in enumerate(cells):
        m = HEADING.match(_text(cell)) if cell["cell_type"] == "markdown" else None
        if m:
            nxt = cells[i + 1] if i + 1 < len(cells) else None
            check = nxt if nxt is not None and nxt["cell_type"] == "code" and CHECK_CALL.search(_text(nxt)) else None
            found.append({"name": f"{int(m[1]):02d}.{m[2]}", "markdown": _text(cell), "check": check})
    return found


def solution_file(nb: Path) -> Path:
    return SOLUTIONS / f"{nb.stem}.md"


def solution_blocks(path: Path) -> dict[str, list[str]]:
    """The ```python blocks of each exercise's section in a solutions file, by exercise name."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line_block in re.split(r"(?m)^(?=## )", path.read_text()):
        m = re.match(r"## Exercise (\d+)\.(\d+)", line_block)
        current = f"{int(m[1]):02d}.{m[2]}" if m else None
        if current:
            blocks[current] = re.findall(r"```python\n(.*?)```", line_block, re.S)
    return blocks


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_exercise_is_checked_or_open_and_links_its_solution(nb):
    found = exercises(nb)
    assert found, f"{nb.name} has no exercise cells ('**Exercise N.k.**')"
    chapter = nb.stem[:2]
    assert [e["name"] for e in found] == [f"{chapter}.{k}" for k in range(1, len(found) + 1)], (
        "exercises are numbered N.1, N.2, ... in order"
    )
    text = solution_file(nb).read_text() if solution_file(nb).exists() else ""
    anchors = {slug(h) for h in HEADING_MD.findall(text)}
    for e in found:
        link = f"../solutions/{nb.stem}.md#{anchor(e['name'])}"
        assert link in e["markdown"], f"exercise {e['name']} does not link its solution ({link})"
        assert anchor(e["name"]) in anchors, f"{solution_file(nb).name} has no heading for exercise {e['name']}"
        if e["check"] is None:
            assert OPEN in e["markdown"], f"exercise {e['name']} has neither a check cell nor the {OPEN} mark"
            continue
        assert OPEN not in e["markdown"], f"exercise {e['name']} is marked open but has a check"
        assert CHECK_CALL.search(_text(e["check"]))[1] == e["name"], f"{e['name']}'s check cell checks another"
        assert e["name"] in ah.exercises.checks(), f"no check is registered for exercise {e['name']}"
        # the negative control: the committed chapter ran the unanswered check, which must not hold
        assert f"Exercise {e['name']}: not answered yet" in _outputs(e["check"]), (
            f"{e['name']}'s check cell has no stored 'not answered yet' (execute the chapter)"
        )


def test_every_registered_check_is_under_an_exercise():
    placed = {e["name"] for nb in NOTEBOOKS for e in exercises(nb) if e["check"] is not None}
    assert set(ah.exercises.checks()) == placed


@pytest.mark.parametrize("name", sorted(ah.exercises.checks()))
def test_a_check_rejects_its_wrong_answer_and_an_unanswered_cell(name):
    c = ah.exercises.checks()[name]
    assert set(c.wrong) >= set(c.answers), f"{name}'s wrong answer must give every answer"
    wrong = ah.exercises.check(name, **c.wrong)
    assert wrong.holds is False and "Hint:" in wrong.message, wrong.message
    unanswered = ah.exercises.check(name, **{**c.wrong, **dict.fromkeys(c.answers, ...)})
    assert unanswered.holds is None and not unanswered


RUNNER = """
import ast, json, sys
import accelhelpers as ah

def run_block(source, namespace):
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<solution>", "exec"), namespace)
    return eval(compile(ast.Expression(last.value), "<solution>", "eval"), namespace) if last else None

report = {}
for name, blocks in json.load(sys.stdin).items():
    try:
        namespace = {}
        results = [run_block(b, namespace) for b in blocks]
        last = results[-1]
        report[name] = [getattr(last, "holds", None), repr(last)]
    except Exception as e:
        report[name] = [False, f"the solution raised {type(e).__name__}: {e}"]
print("RESULTS " + json.dumps(report))
"""


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_the_worked_solutions_pass_their_checks(nb):
    """Each chapter's solutions run in a process of their own, as a learner runs them in a fresh kernel (one
    chapter's state, XLA's or accelerate's, cannot leak into another's); each block runs as a notebook cell, and an
    exercise's last block ends with its check, which must hold."""
    import subprocess
    import sys

    names = [e["name"] for e in exercises(nb) if e["check"] is not None]
    if nb.stem.startswith("07") and not ah.device.xla_installed():
        pytest.skip("chapter 07's solutions train on XLA's CPU device: torch_xla is not installed here")
    blocks = solution_blocks(solution_file(nb))
    missing = [n for n in names if not blocks.get(n)]
    assert not missing, f"{solution_file(nb).name} has no python block for {missing}"
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps({n: blocks[n] for n in names}),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert line, f"the solutions of {nb.stem} did not finish:\n{proc.stderr[-3000:]}"
    report = json.loads(line.removeprefix("RESULTS "))
    failed = {n: msg for n, (holds, msg) in report.items() if holds is not True}
    assert not failed, "\n".join(f"{n}: {msg}" for n, msg in failed.items())
    assert sorted(report) == sorted(names)


def test_check_says_what_is_wrong_in_one_line():
    with pytest.raises(ValueError, match="no exercise '99.9' has a check"):
        ah.exercises.check("99.9", answer=1)
    name, c = next(iter(sorted(ah.exercises.checks().items())))
    with pytest.raises(TypeError, match="needs the answer"):
        ah.exercises.check(name)


def test_the_solutions_index_lists_every_chapter():
    index = (SOLUTIONS / "index.md").read_text()
    for nb in NOTEBOOKS:
        assert f"]({nb.stem}.md)" in index, f"solutions/index.md does not link {nb.stem}.md"
