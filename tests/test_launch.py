"""Starting processes from a notebook: command lines, streamed output, deadlines that kill the whole process group,
stopping at a marker line, free ports."""

import socket
import sys
import time
from pathlib import Path

import pytest

from accelhelpers import launch


def test_torchrun_cmd_for_a_module_or_a_script_on_one_or_several_nodes_and_bad_input():
    cmd = launch.torchrun_cmd("mypackage.worker", "out", "--steps", 3, nproc=2)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    assert cmd[5:] == ["-m", "mypackage.worker", "out", "--steps", "3"]
    assert launch.torchrun_cmd(Path("build/ch06/workers/equivalence.py"), "out")[-2:] == [
        "build/ch06/workers/equivalence.py", "out"]  # a script path runs as itself
    script = launch.torchrun_cmd("tests/rank_scripts/x.py", "a", max_restarts=1)
    assert script[-3:] == ["--max-restarts=1", "tests/rank_scripts/x.py", "a"]
    multi = launch.torchrun_cmd("m", nnodes=2, node_rank=1, rdzv_endpoint="127.0.0.1:29400")
    assert "--node-rank=1" in multi and "--rdzv-backend=c10d" in multi and "--standalone" not in multi
    with pytest.raises(ValueError, match="node_rank"):
        launch.torchrun_cmd("m", nnodes=2, node_rank=2, rdzv_endpoint="h:1")
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        launch.torchrun_cmd("m", nnodes=2)
    with pytest.raises(ValueError, match="nproc >= 1"):
        launch.torchrun_cmd("m", nproc=0)


def test_launch_streams_output_sets_the_environment_and_reports_failure(capsys):
    code = "import os; print('hello'); print(os.environ['USE_TORCH_XLA'], os.environ.get('GONE'))"
    run = launch.launch([sys.executable, "-c", code], 30, env={"GONE": None})
    assert run.returncode == 0 and run.output.split() == ["hello", "0", "None"] and run.seconds > 0
    assert "hello" in capsys.readouterr().out  # echoed as it arrived
    with pytest.raises(RuntimeError, match="exit status 3"):
        launch.launch([sys.executable, "-c", "import sys; print('bad'); sys.exit(3)"], 30, echo=False)
    assert launch.launch([sys.executable, "-c", "raise SystemExit(3)"], 30, echo=False, check=False).returncode == 3
    with pytest.raises(ValueError, match="timeout_s"):
        launch.launch(["true"], 0)


def test_gloo_connection_lines_are_kept_but_not_echoed(capsys):
    code = ("print('[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1'); "
            "print('[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks.'); print('[Gloo] something else')")
    run = launch.launch([sys.executable, "-c", code], 30)
    assert run.output.count("[Gloo]") == 4  # all of it is in the run's output ...
    assert capsys.readouterr().out == "[Gloo] something else\n"  # ... and only what is not the connection log is shown


def test_gloo_pieces_interleaved_by_two_ranks_are_not_echoed_either():
    """Unbuffered, each rank writes the message in pieces: two ranks' pieces interleave and split across lines."""
    msg = "[Gloo] Rank {} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    lines = ["[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
             "1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
             "[rank0] 2 ranks, backend gloo, on the CPU" + msg.format(1) + "\n",
             "\n",
             "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : \n",
             "1[rank0] 2 ranks, backend gloo, on the CPU\n",
             "\n",
             "[rank1] local batch 8 of global 16\n",
             "3\n",
             "[Gloo] something else\n",
             "7\n"]
    shown = launch.GlooFilter()
    assert [shown(line) for line in lines] == [
        None, None, "[rank0] 2 ranks, backend gloo, on the CPU\n", None, None,
        "[rank0] 2 ranks, backend gloo, on the CPU\n", None, "[rank1] local batch 8 of global 16\n", "3\n",
        "[Gloo] something else\n", "7\n"]  # a number a few lines away from the pieces is left alone


@pytest.mark.slow
def test_a_deadline_kills_the_whole_group_even_a_silent_child():
    with pytest.raises(TimeoutError, match="ran past 1"):
        launch.launch([sys.executable, "-c", "import time; print('start', flush=True); time.sleep(60)"], 1, echo=False)
    with pytest.raises(TimeoutError, match="ran past 1"):  # silent and with its output closed: still killed
        launch.launch([sys.executable, "-c", "import os, time; os.close(1); os.close(2); time.sleep(60)"], 1,
                      echo=False)
    run = launch.launch([sys.executable, "-c", "import time; print('a', flush=True); time.sleep(60)"], 1, echo=False,
                        stop_ok=True)
    assert run.returncode is None and run.output == "a\n"


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for a reaper that a container may lack)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_deadline_kills_the_grandchildren_too():
    """torchrun's ranks are its children, and a rank's DataLoader workers theirs: a deadline kills all of them."""
    grandchild = "import time; time.sleep(60)"
    child = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
             "print('grandchild', p.pid, flush=True); time.sleep(60)")
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    with pytest.raises(TimeoutError, match="ran past 3") as e:
        launch.launch([sys.executable, "-c", parent], 3, echo=False)
    pid = int(str(e.value).split("grandchild ")[1].split()[0])
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), f"grandchild {pid} outlived the launch"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_stop_on_a_marker_kills_the_child_and_its_children():
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
            "; print('child', p.pid, flush=True); print('STOP here', flush=True); time.sleep(30); print('never')")
    t0 = time.monotonic()
    proc = launch.start([sys.executable, "-c", code])
    run = launch.finish(proc, 20, echo=False, stop_on="STOP")
    assert run.returncode is None and "STOP here" in run.output and "never" not in run.output
    assert time.monotonic() - t0 < 15
    pid = int(run.output.split("child ")[1].split()[0])
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), f"the child's child {pid} outlived the stop"


def test_kill_ends_the_group_and_takes_a_process_already_gone():
    proc = launch.start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    assert proc.stdout.readline() == "up\n"
    launch.kill(proc)
    assert proc.returncode == -9
    launch.kill(proc)  # reaped and its group gone: no ProcessLookupError


def test_free_port_is_bindable_and_unprivileged():
    port = launch.free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # raises if another socket holds it
        assert s.getsockname()[1] == port


def test_read_lines_stops_at_a_marker_and_leaves_the_rest_to_the_caller():
    """The one deadline reader: at a marker the lines so far come back and what follows stays in the pipe (chapter
    09's wait_for reads a READY cue this way, then the caller reads on); a silent child meets the deadline."""
    proc = launch.start([sys.executable, "-c", "print('a'); print('READY'); print('b'); print('c')"])
    lines, why = launch.read_lines(proc, time.monotonic() + 60, stop_on="READY")
    assert (why, lines) == ("marker", ["a\n", "READY\n"])
    assert proc.stdout.read() == "b\nc\n"
    proc.wait()
    quiet = launch.start([sys.executable, "-c", "import time; time.sleep(60)"])
    t0 = time.monotonic()
    assert launch.read_lines(quiet, t0 + 0.5) == ([], "deadline") and time.monotonic() - t0 < 30
    launch.kill(quiet)
