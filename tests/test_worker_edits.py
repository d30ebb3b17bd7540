"""A learner's edit reaches every launched worker (accelhelpers/cells.py): the export cells a Jupyter kernel ran go to
the processes `ah.launch` starts, and `import accelhelpers` there runs them over the installed package. The chapter
tests edit a copy of chapters 06, 09 and 11 (a defining cell whose function then raises), run it in a real kernel as
far as its first launch, and check that the launched worker fails with that edit: no `make export` in between."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from accelhelpers import cells

ROOT = Path(__file__).resolve().parents[1]


def test_from_history_keeps_each_modules_export_cells_in_the_order_they_last_ran():
    a = "#| export\ndef f():\n    return 1\n"
    a2 = "#| export\ndef f():\n    return 2\n"
    other = "#| export speedrun\nX = 1\n"
    history = ["", "import accelhelpers as ah", a, "#| default_exp parallel\n", a, "print('not exported')", a2,
               "#|export\ndef broken(:\n", other, a, "#| exporti\n_y = 3\n"]
    assert cells.from_history(history) == {"parallel": [a2, a, "#| exporti\n_y = 3\n"], "speedrun": [other]}
    assert cells.from_history(["#| export\nX = 1\n"]) == {}  # no module named yet: nothing to send
    assert cells.from_kernel() == {}  # pytest is not a Jupyter kernel
    assert cells.launch_env() == {}


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, cwd=ROOT)


def test_a_launched_process_runs_the_cells_over_the_package_and_says_when_it_cannot(tmp_path):
    cellfile = tmp_path / "cells.json"
    cellfile.write_text(json.dumps({
        "launch": ["#| export\ndef free_port():\n    return -7\n", "#| export\nraise ValueError('cell 2 broke')\n",
                   "#| export\nFROM_CELL = free_port()\n"],
        "mine": ["#| export\ndef hello():\n    return 'a new module'\n"]}))
    code = "import accelhelpers as ah; print(ah.launch.free_port(), ah.launch.FROM_CELL, ah.mine.hello())"
    run = _python(code, {cells.ENV_VAR: str(cellfile)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["-7", "-7", "a", "new", "module"]
    assert run.stderr.strip() == ("accelhelpers.launch: notebook cell 2 raised ValueError: cell 2 broke (as it did in "
                                  "the notebook); the other cells still apply")
    gone = _python("import accelhelpers", {cells.ENV_VAR: str(tmp_path / "gone.json")})
    assert gone.returncode == 1
    assert "cannot be read (FileNotFoundError): launch the process again from the notebook" in gone.stderr
    plain = _python("import accelhelpers as ah; print(ah.launch.free_port() > 0)", {cells.ENV_VAR: ""})
    assert plain.stdout.strip() == "True"  # without the variable: the installed package


# chapter: (the function its workers call, the cell of the first launch, cells skipped on the way, a cell that launches
# in its place: None runs the chapter's own)
CHAPTERS = {
    "06_distributed_data_parallel": ("setup_rank", 'torchrun("equivalence.py"', (), None),
    "09_long_runs": ("save_checkpoint", 'start("kill_mid_save.py"', (),
                     'print(finish(start("kill_mid_save.py", WORK / "edited", "--way", "atomic")).output)'),
    # the trials in the kernel (section 6) are not needed for the launch of the DDP candidate
    "11_speedrun": ("warm_up", 'WORKERS / "speedrun_ddp.py"', ("with ah.timing.noise_watch() as noise:",), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("chapter", sorted(CHAPTERS))
def test_an_edited_cell_reaches_the_launched_workers(chapter, tmp_path):
    function, launch_mark, skip_marks, after = CHAPTERS[chapter]
    nb = nbformat.read(ROOT / "notebooks" / f"{chapter}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    defining = next(c for c in code if f"\ndef {function}(" in c.source and c.source.startswith("#| export"))
    marker = f"edited in the notebook: {function} raises"
    defining.source += f"\n\n\ndef {function}(*args, **kwargs):\n    raise RuntimeError({marker!r})\n"
    last = next(i for i, c in enumerate(code) if launch_mark in c.source) + (0 if after else 1)
    kept = [c for c in code[:last] if not any(c.source.startswith(m) for m in skip_marks)]
    if after:
        kept.append(nbformat.v4.new_code_cell(after))
    nb.cells = kept
    env = {"ACCEL_PROFILE": "quick", "TQDM_DISABLE": "1", "ACCEL_BUILD": str(tmp_path / "build")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    printed = "\n".join(o.get("text", "") + "\n".join(o.get("traceback", [])) for o in kept[-1].outputs)
    earlier = [o for c in kept[:-1] for o in c.outputs if o.output_type == "error"]
    assert not earlier, f"a cell before the launch failed: {earlier[0].ename}: {earlier[0].evalue}"
    assert marker in printed, f"the workers ran the installed {function}, not the edited cell:\n{printed[-3000:]}"
