"""Non-finite losses: the local check, and chapter 09's check_finite, which agrees across ranks by one all-reduce so
that every rank stops at the same step; the chapter's nan.py on 2 ranks under torchrun shows both ways."""

import json

import pytest
import torch
from torch import nn

import accelhelpers as ah
from tests import longrun_jobs as jobs


def test_is_finite_checks_the_loss_and_every_gradient():
    model = nn.Linear(3, 1)
    loss = model(torch.ones(2, 3)).sum()
    loss.backward()
    assert ah.longrun.is_finite(loss, model)
    assert not ah.longrun.is_finite(loss * float("nan"))
    model.bias.grad[0] = float("inf")
    assert ah.longrun.is_finite(loss) and not ah.longrun.is_finite(loss, model)
    with pytest.raises(TypeError, match="loss must be a tensor"):
        ah.longrun.is_finite(1.0)


def test_check_finite_in_one_process_names_the_step():
    assert ah.longrun.bad_ranks(False) == [] and ah.longrun.bad_ranks(True) == [0]
    ah.longrun.check_finite(torch.tensor(1.5), step=3)
    with pytest.raises(ah.longrun.NonFiniteError, match=r"at step 7 on rank\(s\) \[0\].*Lower the learning rate"):
        ah.longrun.check_finite(torch.tensor(float("inf")), step=7)


@pytest.fixture(scope="module")
def nan_job(tmp_path_factory):
    """The chapter's nan.py: rank 1 alone gets a NaN at step 3, agreed by check_finite, then checked locally with
    a collective timeout of 3 s."""
    d = tmp_path_factory.mktemp("nan")
    script = jobs.workers(d / "workers")["nan.py"]
    started = jobs.Jobs(d, {"nan": jobs.torchrun(script, d / "out", "--steps", 6, "--bad-step", 3, "--timeout", 3)})
    yield started
    started.kill()


def phases(job):
    """What each rank wrote: ([agreed rank 0, rank 1], [local rank 0, rank 1])."""
    return ([json.loads((job.folder / "out" / f"nan_{p}_rank{r}.json").read_text()) for r in (0, 1)]
            for p in ("agreed", "local"))


@pytest.mark.slow
def test_ddp_all_ranks_stop_together_when_only_one_sees_a_nan(nan_job):
    code, out = nan_job.result("nan")
    agreed, _ = phases(nan_job)
    assert [r["steps_done"] for r in agreed] == [3, 3], out[-3000:]
    assert all(r["error"].startswith("NonFiniteError") and "at step 3 on rank(s) [1]" in r["error"] for r in agreed)
    assert all(r["seconds"] < 3 for r in agreed)  # at once, not after the timeout


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_both_when_agreed_and_strands_the_other_when_local(nan_job):
    code, out = nan_job.result("nan")
    assert code != 0, out[-3000:]  # the local phase ends with rank 0's timeout and rank 1's failed final barrier
    agreed, local = phases(nan_job)
    assert [r["steps_done"] for r in agreed + local] == [3, 3, 3, 3]  # the group was still usable after agreeing
    assert local[0]["error"].startswith("PeerFailure") and local[0]["seconds"] >= 2.5
    assert local[1]["error"].startswith("NonFiniteError") and local[1]["seconds"] < 2.5
