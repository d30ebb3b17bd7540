"""device: best device, hardware report, sync, profile, Colab detection."""

import sys
import types

import pytest
import torch

import accelhelpers as ah
from accelhelpers import device as dev


def test_best_device_is_cpu_here_and_listed_last():
    assert ah.available_devices()[-1] == "cpu"
    if not torch.cuda.is_available():
        assert ah.best_device() == torch.device("cpu")


def test_requested_cpu_works():
    assert ah.best_device("cpu").type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_device_names_the_choices():
    with pytest.raises(ah.DeviceUnavailable, match="not present.*present here: .*cpu"):
        ah.best_device("cuda")


def test_unknown_device_names_the_valid_kinds(monkeypatch):
    with pytest.raises(ah.DeviceUnavailable, match="choose one of cuda, xla, mps, cpu"):
        ah.best_device("gpu")
    monkeypatch.setenv("ACCEL_DEVICE", "tpu")
    with pytest.raises(ah.DeviceUnavailable, match="unknown device 'tpu'"):
        ah.best_device()


def test_profile_defaults_and_override(monkeypatch):
    monkeypatch.delenv("ACCEL_PROFILE", raising=False)
    assert ah.profile() == ("quick" if ah.available_devices()[0] == "cpu" else "full")
    monkeypatch.setenv("ACCEL_PROFILE", "FULL")
    assert ah.profile() == "full"


def test_bogus_profile_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("ACCEL_PROFILE", "bogus")
    with pytest.raises(ValueError, match="'bogus' is not a profile: choose one of quick, full"):
        ah.profile()
    assert ah.hardware_report()["profile"].startswith("invalid")


def test_hardware_report_has_the_facts():
    r = ah.hardware_report()
    for key in ("torch", "cpu", "cpu_cores", "cpu_isa", "devices", "best_device", "torch_xla", "colab"):
        assert key in r
    assert r["torch"] == torch.__version__
    assert isinstance(r["cpu_isa"], list)
    text = ah.format_report(r)
    assert "torch" in text and "best_device" in text


def test_sync_is_harmless_on_cpu():
    ah.sync("cpu")
    ah.sync(torch.device("cpu"))


def test_colab_detection(monkeypatch):
    assert ah.in_colab() is False
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert dev.in_colab() is True


def test_tpu_detection_reads_the_environment(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert dev.tpu_present()
