"""The CLI end to end: env, a course run (real chapter 01 and a failing chapter), the report, bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import accelhelpers as ah

ROOT = Path(__file__).resolve().parents[1]


def ah_devices() -> list[str]:
    from accelhelpers.device import available_devices

    return available_devices()


def cli(*args, env=None, cwd=ROOT):
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "accelhelpers", *args], capture_output=True, text=True,
                          cwd=cwd, env=full, timeout=300)


def _notebook(path: Path, *sources: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)


@pytest.fixture()
def toy_course(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    _notebook(nbs / "01_ok.ipynb", "import accelhelpers as ah\nS = ah.session.setup('01', verbose=False)",
              "ah.results.record('answer', 42.0, 'units', 'a toy result')",
              "from ipykernel.connect import get_connection_info\n"
              "print('encrypted:', 'curve_secretkey' in get_connection_info(unpack=True))")
    _notebook(nbs / "02_broken.ipynb", "import accelhelpers as ah\nah.session.setup('02', verbose=False)",
              "raise RuntimeError('this chapter is broken on purpose')")
    _notebook(nbs / "03_ok.ipynb", "import accelhelpers as ah\nah.session.setup('03', verbose=False)",
              "ah.results.record('three', 3, 'x')")
    return tmp_path


@pytest.mark.slow
def test_env_prints_the_report():
    r = cli("env")
    assert r.returncode == 0 and "best_device" in r.stdout and "torch" in r.stdout
    assert json.loads(cli("env", "--json").stdout)["torch"]


@pytest.mark.slow
def test_run_goes_on_past_a_failing_chapter_and_names_it(toy_course):
    out = toy_course / "build"
    r = cli("course", "run", "--out", "build", env={"ACCEL_NOTEBOOKS": str(toy_course / "notebooks")}, cwd=toy_course)
    assert r.returncode == 1
    # each kernel gets CurveZMQ keys from its manager, so none warns that it runs over TCP without encryption
    assert "without encryption" not in r.stderr
    done = nbformat.read(out / "notebooks" / "01_ok.ipynb", as_version=4)
    assert done.cells[-1].outputs[0]["text"] == "encrypted: True\n"
    assert not (toy_course / "notebooks" / "build").exists()  # a relative --out is the caller's, not the kernel's
    assert "02_broken.ipynb" in r.stderr and "failed" in r.stderr
    run = json.loads((out / "run.json").read_text())
    assert [run["chapters"][k]["ok"] for k in ("01", "02", "03")] == [True, False, True]
    assert "broken on purpose" in run["chapters"]["02"]["error"]
    report = (out / "report.md").read_text()
    assert "| answer | 42 | units | a toy result |" in report and "FAILED" in report
    html = (out / "report.html").read_text()
    assert "broken on purpose" in html and "Failed chapters" in html and "2 of 3 chapters ran" in html
    assert (out / "notebooks" / "01_ok.ipynb").exists()
    # the toy chapter 01 records none of the real chapter 01's headline results: the CLI says so
    assert "headline result not recorded, chapter 01: fp32_matmul_peak" in r.stderr


@pytest.mark.slow
def test_bad_input_is_one_clear_message_and_writes_nothing(tmp_path, cli_here):
    out = tmp_path / "out"
    r = cli("course", "run", "--only", "99", "--out", str(out))  # through the real entry point, in a new process
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "no chapter '99': choose from 01" in r.stderr and not out.exists()
    r = cli_here("course", "run", "--profile", "bogus", "--out", out)
    assert r.returncode == 2 and "invalid choice: 'bogus' (choose from 'quick', 'full', 'smoke')" in r.stderr
    assert not out.exists()
    if "cuda" not in ah_devices():
        r = cli_here("bench", "fullbatch", "--rounds", "1", env={"ACCEL_DEVICE": "cuda"})
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.strip() == ("error: device 'cuda' is not present on this machine; present here: "
                                    f"{', '.join(ah_devices())}. Unset ACCEL_DEVICE or pass one of those.")
    assert cli_here("--version").stdout.strip().startswith("accelhelpers 0.")
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    r = cli_here("course", "run", "--out", afile)
    assert r.returncode == 2 and "is a file, not a folder" in r.stderr and afile.read_text() == "x"
    r = cli_here("course", "report", "--out", out)
    assert r.returncode == 2 and "no course run found" in r.stderr
    r = cli_here("env", env={"ACCEL_PROFILE": "bogus"})
    assert r.returncode == 0 and "invalid" in r.stdout


@pytest.mark.slow
def test_real_chapter_01_through_the_cli(chapter_01_run):
    out, returncode, output = chapter_01_run  # `course run --only 1 --out … --param …` (conftest.py), shared
    assert returncode == 0, output
    names = {e["name"] for e in json.loads((out / "results" / "01.json").read_text())}
    assert {"fp32_matmul_peak", "copy_bandwidth", "mlp_forward_overhead"} <= names
    assert (out / "results" / "figures" / "01_roofline.png").exists()
    html = (out / "report.html").read_text()
    assert "fp32_matmul_peak" in html and "01_roofline.png" in html and "GFLOP/s" in html
    assert "Headline results" in html and "fp32 matmul peak" in html and "not recorded" not in output
    assert not list((ROOT / "notebooks").glob("*.tmp*"))


def test_headline_values_read_as_a_learner_reads_them():

    results = {"02": [{"name": "best_speedup_vs_naive", "value": 12.345, "unit": "x", "note": "n"},
                      {"name": "best_fraction_of_peak", "value": 0.5573, "unit": "fraction", "note": ""}],
               "99": [{"name": "best_speedup_vs_naive", "value": 1.0, "unit": "x", "note": ""}]}
    rows = ah.commands.course.headlines(results)
    assert [(k, v) for k, _, v, _ in rows] == [("02", "12.3×"), ("02", "55.7 %")]
    assert ah.commands.course._fmt_unit(213.03, "GFLOP/s") == "213 GFLOP/s"
    assert ah.commands.course._fmt_unit(True, "bool") == "True bool"


NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_parameters_cell_holds_literal_defaults_only(nb):
    """papermill can set any parameter: `PROFILE = None` and sizes, each a literal (None: from the profile)."""
    import ast

    cells = [c for c in nbformat.read(nb, as_version=4).cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{nb.name}: exactly one cell tagged 'parameters'"
    tree = ast.parse(cells[0].source)
    for stmt in tree.body:
        assert isinstance(stmt, ast.Assign), f"{nb.name}: only assignments in the parameters cell"
        ast.literal_eval(stmt.value)  # raises on anything that is not a literal
    names = ah.commands.course.parameter_names(nb)  # what `course run --param` can set
    assert names[0] == "PROFILE" and ast.literal_eval(tree.body[0].value) is None
    following = nbformat.read(nb, as_version=4).cells
    after = following[following.index(cells[0]) + 1].source
    assert f'ah.session.setup("{nb.name[:2]}", profile=PROFILE' in after


@pytest.mark.slow
def test_papermill_parameters_take_effect_in_a_real_chapter(chapter_01_run):
    """`course run --only 1 --param 'MATMUL_SIZES=[16, 32]' …` (papermill's parameters, conftest.py): the chapter
    times exactly the sizes it was given, in the quick profile."""
    out, returncode, output = chapter_01_run
    assert returncode == 0, output
    texts = ["".join(o.get("text", "")) for c in nbformat.read(out / "notebooks" / "01_hardware_and_timing.ipynb",
                                                                 as_version=4).cells
             if c.cell_type == "code" for o in c.get("outputs", [])]
    rows = [line for t in texts for line in t.splitlines() if line.startswith("n=") and "GFLOP/s" in line]
    assert [line.split(":")[0].split("=")[1].strip() for line in rows] == ["16", "32"]
    assert any("'quick' profile" in t for t in texts)


def test_param_names_a_parameter_the_chapter_has_or_says_which_it_has(tmp_path):
    selected = {"01": ROOT / "notebooks" / "01_hardware_and_timing.ipynb"}
    parsed = ah.commands.course.parse_parameters(["MATMUL_SIZES=[16, 32]"], selected)
    assert parsed == {"01": {"MATMUL_SIZES": [16, 32]}}
    for bad, says in (("MATMUL_SIZE=[1]", "no chosen chapter has that parameter; they have "),
                      ("MATMUL_SIZES", "NAME=VALUE"), ("PROFILE=full", "--profile")):
        with pytest.raises(ah.commands.course.CourseError, match=says):
            ah.commands.course.parse_parameters([bad], selected)
    r = cli("course", "run", "--only", "1", "--out", str(tmp_path / "out"), "--param", "NOPE=1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "MATMUL_SIZES" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_course_run_passes_the_profile_as_a_parameter(tmp_path):
    nbs = tmp_path / "notebooks"
    nbs.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell("PROFILE = None")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(
        "import accelhelpers as ah\nS = ah.session.setup('01', profile=PROFILE, verbose=False)\n"
        "ah.results.record('full_profile', float(PROFILE == 'full' and S.profile == 'full'), '',\n"
        "                  'from the parameter')")]
    nbformat.write(nb, nbs / "01_params.ipynb")
    out = tmp_path / "build"
    r = cli("course", "run", "--profile", "full", "--out", str(out), "--no-report",
            env={"ACCEL_NOTEBOOKS": str(nbs), "ACCEL_PROFILE": "quick"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((out / "results" / "01.json").read_text())[0]["value"] == 1.0


@pytest.mark.slow
def test_course_run_never_writes_into_recorded_results(tmp_path):
    for target in (ROOT / "results", ROOT / "results" / "new_run"):
        r = cli("course", "run", "--only", "1", "--out", str(target))
        assert r.returncode == 2 and "recorded evidence" in r.stderr, r.stderr
    assert not (ROOT / "results" / "new_run").exists()


def test_headlines_show_their_range_and_flag_one_that_crosses_one():

    results = {"06": [{"name": "ddp_speedup_b512", "value": 1.05, "unit": "x", "note": "", "spread": [0.87, 1.31],
                       "repeats": 5},
                      {"name": "ddp_sync_share_b64", "value": 0.74, "unit": "fraction", "note": ""}],
               "02": [{"name": "best_speedup_vs_naive", "value": 12.0, "unit": "x", "note": "", "spread": [9.7, 16.6],
                       "repeats": 5}]}
    rows = {label: value for _, label, value, _ in ah.commands.course.headlines(results)}
    assert rows["the same, per-rank batch 512"] == \
        "1.05× (range 0.87×–1.31×, 5 repeats) — not a reliable difference on this machine"
    assert rows["fastest loop vs the naive loop (model-steps/s)"] == "12× (range 9.7×–16.6×, 5 repeats)"
    assert rows["share of a 2-rank DDP step that no_sync saves (all-reduce + bookkeeping)"] == "74 %"


def test_report_says_when_a_chapter_measured_under_noise(tmp_path):

    out = tmp_path / "build"
    (out / "results").mkdir(parents=True)
    (out / "results" / "01.json").write_text(json.dumps([{"name": "noise", "value": 0.6, "unit": "fraction",
                                                           "note": "TOO NOISY to trust small differences: load 4"}]))
    (out / "run.json").write_text(json.dumps({"profile": "quick", "finished": "now", "hardware": {}, "chapters": {
        "01": {"chapter": "01", "notebook": "01_x.ipynb", "ok": True, "error": None, "seconds": 1.0}}}))
    md, html = ah.commands.course.report(out)
    assert "Measured under noise, chapter 01:** TOO NOISY" in md.read_text()
    assert "Measured under noise, chapter 01:</b> TOO NOISY" in html.read_text()


@pytest.mark.slow
def test_readme_tables_are_exactly_what_the_command_writes():
    """The README's chapter map and results tables come from results/ (`python -m accelhelpers course readme`)."""

    r = cli("course", "readme", "--check")
    assert r.returncode == 0, r.stderr
    text, course = (ROOT / "README.md").read_text(), ah.commands.course
    block = text.split(course.README_BEGIN)[1].split(course.README_END)[0]
    assert block.strip() == course.readme_tables().strip() and "| loop | model-steps/s" in block
    chapters = text.split(course.MAP_BEGIN)[1].split(course.MAP_END)[0]
    assert chapters.strip() == course.chapter_map().strip() and "| 01 | [" in chapters


def _readme_with_a_cell_typed(text: str, begin: str, end: str) -> str:
    """The README with the third cell of the first data row inside begin...end replaced by a typed figure."""
    head, rest = text.split(begin, 1)
    block, tail = rest.split(end, 1)
    lines = block.splitlines()
    row = lines[next(i for i, line in enumerate(lines) if line.startswith("|---")) + 1]
    cells = row.split(" | ")
    typed = " | ".join([*cells[:2], "99 s", *cells[3:]])
    assert typed != row
    return f"{head}{begin}{block.replace(row, typed, 1)}{end}{tail}"


def test_the_readme_is_what_course_readme_writes_now():
    """README.md holds exactly what `course readme` writes from the newest recorded runs: no table is stale."""
    assert ah.commands.course.write_readme(ROOT / "README.md", check=True), \
        "README.md is stale: run `python -m accelhelpers course readme`"


@pytest.mark.parametrize("block", ["chapters", "results"])
def test_a_hand_edited_cell_of_a_readme_table_is_stale(tmp_path, block):
    """One typed cell in the chapter map or a results table fails the check, and `course readme` writes it back."""
    course, real = ah.commands.course, (ROOT / "README.md").read_text()
    begin, end = (course.MAP_BEGIN, course.MAP_END) if block == "chapters" else (course.README_BEGIN, course.README_END)
    readme = tmp_path / "README.md"
    readme.write_text(_readme_with_a_cell_typed(real, begin, end))
    assert course.write_readme(readme, check=True) is False
    assert course.write_readme(readme) is True and readme.read_text() == real


def test_every_table_in_the_readme_is_generated():
    """A README table lies between the markers of a command that writes it (`course readme`, or
    `tools/gpu_estimate.py --readme` for the GPU estimate), never typed by hand."""
    course = ah.commands.course
    blocks = [(course.MAP_BEGIN, course.MAP_END), (course.README_BEGIN, course.README_END),
              ("<!-- gpu-estimate:begin -->", "<!-- gpu-estimate:end -->")]
    text = (ROOT / "README.md").read_text()
    for begin, end in blocks:
        assert text.count(begin) == 1 and text.count(end) == 1, begin
        head, rest = text.split(begin, 1)
        text = head + rest.split(end, 1)[1]
    assert [line for line in text.splitlines() if line.lstrip().startswith("|")] == []


def test_the_chapter_map_is_the_newest_course_run_with_the_badges_of_course_links(tmp_path):
    """Every chapter in notebooks/, with its time and first headline in the course run that finished last, a failed
    chapter's error, a chapter the run did not reach, and the badge `course links` writes."""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[project.urls]\n'
                                             'Repository = "https://github.com/someone/fork"\n')
    (tmp_path / "notebooks").mkdir()
    for name in ("01_a.ipynb", "02_b.ipynb", "03_c.ipynb"):
        (tmp_path / "notebooks" / name).write_text("{}")

    def recorded(name, finished, seconds):
        folder = tmp_path / "results" / name
        (folder / "results").mkdir(parents=True)
        chs = {"01": {"chapter": "01", "notebook": "01_a.ipynb", "ok": True, "error": None, "seconds": seconds},
               "02": {"chapter": "02", "notebook": "02_b.ipynb", "ok": False, "error": "OSError: disk", "seconds": 2.0}}
        (folder / "run.json").write_text(json.dumps({"profile": "quick", "finished": finished,
                                                     "hardware": {"cpu": "AMD EPYC", "cpu_cores": 2}, "chapters": chs}))
        (folder / "results" / "01.json").write_text(json.dumps([
            {"name": "copy_bandwidth", "value": 17.4, "unit": "GB/s", "note": ""},
            {"name": "fp32_matmul_peak", "value": seconds, "unit": "GFLOP/s", "note": "", "spread": [1.0, 300.0],
             "repeats": 3}]))

    recorded("course_new", "2026-12-03 14:45:21", 206.0)
    recorded("course_old", "2026-11-30 21:13:00", 150.0)  # its name sorts last; it finished first
    lines = ah.commands.course.chapter_map(tmp_path / "results").splitlines()
    assert "`results/course_new/`" in lines[0] and "quick profile" in lines[0] and "AMD EPYC, 2 cores" in lines[0]
    rows = [line for line in lines if line.startswith("| 0")]
    badge = ah.commands.links.badge("https://github.com/someone/fork", "01_a.ipynb", alt="Colab")
    assert rows[0] == ("| 01 | [Your hardware, and timing it honestly](notebooks/01_a.ipynb) | 206 s | fp32 matmul "
                       f"peak: **206 GFLOP/s (range 1 GFLOP/s–300 GFLOP/s, 3 repeats)** | {badge} |")
    assert "| 2 s | FAILED: OSError: disk |" in rows[1] and "| – | not in that run |" in rows[2] and len(rows) == 3
    for folder in (tmp_path / "results").iterdir():
        (folder / "run.json").unlink()
    with pytest.raises(ah.commands.course.CourseError, match="no recorded course run"):
        ah.commands.course.chapter_map(tmp_path / "results")


