"""Results of a chapter run: named values with units and figures, written where the course report finds them."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from . import longrun  # taught in chapter 09 (temporary file, fsync, rename): one definition, exported

_state: dict[str, str | None] = {"chapter": None}


def repo_root(start: Path | None = None) -> Path | None:
    """The accel-course checkout above `start` (the folder holding pyproject.toml and accelhelpers/)."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").exists() and (folder / "accelhelpers").is_dir():
            return folder
    return None


def build_dir() -> Path:
    """Where runs write their outputs: ACCEL_BUILD, else build/ in the checkout, else ./build."""
    env = os.environ.get("ACCEL_BUILD")
    return Path(env) if env else (repo_root() or Path.cwd()) / "build"


def fresh_dir(*parts: str) -> Path:
    """An empty folder `build_dir()/parts...` for one run of a chapter (anything a previous run left there is
    removed), named as a cell prints it and a process started from the current folder opens it: relative to the
    current folder when it lies in the checkout (`../build/ch06` from notebooks/), else as it is."""
    folder = build_dir().joinpath(*parts)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    root = repo_root()
    if root is not None and folder.resolve().is_relative_to(root):
        return Path(os.path.relpath(folder.resolve()))
    return folder


def results_dir() -> Path:
    """Where recorded results go: ACCEL_RESULTS_DIR (set by the course runner), else build/results."""
    return Path(os.environ.get("ACCEL_RESULTS_DIR") or build_dir() / "results")


def set_chapter(chapter: str) -> None:
    """Name the chapter that later `record` calls belong to (done by `setup`)."""
    if not chapter or not str(chapter).strip():
        raise ValueError("chapter must be a non-empty name such as '01'")
    _state["chapter"] = str(chapter)


def current_chapter() -> str:
    """The chapter set by `setup`/`set_chapter`, or 'scratch' outside a chapter."""
    return _state["chapter"] or "scratch"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write bytes atomically (see `atomic_write`)."""
    longrun.atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: Path, text: str) -> None:
    """Write text atomically (atomic_write_bytes of its UTF-8 encoding)."""
    atomic_write_bytes(path, text.encode())


def _jsonable(value: Any) -> Any:
    """Plain JSON types for numbers that come from torch or numpy."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def record(name: str, value: Any, unit: str = "", note: str = "", spread: tuple[float, float] | None = None,
           repeats: int | None = None) -> Any:
    """Record a named measurement of the current chapter (replacing one of the same name) and return it; `spread`
    (lowest, highest) over `repeats` interleaved repeats, of which `value` is the median, goes into the report."""
    if not name:
        raise ValueError("a result needs a name")
    if spread is not None and not (len(spread) == 2 and spread[0] <= spread[1]):
        raise ValueError(f"spread must be (lowest, highest), got {spread!r}")
    path = results_dir() / f"{current_chapter()}.json"
    entries = [e for e in load_chapter(path) if e["name"] != name]
    entry = {"name": name, "value": _jsonable(value), "unit": unit, "note": note, "time": time.time()}
    if spread is not None:
        entry["spread"] = [_jsonable(spread[0]), _jsonable(spread[1])]
        entry["repeats"] = repeats
    entries.append(entry)
    atomic_write_text(path, json.dumps(entries, indent=1))
    return value


def read_json(path: Path, fix: str, error: type[ValueError] = ValueError) -> Any:
    """A JSON file's contents; one that is not JSON raises `error` naming the file and `fix`, what to do."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path} is not valid JSON ({e}): {fix}") from e


def latest_recorded(pattern: str = "course_*", root: Path | None = None) -> Path | None:
    """The recorded run of a kind (`course_*`, `device-check_*`) under the checkout's results/ (or `root`) that
    finished last; None where none is recorded (a package installed without the checkout, as on Colab)."""
    checkout = repo_root() or repo_root(Path(__file__).parent)
    root = root or (checkout / "results" if checkout else None)
    if root is None:
        return None
    runs = [p for p in root.glob(pattern) if (p / "run.json").exists()]
    fix = "restore it from git or delete the folder"
    return max(runs, key=lambda p: read_json(p / "run.json", fix).get("finished", "")) if runs else None


def recorded_seconds(chapter: str, root: Path | None = None) -> tuple[float, dict[str, Any], Path] | None:
    """(seconds, hardware report, folder) of `chapter` in the newest recorded course run (under the checkout's
    results/, or `root`) if that run was the quick profile and the chapter ran; else None."""
    folder = latest_recorded("course_*", root)
    if folder is None:
        return None
    run = read_json(folder / "run.json", "restore it from git or delete the folder")
    status = run.get("chapters", {}).get(chapter)
    if run.get("profile") != "quick" or not status or not status.get("ok"):
        return None
    return float(status["seconds"]), run.get("hardware", {}), folder


def load_chapter(path: Path) -> list[dict[str, Any]]:
    """The entries recorded in one chapter's results file (empty if there is none)."""
    return read_json(path, "delete it and re-run the chapter") if path.exists() else []


def load_results(folder: Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every chapter's recorded results in `folder`, keyed by chapter."""
    folder = folder or results_dir()
    return {p.stem: load_chapter(p) for p in sorted(Path(folder).glob("*.json"))}


def save_figure(fig: Any, name: str) -> Path:
    """Save a matplotlib figure as PNG for the course report (figures/<chapter>_<name>.png) and return the path."""
    path = results_dir() / "figures" / f"{current_chapter()}_{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    return path
