"""Run the whole course with papermill and write a report of what this machine achieved."""

from __future__ import annotations

import html
import json
import os
import time
from pathlib import Path
from typing import Any

from .device import PROFILES, format_report, hardware_report
from .results import _atomic_write_text, load_results, repo_root

# The one place the course's repository is named: badges and Colab setup cells must agree (tests/test_colab.py).
REPO_URL = "https://github.com/accel-course/accel-course"

TITLES = {
    "01": "Your hardware, and timing it honestly",
    "02": "Full-batch training and the fast loop",
    "03": "Momentum, Adam and one-cycle",
    "04": "Mixed precision",
    "05": "Feeding the accelerator",
    "06": "Distributed data parallel",
    "07": "TPUs and XLA",
    "08": "Quantization, ONNX and FPGA",
}


class CourseError(ValueError):
    """Bad arguments to the course runner; the message names the valid choices."""


def notebooks_dir() -> Path:
    """The notebooks/ folder of the checkout (ACCEL_NOTEBOOKS overrides, for tests)."""
    env = os.environ.get("ACCEL_NOTEBOOKS")
    if env:
        return Path(env)
    root = repo_root() or repo_root(Path(__file__).parent)
    if root is None:
        raise CourseError("cannot find the course's notebooks/ folder: run from inside the accel-course checkout")
    return root / "notebooks"


def chapters(folder: Path | None = None) -> dict[str, Path]:
    """The chapter notebooks, keyed by their two-digit number."""
    folder = folder or notebooks_dir()
    return {p.name[:2]: p for p in sorted(folder.glob("[0-9][0-9]_*.ipynb"))}


def default_out() -> Path:
    """build/ in the checkout."""
    return (repo_root() or repo_root(Path(__file__).parent) or Path.cwd()) / "build"


def _select(only: str | list[str] | None, available: dict[str, Path]) -> dict[str, Path]:
    """The chapters named by --only (e.g. '01,3'), checked against those that exist."""
    if not only:
        return dict(available)
    names = only.split(",") if isinstance(only, str) else list(only)
    chosen = {}
    for name in (n.strip() for n in names if n.strip()):
        key = name.zfill(2) if name.isdigit() else name
        if key not in available:
            raise CourseError(f"no chapter {name!r}: choose from {', '.join(available) or 'none found'}")
        chosen[key] = available[key]
    if not chosen:
        raise CourseError(f"--only named no chapter: choose from {', '.join(available)}")
    return chosen


def check_args(profile: str, only: str | list[str] | None, out: Path) -> dict[str, Path]:
    """Validate everything before anything is written; return the chapters to run."""
    if profile not in PROFILES:
        raise CourseError(f"unknown profile {profile!r}: choose one of {', '.join(PROFILES)}")
    if out.exists() and not out.is_dir():
        raise CourseError(f"--out {out} is a file, not a folder: give a folder (it is created if missing)")
    _check_out(out)
    return _select(only, chapters())


def _check_out(out: Path) -> None:
    """Refuse an output folder that would write over the course's sources (the checkout, its code, notebooks)."""
    target = out.resolve()
    root = repo_root(Path(__file__).parent)
    protected = [root / name for name in ("accelhelpers", "notebooks", "tests", ".ci", ".git")] if root else []
    if (root is not None and target == root.resolve()) \
            or any(target == p.resolve() or p.resolve() in target.parents for p in protected) \
            or (target / "notebooks").resolve() == notebooks_dir().resolve():
        raise CourseError(f"--out {out} would write over the course's sources: use build/ (the default) or a "
                          "folder outside accelhelpers/, notebooks/ and tests/")


