"""reproduce: udlbook-20.2 runs to the end, survives kills and Ctrl-C with the same bits, refuses to overwrite."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import accelhelpers as ah

# A short run: 1/2500 of udlbook's epochs (200 for depth 1, 80 for the others), eager (no compile time),
# one thread (the arithmetic order must not depend on the machine), test error every 10 epochs.
SHORT = ["--epochs-scale", "0.0004", "--test-every", "10", "--threads", "1", "--no-compile"]
ENV = dict(os.environ, TQDM_DISABLE="1")


def _cli(out: Path, *extra: str) -> list[str]:
    """The command line of a short run into `out`."""
    return [sys.executable, "-m", "accelhelpers", "reproduce", "udlbook-20.2", "--out", str(out), *SHORT, *extra]


def _run(out: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a short run to its end."""
    return subprocess.run(_cli(out, *extra), capture_output=True, text=True, timeout=timeout, env=ENV)


def _same_run(a: Path, b: Path) -> None:
    """Two completed runs hold the same bits: every weight, every epoch's error, the JSON's results."""
    for d in (1, 2, 3, 4):
        sa, sb = (ah.longrun.read_checkpoint(p / f"ckpt_depth{d}.pt") for p in (a, b))
        assert sa["step"] == sb["step"] == sa["extra"]["settings"]["epochs"]
        assert all(torch.equal(sa["model"][k], sb["model"][k]) for k in sa["model"])
        assert torch.equal(sa["extra"]["wrong"], sb["extra"]["wrong"])
        assert torch.equal(sa["extra"]["test_err"].nan_to_num(-1), sb["extra"]["test_err"].nan_to_num(-1))
    with np.load(a / "udlbook-20.2_wrong.npz") as fa, np.load(b / "udlbook-20.2_wrong.npz") as fb:
        assert all(np.array_equal(fa[k], fb[k]) for k in fa.files)
    timing = {"train_s", "sessions", "steps_per_s"}
    ja, jb = (ah.udlbook.load_result(p)["depths"] for p in (a, b))
    assert [{k: v for k, v in d.items() if k not in timing} for d in ja] == \
        [{k: v for k, v in d.items() if k not in timing} for d in jb]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One uninterrupted short run (the reference)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    r = _run(out)
    assert r.returncode == 0, r.stderr
    return out, r


@pytest.mark.slow
def test_a_run_writes_the_result_the_figure_and_every_epochs_error(straight):
    out, r = straight
    res = ah.udlbook.load_result(out)
    assert res["schema"] == ah.udlbook.SCHEMA and [d["depth"] for d in res["depths"]] == [1, 2, 3, 4]
    assert [d["epochs"] for d in res["depths"]] == [200, 80, 80, 80]
    for d in res["depths"]:
        assert d["curve"]["epochs"][0] == 1 and d["curve"]["epochs"][-1] == d["epochs"]
        assert d["test"]["epochs"] == list(range(10, d["epochs"] + 1, 10))
        assert d["final_train_err"] == d["curve"]["train_err"][-1] and 0 <= d["final_test_err"] <= 100
    with np.load(out / "udlbook-20.2_wrong.npz") as f:
        assert f["depth1"].shape == (200,) and f["depth1"].dtype == np.uint16
    assert (out / "udlbook-20.2.png").read_bytes()[:4] == b"\x89PNG"
    assert "depth 1 (298 units): 200 epochs" in r.stdout and "wall time" in r.stdout


