"""Chapter 09's long run: exact resume (in one process and across processes), what each state left out costs, the
chapter's scripts that kill, resume and restart it (train.py, variants.py, kill_mid_save.py, and under torchrun on
2 ranks elastic.py and fsdp.py), and the helpers that start and watch them."""

import json
import signal
import sys

import pytest
import torch

import accelhelpers as ah
from tests import longrun_jobs as jobs


@pytest.fixture(autouse=True)
def one_thread():
    """Bit-for-bit comparisons with the scripts, which run with 1 torch thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """The chapter's scripts, as its %%writefile cells write them."""
    return jobs.workers(tmp_path_factory.mktemp("workers09"))


def same(a, b) -> bool:
    """Bit-for-bit equality of two nested states."""
    return ah.longrun.digest(a) == ah.longrun.digest(b)


def straight(steps: int = 20) -> ah.longrun.RunState:
    """An uninterrupted run of `steps` steps."""
    return ah.longrun.train(ah.longrun.make_run(total_steps=steps), steps)


# --- in one process ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("at", [11, 16], ids=["mid-epoch", "epoch-end"])
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path, at):
    reference = straight()
    cut = ah.longrun.train(ah.longrun.make_run(total_steps=20), at)
    assert cut.step == at
    ah.longrun.save(cut, tmp_path / "c.pt")
    resumed = ah.longrun.train(ah.longrun.resume(ah.longrun.make_run(total_steps=20), tmp_path / "c.pt"), 20)
    for name in ("model", "opt", "sched"):
        assert same(getattr(reference, name).state_dict(), getattr(resumed, name).state_dict()), name
    assert ah.metrics.max_abs_diff(ah.longrun.weights(reference), ah.longrun.weights(resumed)) == 0.0


