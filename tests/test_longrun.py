"""Chapter 09's long run: exact resume (in one process and across processes), what each state left out costs, the
workers the chapter kills, preempts and restarts (2 gloo ranks under torchrun), and faults.Preemption."""

import json
import os
import signal
import sys
import threading
import time

import pytest
import torch

import accelhelpers as ah
from accelhelpers import checkpoint as ck
from accelhelpers import faults, launch, longrun


@pytest.fixture(autouse=True)
def one_thread():
    """Bit-for-bit comparisons with the workers, which run with 1 torch thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def same(a, b) -> bool:
    """Bit-for-bit equality of two nested states."""
    return ck.digest(a) == ck.digest(b)


def straight(steps: int = 20) -> longrun.Run:
    """An uninterrupted run of `steps` steps."""
    return longrun.train(longrun.make_run(total_steps=steps), steps)


# --- in one process ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("at", [11, 16], ids=["mid-epoch", "epoch-end"])
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path, at):
    reference = straight()
    cut = longrun.train(longrun.make_run(total_steps=20), at)
    assert cut.step == at
    longrun.save(cut, tmp_path / "c.pt")
    resumed = longrun.train(longrun.resume(longrun.make_run(total_steps=20), tmp_path / "c.pt"), 20)
    for name in ("model", "opt", "sched"):
        assert same(getattr(reference, name).state_dict(), getattr(resumed, name).state_dict()), name
    assert ah.metrics.max_abs_diff(longrun.weights(reference), longrun.weights(resumed)) == 0.0


def test_training_in_pieces_equals_training_at_once():
    run = longrun.make_run(total_steps=20)
    for stop in (3, 8, 9, 20):  # stops inside an epoch, at its last batch, and just after it
        longrun.train(run, stop)
    assert same(run.model.state_dict(), straight().model.state_dict())


@pytest.mark.parametrize("leave_out", longrun.LEAVE_OUT)
def test_every_state_left_out_of_a_resume_changes_the_result(tmp_path, leave_out):
    longrun.save(longrun.train(longrun.make_run(total_steps=20), 11), tmp_path / "c.pt")
    resumed = longrun.train(longrun.resume(longrun.make_run(total_steps=20), tmp_path / "c.pt", leave_out), 20)
    assert ah.metrics.max_abs_diff(longrun.weights(straight()), longrun.weights(resumed)) > 0


def test_resume_names_the_states_it_can_leave_out(tmp_path):
    longrun.save(longrun.make_run(), tmp_path / "c.pt")
    with pytest.raises(ValueError, match="leave_out must be None or one of optimizer, scheduler, python"):
        longrun.resume(longrun.make_run(), tmp_path / "c.pt", "weights")


def test_train_step_takes_another_backward_and_after_step_stops_early():
    run = longrun.make_run()
    calls = []
    loss = longrun.train_step(run, torch.randn(4, 16), torch.zeros(4, dtype=torch.long),
                              backward=lambda t: calls.append(t) or t.backward())
    assert len(calls) == 1 and loss > 0
    assert longrun.train(longrun.make_run(), 30, after_step=lambda r: r.step == 5).step == 5


def test_weights_of_a_run_and_of_its_checkpoint_agree_and_exit_reason_reads_statuses(tmp_path):
    run = longrun.train(longrun.make_run(), 3)
    longrun.save(run, tmp_path / "w.pt")
    assert ah.metrics.max_abs_diff(longrun.weights(run), longrun.weights(tmp_path / "w.pt")) == 0.0
    assert [longrun.exit_reason(c) for c in (0, 1, -9, -15)] == ["exit 0", "exit 1", "killed by SIGKILL",
                                                                "killed by SIGTERM"]


# --- faults.Preemption ---------------------------------------------------------------------------------------------

def test_preemption_turns_sigterm_into_a_flag_and_puts_the_old_handler_back():
    before = signal.getsignal(signal.SIGTERM)
    with faults.Preemption() as p:
        assert p.requested is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # Python runs the handler between bytecodes
        assert p.requested == "SIGTERM" and p.at is not None
    assert signal.getsignal(signal.SIGTERM) is before


def test_preemption_outside_the_main_thread_says_so():
    errors = []

    def enter():
        try:
            with faults.Preemption():
                pass
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert len(errors) == 1 and "Preemption must be entered in the main thread" in errors[0]


# --- workers in fresh processes ------------------------------------------------------------------------------------

def test_a_save_killed_half_way_loses_everything_with_torch_save_and_nothing_atomically(tmp_path):
    procs = {way: longrun.start("kill_mid_save", tmp_path / way, "--way", way) for way in ("torch.save", "atomic")}
    codes = {way: longrun.finish(p, 180)[0] for way, p in procs.items()}
    assert codes == {"torch.save": -signal.SIGKILL, "atomic": -signal.SIGKILL}
    with pytest.raises(ck.CheckpointError, match="unreadable"):
        ck.read_checkpoint(tmp_path / "torch.save" / "model.pt")
    assert ck.read_checkpoint(tmp_path / "atomic" / "model.pt")["step"] == 0
    assert len(list((tmp_path / "atomic").glob(".model.pt.*.tmp"))) == 1


def test_sigterm_is_a_clean_save_with_preemption_and_a_loss_without(tmp_path):
    procs = {pre: longrun.start("train", tmp_path / str(pre), "--steps", 10**6, "--every", 1000,
                                *(["--preemptible"] if pre else [])) for pre in (False, True)}
    for proc in procs.values():
        longrun.wait_for(proc, "READY", 180)
        proc.send_signal(signal.SIGTERM)
    codes = {pre: longrun.finish(p, 180)[0] for pre, p in procs.items()}
    assert codes == {False: -signal.SIGTERM, True: 0}
    assert not (tmp_path / "False" / "ckpt").exists()
    result = json.loads((tmp_path / "True" / "result.json").read_text())
    assert result["signal"] == "SIGTERM" and result["stopped"] >= 10 and result["signal_to_saved_s"] > 0
    newest = ck.latest_good_checkpoint(tmp_path / "True" / "ckpt")
    assert ck.read_checkpoint(newest)["step"] == result["stopped"]


def test_a_run_killed_between_checkpoints_resumes_bit_identical_in_a_new_process(tmp_path):
    args = ("--steps", 24, "--every", 8)
    procs = [longrun.start("train", tmp_path / "ref", *args), longrun.start("train", tmp_path / "cut", *args,
                                                                            "--die-at", 13)]
    assert [longrun.finish(p, 180)[0] for p in procs] == [0, -signal.SIGKILL]
    assert ck.latest_good_checkpoint(tmp_path / "cut" / "ckpt").name == "step_00000008.pt"
    code, out = longrun.finish(longrun.start("train", tmp_path / "cut", *args), 180)  # the same command again
    assert code == 0, out[-2000:]
    assert json.loads((tmp_path / "cut" / "result.json").read_text())["started"] == 8
    a, b = (ck.read_checkpoint(tmp_path / run / "final.pt") for run in ("ref", "cut"))
    assert all(same(a[k], b[k]) for k in ("model", "optimizer", "scheduler"))


def test_finish_and_wait_for_kill_a_worker_that_outlives_its_timeout(tmp_path):
    proc = longrun.start("train", tmp_path, "--steps", 10**6, "--every", 10**6)
    with pytest.raises(TimeoutError, match=r"worker train .* printed no NEVER within 1 s and was killed"):
        longrun.wait_for(proc, "NEVER", timeout=1)
    assert proc.poll() is not None
    proc = longrun.start("train", tmp_path, "--steps", 10**6, "--every", 10**6)
    with pytest.raises(TimeoutError, match=r"accelhelpers\.longrun train .* ran past 1 s and was killed"):
        longrun.finish(proc, timeout=1)
    assert proc.poll() is not None
    proc = longrun.start("train", tmp_path / "short", "--steps", 3)
    with pytest.raises(RuntimeError, match=r"worker train .* ended \(exit 0\) without printing READY"):
        longrun.wait_for(proc, "READY", timeout=180)


def test_wait_for_times_out_when_the_group_has_gone_before_the_kill():
    code = "import subprocess; subprocess.Popen(['sleep', '3'], start_new_session=True)"  # keeps the output open
    proc = launch.start([sys.executable, "-c", code])
    proc.wait()  # exited and reaped: killing its group finds nobody
    with pytest.raises(TimeoutError, match="printed no NEVER within 1 s and was killed"):
        longrun.wait_for(proc, "NEVER", timeout=1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is enforced on Linux")
def test_a_real_cpu_oom_under_a_memory_limit_is_backed_off_both_ways(tmp_path):
    code, out = longrun.finish(longrun.start("oom", tmp_path, "--budget-mb", 128, "--start-batch", 65536), 300)
    assert code == 0, out[-2000:]
    r = json.loads((tmp_path / "oom.json").read_text())
    assert r["plain_kind"] == "cpu" and "DefaultCPUAllocator" in r["plain_error"]
    assert r["tried"]["ours"][:2] == [65536, 32768] and r["ours"] == r["tried"]["ours"][-1] < 65536
    assert r["tried"]["accelerate"][:2] == [65536, 58982] and r["accelerate"] == r["tried"]["accelerate"][-1]
    assert len(r["tried"]["accelerate"]) > len(r["tried"]["ours"])


# --- under torchrun, 2 gloo ranks ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torchrun_jobs(tmp_path_factory):
    """The chapter's torchrun jobs, started at once (they mostly wait on each other)."""
    d = tmp_path_factory.mktemp("longrun_torchrun")
    jobs = {"nan": longrun.torchrun("nan", d / "nan", "--steps", 6, "--bad-step", 3, "--timeout", 3),
            "ref": longrun.torchrun("elastic", d / "ref", "--steps", 12, "--every", 5),
            "crashed": longrun.torchrun("elastic", d / "crashed", "--steps", 12, "--every", 5, "--crash-at", 7,
                                        restarts=1),
            "fsdp": longrun.torchrun("fsdp", d / "fsdp", "--steps", 2)}
    yield d, jobs
    for proc in jobs.values():
        if proc.poll() is None:
            launch.kill(proc)


