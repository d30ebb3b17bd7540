"""The chapters' Colab badges and setup cells, written from one place: `[project.urls] Repository` and the package
version in pyproject.toml / accelhelpers/__init__.py. `python -m accelhelpers course links` rewrites them;
`--check` only reports what differs (tests/test_colab.py runs it)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from .. import __version__
from ..results import atomic_write_text, repo_root
from . import CommandError

# The extras each chapter's setup cell installs beyond `course` (chapter 08 the ONNX/hls4ml stack, 10 its toolflows).
EXTRAS = {"08": "course,deploy", "10": "course,deploy,edge"}
BADGE_IMG = "https://colab.research.google.com/assets/colab-badge.svg"
BADGE_RE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\(https://colab\.research\.google\.com/github/[^)]*\)")
README_BADGE_RE = re.compile(r"\[!\[Colab\]\([^)]*\)\]\(https://colab\.research\.google\.com/github/[^)]*?"
                             r"/notebooks/(\d\d_[^)]+\.ipynb)\)")

# As `ruff format` writes it (make lint checks the notebooks' formatting).
SETUP_CELL = '''\
# On Colab or Kaggle only: install the course's helpers at the release these notebooks match.
# torch is never reinstalled: the runtime's own build matches its GPU or TPU.
# (Written by `python -m accelhelpers course links` from pyproject.toml's [project.urls] and version.)
import os, subprocess, sys

if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
    SPEC = "{spec}"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", SPEC], capture_output=True, text=True)
    if pip.returncode:  # one line saying what failed and what to do, never pip's traceback
        why = (pip.stderr.strip().splitlines() or ["pip printed no reason"])[-1]
        raise SystemExit(
            f"could not install {{SPEC}}: {{why}} -- on Kaggle turn on Settings > Internet; "
            "elsewhere check that this release is published (the course README, 'Publishing')"
        )
import accelhelpers as ah'''


def repository(root: Path) -> str:
    """The course's repository URL, `[project.urls] Repository` in pyproject.toml (a GitHub https URL)."""
    meta = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    url = meta.get("urls", {}).get("Repository", "")
    if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url):
        raise CommandError(f"pyproject.toml's [project.urls] Repository is {url!r}: set it to the course's GitHub "
                           "repository, e.g. https://github.com/OWNER/NAME")
    return url


def release() -> str:
    """The tag the setup cells install and the badges open: `v` + the package version."""
    return f"v{__version__}"


def badge(repo: str, notebook: str, alt: str = "Open In Colab") -> str:
    """A chapter's Colab badge: the notebook at the release tag, so the notebook and the helpers it installs match."""
    slug = repo.removeprefix("https://github.com/")
    return f"[![{alt}]({BADGE_IMG})](https://colab.research.google.com/github/{slug}/blob/{release()}/notebooks/{notebook})"


def setup_cell(repo: str, chapter: str) -> str:
    """A chapter's first code cell: install the helpers at the release on Colab/Kaggle only, then import them."""
    return SETUP_CELL.format(spec=f"accelhelpers[{EXTRAS.get(chapter, 'course')}] @ git+{repo}@{release()}")


def _source(text: str) -> list[str]:
    """Text as a notebook cell's source list (one string per line, newlines kept)."""
    return text.splitlines(keepends=True)


def sync(root: Path | None = None, check: bool = False) -> list[str]:
    """Write every chapter's badge and setup cell and the badges of README.md and README_zh.md from pyproject.toml;
    with `check`, write nothing. Returns the files that differed."""
    root = root or repo_root()
    if root is None:
        raise CommandError("run from inside the accel-course checkout (no pyproject.toml found)")
    repo, changed = repository(root), []
    for path in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text())
        first = "".join(nb["cells"][0]["source"])
        code = next(c for c in nb["cells"] if c["cell_type"] == "code")
        if not BADGE_RE.search(first) or "import accelhelpers as ah" not in "".join(code["source"]):
            raise CommandError(f"{path.name}: no Colab badge in the first cell or no setup cell to rewrite")
        new_first = BADGE_RE.sub(badge(repo, path.name).replace("\\", "\\\\"), first)
        new_setup = setup_cell(repo, path.name[:2])
        if new_first != first or "".join(code["source"]) != new_setup:
            changed.append(path.name)
            if not check:
                nb["cells"][0]["source"], code["source"] = _source(new_first), _source(new_setup)
                atomic_write_text(path, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    for readme in (root / "README.md", root / "README_zh.md"):  # the course map in English and in Chinese
        if not readme.exists():
            continue
        text = readme.read_text()
        new = README_BADGE_RE.sub(lambda m: badge(repo, m.group(1), alt="Colab"), text)
        if new != text:
            changed.append(readme.name)
            if not check:
                atomic_write_text(readme, new)
    return changed
