"""Preemption: the SIGTERM handler of chapter 09 (a flag, not an exit; the old handler put back; main thread only),
and the chapter's preemptible.py, which saves the step it finished and leaves cleanly where a run without the
handler is killed with nothing saved."""

import json
import os
import signal
import threading
import time

import pytest

import accelhelpers as ah
from tests import longrun_jobs as jobs


def test_preemption_turns_sigterm_into_a_flag_and_puts_the_old_handler_back():
    before = signal.getsignal(signal.SIGTERM)
    with ah.longrun.Preemption() as p:
        assert p.requested is None
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # Python runs the handler between bytecodes
        assert p.requested == "SIGTERM" and p.at is not None
    assert signal.getsignal(signal.SIGTERM) is before


def test_preemption_outside_the_main_thread_says_so():
    errors = []

    def enter():
        try:
            with ah.longrun.Preemption():
                pass
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=enter)
    t.start()
    t.join()
    assert len(errors) == 1 and "Preemption must be entered in the main thread" in errors[0]


@pytest.mark.slow
def test_sigterm_is_a_clean_save_with_preemption_and_a_loss_without(tmp_path):
    script = jobs.workers(tmp_path / "workers")["preemptible.py"]
    procs = {pre: jobs.start(script, tmp_path / str(pre), "--steps", 10**6, "--every", 1000,
                             *([] if pre else ["--no-handler"])) for pre in (False, True)}
    try:
        sent = {}
        for pre, proc in procs.items():
            ah.longrun.wait_for(proc, "READY", 180)
            sent[pre] = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        codes = {pre: jobs.finish(p, 180)[0] for pre, p in procs.items()}
    finally:
        jobs.kill_all(procs.values())
    assert codes == {False: -signal.SIGTERM, True: 0}
    assert not (tmp_path / "False" / "ckpt").exists()
    result = json.loads((tmp_path / "True" / "result.json").read_text())
    assert result["signal"] == "SIGTERM" and result["stopped"] >= 10
    assert sent[True] < result["signal_at"] <= result["saved_at"] <= result["leaving_at"]  # one clock for both
    newest = ah.longrun.latest_good_checkpoint(tmp_path / "True" / "ckpt")
    assert ah.longrun.read_checkpoint(newest)["step"] == result["stopped"]
