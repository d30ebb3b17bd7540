"""Dead or stuck peers: chapter 06's init_distributed and chapter 09's peer_guard say what to do, and a peer that
exits, hangs or is killed before an all-reduce is a clear error on the other rank within the collective timeout, not
a hang (tests/rank_scripts/peer_faults.py, 2 gloo ranks under torchrun)."""

import json
import re
import time
from pathlib import Path

import pytest

import accelhelpers as ah
from tests import longrun_jobs as jobs

SCRIPT = Path(__file__).resolve().parent / "rank_scripts" / "peer_faults.py"


@pytest.fixture(scope="module")
def peer_jobs(tmp_path_factory):
    """The three faults, started at once (they mostly wait on each other), and when."""
    d = tmp_path_factory.mktemp("peers")
    started = jobs.Jobs(d, {f: jobs.torchrun(SCRIPT, d / f, "--fault", f, "--timeout", 3)
                            for f in ("exit", "hang", "kill")})
    yield started, time.perf_counter()
    started.kill()


@pytest.mark.slow
def test_a_dead_or_stuck_peer_is_a_clear_error_within_the_timeout_not_a_hang(peer_jobs):
    started, t0 = peer_jobs
    d = started.folder
    outcome = {f: started.result(f, timeout=120) for f in ("exit", "hang", "kill")}
    assert time.perf_counter() - t0 < 60
    for fault in ("exit", "hang"):
        rc, out = outcome[fault]
        rank0 = json.loads((d / fault / "rank0.json").read_text())
        assert rc != 0 and "exitcode  : 3" in out, out[-3000:]
        assert re.search(r"rank 0: all_reduce of the gradients failed: a peer process died, left early or stopped "
                         r"responding .*torchrun --max-restarts", rank0["error"])
        assert rank0["seconds"] < 3 + 5
    assert "Timed out" in json.loads((d / "hang" / "rank0.json").read_text())["error"]
    rc, out = outcome["kill"]  # torchrun notices the dead worker and stops the others
    # torchrun names the signal that killed the worker, whether or not rank 0 saw the peer go first
    assert rc != 0 and "Signal 9 (SIGKILL) received by PID" in out, out[-3000:]


def test_init_distributed_and_peer_guard_say_what_to_do(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="not started by torchrun: RANK, WORLD_SIZE.*torchrun --nproc-per-node"):
        ah.parallel.init_distributed()
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        ah.parallel.init_distributed(timeout_s=0)
    with pytest.raises(ah.longrun.PeerFailure, match=r"rank 0: barrier failed: a peer .*\(RuntimeError: Connection "
                                                     r"reset by peer\)"):
        with ah.longrun.peer_guard("barrier"):
            raise RuntimeError("Connection reset by peer")
    with pytest.raises(ValueError, match="unrelated"):
        with ah.longrun.peer_guard():
            raise ValueError("unrelated")
