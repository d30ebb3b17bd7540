"""`make test-colab`: the course under Colab's own package sets, installed the way the notebooks install it.

For the GPU image and the TPU image (pip-freeze.{gpu,tpu}.txt beside this file) this script
1. makes a virtual environment with the packages Colab ships that the course uses, at Colab's versions;
2. installs the course exactly as the chapters' setup cells do (`accelhelpers[course,deploy] @ git+<repo>@<ref>`),
   with the repository URL pointed at this checkout's committed HEAD, under Colab's versions as constraints:
   an extra that would replace one of Colab's packages (protobuf, say) makes the install fail;
3. checks that Colab's torch and protobuf are still the ones installed;
4. runs every chapter top to bottom with the course runner (papermill, on the CPU; XLA's CPU device on the TPU
   image). On the GPU image the chapters run their smoke profile: the full profile's shapes, dtypes and code paths,
   a few steps of each, which is what a learner on a Colab GPU starts (the full profile); the quick profile runs
   under nbval in `make test`. The TPU image runs the quick profile. On the GPU image, which has no torch_xla,
   chapter 07 must stop at its first XLA cell with advice that exists (a TPU runtime), and every other chapter must
   pass.

Colab runs Python 3.13; this runs the machine's Python (3.11 here), so what only 3.13 would show is not caught.
Usage: python tests/colab/check.py gpu|tpu [--only 01,02] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# What each image ships that the course imports (or that pins what it imports), at the image's versions.
SHIPPED = ["torch", "torchvision", "fastai", "fastcore", "fastprogress", "accelerate", "protobuf", "numpy",
           "matplotlib", "scikit-learn", "scipy", "pandas", "tqdm", "ipywidgets", "ipykernel", "pillow"]
EXTRA_SHIPPED = {"gpu": ["grpcio-status"], "tpu": ["torch-xla"]}  # grpcio-status pins protobuf < 6 on the GPU image
RUNNER = ["papermill==2.7.0"]  # not on Colab: the runner that executes the notebooks here
# Seconds each chapter takes in the quick profile (tests/conftest.py's COST, which orders `make test` the same way):
# the runners take the longest first.
sys.path.insert(0, str(HERE.parent))
from conftest import COST as _FILE_COST  # noqa: E402

COST = {stem[:2]: seconds for stem, seconds in _FILE_COST.items() if stem[:2].isdigit()}
# Seconds each chapter's smoke profile took in this harness (the GPU image's torch 2.11, two runners on the 2-core
# machine, CI's clone of 2026-12-03; 07 stops at once without torch_xla; 12 estimated after its new sections; 11 scaled
# by its smoke run here with one seed and 1-s runs, 167 s against 254 s with two seeds and 2-s runs): the runners
# share them out by them.
SMOKE_COST = {"01": 42, "02": 172, "03": 52, "04": 131, "05": 102, "06": 156, "07": 9, "08": 101, "09": 102,
              "10": 117, "11": 270, "12": 120}


def share_out(keys: list[str], cost: dict[str, float], jobs: int) -> list[list[str]]:
    """The chapters split among `jobs` runners so they finish together: longest first, each to the runner with the
    least work so far (a greedy longest-processing-time schedule; dealing them out in turns left one runner 5 min
    behind the other when chapter 11 alone was half of its share)."""
    shares: list[list[str]] = [[] for _ in range(jobs)]
    load = [0.0] * jobs
    for key in sorted(keys, key=lambda k: -cost.get(k, 0)):
        i = load.index(min(load))
        shares[i].append(key)
        load[i] += cost.get(key, 0)
    return [s for s in shares if s]


def colab_pins(kind: str) -> dict[str, str]:
    """{package: version} of Colab's image, local build tags (+cu128, +cpu) dropped."""
    pins = {}
    for line in (HERE / f"pip-freeze.{kind}.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.split("+")[0].strip()
    return pins


def setup_requirement() -> str:
    """The widest requirement the chapters' setup cells install (the most extras), the same URL and ref in every
    chapter (tests/test_colab.py checks that)."""
    found = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        src = "".join(json.loads(path.read_text())["cells"][1]["source"])
        found += re.findall(r'"(accelhelpers\[[^"]+\] @ git\+[^"]+)"', src)
    return max(found, key=lambda req: req.split("]")[0].count(","))


def local_requirement(req: str) -> str:
    """The same requirement with the GitHub URL and release replaced by this checkout's committed HEAD."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    name = req.split(" @ ")[0]
    return f"{name} @ git+file://localhost{ROOT}@{head}"  # pip 23 cannot parse file:/// here


def pip_install(cmd: list[str], tries: int = 3) -> None:
    """A pip install, tried again when it fails: a download cut off mid-wheel (urllib3's read error, which pip's own
    --retries does not cover) is the registry's hiccup, not the course's; a real conflict fails all three times."""
    for attempt in range(1, tries + 1):
        print("+", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode == 0:
            return
        if attempt < tries:
            print(f"pip failed (attempt {attempt} of {tries}); trying again in 10 s", flush=True)
            time.sleep(10)
    sys.exit(f"pip failed {tries} times: {' '.join(cmd[3:])[:200]} ... (see its message above)")


# An image's venv as installed here (torch's CUDA build and its libraries: 6.0 GB for the GPU image; 1.5 GB for the
# TPU image, whose torch, torch_xla and CUDA libraries are .venv's, linked), plus room for pip's downloads.
NEED_GB = {"gpu": 9, "tpu": 4}


def check_disk(kind: str, env_dir: Path) -> None:
    """Stop with one line before installing an image that cannot fit: a disk that fills up mid-install leaves a
    broken venv and pip's error about a download, not about the disk."""
    if env_dir.exists():
        return  # an update of an installed image needs far less
    free = shutil.disk_usage(ROOT).free / 2**30
    if free < NEED_GB[kind]:
        sys.exit(f"error: {free:.1f} GB free on this disk; Colab's {kind} image needs about {NEED_GB[kind]} GB here "
                 f"(torch's CUDA build): free some space (old .venv-colab-* folders, build/) and run again")


# The TPU image's torch, torchvision and torch_xla are the course's own pins, which .venv holds (with torch's CUDA
# libraries and triton, about 6.6 GB). Instead of downloading and unpacking them a second time (about 5 minutes of
# CI), the image's venv sees .venv's copies through a .pth file, as Colab ships them preinstalled; pip installs the
# rest itself. They are linked from a folder outside the venv, so pip never uninstalls them, and only where .venv's
# versions are the image's: otherwise pip installs the image's own.
SHARED = {"tpu": ("torch", "torchvision", "torch-xla", "triton")}
LIST_DISTS = """
import importlib.metadata as m, json, sys, sysconfig
want = set(sys.argv[1:])
dists = {}
for d in m.distributions():
    name = d.metadata["Name"].lower()
    if name in want or name.startswith("nvidia-"):
        dists[name] = [d.version, sorted({str(f).split("/")[0] for f in d.files or [] if not str(f).startswith("..")})]
print(json.dumps({"site": sysconfig.get_paths()["purelib"], "dists": dists}))
"""


def link_shared(kind: str, py: Path) -> bool:
    """Let the image's venv `py` import .venv's copies of SHARED[kind] (and torch's nvidia-* libraries) where their
    versions are the image's; whether it did."""
    names = SHARED.get(kind, ())
    base = ROOT / ".venv" / "bin" / "python"
    if not names or not base.exists():
        return False
    found = json.loads(subprocess.run([str(base), "-c", LIST_DISTS, *names], capture_output=True, text=True,
                                      check=True).stdout)
    pins = colab_pins(kind)
    if any(found["dists"].get(n, [None])[0] is None or found["dists"][n][0].split("+")[0] != pins.get(n)
           for n in names if n in pins):
        print(f"not linking .venv's {', '.join(names)}: their versions are not the {kind} image's", flush=True)
        return False
    shared = ROOT / "build" / f"colab-{kind}-shared"
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir(parents=True)
    for top in sorted({t for _, tops in found["dists"].values() for t in tops}):
        (shared / top).symlink_to(Path(found["site"]) / top)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "_accel_course_shared.pth").write_text(f"{shared}\n")
    print(f"linked .venv's {', '.join(names)} and torch's nvidia libraries into the {kind} image's venv", flush=True)
    return True


