"""session (setup, threads) and internals: a chapter's first cell, the thread-count context manager and the
private-API wrappers."""

import os
import subprocess
import sys

import pytest
import torch

import accelhelpers as ah


def test_setup_seeds_and_announces(capsys):
    s = ah.session.setup("95", seed=3)
    a = torch.rand(2)
    ah.session.setup("95", seed=3, verbose=False)
    assert torch.equal(a, torch.rand(2))
    out = capsys.readouterr().out
    assert "This machine: " in out and "best device: " in out and "cpu_isa" not in out
    assert s.chapter == "95" and ah.results.current_chapter() == "95"
    if s.device.type == "cpu":
        assert "no GPU or TPU found" in out and s.quick


def test_only_chapter_01_prints_the_whole_hardware_report(capsys):
    """Review XC-5: the 17-line report in every chapter's first cell; chapter 01 teaches reading it, the others
    print one line naming the machine."""
    ah.session.setup("01")
    full = capsys.readouterr().out
    assert "cpu_isa" in full and "best_device" in full and "This machine: " not in full
    ah.session.setup("02")
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("This machine: ") and ah.device.machine_line(ah.device.hardware_report()) in line


def test_threads_sets_and_restores_even_on_error():
    before = torch.get_num_threads()
    with ah.session.threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), ah.session.threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before
    with ah.session.threads(None):
        assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="n >= 1"), ah.session.threads(0):
        pass


def test_inductor_compile_threads_is_restored():
    import torch._inductor.config as config

    before = config.compile_threads
    with ah.internals.inductor_compile_threads(1):
        assert config.compile_threads == 1
    assert config.compile_threads == before


def test_dynamo_explain_counts_a_graph_break():
    def f(x):
        y = x * 2
        print("", end="")  # a graph break
        return y + 1

    ex = ah.internals.dynamo_explain(f, torch.ones(3))
    assert ex.graph_count == 2 and ex.graph_break_count == 1


def test_reset_accelerate_state_lets_a_second_accelerator_start(monkeypatch):
    import os

    if "USE_TORCH_XLA" not in os.environ:
        monkeypatch.setenv("USE_TORCH_XLA", "0")
    from accelerate import Accelerator

    Accelerator(cpu=True, gradient_accumulation_steps=2)
    ah.internals.reset_accelerate_state()
    assert Accelerator(cpu=True, gradient_accumulation_steps=4).gradient_accumulation_steps == 4
    ah.internals.reset_accelerate_state()


@pytest.mark.parametrize("preset, expected", [(None, True), ("0", False)])
def test_setup_lets_inductor_trust_the_cpu_flags_in_this_process_and_its_children(preset, expected):
    """Inductor's first CPU compile of a process loads a test library in a new Python per vector instruction set
    (seconds each); after setup a compile in this process, and in a worker it starts, reads the CPU's flags instead.
    A value the learner set is kept."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
    if preset is not None:
        env["TORCHINDUCTOR_VEC_ISA_OK"] = preset
    child = "import torch._inductor.config as c; print(c.cpp.vec_isa_ok)"
    code = (
        "import subprocess, sys\nimport accelhelpers as ah\nah.session.setup('95', verbose=False)\n"
        f"import torch._inductor.config as c\nprint(c.cpp.vec_isa_ok)\n"
        f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True).stdout.strip())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == [str(expected), str(expected)]
