"""The course in a real browser: chapter 01 in JupyterLab as a new user runs it, and the `make course` report.

Headless Chromium is Debian's `chromium` package (`make test` installs it when it can), driven by Playwright with
its executable path: no browser is ever downloaded. ACCEL_CHROMIUM names another Chromium. Without one these tests
skip, unless ACCEL_REQUIRE_BROWSER=1, where they fail. Screenshots go to build/screenshots/.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest
from papermill.iorw import load_notebook_node
from papermill.parameterize import parameterize_notebook

import accelhelpers as ah
from tests.conftest import CHAPTER_01_PARAMS

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "build" / "screenshots"
CHAPTER = "01_hardware_and_timing.ipynb"
# Without the background-networking flags Chromium keeps opening connections that a closed network refuses.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INSTALL_HINT = ("install Debian's chromium (`apt-get install chromium`; `make test` does it as root) "
                "or set ACCEL_CHROMIUM to a Chromium executable")


def _find_chromium() -> tuple[str | None, str]:
    """The Chromium to drive, and why there is none."""
    named = os.environ.get("ACCEL_CHROMIUM")
    if named:
        found = shutil.which(named)
        return found, f"ACCEL_CHROMIUM={named!r} is not an executable"
    for candidate in (shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate, ""
    return None, "no Chromium found"


CHROMIUM, _why = _find_chromium()
if CHROMIUM is None:
    if os.environ.get("ACCEL_REQUIRE_BROWSER") == "1":
        pytest.fail(f"ACCEL_REQUIRE_BROWSER=1 but {_why}: {INSTALL_HINT}", pytrace=False)
    pytest.skip(f"browser tests: {_why}; {INSTALL_HINT}", allow_module_level=True)

from playwright.sync_api import sync_playwright  # noqa: E402  (only once a Chromium is known to exist)

# What JupyterLab 4 renders for an exception: a stderr-typed text output (like any warning), holding IPython's
# traceback: "ZeroDivisionError      Traceback (most recent call last)", or, for a SyntaxError, no such header but
# "Cell In[3], line 1". Harmless stderr (warnings, progress bars, a logged "Traceback ...:") matches neither.
_ERROR_OUTPUTS_JS = r"""(panel) => {
  const tb = /^\s*\S+\s{2,}Traceback \(most recent call last\)\s*$/m, where = /^\s*Cell In\[\d+\], line \d+/m;
  return [...panel.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')]
    .map(e => e.textContent).filter(t => tb.test(t) || where.test(t));
}"""
_STATE_JS = """(panel) => ({
  status: panel.querySelector('.jp-Notebook-ExecutionIndicator')?.dataset.status ?? null,
  prompts: [...panel.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim()),
  dialogs: document.querySelectorAll('.jp-Dialog').length,
})"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook(path: Path, *sources: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)


class Lab:
    """A JupyterLab server on 127.0.0.1 serving `root`, with its token."""

    def __init__(self, root: Path, port: int, token: str, log: Path):
        self.root, self.port, self.token, self.log = root, port, token, log
        self.base = f"http://127.0.0.1:{port}"

    def api(self, path: str):
        with urllib.request.urlopen(f"{self.base}{path}?token={self.token}", timeout=5) as r:
            return json.load(r)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`jupyter lab` as a new user starts it: fresh settings and workspace, on a copy of the chapters to run."""
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "notebooks"
    root.mkdir()
    # A copy (JupyterLab saves: never the committed notebook), with the small sizes of the shared CLI run injected
    # after its parameters cell as papermill does: the browser is what is tested here, and nbval runs the chapter's
    # own sizes.
    nb = load_notebook_node(str(ROOT / "notebooks" / CHAPTER))  # papermill's reader: every cell gets its tags list
    small = ah.commands.course.parse_parameters(CHAPTER_01_PARAMS, {"01": ROOT / "notebooks" / CHAPTER})["01"]
    nbformat.write(parameterize_notebook(nb, small), root / CHAPTER)
    _notebook(root / "error_control.ipynb", "import sys, warnings\nprint('a harmless note', file=sys.stderr)\n"
              "warnings.warn('a harmless warning')", "1/0", "print('never reached')")
    # A new user's view, minus the one first-run question: "get notified about official Jupyter news?".
    settings = tmp / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    env = {**os.environ,
           "ACCEL_RESULTS_DIR": str(tmp / "build" / "results"), "ACCEL_BUILD": str(tmp / "build"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp / "lab-settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "workspaces"),
           "JUPYTER_CONFIG_DIR": str(tmp / "jupyter-config"), "JUPYTER_RUNTIME_DIR": str(tmp / "jupyter-runtime"),
           "IPYTHONDIR": str(tmp / "ipython")}
    env.setdefault("ACCEL_PROFILE", "quick")
    for name in ("ACCEL_DEVICE", "TQDM_DISABLE"):  # a new user's kernel: chosen device, progress bars shown
        env.pop(name, None)
    port, token = _free_port(), secrets.token_hex(16)
    log = tmp / "jupyter-lab.log"
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
           f"--port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root,
                                start_new_session=True)  # a Ctrl+C of pytest is left to the finalizer below
    server = Lab(root, port, token, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                server.api("/api/status")
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"jupyter lab did not answer on port {port} in 90 s:\n{server.log_tail()}")
                time.sleep(0.3)
        yield server
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server (it shuts its kernels down), kill it if it hangs, then any kernel it left behind."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)  # the kernels: own sessions, not our group
    except psutil.NoSuchProcess:
        children = []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    _, alive = psutil.wait_procs(children, timeout=5)
    for child in alive:
        child.kill()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)  # a fresh temporary profile
        try:
            yield b
        finally:
            b.close()


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    pg.console_errors = []
    pg.on("pageerror", lambda e: pg.console_errors.append(f"page error: {e}"))
    pg.on("console", lambda m: pg.console_errors.append(f"{m.text} ({m.location.get('url')})")
          if m.type == "error" else None)
    yield pg
    context.close()


def _run_all(page, lab: Lab, name: str, timeout: float = 240):
    """Open `name` in JupyterLab, wait for its kernel, Run > Run All Cells, wait until every queued cell is done.

    Returns the notebook panel and its final state (kernel status, input prompts, open dialogs)."""
    page.goto(f"{lab.base}/lab/tree/{name}?reset&token={lab.token}")
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").first
    panel.locator(".jp-CodeCell").first.wait_for()
    deadline = time.monotonic() + 90  # the kernel starts on opening, as for any user; Run All waits for it
    while True:
        sessions = [s for s in lab.api("/api/sessions") if s["path"] == name]
        state = panel.evaluate(_STATE_JS)
        if sessions and sessions[0]["kernel"]["execution_state"] == "idle" and state["status"] == "idle":
            break
        assert time.monotonic() < deadline, f"the kernel of {name} never became idle: {sessions} {state}"
        time.sleep(0.3)
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu .lm-Menu-item", has_text=re.compile(r"^Run All Cells")).click()
    t0, done_twice = time.monotonic(), 0
    while done_twice < 2:  # idle, nothing queued ([*]), the first cell numbered; twice in a row
        time.sleep(0.5)
        state = panel.evaluate(_STATE_JS)
        done = (state["status"] == "idle" and state["prompts"] and re.search(r"\d", state["prompts"][0])
                and not any("*" in p for p in state["prompts"]))
        done_twice = done_twice + 1 if done else 0
        assert not state["dialogs"], f"a dialog opened while running {name}: {page.locator('.jp-Dialog').inner_text()}"
        assert time.monotonic() - t0 < timeout, f"{name} still running after {timeout:.0f} s: {state}"
    state["seconds"] = round(time.monotonic() - t0, 1)
    return panel, state


def _save(page, panel, path: Path, n_expected: int) -> nbformat.NotebookNode:
    """Ctrl+S in the notebook; return the saved file once it holds the run's execution counts."""
    panel.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})  # focus the notebook, not an editor
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 30
    while True:
        nb = nbformat.read(path, as_version=4)
        if sum(c.get("execution_count") is not None for c in nb.cells if c.cell_type == "code") >= n_expected:
            return nb
        assert time.monotonic() < deadline, f"{path.name} was not saved with its outputs within 30 s"
        time.sleep(0.3)