def make_env(kind: str) -> Path:
    env_dir = ROOT / f".venv-colab-{kind}"
    py = env_dir / "bin" / "python"
    pins = colab_pins(kind)
    shipped = [f"{p}=={pins[p]}" for p in SHIPPED + EXTRA_SHIPPED[kind] if p in pins]
    stamp = env_dir / ".installed"
    want = "\n".join(shipped + [subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                               text=True).stdout.strip()])
    if stamp.exists() and stamp.read_text() == want:
        return py
    check_disk(kind, env_dir)
    if not py.exists():
        venv.create(env_dir, with_pip=True)
    link_shared(kind, py)
    build = ROOT / "build"
    build.mkdir(exist_ok=True)
    constraints = build / f"colab-{kind}-constraints.txt"
    # Colab's torch is a +cu128 build from PyTorch's index; PyPI's has other CUDA libraries (it runs on the CPU
    # here either way), so the CUDA runtime packages are left to torch's own requirements.
    kept = {p: v for p, v in pins.items() if not p.startswith(("nvidia-", "cuda-"))}
    constraints.write_text("\n".join(f"{p}=={v}" for p, v in sorted(kept.items())) + "\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    pip_install(pip + shipped + RUNNER + ["-c", str(constraints)])  # the image, as Colab ships it
    # the course, as the setup cells install it, with Colab's versions as constraints (a fresh install each time:
    # pip keeps an installed accelhelpers of the same version even when the commit differs)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "accelhelpers"], check=False)
    pip_install(pip + [local_requirement(setup_requirement()), "-c", str(constraints)])
    stamp.write_text(want)
    return py


def check_kept(py: Path, kind: str) -> None:
    """Colab's torch and protobuf must be the ones installed after the course's install."""
    pins = colab_pins(kind)
    for name in ("torch", "protobuf"):
        got = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version('{name}'))"],
                             capture_output=True, text=True, check=True).stdout.strip().split("+")[0]
        assert got == pins[name], f"the course's install replaced Colab's {name} {pins[name]} with {got}"
        print(f"kept Colab's {name} {got}")