def test_readme_check_fails_when_a_table_was_edited_by_hand(tmp_path, monkeypatch):

    readme = tmp_path / "README.md"
    course = ah.commands.course
    begin, end = course.README_BEGIN, course.README_END
    readme.write_text(f"intro\n{course.MAP_BEGIN}\n| typed | 9 s |\n{course.MAP_END}\n{begin}\n| typed | 99× |\n{end}"
                      "\nrest\n")
    assert course.write_readme(readme, check=True) is False
    assert course.write_readme(readme) is True
    assert course.write_readme(readme, check=True) is True
    assert readme.read_text().startswith("intro\n") and readme.read_text().endswith("rest\n")
    assert "| typed |" not in readme.read_text()
    readme.write_text(f"{course.MAP_BEGIN}\n{course.MAP_END}\nno results markers")
    with pytest.raises(course.CourseError, match="no results markers"):
        course.write_readme(readme)
    readme.write_text(f"{begin}\n{end}\nno chapter map")
    with pytest.raises(course.CourseError, match="no chapter-map markers"):
        course.write_readme(readme)


def test_a_damaged_recorded_udlbook_run_is_bad_input_for_the_readme(tmp_path):
    """udlbook's reader raises its own ResultError; the readme command turns it into one line, like results/."""
    folder = tmp_path / "results" / "udlbook-20.2_cpu-test_2026-01-02"
    folder.mkdir(parents=True)
    (folder / "udlbook-20.2.json").write_text('{"schema": ')
    with pytest.raises(ah.udlbook.ResultError):
        ah.udlbook.recorded(tmp_path)
    with pytest.raises(ah.commands.course.CourseError, match="udlbook-20.2.json is not valid JSON"):
        ah.commands.course.readme_tables(tmp_path / "results")