@pytest.mark.slow
def test_killed_at_random_points_and_resumed_it_ends_with_the_same_bits(straight, tmp_path):
    out = tmp_path / "run"
    rng = random.Random(0)
    kills = 0
    for attempt in range(6):
        p = subprocess.Popen(_cli(out, "--checkpoint-every", "0", *(["--resume"] if attempt else [])), env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120  # the first attempt is killed only once training has started
        while not list(out.glob("progress_depth*.json")) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        if p.poll() is not None:
            break
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += 1
    assert kills >= 1
    if not (out / "udlbook-20.2.json").exists():  # an attempt may have finished the run before its kill
        r = _run(out, "--resume")
        assert r.returncode == 0, r.stderr
    _same_run(straight[0], out)


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_says_how_to_resume(straight, tmp_path):
    out = tmp_path / "run"
    p = subprocess.Popen(_cli(out), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not list(out.glob("progress_depth*.json")) and p.poll() is None:
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    if p.returncode == 0:
        pytest.skip("the run finished before the interrupt arrived")
    assert p.returncode == 130 and "--resume" in err and "Traceback" not in err
    assert list(out.glob("ckpt_depth*.pt"))
    r = _run(out, "--resume")
    assert r.returncode == 0, r.stderr
    _same_run(straight[0], out)


@pytest.mark.slow
def test_refuses_to_overwrite_or_to_mix_settings(straight, tmp_path):
    done = _run(straight[0], "--resume")
    assert done.returncode == 2 and "already holds a completed udlbook-20.2 run" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt_depth2.pt").write_bytes((straight[0] / "ckpt_depth2.pt").read_bytes())
    again = _run(out)
    assert again.returncode == 2 and "add --resume" in again.stderr
    other = subprocess.run([sys.executable, "-m", "accelhelpers", "reproduce", "udlbook-20.2", "--out", str(out),
                            "--epochs-scale", "0.001", "--test-every", "10", "--threads", "1", "--no-compile",
                            "--resume", "--depths", "2"], capture_output=True, text=True, timeout=120, env=ENV)
    assert other.returncode == 2 and "epochs=80, not 200" in other.stderr and "--epochs-scale" in other.stderr


@pytest.fixture(scope="module")
def straight_bf16(tmp_path_factory):
    """One uninterrupted short run in bf16."""
    out = tmp_path_factory.mktemp("straight_bf16") / "run"
    r = _run(out, "--precision", "bf16")
    assert r.returncode == 0, r.stderr
    return out, r


@pytest.mark.slow
def test_bf16_runs_in_bf16_and_resumes_to_the_same_bits(straight, straight_bf16, tmp_path):
    res = ah.udlbook.load_result(straight_bf16[0])
    assert res["settings"]["precision"] == "bf16"
    fp32, bf16 = (ah.longrun.read_checkpoint(p[0] / "ckpt_depth4.pt")["model"] for p in (straight, straight_bf16))
    assert all(t.dtype == torch.float32 for t in bf16.values())  # the weights stay fp32 ...
    assert any(not torch.equal(fp32[k], bf16[k]) for k in fp32)  # ... and the arithmetic was bf16's
    out = tmp_path / "run"
    p = subprocess.Popen(_cli(out, "--precision", "bf16", "--checkpoint-every", "0"), env=ENV,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not list(out.glob("ckpt_depth*.pt")) and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    mixed = _run(out, "--resume")  # an fp32 resume of a bf16 run is refused
    assert mixed.returncode == 2 and "precision=bf16, not fp32" in mixed.stderr and "--precision" in mixed.stderr
    r = _run(out, "--resume", "--precision", "bf16")
    assert r.returncode == 0, r.stderr
    _same_run(straight_bf16[0], out)


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["--depths", "5"], "--depths must be among 1,2,3,4"),
    (["--epochs-scale", "0"], "--epochs-scale must be in (0, 1]"),
    (["--jobs", "0"], "--jobs must be at least 1"),
])
def test_bad_arguments_get_one_line(tmp_path, args, message):
    r = subprocess.run([sys.executable, "-m", "accelhelpers", "reproduce", "udlbook-20.2", "--out",
                        str(tmp_path / "x"), *args], capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_out_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        ah.commands.reproduce.run(f)


def test_jobs_split_the_work_evenly_and_the_grid_is_log_spaced():
    s = ah.commands.reproduce.Settings()
    groups = ah.commands.reproduce._groups([1, 2, 3, 4], 2, s)
    assert sorted(d for g in groups for d in g) == [1, 2, 3, 4] and len(groups) == 2
    cost = [sum(s.epochs(d) * ah.commands.reproduce.STEP_COST["fp32"][d] for d in g) for g in groups]
    assert max(cost) / min(cost) < 1.5
    grid = ah.commands.reproduce._grid(500_000)
    assert grid[0] == 1 and grid[-1] == 500_000 and np.all(np.diff(grid) > 0) and len(grid) < 1500
    assert list(grid[:10]) == list(range(1, 11))


def test_the_fast_path_honours_accel_device_cpu(monkeypatch):
    """The notebook tests set ACCEL_DEVICE=cpu on every machine; bench honoured it, reproduce trained on the GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("ACCEL_DEVICE", "cpu")
    assert ah.commands.reproduce._device() == torch.device("cpu")
    monkeypatch.delenv("ACCEL_DEVICE")
    assert ah.commands.reproduce._device() == torch.device("cuda")


def test_load_result_says_what_to_run(tmp_path):
    with pytest.raises(ValueError, match="python -m accelhelpers reproduce udlbook-20.2"):
        ah.udlbook.load_result(tmp_path)
    (tmp_path / "udlbook-20.2.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="not a udlbook-20.2 result"):
        ah.udlbook.load_result(tmp_path)
    (tmp_path / "udlbook-20.2.json").write_text('{"schema": ')  # cut short: one line for the CLI, no traceback
    with pytest.raises(ah.udlbook.ResultError, match="udlbook-20.2.json is not valid JSON .*reproduce udlbook-20.2"):
        ah.udlbook.load_result(tmp_path)


@pytest.mark.slow
def test_recorded_finds_the_newest_committed_run_and_every_epochs_error(straight, tmp_path):
    import shutil

    assert ah.udlbook.recorded(tmp_path) is None
    # newest by the time the run finished, whatever the folder names (a second run of a day has the time appended)
    for name, created in (("2026-11-30-2249", "2026-11-30T23:45:00"), ("2026-11-30", "2026-11-30T17:40:02"),
                          ("2026-01-02", "2026-01-02T10:00:00")):
        folder = shutil.copytree(straight[0], tmp_path / "results" / f"udlbook-20.2_cpu-test_{name}")
        result = json.loads((folder / "udlbook-20.2.json").read_text())
        (folder / "udlbook-20.2.json").write_text(json.dumps({**result, "created": created}))
    result, folder = ah.udlbook.recorded(tmp_path)
    assert folder.name.endswith("2026-11-30-2249") and result["schema"] == ah.udlbook.SCHEMA
    assert [f.name for _, f in ah.udlbook.recorded_runs(tmp_path)] == [  # oldest finished first
        f"udlbook-20.2_cpu-test_{n}" for n in ("2026-01-02", "2026-11-30", "2026-11-30-2249")]
    errs = ah.udlbook.train_errors(folder)
    for d in result["depths"]:
        e = errs[d["depth"]]
        assert len(e) == d["epochs"] and e[-1] == pytest.approx(d["final_train_err"])
        assert [round(float(e[i - 1]), 3) for i in d["curve"]["epochs"]] == d["curve"]["train_err"]
    assert "wall time" in ah.udlbook.describe(result) and "1 process(es) x 1 thread(s)" in ah.udlbook.describe(result)


@pytest.mark.slow
def test_an_in_process_run_gives_ctrl_c_and_kill_back(tmp_path):
    # A run in a notebook's kernel or a test process must not keep its handlers: afterwards Ctrl-C interrupts again.
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    settings = ah.commands.reproduce.Settings(epochs_scale=0.00005, test_every=5, threads=None, compile=False)
    # depths 1, 3, 4 left untrained
    assert ah.commands.reproduce.run(tmp_path / "run", settings=settings, depths=[2]) is None
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    assert ah.longrun.read_checkpoint(tmp_path / "run" / "ckpt_depth2.pt")["step"] == 10


@pytest.mark.slow
def test_describe_names_the_torch_the_run_used_not_this_one(straight):
    result = ah.udlbook.load_result(straight[0])
    result["hardware"] = {**result["hardware"], "torch": "1.0-test"}
    assert "torch 1.0-test" in ah.udlbook.describe(result) and torch.__version__ not in ah.udlbook.describe(result)
