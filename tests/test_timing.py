"""timing, written in chapter 01's cells and exported by nbdev: the device sync, the benchmark, interleaved
rounds, the noise check, FLOP counts, measured peaks."""

import time

import pytest
import torch

import accelhelpers as ah
from accelhelpers import timing

TICK = 2.0**-9  # about 2 ms, exact in binary: sums of ticks compare exactly


def test_benchmark_divides_by_its_calls_and_syncs_before_every_clock_read(clock):
    """Mutations this catches: a benchmark that forgets `/ calls` reads 5 ticks; one that skips the sync before a
    clock read fails the unsynced count; a calibration that stops early or late changes calls_per_repeat."""
    t = timing.benchmark(clock.work(TICK), repeats=3, min_time=5 * TICK, warmup=1)
    assert t.times == [TICK] * 3 and t.calls_per_repeat == 5  # 1 call is short of 5 ticks; 5 calls last exactly 5
    assert clock.events.count("call") == 1 + (1 + 5) + 3 * 5  # warm-up, two calibration repeats, three repeats
    assert clock.unsynced_reads() == 0


def test_benchmark_sleeps_at_least_what_it_sleeps():
    """On the real clock, only what a sleep guarantees: at least its duration (Python's time.sleep); a busy machine
    oversleeps by any amount, so there is no upper bound."""
    t = ah.timing.benchmark(lambda: time.sleep(0.002), repeats=3, min_time=0.01, warmup=1)
    assert t.best >= 0.002 and t.best <= t.median <= t.worst and len(t.times) == 3
    assert "median" in str(t)


def test_interleaved_alternates_the_functions_round_by_round(clock):
    """Mutations this catches: all of one function's rounds before the other's (the order of calls), times not
    divided by each function's own calls, a missing sync."""
    got = timing.interleaved({"a": clock.work(TICK, "a"), "b": clock.work(3 * TICK, "b")}, rounds=3,
                             min_time=6 * TICK)
    assert (got["a"].calls_per_repeat, got["b"].calls_per_repeat) == (6, 2)
    assert got["a"].times == [TICK] * 3 and got["b"].times == [3 * TICK] * 3
    timed = [e for e in clock.events if e in "ab"][-3 * (6 + 2):]  # the rounds, after each function's calibration
    assert "".join(timed) == ("a" * 6 + "b" * 2) * 3
    assert clock.unsynced_reads() == 0


def test_interleaved_without_warmup_times_each_call_once_a_round(clock):
    """warmup=False (chapter 02's rows, which size their own rounds): no warm-up or calibration call, each function
    once a round in turn, synced before each clock read. Mutations this catches: a calibration call left in, one
    function's rounds before the other's, a row's time taken from another row's clock reads, a missing sync."""
    got = timing.interleaved({"a": clock.work(TICK, "a"), "b": clock.work(3 * TICK, "b")}, rounds=3, warmup=False)
    assert "".join(e for e in clock.events if e in "ab") == "ab" * 3
    assert got["a"].times == [TICK] * 3 and got["b"].times == [3 * TICK] * 3 and got["a"].calls_per_repeat == 1
    assert clock.unsynced_reads() == 0


def test_a_spread_is_the_median_and_the_range():
    assert ah.timing.spread([3.0, 1.0, 2.0, 10.0]) == (2.5, 1.0, 10.0)
    s = ah.timing.spread(x for x in (2.0, 4.0, 3.0))  # any iterable, read once
    assert (s.median, s.lo, s.hi) == (3.0, 2.0, 4.0)
    with pytest.raises(ValueError, match="at least one value"):
        ah.timing.spread([])