PROFILE = {"gpu": "smoke", "tpu": "quick"}  # the profile each image's chapters run


def run_chapters(py: Path, kind: str, only: str | None, jobs: int = 2) -> int:
    """Run the chapters with the installed course's runner, in `jobs` runners at once (each its own share of the
    chapters and its own folder; what they measure is not compared here, only that each chapter runs), shared out
    so that the runners finish together (share_out)."""
    out = ROOT / "build" / f"colab-{kind}"
    shutil.rmtree(out, ignore_errors=True)  # a runner merges into an existing run.json: start from none
    env = {**os.environ, "ACCEL_DEVICE": "cpu", "PJRT_DEVICE": "CPU", "TQDM_DISABLE": "1",
           "OMP_WAIT_POLICY": "PASSIVE",  # two runners on two cores: idle OpenMP threads sleep, not spin
           "PYTHONPATH": ""}  # the installed course, not the checkout's folder
    keys = [k.strip().zfill(2) for k in only.split(",")] if only else \
        sorted(p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    shares = share_out(keys, SMOKE_COST if PROFILE[kind] == "smoke" else COST, jobs)
    procs = []
    for i, share in enumerate(shares):
        cmd = [str(py), "-m", "accelhelpers", "course", "run", "--profile", PROFILE[kind],
               "--out", str(out / f"runner{i}"), "--no-report", "--only", ",".join(share)]
        print("+", " ".join(cmd), flush=True)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
    for proc in procs:
        print(proc.communicate()[0])
    chapters = {}
    for i in range(len(shares)):
        chapters.update(json.loads((out / f"runner{i}" / "run.json").read_text())["chapters"])
    failures = []
    for key, st in chapters.items():
        if kind == "gpu" and key == "07":
            ok = not st["ok"] and "Change runtime type > TPU" in str(st["error"])
            print(f"07 on the GPU image (no torch_xla): {'stops with the TPU-runtime advice' if ok else st}")
        else:
            ok = st["ok"]
        if not ok:
            failures.append(f"{key}: {st['error']}")
    print(f"colab-{kind} ({PROFILE[kind]} profile): {len(chapters) - len(failures)} of {len(chapters)} chapters "
          f"as expected "
          f"({sum(s['seconds'] for s in chapters.values()):.0f} s)")
    for f in failures:
        print("FAILED", f, file=sys.stderr)
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["gpu", "tpu"])
    p.add_argument("--only", default=None)
    p.add_argument("--jobs", type=int, default=2, help="course runners at once (default 2)")
    args = p.parse_args()
    py = make_env(args.kind)
    check_kept(py, args.kind)
    return run_chapters(py, args.kind, args.only, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