@pytest.mark.slow
def test_chapter_01_runs_in_jupyterlab_without_errors(lab, page):
    panel, state = _run_all(page, lab, CHAPTER)
    n_code = sum(c.cell_type == "code" for c in nbformat.read(lab.root / CHAPTER, as_version=4).cells)
    errors = panel.evaluate(_ERROR_OUTPUTS_JS)
    assert not errors, "error output in JupyterLab:\n" + "\n\n".join(errors) + "\n" + "\n".join(page.console_errors)
    assert len(state["prompts"]) == n_code and all(re.fullmatch(r"\[\d+\]:", p) for p in state["prompts"]), \
        f"not every code cell ran: {state['prompts']}"
    assert panel.locator(".jp-OutputArea-output img").count() >= 1, "the roofline figure is not shown"
    # code cells: the install cell, the `parameters` cell, the injected one, then `S = ah.session.setup(...)`, which
    # prints the report
    setup = panel.locator(".jp-CodeCell").nth(3).locator(".jp-OutputArea").text_content()
    assert "best_device" in setup and "profile" in setup, f"the setup cell shows no hardware report: {setup!r}"
    saved = _save(page, panel, lab.root / CHAPTER, n_code)
    outputs = [o for c in saved.cells if c.cell_type == "code" for o in c.outputs]
    assert outputs and not [o for o in outputs if o.output_type == "error"]
    # The saved notebook with the measured roofline in view, in a tall window to show more of the run.
    page.set_viewport_size({"width": 1440, "height": 1600})
    panel.locator(".jp-OutputArea-output img").first.evaluate("e => e.scrollIntoView({block: 'center'})")
    page.wait_for_timeout(1000)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SHOTS / "jupyterlab_ch01.png", full_page=True)
    print(f"chapter 01 ran in JupyterLab in {state['seconds']} s; browser console errors: {page.console_errors}")


