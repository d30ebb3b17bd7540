"""Colab: every chapter's badge and setup cell are written from pyproject.toml's one repository URL and the version,
and the setup cell installs the helpers only on Colab, never torch, and fails in one line (run here with a faked
google.colab module, installing nothing)."""

import importlib.machinery
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

import accelhelpers as ah

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
REPO_URL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
SLUG = REPO_URL.removeprefix("https://github.com/")
RELEASE = f"v{ah.__version__}"


def _cells(nb_path):
    return json.loads(nb_path.read_text())["cells"]


def _setup_source(nb_path):
    code = [c for c in _cells(nb_path) if c["cell_type"] == "code"]
    return "".join(code[0]["source"])


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_badge_points_at_this_notebook_in_the_one_repository(nb):
    first = "".join(_cells(nb)[0]["source"])
    badges = re.findall(r"https://colab\.research\.google\.com/github/([^)\s]+)", first)
    assert badges == [f"{SLUG}/blob/{RELEASE}/notebooks/{nb.name}"]


def test_badges_and_setup_cells_agree_with_pyproject(cli_here):
    """`course links --check` (what `make links` writes) finds nothing to change: the notebooks and the README name
    the repository and release of pyproject.toml."""
    assert cli_here("course", "links", "--check").returncode == 0


