"""Shared fixtures: every test writes its results and cache into a temporary folder."""

import pytest


@pytest.fixture(autouse=True)
def _isolated_outputs(tmp_path, monkeypatch):
    """Keep results and builds of unit tests out of the checkout's build/ (the data cache stays shared)."""
    monkeypatch.setenv("ACCEL_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("ACCEL_BUILD", str(tmp_path / "build"))
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)
