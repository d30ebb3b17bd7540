"""Colab: every chapter's badge and setup cell name the one repository URL, and the setup cell installs the
helpers only on Colab, never torch (run here with a faked google.colab module, installing nothing)."""

import importlib.machinery
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from accelhelpers.course import REPO_URL

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SLUG = REPO_URL.removeprefix("https://github.com/")


def _cells(nb_path):
    return json.loads(nb_path.read_text())["cells"]


def _setup_source(nb_path):
    code = [c for c in _cells(nb_path) if c["cell_type"] == "code"]
    return "".join(code[0]["source"])


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_badge_points_at_this_notebook_in_the_one_repository(nb):
    first = "".join(_cells(nb)[0]["source"])
    badges = re.findall(r"https://colab\.research\.google\.com/github/([^)\s]+)", first)
    assert badges == [f"{SLUG}/blob/main/notebooks/{nb.name}"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_setup_cell_installs_the_helpers_only_on_colab(nb, monkeypatch):
    src = _setup_source(nb)
    colab_part = src[: src.index("import accelhelpers as ah")]
    assert f"git+{REPO_URL}" in colab_part
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    exec(colab_part, {})  # not on Colab: nothing is installed
    assert calls == []
    fake = types.ModuleType("google.colab")
    fake.__spec__ = importlib.machinery.ModuleSpec("google.colab", None)
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", fake)
    exec(colab_part, {})
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert f"accelhelpers @ git+{REPO_URL}" in cmd
    assert not any(re.match(r"torch\b", arg) for arg in cmd), "the setup cell must never reinstall torch"


def test_colab_extras_are_our_pins_and_none_of_them_brings_torch(monkeypatch):
    """Chapter 08 installs its deployment tools on Colab (Colab has none of them): the versions must be the
    pinned ones, and none of them may depend on torch (pip would replace Colab's build)."""
    from importlib.metadata import requires

    pins = dict(line.split(";")[0].strip().split("==") for line in (ROOT / "requirements.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for nb in NOTEBOOKS:
        src = _setup_source(nb)
        extras = re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', src)
        for name, ver in extras:
            assert pins.get(name) == ver, f"{nb.name}: {name}=={ver} on Colab, requirements.txt: {pins.get(name)}"
            deps = [re.split(r"[ ;<>=!~\[]", r)[0].lower() for r in (requires(name) or []) if "extra ==" not in r]
            assert "torch" not in deps, f"{name} depends on torch"
        if nb.name.startswith("08_"):
            assert {n for n, _ in extras} == {"onnx", "onnxscript", "onnxruntime", "hls4ml"}
