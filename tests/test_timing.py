"""timing: the benchmark, FLOP counts, measured peaks."""

import os
import time

import pytest
import torch

import accelhelpers as ah
from accelhelpers import timing


def test_benchmark_measures_a_known_sleep():
    t = ah.timing.benchmark(lambda: time.sleep(0.002), repeats=3, min_time=0.01, warmup=1)
    assert 0.0018 < t.median < 0.01
    assert t.best <= t.median and len(t.times) == 3 and t.calls_per_repeat >= 1
    assert "median" in str(t)


def test_benchmark_warms_up_and_calibrates():
    calls = []
    t = ah.timing.benchmark(lambda: calls.append(1), warmup=5, repeats=2, min_time=0.001)
    assert len(calls) >= 5 + 2 * t.calls_per_repeat and t.calls_per_repeat > 1


def test_benchmark_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats >= 1"):
        ah.timing.benchmark(lambda: None, repeats=0)


def test_mlp_flops_matches_a_hand_count():
    # forward 2*B*(a*b + b*c); weight grads the same; input grads only for the second layer
    assert ah.timing.mlp_flops([3, 4, 5], 2, backward=False) == 2 * 2 * (12 + 20)
    assert ah.timing.mlp_flops([3, 4, 5], 2) == 2 * 2 * (12 + 20) * 2 + 2 * 2 * 20


def test_mlp_flops_matches_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    sizes = ah.models.udl_sizes(4)
    model, x = ah.models.udl_mlp(4), torch.randn(64, 40)
    with FlopCounterMode(display=False) as fc:
        model(x).sum().backward()
    assert fc.get_total_flops() == ah.timing.mlp_flops(sizes, 64)


def test_mlp_flops_bad_input():
    with pytest.raises(ValueError):
        ah.timing.mlp_flops([40], 10)
    with pytest.raises(ValueError):
        ah.timing.mlp_flops([40, 10], 0)


def test_peaks_count_the_flops_and_bytes_of_what_they_time(monkeypatch):
    """2n^3 FLOPs per n x n matmul, and a read plus a write of every byte copied, over the best repeat."""
    ran = []

    def fixed_timing(fn, device="cpu", **kw):  # the timed function really runs; its time is fixed
        ran.append(fn())
        return timing.Timing([0.5, 0.25, 0.4])

    monkeypatch.setattr(timing, "benchmark", fixed_timing)
    assert timing.matmul_gflops(100) == pytest.approx(2 * 100**3 / 0.25 / 1e9)
    assert timing.copy_gbps(4_000_000) == pytest.approx(2 * 4_000_000 / 0.25 / 1e9)
    assert tuple(ran[0].shape) == (100, 100) and ran[1].numel() == 1_000_000


def test_measured_peaks_are_physically_possible_here():
    """No CPU core does more than 32 fp32 FMAs (64 FLOPs) a cycle at 6 GHz: a higher figure is a counting bug."""
    gf = timing.matmul_gflops(256, min_time=0.01, repeats=2)
    bw = timing.copy_gbps(8 * 2**20, min_time=0.01, repeats=2)
    cores = os.cpu_count() or 1
    assert 0 < gf < cores * 64 * 6.0 and 0 < bw < 2000
    assert ah.timing.fraction_of_peak(50.0, 200.0) == 0.25
    with pytest.raises(ValueError):
        ah.timing.fraction_of_peak(1.0, 0.0)


def test_unsynced_time_measures_the_calls():
    took = timing.time_unsynced(lambda: time.sleep(0.01), calls=3)
    assert 0.009 < took < 1.0  # seconds per call: each call sleeps 10 ms


def test_round_ratios_are_per_interleaved_round():
    from accelhelpers.timing import Timing, round_ratios

    slow, fast = Timing([2.0, 3.0, 4.0, 2.0]), Timing([1.0, 1.0, 1.0, 4.0])
    assert round_ratios(slow, fast) == (2.5, 0.5, 4.0)
    with pytest.raises(ValueError, match="same number"):
        round_ratios(Timing([1.0, 1.0]), Timing([1.0, 1.0]))


def test_noise_watch_reads_load_and_the_reference_kernel():
    from accelhelpers.timing import Noise, noise_watch

    with noise_watch() as noise:
        sum(range(1000))
    assert noise.reference_s[0] > 0 and noise.reference_s[1] > 0 and noise.cores >= 1
    assert noise.verdict().startswith(("quiet enough", "TOO NOISY"))
    busy = Noise(load=(0.1, 3.5), reference_s=(1e-3, 1e-3), cores=2)
    drifting = Noise(load=(0.1, 0.1), reference_s=(1e-3, 1.5e-3), cores=2)
    quiet = Noise(load=(0.5, 0.6), reference_s=(1e-3, 1.1e-3), cores=2)
    assert busy.noisy and drifting.noisy and not quiet.noisy
    assert "50% drift" in drifting.verdict()


def test_load_average_and_hours_read_as_a_learner_reads_them(monkeypatch):
    import os

    from accelhelpers.timing import hours, load_average

    monkeypatch.setattr(os, "getloadavg", lambda: (1.23456, 0.0, 0.0))
    assert load_average() == 1.23
    monkeypatch.delattr(os, "getloadavg")  # Windows has none
    assert load_average() is None
    assert [hours(h) for h in (0.5, 3.21, 74.4)] == ["30 min", "3.2 h", "3.1 days"]


def test_record_keeps_the_range(tmp_path, monkeypatch):
    import json

    import accelhelpers as ah

    ah.results.set_chapter("99")
    ah.results.record("ratio", 1.2, "x", "n", spread=(0.9, 1.5), repeats=5)
    entry = json.loads((ah.results.results_dir() / "99.json").read_text())[0]
    assert entry["spread"] == [0.9, 1.5] and entry["repeats"] == 5
    with pytest.raises(ValueError, match="spread must be"):
        ah.results.record("bad", 1.0, "x", spread=(2.0, 1.0))


def test_record_noise_keeps_the_noisiest_check(tmp_path, monkeypatch, capsys):
    from accelhelpers.timing import Noise, record_noise

    monkeypatch.setenv("ACCEL_RESULTS_DIR", str(tmp_path))
    quiet, loud = Noise((0.1, 0.1), (1.0, 1.05), 2), Noise((0.1, 5.0), (1.0, 1.0), 2)
    assert record_noise(quiet, loud) is loud
    assert "TOO NOISY" in capsys.readouterr().out
    assert any(p.read_text().count('"noise"') for p in tmp_path.glob("*.json"))
    with pytest.raises(ValueError):
        record_noise()