@pytest.mark.slow
def test_plain_pytest_nbval_compares_the_quick_cpu_run_on_any_machine(tmp_path):
    """A machine whose environment asks for the full profile on a GPU (as a GPU machine's default would) still
    compares the committed quick CPU outputs: the root conftest.py sets both for every kernel nbval starts."""
    probe = ROOT / "build" / "nbval_probe"
    probe.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell("import os\nprint(os.environ['ACCEL_PROFILE'], os.environ['ACCEL_DEVICE'])")
    cell.execution_count = 1
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="quick cpu\n")]
    nb.cells = [cell]
    nbformat.write(nb, probe / "probe.ipynb")
    r = subprocess.run([sys.executable, "-m", "pytest", "--nbval", str(probe / "probe.ipynb"), "-q",
                        "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},  # not -n 2's
                            "ACCEL_PROFILE": "full", "ACCEL_DEVICE": "cuda"})
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:]


def test_report_html_is_rendered_from_the_shipped_template_and_escapes_what_it_shows(tmp_path):
    """The page comes from accelhelpers/templates/report.html.j2 (package data, so a wheel carries it); recorded text
    such as an error message is shown, never interpreted as markup."""
    import fnmatch
    import importlib.resources
    import tomllib


    template = importlib.resources.files("accelhelpers") / "templates" / "report.html.j2"
    assert template.is_file()
    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch("templates/report.html.j2", p) for p in shipped["accelhelpers"])
    out = tmp_path / "build"
    (out / "results" / "figures").mkdir(parents=True)
    (out / "results" / "figures" / "01_plot.png").write_bytes(b"")
    (out / "results" / "01.json").write_text(json.dumps([
        {"name": "fp32_matmul_peak", "value": 213.0, "unit": "GFLOP/s", "note": "a <b>bold</b> & claim"}]))
    (out / "run.json").write_text(json.dumps({"profile": "quick", "finished": "now", "hardware": {}, "chapters": {
        "01": {"chapter": "01", "notebook": "01_x.ipynb", "ok": True, "error": None, "seconds": 1.0},
        "02": {"chapter": "02", "notebook": "02_x.ipynb", "ok": False, "error": "ValueError: <script>x</script>",
               "seconds": 2.0}}}))
    _, html = ah.commands.course.report(out)
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "<title>accel-course report</title>" in page
    assert "1 of 2 chapters ran, in 3 s." in page and "Failed chapters:" in page
    assert "<script>" not in page and "ValueError: &lt;script&gt;x&lt;/script&gt;" in page
    assert "a &lt;b&gt;bold&lt;/b&gt; &amp; claim" in page and "<td class=num>213 GFLOP/s</td>" in page
    assert "<img src='results/figures/01_plot.png' alt='01_plot'>" in page and "all 1 recorded results" in page
    assert page.count("<h2 id=ch") == 2 and "{{" not in page and "{%" not in page


