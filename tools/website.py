"""The course as a website (`make site`, docs/site.md): `python tools/website.py [OUT]` (default build/site).

Stages the pages into OUT-src/ (the site's source tree, laid out as the repository is, so that relative links keep
working): docs/index.md as the home page, the guides and docs/site.md under docs/, the exercises' worked solutions
under solutions/, every chapter with its committed outputs under notebooks/, and under results/ a page listing the
recorded runs with the report of each recorded course run and device check. Then Sphinx with MyST-NB (docs/conf.py)
renders them into OUT/, never executing a cell, and MathJax is copied in so formulas render offline. Run it with
.venv-site's Python (`make site` installs it from requirements-site.txt).

Staging changes the copies, never the committed files: each chapter's Colab badge image (Colab's own SVG, fetched
from colab.research.google.com) becomes docs/colab-badge.svg, so a page loads nothing from another site, and each
markdown cell gets an HTML anchor named by its cell id (docs/conf.py does the same for code cells): docs/guides.md
links to cells as `chapter.ipynb#<cell id>`. A page's download button offers the committed notebook.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: tools/ is a package of the checkout
    sys.path.insert(0, str(ROOT))

from tools.nbexport import chapters  # noqa: E402

BADGE_SVG = "colab-badge.svg"
RUN_KINDS = {"course": "Course report", "device-check": "Device check"}


def recorded_runs(results: Path) -> list[Path]:
    """The recorded course runs and device checks under results/ (folders with run.json and report.md), newest
    first: ordered by the time each finished (run.json), then by name."""
    runs = [p for kind in RUN_KINDS for p in results.glob(f"{kind}_*")
            if (p / "run.json").is_file() and (p / "report.md").is_file()]
    return sorted(runs, key=lambda p: (json.loads((p / "run.json").read_text())["finished"], p.name), reverse=True)


def latest_course_run(results: Path) -> Path | None:
    """The recorded `make course` run that finished last; None when none is recorded."""
    return next((p for p in recorded_runs(results) if p.name.startswith("course_")), None)


def _kind(folder: Path) -> str:
    return folder.name.split("_", 1)[0]


def _stage_notebook(src: Path, dest: Path, badge: str) -> None:
    """A chapter's copy for the site: the local badge image, and an anchor per markdown cell (its cell id)."""
    from accelhelpers.commands.links import BADGE_IMG

    nb = json.loads(src.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"]).replace(BADGE_IMG, badge)
        if cell.get("id"):
            text = f'<div id="{cell["id"]}" class="cell-anchor"></div>\n\n{text}'
        cell["source"] = text
    dest.write_text(json.dumps(nb, ensure_ascii=False, indent=1) + "\n")


def _stage_report(folder: Path, dest: Path) -> None:
    """A recorded run's report.md and its figures, titled by what ran, where and when."""
    info = json.loads((folder / "run.json").read_text())
    dest.mkdir(parents=True)
    report = (folder / "report.md").read_text()
    title = f"# {RUN_KINDS[_kind(folder)]}: {folder.name.split('_', 1)[1]}, finished {info['finished']}"
    report = re.sub(r"\A# .*", lambda _: title, report, count=1)
    (dest / "report.md").write_text(report)
    figures = folder / "results" / "figures"
    if figures.is_dir():
        shutil.copytree(figures, dest / "results" / "figures")


def _readme_tables(root: Path, runs: list[Path], repo: str) -> str:
    """The README's results tables (`course readme` writes them from results/), their links pointed at this site's
    report pages, or at the repository for the other files."""
    from accelhelpers.commands.course import readme_tables

    pages = {f"results/{p.name}/": f"{p.name}/report.md" for p in runs}

    def link(m: re.Match) -> str:
        target = m.group(1)
        return f"]({pages.get(target) or f'{repo}/blob/HEAD/{target}'})"

    return re.sub(r"\]\((results/[^)\s]+)\)", link, readme_tables(root / "results"))


def _results_page(root: Path, runs: list[Path], repo: str) -> str:
    """results/index.md: the latest course report first, every recorded run with its page, the README's tables."""
    latest = latest_course_run(root / "results")
    lines = ["# Recorded results", "",
             "The runs recorded under the repository's `results/` folder, each in `<what>_<hardware>_<date>/`: "
             "`make course` (every chapter, with its report), `make device-check` (the accelerator check), and the "
             "long experiments (`python -m accelhelpers reproduce ...`, `bench`). These pages are those files as "
             "committed.", ""]
    if latest:
        lines += [f"**The latest course report:** [{latest.name}]({latest.name}/report.md).", ""]
    lines += ["| recorded run | what | finished | chapters |", "|---|---|---|---|"]
    for p in runs:
        info = json.loads((p / "run.json").read_text())
        chs = info.get("chapters", {})
        ok = sum(bool(st.get("ok")) for st in chs.values())
        lines.append(f"| [{p.name}]({p.name}/report.md) | {RUN_KINDS[_kind(p)]}, {info.get('profile', '?')} "
                     f"profile | {info['finished']} | {ok} of {len(chs)} ran |")
    others = sorted(p.name for p in (root / "results").iterdir()
                    if p not in runs and not p.name.endswith(".tmp") and not p.name.startswith("."))
    if others:
        lines += ["", "Other recorded results (files in the repository): "
                  + ", ".join(f"[`{name}`]({repo}/blob/HEAD/results/{name})" for name in others) + "."]
    lines += ["", "## Results tables (as in the README)", "", _readme_tables(root, runs, repo), ""]
    if runs:
        lines += ["```{toctree}", ":hidden:", ":maxdepth: 1", ""]
        lines += [f"{RUN_KINDS[_kind(p)]}, {p.name.split('_', 1)[1]} <{p.name}/report>" for p in runs]
        lines += ["```", ""]
    return "\n".join(lines)


def stage(src: Path, root: Path = ROOT) -> None:
    """Lay out the site's source tree in `src` (emptied first)."""
    from accelhelpers.commands.links import repository

    repo = repository(root)
    if src.exists():
        shutil.rmtree(src)
    (src / "docs").mkdir(parents=True)
    shutil.copy(root / "docs" / "index.md", src / "index.md")
    for page in ("guides.md", "site.md"):
        shutil.copy(root / "docs" / page, src / "docs" / page)
    shutil.copytree(root / "solutions", src / "solutions")
    (src / "notebooks").mkdir()
    shutil.copy(root / "docs" / BADGE_SVG, src / "notebooks" / BADGE_SVG)
    for nb in chapters(root):
        _stage_notebook(nb, src / "notebooks" / nb.name, BADGE_SVG)
    runs = recorded_runs(root / "results")
    (src / "results").mkdir()
    for p in runs:
        _stage_report(p, src / "results" / p.name)
    (src / "results" / "index.md").write_text(_results_page(root, runs, repo))


def build(out: Path, root: Path = ROOT) -> Path:
    """Stage the pages next to `out` and render them into `out` (emptied first); returns `out`."""
    try:
        import jupyter_server_mathjax
        import myst_nb  # noqa: F401  (docs/conf.py's extension: missing, say so here rather than in Sphinx's words)
        from sphinx.cmd.build import build_main
    except ModuleNotFoundError as e:
        raise SystemExit(f"{e.name} is not installed: build the site with `make site`, which installs its toolchain "
                         "(requirements-site.txt) into .venv-site and runs this with that Python") from e

    from accelhelpers.commands.links import repository

    src = out.with_name(out.name + "-src")
    stage(src, root)
    if out.exists():
        shutil.rmtree(out)
    os.environ["ACCEL_SITE_REPOSITORY"] = repository(root)
    # -W: a warning (a broken cross-reference, a missing image) fails the build; -q: only warnings are printed.
    code = build_main(["-b", "html", "-q", "-W", "--keep-going", "-c", str(root / "docs"), "-d", str(src / ".doctrees"),
                       str(src), str(out)])
    if code:
        raise SystemExit(f"sphinx-build failed ({code}): see the warnings above")
    mathjax = Path(jupyter_server_mathjax.__file__).parent / "static"
    shutil.copytree(mathjax, out / "_static" / "mathjax")
    for nb in chapters(root):  # the download button offers the chapter as committed, not the staged copy
        shutil.copy(nb, out / "_sources" / "notebooks" / nb.name)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else ROOT / "build" / "site").resolve()
    t0 = time.monotonic()
    build(out)
    print(f"the course website: {out}/index.html ({time.monotonic() - t0:.0f} s); serve it with "
          f"`python -m http.server -d {out}` and open http://127.0.0.1:8000/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