@pytest.mark.parametrize(
    ("ratios", "words", "expected"),
    [
        ([1.31, 1.2, 1.45], (), "1.31x faster (1.20-1.45x)"),
        ([0.8, 0.74, 0.9], (), "0.80x, slower (0.74-0.90x)"),
        ([0.97, 1.12, 1.04], (), "1.04x, no measured difference (0.97-1.12x)"),
        ([1.0, 1.5, 1.6], (), "1.50x, no measured difference (1.00-1.60x)"),  # a round that tied: not faster
        ([1.004, 1.1, 1.2], (), "1.10x, no measured difference (1.00-1.20x)"),  # read as printed
        ([0.996, 0.9, 0.8], (), "0.90x, no measured difference (0.80-1.00x)"),
        ([2.0, 3.0, 4.0], ("cheaper", "dearer"), "3.00x cheaper (2.00-4.00x)"),
    ],
)
def test_the_verdict_is_read_from_the_range_not_the_median(ratios, words, expected):
    """Mutations this catches: a verdict from the median (the 0.97-1.12 row would read faster), `>=` instead of `>`
    at the range's ends, a low end of 1.004 (printed 1.00) read as above 1, the words swapped."""
    assert ah.timing.verdict(ratios, *words) == expected
    assert ah.timing.verdict(ah.timing.spread(ratios), *words) == expected


def test_a_timing_reports_the_median_and_the_range():
    t = ah.timing.Timing([0.002, 0.001, 0.003, 0.0025], calls_per_repeat=8)
    assert (t.median, t.best, t.worst) == (pytest.approx(0.00225), 0.001, 0.003)
    assert str(t) == "2.25 ms median (range 1 ms to 3 ms, 4 repeats of 8 calls)"


def test_sync_returns_on_cpu_and_refuses_a_non_device():
    assert ah.timing.sync("cpu") is None and ah.timing.sync(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="is not a device: choose one of cuda, xla, mps, cpu"):
        ah.timing.sync("tpu")


def test_interleaved_refuses_nothing_to_time():
    with pytest.raises(ValueError, match="at least one function"):
        ah.timing.interleaved({})
    with pytest.raises(ValueError, match="rounds >= 1"):
        ah.timing.interleaved({"a": lambda: None}, rounds=0)


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


def test_measured_peaks_name_the_thread_count_they_hold_for(monkeypatch):
    sizes = []
    monkeypatch.setattr(timing, "matmul_gflops", lambda n, device="cpu": sizes.append(n) or float(n))
    monkeypatch.setattr(timing, "copy_gbps", lambda n_bytes, device="cpu": n_bytes / 2**20)
    with ah.session.threads(1):
        assert timing.measure_peaks() == {"matmul_gflops": 2048.0, "copy_gbps": 64.0, "threads": 1}
    assert sizes == [512, 1024, 2048]


def test_unsynced_time_divides_by_its_calls_and_never_syncs(clock):
    """Mutations this catches: forgetting `/ calls` (3 ticks), or a sync that the wrong way of timing does not do."""
    assert timing.time_unsynced(clock.work(TICK), calls=3) == TICK
    assert "sync" not in clock.events and clock.events.count("call") == 3


def test_round_ratios_are_per_interleaved_round():
    from accelhelpers.timing import Timing, round_ratios

    slow, fast = Timing([2.0, 3.0, 4.0, 2.0]), Timing([1.0, 1.0, 1.0, 4.0])
    assert round_ratios(slow, fast) == (2.5, 0.5, 4.0)
    with pytest.raises(ValueError, match="same number"):
        round_ratios(Timing([1.0, 1.0]), Timing([1.0, 1.0]))


@pytest.mark.slow
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


def test_record_noise_keeps_the_noisiest_check(tmp_path, monkeypatch, capsys):
    from accelhelpers.timing import Noise, record_noise

    monkeypatch.setenv("ACCEL_RESULTS_DIR", str(tmp_path))
    quiet, loud = Noise((0.1, 0.1), (1.0, 1.05), 2), Noise((0.1, 5.0), (1.0, 1.0), 2)
    assert record_noise(quiet, loud) is loud
    assert "TOO NOISY" in capsys.readouterr().out
    assert any(p.read_text().count('"noise"') for p in tmp_path.glob("*.json"))
    with pytest.raises(ValueError):
        record_noise()