@pytest.mark.slow
def test_the_error_check_catches_an_exception(lab, page):
    """Negative control: the same run and checks on a notebook whose second cell raises."""
    panel, state = _run_all(page, lab, "error_control.ipynb", timeout=60)
    errors = panel.evaluate(_ERROR_OUTPUTS_JS)
    assert len(errors) == 1 and "ZeroDivisionError" in errors[0], errors
    stderr = panel.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    assert "a harmless warning" in stderr.first.inner_text()  # shown as stderr, yet not taken for an error
    # Run All queues every cell; after cell 2 fails, ipykernel 7 aborts the requests it already holds, and one that
    # reaches its shell thread a moment later still runs (that thread ignores stop_on_error_timeout): on a loaded
    # host the third cell may run. What must hold: the second cell is the one that failed, and the only one.
    assert state["prompts"][:2] == ["[1]:", "[2]:"], state["prompts"]
    saved = _save(page, panel, lab.root / "error_control.ipynb", 2)
    assert [o.ename for c in saved.cells for o in c.outputs if o.output_type == "error"] == ["ZeroDivisionError"]


@pytest.mark.slow
def test_course_report_renders(tmp_path, page, chapter_01_run):
    """build/report.html of a real run of chapter 01 (the shared one of conftest.py), opened from disk as
    `make course` leaves it."""
    import shutil

    import accelhelpers as ah

    run_out, returncode, output = chapter_01_run
    assert returncode == 0, output
    out = tmp_path / "build"
    shutil.copytree(run_out, out)  # the report is written afresh here, not into the shared run
    _, html_path = ah.commands.course.report(out)
    page.goto(html_path.resolve().as_uri())
    page.wait_for_load_state("load")
    assert page.title() == "accel-course report"
    assert page.get_by_role("heading", level=1).inner_text() == "accel-course report"
    assert page.get_by_role("heading", name="Hardware", exact=True).is_visible()
    chapters = page.locator("table").filter(has=page.locator("th", has_text=re.compile(r"^status$")))
    assert chapters.is_visible(), "no chapter table (a table with a 'status' column)"
    row = chapters.locator("tr", has_text=ah.commands.course.TITLES["01"])
    assert row.is_visible() and row.locator("td.ok").inner_text() == "ok"
    images = page.evaluate("() => [...document.images].map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])")
    assert images and all(complete and width > 0 for _, complete, width in images), images
    assert any("01_roofline.png" in src for src, *_ in images)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SHOTS / "report.png", full_page=True)
