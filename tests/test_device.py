"""device: best device, hardware report, profile, Colab detection."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch

import accelhelpers as ah
from accelhelpers import device as dev


def test_best_device_is_cpu_here_and_listed_last():
    assert ah.device.available_devices()[-1] == "cpu"
    if not torch.cuda.is_available():
        assert ah.device.best_device() == torch.device("cpu")


def test_requested_cpu_works():
    assert ah.device.best_device("cpu").type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_device_names_the_choices():
    with pytest.raises(ah.device.DeviceUnavailable, match="not present.*present here: .*cpu"):
        ah.device.best_device("cuda")


def test_unknown_device_names_the_valid_kinds(monkeypatch):
    with pytest.raises(ah.device.DeviceUnavailable, match="choose one of cuda, xla, mps, cpu"):
        ah.device.best_device("gpu")
    monkeypatch.setenv("ACCEL_DEVICE", "tpu")
    with pytest.raises(ah.device.DeviceUnavailable, match="unknown device 'tpu'"):
        ah.device.best_device()


def test_profile_defaults_and_override(monkeypatch):
    monkeypatch.delenv("ACCEL_PROFILE", raising=False)
    assert ah.device.choose_profile() == ("quick" if ah.device.available_devices()[0] == "cpu" else "full")
    monkeypatch.setenv("ACCEL_PROFILE", "FULL")
    assert ah.device.choose_profile() == "full"


def test_bogus_profile_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ACCEL_PROFILE", "bogus")
    with pytest.raises(ValueError, match="'bogus' is not a profile: choose one of quick, full"):
        ah.device.choose_profile()
    assert ah.device.hardware_report()["profile"].startswith("invalid")


def test_cpu_requested_reads_accel_device(monkeypatch):
    monkeypatch.setenv("ACCEL_DEVICE", "CPU:0")
    assert ah.device.cpu_requested()
    monkeypatch.setenv("ACCEL_DEVICE", "cuda")
    assert not ah.device.cpu_requested()
    monkeypatch.delenv("ACCEL_DEVICE")
    assert not ah.device.cpu_requested()


def test_xla_version_is_none_without_package_metadata(monkeypatch):
    """A torch_xla module that find_spec finds but that has no package metadata (a source checkout on the path)
    made hardware_report, and so session.setup, raise PackageNotFoundError."""
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name == "torch_xla":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(ah.device, "xla_installed", lambda: True)
    monkeypatch.setattr(ah.device, "tpu_chips", lambda: 0)
    assert ah.device.hardware_report()["torch_xla"] is None
    assert ah.device.xla_version() is None


def test_hardware_report_has_the_facts():
    r = ah.device.hardware_report()
    for key in ("torch", "cpu", "cpu_cores", "cpu_isa", "devices", "best_device", "torch_xla", "colab", "tpu_chips"):
        assert key in r
    assert r["torch"] == torch.__version__
    assert isinstance(r["cpu_isa"], list)
    text = ah.device.format_report(r)
    assert "torch" in text and "best_device" in text


def test_the_report_counts_tpu_chips_without_torch_xla(monkeypatch):
    """Colab's GPU image has no torch_xla; the report left tpu_chips out there and chapter 01's monitor cell, which
    reads it, failed with KeyError: 'tpu_chips' (the colab-gpu stage of CI)."""
    monkeypatch.setattr(ah.device, "xla_installed", lambda: False)
    monkeypatch.setattr(ah.device, "tpu_chips", lambda: 0)
    assert ah.device.hardware_report()["tpu_chips"] == 0


def test_machine_line_names_the_recorded_hardware_in_one_line():
    cpu = {"cpu": "AMD EPYC", "cpu_cores": 2, "torch": "2.9.0", "best_device": "cpu", "gpu": None}
    assert ah.device.machine_line(cpu) == "AMD EPYC, 2 cores · torch 2.9.0 · best device: cpu"
    gpu = ah.device.machine_line({**cpu, "gpu": "NVIDIA H200", "gpu_memory_gb": 139.8, "best_device": "cuda"})
    assert gpu.startswith("NVIDIA H200 (139.8 GiB) · AMD EPYC") and "\n" not in gpu
    assert ah.device.machine_line({}) == "CPU, ? cores · torch ? · best device: ?"  # an older record, keys missing


def test_colab_detection(monkeypatch):
    assert ah.device.in_colab() is False
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert dev.in_colab() is True


@pytest.mark.slow
def test_colab_detection_never_raises_without_a_google_package(tmp_path):
    """`python -m accelhelpers env` in an environment with no `google` package at all (protobuf provides one here,
    so the subprocess blocks it): find_spec("google.colab") used to raise ModuleNotFoundError."""
    block = tmp_path / "sitecustomize.py"
    block.write_text("import sys\nclass _Block:\n    def find_spec(self, name, path=None, target=None):\n"
                     "        if name == 'google' or name.startswith('google.'):\n"
                     "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
                     "sys.meta_path.insert(0, _Block())\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "accelhelpers", "env", "--json"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["colab"] is False


def test_kaggle_detection(monkeypatch):
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    assert dev.hardware_report()["kaggle"] is False
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert dev.hardware_report()["kaggle"] is True


def _fake_pci(root, devices):
    for i, (vendor, device) in enumerate(devices):
        d = root / f"0000:00:{i:02x}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")
    return root


def test_tpu_chips_are_counted_on_the_pci_bus_like_torch_xla(tmp_path):
    """v5e/v6e hosts expose /dev/vfio/<N> with N other than 0; the PCI bus is what torch_xla reads."""
    root = _fake_pci(tmp_path, [("0x1ae0", "0x0063"), ("0x1ae0", "0x006f"), ("0x10de", "0x2330"),
                                ("0x1ae0", "0x0001")])
    assert dev.tpu_chips(root) == 2
    assert dev.tpu_chips(tmp_path / "missing") == 0


@pytest.mark.slow
def test_tpu_pci_ids_are_torch_xlas():
    pytest.importorskip("torch_xla")
    if os.environ.get("ACCEL_COMPAT"):
        pytest.skip("the compat environment has no torch_xla")
    import torch_xla._internal.tpu as tpu

    assert dev.GOOGLE_PCI_VENDOR == tpu._GOOGLE_PCI_VENDOR_ID
    assert set(dev.TPU_PCI_DEVICES) == set(tpu._TPU_PCI_DEVICE_IDS)


def test_on_a_tpu_host_a_chapter_not_written_for_xla_runs_on_the_cpu_and_says_so(monkeypatch, capsys):
    # the hardware this test stands for: a TPU host with torch_xla installed
    monkeypatch.setattr(dev, "available_devices", lambda: ["xla", "cpu"])
    monkeypatch.delenv("ACCEL_PROFILE", raising=False)
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)
    s = ah.session.setup("04")
    assert s.device.type == "cpu" and s.profile == "quick"
    assert "written for cuda, mps, cpu: it runs on the CPU here" in capsys.readouterr().out


def test_profile_parameter_and_pick(monkeypatch):
    monkeypatch.delenv("ACCEL_PROFILE", raising=False)
    s = ah.session.setup("01", profile="full", verbose=False)
    assert s.profile == "full" and s.pick(None, quick=1, full=2) == 2 and s.pick(5, quick=1, full=2) == 5
    assert ah.session.setup("01", profile=None, verbose=False).pick(None, quick=1, full=2) == 1  # CPU here: quick
    with pytest.raises(ValueError, match="PROFILE='fast' is not a profile: choose one of quick, full, smoke"):
        ah.session.setup("01", profile="fast", verbose=False)


def test_the_smoke_profile_takes_the_full_shapes_and_its_own_counts(capsys):
    s = ah.session.setup("01", profile="smoke")
    assert "smoke profile" in capsys.readouterr().out and not s.quick
    assert s.pick(None, quick=64, full=4096) == 4096  # a shape: the full one
    assert s.pick(None, quick=20, full=300, smoke=3) == 3  # a count: a few
    assert s.pick(7, quick=20, full=300, smoke=3) == 7  # a parameter still wins
    full = ah.session.setup("01", profile="full", verbose=False)
    assert full.pick(None, quick=20, full=300, smoke=3) == 300
    assert ah.session.setup("01", profile="quick", verbose=False).pick(None, quick=20, full=300, smoke=3) == 20


def test_fit_budget_announces_and_scales_down(capsys):
    from accelhelpers.session import fit_budget

    assert fit_budget(1000, 0.01, "epochs", limit_s=600) == 1000
    assert "within the 600 s budget" in capsys.readouterr().out
    assert fit_budget(1_100_000, 0.002, "model-epochs", limit_s=600) == 300_000
    assert "over the 600 s budget: running 300,000 instead" in capsys.readouterr().out
    with pytest.raises(ValueError, match="units >= 1"):
        fit_budget(0, 0.1, "epochs")


def test_tpu_detection_reads_the_environment(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert dev.tpu_present()
