"""session (setup, threads) and internals: a chapter's first cell, the thread-count context manager and the
private-API wrappers."""

import pytest
import torch

import accelhelpers as ah


def test_setup_seeds_and_announces(capsys):
    s = ah.session.setup("95", seed=3)
    a = torch.rand(2)
    ah.session.setup("95", seed=3, verbose=False)
    assert torch.equal(a, torch.rand(2))
    out = capsys.readouterr().out
    assert "best_device" in out and s.chapter == "95" and ah.results.current_chapter() == "95"
    if s.device.type == "cpu":
        assert "no GPU or TPU found" in out and s.quick


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
