"""Chapter 09's long run: exact resume in one process, what each state left out costs, train.py's resume at start-up
(the chapter's script, imported), and the helpers that start and watch the chapter's scripts."""

import runpy
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


@pytest.mark.parametrize("leave_out", ah.longrun.LEAVE_OUT)  # the control of the test above
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


# Left to nbval: a save SIGKILLed half-way (chapter 09 cell 23); SIGKILLed, resumed in a new process (cell 41).
def test_train_py_resumes_at_start_up_from_the_newest_checkpoint(tmp_path, workers):
    """train.py's train_from_checkpoint, stopped after step 13 and called again, starts at the checkpoint of step 8
    and ends with the weights, optimizer and scheduler of a run that was never stopped."""
    train_from_checkpoint = runpy.run_path(str(workers["train.py"]))["train_from_checkpoint"]
    straight, began = train_from_checkpoint(tmp_path / "straight", 24, 8)
    assert began == 0 and straight.step == 24
    steps = iter(range(1, 25))
    cut, _ = train_from_checkpoint(tmp_path / "cut", 24, 8, stop=lambda: next(steps) == 13)  # asked after each step
    assert cut.step == 13
    assert sorted(p.name for p in (tmp_path / "cut" / "ckpt").iterdir()) == ["step_00000008.pt"]
    resumed, began = train_from_checkpoint(tmp_path / "cut", 24, 8)
    assert (began, resumed.step) == (8, 24)
    for name in ("model", "opt", "sched"):
        assert same(getattr(straight, name).state_dict(), getattr(resumed, name).state_dict()), name


# --- the chapter's scripts in fresh processes ----------------------------------------------------------------------

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


# Left to nbval: torchrun restarts a killed rank (chapter 09 cells 67, 90); FSDP2 shards load in 1 process (cell 50).