@pytest.mark.slow
def test_cli_says_bad_input_in_one_line_and_leaves_a_bug_its_traceback(tmp_path, monkeypatch, cli_here):
    """Only the package's own input errors (CommandError, DeviceUnavailable) become one line and exit 2; any other
    exception, a ValueError from deep inside included, is a bug and keeps its traceback."""
    from accelhelpers.__main__ import main

    (tmp_path / "run.json").write_text("{not json")
    r = cli("course", "report", "--out", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "run.json is not valid JSON" in r.stderr
    r = cli_here("reproduce", "udlbook-20.2", "--depths", "7", "--out", tmp_path / "udl")
    assert r.returncode == 2 and r.stderr.strip() == "error: --depths must be among 1,2,3,4, got [7]"
    r = cli_here("reproduce", "udlbook-20.2", "--depths", "one", "--out", tmp_path / "udl")
    assert r.returncode == 2 and "'one' is not a comma-separated list of depths" in r.stderr
    assert not (tmp_path / "udl").exists()

    def bug(*args, **kwargs):
        raise ValueError("an internal bug, not bad input")

    monkeypatch.setattr(ah.commands.course, "write_readme", bug)
    with pytest.raises(ValueError, match="internal bug"):
        main(["course", "readme", "--check"])
    code = ("import sys; import accelhelpers as ah; from accelhelpers.__main__ import main\n"
            "def bug(**kw): raise ValueError('an internal bug')\n"
            "ah.commands.course.write_readme = bug; sys.exit(main(['course', 'readme']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr
    assert r.stderr.strip().endswith("ValueError: an internal bug") and "error: an internal bug" not in r.stderr
