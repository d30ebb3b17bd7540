"""Shared fixtures: every test writes its results and cache into a temporary folder."""

import pytest


@pytest.fixture(autouse=True)
def _isolated_outputs(tmp_path, monkeypatch):
    """Keep results and builds of unit tests out of the checkout's build/ (the data cache stays shared)."""
    monkeypatch.setenv("ACCEL_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("ACCEL_BUILD", str(tmp_path / "build"))
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)


# torch 2.14.1 (make test-compat only): a gloo worker sometimes aborts at exit, after its work and its result files
# are done, with "terminate called without an active exception" (seen in about 1 of 5 compat runs, on a different
# multi-process test each time; never with our pinned torch 2.9). Multi-process tests rerun such a launch once in
# the compat environment; the rerun must then pass every check. Any other failure, or this one with our pins,
# fails as before.
TEARDOWN_ABORT = "terminate called without an active exception"


def compat_teardown_abort(output: str) -> bool:
    """True for the known torch 2.14 exit-time abort of a gloo worker, in `make test-compat` only."""
    import os

    return os.environ.get("ACCEL_COMPAT") == "1" and TEARDOWN_ABORT in output