def _run_one(key: str, nb: Path, out: Path, profile: str) -> dict[str, Any]:
    """Execute one chapter with papermill into out/notebooks; never raises for a failing notebook."""
    import papermill as pm

    results = out / "results"
    (results / f"{key}.json").unlink(missing_ok=True)
    for old in (results / "figures").glob(f"{key}_*.png"):
        old.unlink()
    env = {"ACCEL_PROFILE": profile, "ACCEL_RESULTS_DIR": str(results), "ACCEL_BUILD": str(out)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    t0 = time.perf_counter()
    status: dict[str, Any] = {"chapter": key, "notebook": nb.name, "ok": True, "error": None}
    try:
        pm.execute_notebook(str(nb), str(out / "notebooks" / nb.name), cwd=str(nb.parent),
                            progress_bar=False, log_output=False, kernel_name="python3")
    except Exception as e:  # a failing chapter is reported, the others still run
        status["ok"] = False
        status["error"] = f"{getattr(e, 'ename', type(e).__name__)}: {getattr(e, 'evalue', e)}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    status["seconds"] = round(time.perf_counter() - t0, 1)
    return status


def run(profile: str = "quick", only: str | list[str] | None = None, out: Path | None = None,
        progress: bool = True) -> list[dict[str, Any]]:
    """Execute the chosen chapters into `out` (default build/), record run times and failures in run.json."""
    out = Path(out) if out else default_out()
    selected = check_args(profile, only, out)
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    statuses = []
    bar = tqdm(selected.items(), desc="course", unit="chapter", disable=not progress)
    for key, nb in bar:
        bar.set_postfix_str(nb.stem)
        statuses.append(_run_one(key, nb, out, profile))
    previous = _load_run(out).get("chapters", {}) if (out / "run.json").exists() else {}
    previous.update({s["chapter"]: s for s in statuses})
    _atomic_write_text(out / "run.json", json.dumps(
        {"profile": profile, "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "hardware": hardware_report(),
         "chapters": dict(sorted(previous.items()))}, indent=1))
    return statuses


def _load_run(out: Path) -> dict[str, Any]:
    """The runner's run.json in `out`."""
    path = out / "run.json"
    if not path.exists():
        raise CourseError(f"no course run found in {out}: run `python -m accelhelpers course run` first")
    return json.loads(path.read_text())


def _fmt(value: Any) -> str:
    """A value for a table: floats to 3 significant digits."""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def report(out: Path | None = None) -> tuple[Path, Path]:
    """Write report.md and report.html in `out` from run.json, the recorded results and the figures."""
    out = Path(out) if out else default_out()
    run_info = _load_run(out)
    results = load_results(out / "results")
    figures = sorted((out / "results" / "figures").glob("*.png"))
    hw = run_info.get("hardware") or hardware_report()
    md = [f"# accel-course report\n\nProfile **{run_info['profile']}**, finished {run_info['finished']}.\n",
          "## Hardware\n", "```", format_report(hw), "```\n", "## Chapters\n",
          "| chapter | title | status | seconds |", "|---|---|---|---|"]
    for key, st in run_info["chapters"].items():
        md.append(f"| {key} | {TITLES.get(key, st['notebook'])} | {'ok' if st['ok'] else 'FAILED'} | "
                  f"{st['seconds']} |")
    for key, st in run_info["chapters"].items():
        md.append(f"\n## {key} · {TITLES.get(key, st['notebook'])}\n")
        if not st["ok"]:
            md.append(f"**Failed:** `{st['error']}`\n")
        entries = results.get(key, [])
        if entries:
            md += ["| result | value | unit | note |", "|---|---|---|---|"]
            md += [f"| {e['name']} | {_fmt(e['value'])} | {e['unit']} | {e['note']} |" for e in entries]
        elif st["ok"]:
            md.append("No results recorded.")
        for fig in (f for f in figures if f.name.startswith(f"{key}_")):
            md.append(f"\n![{fig.stem}](results/figures/{fig.name})")
    md_path = out / "report.md"
    _atomic_write_text(md_path, "\n".join(md) + "\n")
    html_path = out / "report.html"
    _atomic_write_text(html_path, _html(run_info, hw, results, figures))
    return md_path, html_path


_CSS = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.3em .7em;text-align:left}
th{background:#f3f3f3}.ok{color:#137333}.fail{color:#b3261e;font-weight:bold}pre{background:#f7f7f7;padding:1em}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}td.num{text-align:right;font-variant-numeric:tabular-nums}"""


def _html(run_info: dict, hw: dict, results: dict, figures: list[Path]) -> str:
    """The report as one self-contained-but-for-images HTML page."""
    e = html.escape
    rows = "".join(
        f"<tr><td>{k}</td><td><a href='#ch{k}'>{e(TITLES.get(k, s['notebook']))}</a></td>"
        f"<td class={'ok' if s['ok'] else 'fail'}>{'ok' if s['ok'] else 'FAILED'}</td>"
        f"<td class=num>{s['seconds']}</td></tr>" for k, s in run_info["chapters"].items())
    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>accel-course report</title>"
             f"<style>{_CSS}</style></head><body><h1>accel-course report</h1>"
             f"<p>Profile <b>{e(run_info['profile'])}</b>, finished {e(run_info['finished'])}.</p>"
             f"<h2>Hardware</h2><pre>{e(format_report(hw))}</pre><h2>Chapters</h2>"
             f"<table><tr><th>chapter</th><th>title</th><th>status</th><th>seconds</th></tr>{rows}</table>"]
    for key, st in run_info["chapters"].items():
        parts.append(f"<h2 id=ch{key}>{key} · {e(TITLES.get(key, st['notebook']))}</h2>")
        if not st["ok"]:
            parts.append(f"<p class=fail>Failed: <code>{e(str(st['error']))}</code></p>")
        entries = results.get(key, [])
        if entries:
            parts.append("<table><tr><th>result</th><th>value</th><th>unit</th><th>note</th></tr>" + "".join(
                f"<tr><td>{e(r['name'])}</td><td class=num>{e(_fmt(r['value']))}</td><td>{e(r['unit'])}</td>"
                f"<td>{e(r['note'])}</td></tr>" for r in entries) + "</table>")
        for fig in (f for f in figures if f.name.startswith(f"{key}_")):
            parts.append(f"<img src='results/figures/{e(fig.name)}' alt='{e(fig.stem)}'>")
    parts.append("</body></html>")
    return "\n".join(parts)