def test_a_nan_on_one_rank_stops_both_when_agreed_and_strands_the_other_when_local(torchrun_jobs):
    d, jobs = torchrun_jobs
    code, out = longrun.finish(jobs["nan"], 300)
    assert code != 0, out[-3000:]  # the local phase ends with rank 0's timeout and rank 1's failed final barrier
    agreed, local = ([json.loads((d / "nan" / f"nan_{p}_rank{r}.json").read_text()) for r in (0, 1)]
                     for p in ("agreed", "local"))
    assert [r["steps_done"] for r in agreed + local] == [3, 3, 3, 3]
    assert all("on rank(s) [1]" in r["error"] and r["seconds"] < 3 for r in agreed)
    assert local[0]["error"].startswith("PeerFailure") and local[0]["seconds"] >= 2.5
    assert local[1]["error"].startswith("NonFiniteError")


def test_torchrun_restarts_a_killed_worker_and_it_resumes_from_the_last_checkpoint(torchrun_jobs):
    d, jobs = torchrun_jobs
    for name in ("ref", "crashed"):
        code, out = longrun.finish(jobs[name], 300)
        assert code == 0, out[-3000:]
    for rank in (0, 1):
        log = (d / "crashed" / f"log_rank{rank}.txt").read_text().splitlines()
        restart = log.index("attempt 1 resumed at step 5")
        assert "attempt 0 step 7" in log[:restart] and log[restart + 1] == "attempt 1 step 6"
        assert log[-1] == "attempt 1 step 12"
    a, b = (ck.read_checkpoint(d / run / "final.pt") for run in ("ref", "crashed"))
    assert all(same(a[k], b[k]) for k in ("model", "optimizer", "scheduler"))


def test_fsdp2_shards_saved_by_two_ranks_load_into_one_process(torchrun_jobs):
    import torch.distributed.checkpoint as dcp

    d, jobs = torchrun_jobs
    code, out = longrun.finish(jobs["fsdp"], 300)
    assert code == 0, out[-3000:]
    shard = json.loads((d / "fsdp" / "fsdp_rank1.json").read_text())
    assert shard == {"type": "DTensor", "local": [32, 16], "global": [64, 16]}
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    state = {"model": model.state_dict()}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.load(state, checkpoint_id=d / "fsdp" / "dcp")
    full = torch.load(d / "fsdp" / "full.pt", weights_only=True)
    assert all(torch.equal(full[k], v) for k, v in state["model"].items())
