"""Tests of accelhelpers.xla: version check, PJRT device choice, counters on XLA's CPU device, bucketing,
debug-log parsing and the launch subprocess. XLA runtime tests need torch_xla (Linux x86_64) and use
PJRT_DEVICE=CPU; they are skipped where torch_xla is not installed."""

import os
from pathlib import Path

import pytest
import torch

import accelhelpers as ah
from tests.workers import write_workers

needs_xla = pytest.mark.skipif(not ah.device.xla_installed(), reason="torch_xla is not installed")


@pytest.fixture(scope="module")
def xdev():
    """The XLA CPU device of this test process (the runtime starts once and stays up)."""
    pytest.importorskip("torch_xla")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch_xla

    return torch_xla.device()


# --- versions and device choice (no runtime needed) ---

ROOT = Path(__file__).resolve().parents[1]


def test_base_version_strips_local_tag():
    assert ah.xla.base_version("2.9.0+cu128") == "2.9.0"
    assert ah.xla.base_version("2.9.0") == "2.9.0"


def test_version_fix_none_when_matching():
    assert ah.xla.version_fix("2.9.0+cu128", "2.9.0") is None
    assert ah.xla.version_fix("2.9.0+cpu", "2.9.0+cpu") is None


def test_version_fix_gives_matching_pip_command():
    fix = ah.xla.version_fix("2.9.0+cu128", "2.8.0")
    assert fix.startswith("pip install torch==2.8.0 'torch_xla[tpu]==2.8.0'")
    on_tpu = ah.xla.version_fix("2.9.0+cu128", None, on_tpu=True)
    assert on_tpu.startswith(f"pip install torch=={ah.xla.NEWEST_XLA} 'torch_xla[tpu]=={ah.xla.NEWEST_XLA}'")


def test_without_torch_xla_on_a_gpu_runtime_no_impossible_install_is_advised():
    """Colab's GPU runtime (torch 2.11, no torch_xla): never advise torch_xla 2.11 (no such release) nor a TPU build."""
    advice = ah.xla.version_fix("2.11.0+cu130", None, on_tpu=False)
    assert "2.11" not in advice and "[tpu]" not in advice
    assert "TPU" in advice and f"torch_xla=={ah.xla.NEWEST_XLA}" in advice
    on_tpu = ah.xla.version_fix("2.11.0+cu130", None, on_tpu=True)
    assert "2.11" not in on_tpu and f"torch_xla[tpu]=={ah.xla.NEWEST_XLA}" in on_tpu


def test_newest_xla_is_the_pinned_one():
    pins = (ROOT / "requirements.txt").read_text()
    assert f"torch-xla=={ah.xla.NEWEST_XLA};" in pins


def test_installed_versions_reads_metadata():
    """torch's version (with its build tag, +cu128) and torch_xla's from its installed distribution, unimported."""
    import importlib.metadata as md

    torch_v, xla_v = ah.xla.installed_versions()
    assert torch_v.split("+")[0] == md.version("torch").split("+")[0]
    assert xla_v == (md.version("torch_xla") if ah.device.xla_installed() else None)
    if ah.device.xla_installed():
        assert ah.xla.version_fix(torch_v, xla_v) is None  # the pinned environment is consistent


def test_choose_pjrt_device(monkeypatch):
    for key in ("PJRT_DEVICE", "COLAB_TPU_ADDR", "TPU_NAME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(ah.device, "tpu_present", lambda: False)
    assert ah.xla.choose_pjrt_device() == "CPU"
    monkeypatch.setattr(ah.device, "tpu_present", lambda: True)
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)
    assert ah.xla.choose_pjrt_device() == "TPU"
    monkeypatch.setenv("ACCEL_DEVICE", "cpu")  # the notebook tests compare the CPU run, on a TPU host too
    assert ah.xla.choose_pjrt_device() == "CPU"
    monkeypatch.setenv("PJRT_DEVICE", "CUDA")
    assert ah.xla.choose_pjrt_device() == "CUDA"  # an explicit choice wins


def test_use_xla_stops_on_version_mismatch(monkeypatch):
    monkeypatch.setattr(ah.xla, "installed_versions", lambda: ("2.9.0+cu128", "2.8.0"))
    with pytest.raises(RuntimeError, match=r"(?s)do not match.*pip install torch==2\.8\.0"):
        ah.xla.use_xla()


# --- buckets ---

def test_pad_to_bucket_picks_the_smallest_bucket_and_errors():
    assert ah.xla.pad_to_bucket(torch.zeros(1, 29), [40, 32]).shape[-1] == 32
    assert ah.xla.pad_to_bucket(torch.zeros(1, 32), [32, 40]).shape[-1] == 32
    assert ah.xla.pad_to_bucket(torch.zeros(1, 33), [32, 40]).shape[-1] == 40
    with pytest.raises(ValueError, match="add a bucket >= 41"):
        ah.xla.pad_to_bucket(torch.zeros(1, 41), [32, 40])
    with pytest.raises(ValueError):
        ah.xla.pad_to_bucket(torch.zeros(1, 0), [32])