def test_training_in_pieces_equals_training_at_once():
    run = ah.longrun.make_run(total_steps=20)
    for stop in (3, 8, 9, 20):  # stops inside an epoch, at its last batch, and just after it
        ah.longrun.train(run, stop)
    assert same(run.model.state_dict(), straight().model.state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("leave_out", ah.longrun.LEAVE_OUT)
def test_every_state_left_out_of_a_resume_changes_the_result(tmp_path, leave_out):
    ah.longrun.save(ah.longrun.train(ah.longrun.make_run(total_steps=20), 11), tmp_path / "c.pt")
    resumed = ah.longrun.train(ah.longrun.resume(ah.longrun.make_run(total_steps=20), tmp_path / "c.pt", leave_out),
                               20)
    assert ah.metrics.max_abs_diff(ah.longrun.weights(straight()), ah.longrun.weights(resumed)) > 0


def test_resume_names_the_states_it_can_leave_out(tmp_path):
    ah.longrun.save(ah.longrun.make_run(), tmp_path / "c.pt")
    with pytest.raises(ValueError, match="leave_out must be None or one of optimizer, scheduler, python"):
        ah.longrun.resume(ah.longrun.make_run(), tmp_path / "c.pt", "weights")


def test_train_step_takes_another_backward_and_after_step_stops_early():
    run = ah.longrun.make_run()
    calls = []
    loss = ah.longrun.train_step(run, torch.randn(4, 16), torch.zeros(4, dtype=torch.long),
                                 backward=lambda t: calls.append(t) or t.backward())
    assert len(calls) == 1 and loss > 0
    assert ah.longrun.train(ah.longrun.make_run(), 30, after_step=lambda r: r.step == 5).step == 5


def test_weights_of_a_run_and_of_its_checkpoint_agree_and_exit_reason_reads_statuses(tmp_path):
    run = ah.longrun.train(ah.longrun.make_run(), 3)
    ah.longrun.save(run, tmp_path / "w.pt")
    assert ah.metrics.max_abs_diff(ah.longrun.weights(run), ah.longrun.weights(tmp_path / "w.pt")) == 0.0
    assert [ah.longrun.exit_reason(c) for c in (0, 1, -9, -15)] == ["exit 0", "exit 1", "killed by SIGKILL",
                                                                   "killed by SIGTERM"]


# --- the chapter's scripts in fresh processes ----------------------------------------------------------------------

@pytest.mark.slow
def test_a_save_killed_half_way_loses_everything_with_torch_save_and_nothing_atomically(tmp_path, workers):
    procs = {way: jobs.start(workers["kill_mid_save.py"], tmp_path / way, "--way", way)
             for way in ("torch.save", "atomic")}
    codes = {way: jobs.finish(p, 180)[0] for way, p in procs.items()}
    assert codes == {"torch.save": -signal.SIGKILL, "atomic": -signal.SIGKILL}
    with pytest.raises(ah.longrun.CheckpointError, match="unreadable"):
        ah.longrun.read_checkpoint(tmp_path / "torch.save" / "model.pt")
    assert ah.longrun.read_checkpoint(tmp_path / "atomic" / "model.pt")["step"] == 0
    assert len(list((tmp_path / "atomic").glob(".model.pt.*.tmp"))) == 1


@pytest.mark.slow
def test_a_run_killed_between_checkpoints_resumes_bit_identical_in_a_new_process(tmp_path, workers):
    args = ("--steps", 24, "--every", 8)
    procs = [jobs.start(workers["train.py"], tmp_path / "ref", *args),
             jobs.start(workers["train.py"], tmp_path / "cut", *args, "--die-at", 13)]
    assert [jobs.finish(p, 180)[0] for p in procs] == [0, -signal.SIGKILL]
    assert ah.longrun.latest_good_checkpoint(tmp_path / "cut" / "ckpt").name == "step_00000008.pt"
    code, out = jobs.finish(jobs.start(workers["train.py"], tmp_path / "cut", *args), 180)  # the same command again
    assert code == 0, out[-2000:]
    assert json.loads((tmp_path / "cut" / "result.json").read_text())["started"] == 8
    a, b = (ah.longrun.read_checkpoint(tmp_path / run / "final.pt") for run in ("ref", "cut"))
    assert all(same(a[k], b[k]) for k in ("model", "optimizer", "scheduler"))


@pytest.mark.slow
def test_finish_and_wait_for_kill_a_worker_that_outlives_its_timeout(tmp_path, workers):
    endless = ("--steps", 10**6, "--every", 10**6)
    proc = jobs.start(workers["train.py"], tmp_path, *endless)
    with pytest.raises(TimeoutError, match=r"worker train\.py printed no NEVER within 1 s and was killed"):
        ah.longrun.wait_for(proc, "NEVER", timeout=1)
    assert proc.poll() is not None
    proc = jobs.start(workers["train.py"], tmp_path, *endless)
    with pytest.raises(TimeoutError, match=r"train\.py .* ran past 1 s and was killed"):
        ah.launch.finish(proc, 1, echo=False, check=False)
    assert proc.poll() is not None
    proc = jobs.start(workers["train.py"], tmp_path / "short", "--steps", 3)
    with pytest.raises(RuntimeError, match=r"worker train\.py ended \(exit 0\) without printing READY"):
        ah.longrun.wait_for(proc, "READY", timeout=180)


@pytest.mark.slow
def test_wait_for_times_out_when_the_group_has_gone_before_the_kill():
    code = "import subprocess; subprocess.Popen(['sleep', '3'], start_new_session=True)"  # keeps the output open
    proc = ah.launch.start([sys.executable, "-c", code])
    proc.wait()  # exited and reaped: killing its group finds nobody
    with pytest.raises(TimeoutError, match="printed no NEVER within 1 s and was killed"):
        ah.longrun.wait_for(proc, "NEVER", timeout=1)


# --- under torchrun, 2 ranks (gloo on the CPU, or nccl with a GPU each) ---------------------------------------------

@pytest.fixture(scope="module")
def torchrun_jobs(tmp_path_factory, workers):
    """The chapter's elastic.py (uninterrupted, and with rank 1 killed and the job restarted) and fsdp.py, started
    at once (they mostly wait on each other)."""
    d = tmp_path_factory.mktemp("longrun_torchrun")
    started = jobs.Jobs(d, {
        "ref": jobs.torchrun(workers["elastic.py"], d / "ref", "--steps", 12, "--every", 5),
        "crashed": jobs.torchrun(workers["elastic.py"], d / "crashed", "--steps", 12, "--every", 5, "--crash-at", 7,
                                 restarts=1),
        "fsdp": jobs.torchrun(workers["fsdp.py"], d / "fsdp", "--steps", 2)})
    yield started
    started.kill()


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_it_resumes_from_the_last_checkpoint(torchrun_jobs):
    d = torchrun_jobs.folder
    for name in ("ref", "crashed"):
        code, out = torchrun_jobs.result(name)
        assert code == 0, out[-3000:]
    for rank in (0, 1):
        log = (d / "crashed" / f"log_rank{rank}.txt").read_text().splitlines()
        restart = log.index("attempt 1 resumed at step 5")
        assert "attempt 0 step 7" in log[:restart] and log[restart + 1] == "attempt 1 step 6"
        assert log[-1] == "attempt 1 step 12"
    a, b = (ah.longrun.read_checkpoint(d / run / "final.pt") for run in ("ref", "crashed"))
    assert all(same(a[k], b[k]) for k in ("model", "optimizer", "scheduler"))


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_restarted_and_resumes_from_the_last_checkpoint(torchrun_jobs):
    """The restarted job lost no step beyond its last checkpoint, and kept only the newest two (keep=2)."""
    d = torchrun_jobs.folder
    code, out = torchrun_jobs.result("crashed")
    assert code == 0, out[-3000:]
    for rank in (0, 1):
        steps = [int(line.split()[-1]) for line in (d / "crashed" / f"log_rank{rank}.txt").read_text().splitlines()
                 if line.split()[2] == "step"]
        assert steps == [*range(1, 8), *range(6, 13)]  # 1-7, killed; resumed from the checkpoint of step 5: 6-12
    assert sorted(p.name for p in (d / "crashed" / "ckpt").iterdir()) == ["step_00000005.pt", "step_00000010.pt"]
    assert "[rank0] 2 ranks, backend" in out


@pytest.mark.slow
def test_fsdp2_shards_saved_by_two_ranks_load_into_one_process(torchrun_jobs):
    import torch.distributed.checkpoint as dcp

    d = torchrun_jobs.folder
    code, out = torchrun_jobs.result("fsdp")
    assert code == 0, out[-3000:]
    shard = json.loads((d / "fsdp" / "fsdp_rank1.json").read_text())
    assert {k: shard[k] for k in ("type", "local", "global")} == {"type": "DTensor", "local": [32, 16],
                                                                 "global": [64, 16]}
    assert shard["device"].split(":")[0] in ("cpu", "cuda")
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    state = {"model": model.state_dict()}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.load(state, checkpoint_id=d / "fsdp" / "dcp")
    full = torch.load(d / "fsdp" / "full.pt", weights_only=True)
    assert all(torch.equal(full[k], v) for k, v in state["model"].items())
