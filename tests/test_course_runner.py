"""The course runner's reliability: --only and --out cannot reach outside the course, a re-run replaces the results
instead of piling them up, Ctrl-C (even one that a library turns into another error) leaves the last complete
report as it was, and parameters given for one chapter reach that chapter only."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

import accelhelpers as ah

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "USE_TORCH_XLA": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_only_cannot_reach_outside_the_notebooks(tmp_path):
    for only in ("../README.md", "/etc/passwd", "01/../../pyproject", "~", "notebooks/01"):
        with pytest.raises(ah.commands.course.CourseError, match="no chapter"):
            ah.commands.course.check_args("quick", only, tmp_path / "out")
    for nb in ah.commands.course.check_args("quick", None, tmp_path / "out").values():
        assert nb.resolve().parent == ah.commands.course.notebooks_dir().resolve()


@pytest.mark.parametrize("out", [".", "notebooks", "accelhelpers", "accelhelpers/sub", "tests"])
def test_out_cannot_write_over_the_sources(out):
    with pytest.raises(ah.commands.course.CourseError, match="would write over the course's sources"):
        ah.commands.course.check_args("quick", None, ROOT / out)


def _toy_notebook(path: Path, *sources: str) -> None:
    """A notebook with the given code cells."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)


@pytest.mark.slow
def test_course_reruns_overwrite_cleanly_and_ctrl_c_leaves_the_report_whole(tmp_path, monkeypatch):
    nbs, out, mark = tmp_path / "notebooks", tmp_path / "out", tmp_path / "mark"
    nbs.mkdir()
    _toy_notebook(nbs / "00_slow.ipynb", f"import pathlib, time\npathlib.Path({str(mark)!r}).touch()\ntime.sleep(30)")
    _toy_notebook(nbs / "01_toy.ipynb", "import os, accelhelpers as ah\nah.session.setup('01', verbose=False)",
                  "ah.results.record('value', float(os.environ['TOY_VALUE']), 'x')")
    monkeypatch.setenv("ACCEL_NOTEBOOKS", str(nbs))
    for value in ("1.5", "2.5"):  # a re-run replaces the results, it does not pile them up
        monkeypatch.setenv("TOY_VALUE", value)
        assert [s["ok"] for s in ah.commands.course.run("quick", "01", out, progress=False)] == [True]
        ah.commands.course.report(out)
    assert "| value | 2.5 | x |" in (out / "report.md").read_text() and "1.5" not in (out / "report.md").read_text()
    assert [e["value"] for e in json.loads((out / "results" / "01.json").read_text())] == [2.5]
    assert list(json.loads((out / "run.json").read_text())["chapters"]) == ["01"]
    before = {p: p.read_bytes() for p in (out / "run.json", out / "report.md", out / "report.html")}
    proc = subprocess.Popen([sys.executable, "-m", "accelhelpers", "course", "run", "--out", str(out)], cwd=ROOT,
                            env={**ENV, "ACCEL_NOTEBOOKS": str(nbs)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 90
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mark.exists(), "chapter 00 never started"
        proc.send_signal(signal.SIGINT)  # Ctrl-C while a chapter runs
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted: run.json and the report were left as they were" in err, err[-3000:]
    assert {p: p.read_bytes() for p in before} == before  # the last complete run's report, untouched
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def test_ctrl_c_that_a_library_turns_into_an_error_still_stops_the_course_run(tmp_path, monkeypatch):
    import papermill

    def interrupted_execute(*args, **kwargs):  # nbclient/jupyter_client may re-raise Ctrl-C as another error
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise RuntimeError("Kernel died before replying") from None

    nbs, out = tmp_path / "notebooks", tmp_path / "out"
    nbs.mkdir()
    _toy_notebook(nbs / "00_a.ipynb", "pass")
    _toy_notebook(nbs / "01_b.ipynb", "pass")
    monkeypatch.setenv("ACCEL_NOTEBOOKS", str(nbs))
    monkeypatch.setattr(papermill, "execute_notebook", interrupted_execute)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the tests run in the background (nohup, CI)
    with pytest.raises(KeyboardInterrupt):
        ah.commands.course.run("quick", None, out, progress=False)
    assert not (out / "run.json").exists()  # the interrupted run wrote nothing; chapter 01 never started
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C handling given back as it was


@pytest.mark.slow
def test_the_course_runner_gives_a_chapter_its_own_profile(tmp_path, monkeypatch):
    """The device check runs chapter 11's full profile on a GPU: run(..., parameters={key: {...}}) reaches that
    chapter's parameters cell only, and its status says which profile it ran."""
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    for key in ("01", "11"):
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        params = nbformat.v4.new_code_cell("PROFILE = None")
        params.metadata["tags"] = ["parameters"]
        nb.cells = [params, nbformat.v4.new_code_cell(
            f"import accelhelpers as ah\nS = ah.session.setup('{key}', profile=PROFILE, verbose=False)\n"
            "ah.results.record('full', float(S.profile == 'full'), '')")]
        nbformat.write(nb, nbs / f"{key}_toy.ipynb")
    monkeypatch.setenv("ACCEL_NOTEBOOKS", str(nbs))
    statuses = ah.commands.course.run("quick", None, tmp_path / "out", progress=False,
                                      parameters={"11": {"PROFILE": "full"}})
    assert [(s["chapter"], s["ok"], s.get("profile")) for s in statuses] == [("01", True, None), ("11", True, "full")]
    results = ah.results.load_results(tmp_path / "out" / "results")
    assert [results[k][0]["value"] for k in ("01", "11")] == [0.0, 1.0]
    assert "11" in ah.commands.course.GPU_CHAPTERS and "11" in ah.commands.course.FULL_ON_GPU


# --- papermill reads every chapter's parameters cell ---------------------------------------------------------------
def papermill_parameters(source: str) -> tuple[list[str], list[str]]:
    """The parameter names papermill's Python translator finds in a parameters cell, and the warnings it logs (an `=`
    inside a comment makes it skip the line: "Unable to parse line 3 ...")."""
    import logging

    from papermill.translators import PythonTranslator

    logger, caught = logging.getLogger("papermill"), []
    handler = logging.Handler()
    handler.emit = lambda record: caught.append(record.getMessage())
    logger.addHandler(handler)
    try:
        found = PythonTranslator.inspect(nbformat.v4.new_code_cell(source))
    finally:
        logger.removeHandler(handler)
    return [p.name for p in found], caught


@pytest.mark.parametrize("chapter", sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
def test_papermill_parses_every_line_of_each_parameters_cell(chapter):
    nb = nbformat.read(ROOT / "notebooks" / chapter, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    names, warnings = papermill_parameters(cell.source)
    assigned = [line.split("=")[0].strip() for line in cell.source.splitlines() if line and not line.startswith("#")]
    assert not warnings and names == assigned, (chapter, warnings, sorted(set(assigned) - set(names)))


def test_papermill_parameters_catches_an_equals_sign_in_a_comment_negative_control():
    names, warnings = papermill_parameters("A = 1  # fine\nB = 500  # 4000 = 8 x 500\n")
    assert names == ["A"] and warnings == ["Unable to parse line 2 'B = 500  # 4000 = 8 x 500'."]


@pytest.mark.slow
def test_the_device_check_runs_end_to_end(tmp_path):
    """`course device-check` as a GPU machine runs it, on this CPU with chapter 01's small sizes and a one-round
    benchmark: the hardware report, the benchmark's JSON, the chapter and its report; a bad --param stops it in one
    line before the benchmark's minutes. (CI ran `make device-check --only 01` as a stage of its own before: 175 s.)"""
    from tests.conftest import CHAPTER_01_PARAMS

    env = {**ENV, "ACCEL_RESULTS_DIR": str(tmp_path / "results"), "ACCEL_BUILD": str(tmp_path / "build")}
    params = [arg for p in CHAPTER_01_PARAMS for arg in ("--param", p)]
    cmd = [sys.executable, "-m", "accelhelpers", "course", "device-check", "--only", "01", "--out",
           str(tmp_path / "dc"), "--bench-rounds", "1", "--bench-round-s", "0.05"]
    r = subprocess.run([*cmd, *params], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = tmp_path / "dc"
    assert json.loads((out / "bench_fullbatch.json").read_text())["rounds"] == 1
    assert json.loads((out / "hardware.json").read_text())["best_device"] == "cpu"
    assert [k for k, st in json.loads((out / "run.json").read_text())["chapters"].items() if st["ok"]] == ["01"]
    assert (out / "report.md").exists() and f"device check: {out}" in r.stdout
    bad = subprocess.run([*cmd, "--param", "NO_SUCH=1"], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert bad.returncode == 2 and "NO_SUCH" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "interleaved rounds" not in bad.stdout  # the benchmark never started


def test_the_device_check_never_records_over_a_recorded_one(tmp_path, monkeypatch):
    monkeypatch.setattr(ah.commands.course, "results_root", lambda: tmp_path / "results")
    hw = ah.device.hardware_report()
    day = time.strftime("%Y-%m-%d")
    target = tmp_path / "results" / f"device-check_{ah.commands.course.hardware_slug(hw)}_{day}"
    (target / "results").mkdir(parents=True)
    with pytest.raises(ah.commands.course.CourseError, match="already holds a recorded device check"):
        ah.commands.course.device_check(tmp_path / "dc", record=True, only="01")
    assert not (tmp_path / "dc").exists() and list(target.iterdir()) == [target / "results"]  # nothing written