def test_pad_to_bucket_matches_torch_pad():
    x = torch.randn(3, 29)
    p = ah.xla.pad_to_bucket(x, [32, 40], value=-1.0)
    assert p.shape == (3, 32)
    assert torch.equal(p, torch.nn.functional.pad(x, (0, 3), value=-1.0))
    assert ah.xla.pad_to_bucket(torch.randn(2, 40), [32, 40]).shape == (2, 40)


# --- debug log parsing ---

def test_compile_causes(tmp_path):
    log = tmp_path / "debug.txt"
    block = ("Compilation Analysis: ====\nCompilation Analysis: Compilation Cause\n"
             "Compilation Analysis:   {cause}\nCompilation Analysis: Graph Info: \n")
    log.write_text(block.format(cause="user torch_xla.sync"))
    causes, end = ah.xla.compile_causes(log)
    assert causes == ["user torch_xla.sync"]
    with open(log, "a") as f:
        f.write(block.format(cause="most likely user code trying to access tensor value before torch_xla.sync"))
    new, _ = ah.xla.compile_causes(log, start=end)
    assert new == ["most likely user code trying to access tensor value before torch_xla.sync"]
    with pytest.raises(FileNotFoundError, match="debug_file"):
        ah.xla.compile_causes(tmp_path / "missing.txt")


# --- counters on the real XLA CPU device ---

def test_counts_subtract():
    a = ah.xla.XlaCounts(compiles=3, executions=10, compile_s=2.0)
    b = ah.xla.XlaCounts(compiles=1, executions=4, compile_s=0.5)
    d = a - b
    assert (d.compiles, d.executions, d.compile_s) == (2, 6, 1.5)
    assert d.counts() == {"compiles": 2, "cached_compiles": 0, "executions": 6, "to_host": 0, "syncs": 0}


@needs_xla
def test_lazy_execution_counts(xdev):
    import torch_xla

    a = torch.full((7, 5), 2.0, device=xdev)
    with ah.xla.counting() as rec:
        b = (a * 3).sum(1)  # recorded, not run
    assert rec.delta.executions == 0 and rec.delta.compiles == 0
    assert "aten::sum" in ah.xla.pending_ir(b)
    with ah.xla.counting() as rec:
        torch_xla.sync()
    assert rec.delta.executions == 1 and rec.delta.compiles in (0, 1)
    with ah.xla.counting() as rec:
        values = b.cpu()
    assert rec.delta.to_host == 1 and rec.delta.executions == 0
    assert torch.equal(values, torch.full((7,), 30.0))  # numerically what eager CPU gives


@needs_xla
def test_same_graph_compiles_once(xdev):
    import torch_xla

    x = torch.ones(11, 13, device=xdev)
    torch_xla.sync()  # materialise x first, so every iteration below sees the same graph inputs
    with ah.xla.counting() as rec:
        for _ in range(4):
            x = x * 0.5 + 1  # same graph every iteration
            torch_xla.sync()
    assert rec.delta.executions == 4
    assert rec.delta.compiles <= 1 and rec.delta.compiles + rec.delta.cached_compiles == 4
    with ah.xla.counting() as rec:
        for n in (17, 19):  # two new shapes: two new graphs
            y = torch.ones(n, 3, device=xdev) * 2
            torch_xla.sync()
    assert rec.delta.compiles == 2
    assert y.shape == (19, 3)


@needs_xla
def test_pending_ir_rejects_cpu_tensors(xdev):
    with pytest.raises(ValueError, match="XLA tensors"):
        ah.xla.pending_ir(torch.ones(2))


@needs_xla
def test_use_xla_after_runtime_started_keeps_device(xdev, capsys, monkeypatch, tmp_path):
    torch.ones(1, device=xdev).cpu()  # make sure the runtime is up
    assert ah.xla.runtime_started()
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    for key in ("PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_FILE"):
        monkeypatch.setenv(key, "")  # so that monkeypatch restores them after use_xla changes them
    dev = ah.xla.use_xla(debug_file=tmp_path / "log.txt")
    out = capsys.readouterr().out
    assert dev == xdev and "PJRT_DEVICE=CPU" in out and "already running" in out
    assert os.environ["PT_XLA_DEBUG_FILE"] == str(tmp_path / "log.txt") and (tmp_path / "log.txt").exists()


# --- subprocess collection and the launch demo ---

def test_launch_demo_rejects_bad_devices(tmp_path):
    with pytest.raises(ValueError, match="devices >= 1"):
        ah.xla.launch_demo(tmp_path / "xla_launch.py", 0)


@pytest.mark.slow
@needs_xla
def test_launch_demo_one_device_runs(tmp_path):
    """The launch script chapter 07 writes (its %%writefile cell), on one XLA CPU device."""
    script = write_workers("07", tmp_path)["xla_launch.py"]
    rc, out = ah.xla.launch_demo(script, 1, all_reduce=True, timeout=60)
    assert rc == 0, out
    assert "replica 0: ordinal 0 of 1" in out
    assert "all-reduced sum = [1.0, 1.0, 1.0]" in out  # one replica: the sum is its own tensor