def test_links_rewrites_a_stale_badge_and_setup_cell(tmp_path):
    """A copy of the course whose pyproject names another repository: `sync` rewrites every badge and setup cell
    to it, and `--check` then finds nothing left."""
    import shutil

    for name in ("pyproject.toml", "README.md", "README_zh.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns("[!0-9]*"))
    py = tmp_path / "pyproject.toml"
    py.write_text(py.read_text().replace(REPO_URL, "https://github.com/someone/fork"))
    changed = ah.commands.links.sync(tmp_path)
    assert len(changed) == len(NOTEBOOKS) + 2
    assert ah.commands.links.sync(tmp_path, check=True) == []
    for nb in sorted((tmp_path / "notebooks").glob("*.ipynb")):
        assert f"git+https://github.com/someone/fork@{RELEASE}" in _setup_source(nb)
        assert "github/someone/fork/blob/" in "".join(_cells(nb)[0]["source"])
    assert "github/someone/fork/blob/" in (tmp_path / "README.md").read_text()
    assert "github/someone/fork/blob/" in (tmp_path / "README_zh.md").read_text()  # the Chinese map's badges too


def test_links_refuses_a_repository_that_is_not_a_github_url(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[project.urls]\nRepository = "accel-course"\n')
    with pytest.raises(ah.commands.CommandError, match=r"\[project.urls\] Repository"):
        ah.commands.links.sync(tmp_path)


EXTRAS = {"08": "course,deploy", "10": "course,deploy,edge"}  # every other chapter: the `course` extra


def _install_part(nb):
    src = _setup_source(nb)
    return src[: src.index("import accelhelpers as ah")]


def _installs(nb, monkeypatch, returncode=0, stderr="", **env):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(subprocess, "run", run)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    exec(_install_part(nb), {})
    return calls


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_setup_cell_installs_the_release_only_on_colab_and_kaggle(nb, monkeypatch):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    assert _installs(nb, monkeypatch) == []  # neither Colab nor Kaggle: nothing is installed
    fake = types.ModuleType("google.colab")
    fake.__spec__ = importlib.machinery.ModuleSpec("google.colab", None)
    monkeypatch.setitem(sys.modules, "google.colab", fake)  # Colab's kernel has imported it before any cell
    on_colab = _installs(nb, monkeypatch)
    monkeypatch.delitem(sys.modules, "google.colab")
    on_kaggle = _installs(nb, monkeypatch, KAGGLE_KERNEL_RUN_TYPE="Interactive")
    extras = EXTRAS.get(nb.name[:2], "course")
    for calls in (on_colab, on_kaggle):
        assert len(calls) == 1
        cmd = calls[0]
        assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
        assert f"accelhelpers[{extras}] @ git+{REPO_URL}@{RELEASE}" in cmd
        assert not any(re.match(r"torch\b", arg) for arg in cmd), "the setup cell must never reinstall torch"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_failed_install_stops_the_setup_cell_in_one_line(nb, monkeypatch):
    """pip fails (no such tag, no internet): the cell stops with one line naming what failed and what to do, not a
    CalledProcessError traceback."""
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    pip_err = "Collecting x\n  ERROR: Could not find a version that satisfies the requirement (tag v9 not found)\n"
    with pytest.raises(SystemExit) as stop:
        _installs(nb, monkeypatch, returncode=1, stderr=pip_err)
    message = str(stop.value)
    assert "\n" not in message and "tag v9 not found" in message and "Internet" in message and RELEASE in message


def test_release_is_this_package_version():
    """The version is written once (accelhelpers/__init__.py): the package metadata and the release the setup
    cells install are read from it."""
    from importlib.metadata import version

    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()
    assert version("accelhelpers") == ah.__version__
    assert ah.commands.links.release() == RELEASE


def _pins(path):
    return {line.split("==")[0].lower(): line.split("==")[1].split(";")[0].split("+")[0].strip()
            for line in path.read_text().splitlines() if "==" in line and not line.startswith("#")}


def test_extras_admit_our_pins_and_colabs_versions_and_none_brings_torch():
    """An extra installed on Colab must not replace what Colab ships (its torch above all), and our pinned
    environment must satisfy the same ranges."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ours = _pins(ROOT / "requirements.txt")
    colab = {kind: _pins(ROOT / "tests" / "colab" / f"pip-freeze.{kind}.txt") for kind in ("gpu", "tpu")}
    for name in ("course", "deploy", "edge"):
        for line in extras[name]:
            req = Requirement(line)
            key = req.name.lower()
            assert ours.get(key) in req.specifier, f"[{name}] {line}: requirements.txt pins {ours.get(key)}"
            for kind, pins in colab.items():
                if key in pins:
                    assert pins[key] in req.specifier, f"[{name}] {line} would replace Colab {kind}'s {pins[key]}"
            deps = [Requirement(r).name.lower() for r in (requires(req.name) or []) if "extra ==" not in r]
            # these need torch with a lower bound that Colab's torch meets (make test-colab installs them under
            # Colab's versions as constraints, so one that would replace Colab's torch fails there)
            assert "torch" not in deps or key in {"fastai", "accelerate", "brevitas"}, f"{req.name} depends on torch"


def test_deploy_extra_keeps_colabs_protobuf():
    """onnx 1.23 needs protobuf >= 6.31.1; Colab's GPU image pins 5.29.6 (grpcio-status there needs < 6)."""
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    onnx = next(Requirement(r) for r in extras["deploy"] if r.startswith("onnx>") or r.startswith("onnx="))
    assert "1.23.2" not in onnx.specifier and _pins(ROOT / "requirements.txt")["onnx"] in onnx.specifier


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_colab_opens_each_chapter_on_its_accelerator(nb):
    meta = json.loads(nb.read_text())["metadata"]
    assert meta["accelerator"] == ("TPU" if nb.name.startswith("07_") else "GPU")
    assert "colab" in meta


@pytest.fixture()
def check():
    """tests/colab/check.py, the harness of make test-colab, as a module."""
    spec = importlib.util.spec_from_file_location("colab_check", ROOT / "tests" / "colab" / "check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    return check


def test_the_colab_check_stops_in_one_line_before_an_image_that_cannot_fit(check, tmp_path, monkeypatch):
    monkeypatch.setattr(check.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=2 * 2**30))
    with pytest.raises(SystemExit, match=r"^error: 2\.0 GB free on this disk; Colab's gpu image needs about 9 GB"):
        check.check_disk("gpu", tmp_path / ".venv-colab-gpu")
    check.check_disk("gpu", tmp_path)  # an installed image's folder: updating it needs far less, so no check


def test_the_colab_runners_get_shares_that_finish_together(check):
    cost = {"a": 10, "b": 6, "c": 5, "d": 4, "e": 3}
    # longest first, each to the runner with less work so far: 10+4 against 6+5+3 (dealing in turns gave 18 and 10)
    assert check.share_out(list("edcba"), cost, 2) == [["a", "d"], ["b", "c", "e"]]
    shares = check.share_out(sorted(check.SMOKE_COST), check.SMOKE_COST, 2)
    loads = [sum(check.SMOKE_COST[k] for k in s) for s in shares]
    assert max(loads) - min(loads) <= max(check.SMOKE_COST.values()) / 10
    assert check.share_out(["a"], cost, 3) == [["a"]]  # no empty runner
