"""Tests for accelhelpers.pipeline (exported from chapter 05): augmentation, loaders, seeding, profiling, starvation,
logging habits, batch size, accumulation."""

import os
import pickle
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import accelhelpers as ah


@pytest.fixture(scope="module")
def digits8():
    return ah.pipeline.digits_uint8()


def test_random_affine_is_a_bounded_rotation_zoom_shift():
    g = torch.Generator().manual_seed(0)
    th = ah.pipeline.random_affine(500, max_deg=15, max_shift=0.1, max_zoom=0.1, generator=g)
    assert th.shape == (500, 2, 3)
    det = torch.linalg.det(th[:, :, :2])              # 1 / zoom^2 with zoom in [0.9, 1.1]
    assert det.min() >= 1 / 1.1**2 - 1e-5 and det.max() <= 1 / 0.9**2 + 1e-5
    assert th[:, :, 2].abs().max() <= 0.1
    assert torch.equal(ah.pipeline.random_affine(0), torch.empty(0, 2, 3))


def test_affine_grid_matches_torch():
    th = ah.pipeline.random_affine(7, generator=torch.Generator().manual_seed(1))
    ref = F.affine_grid(th, [7, 1, 32, 32], align_corners=False)
    torch.testing.assert_close(ah.pipeline.affine_grid(th, 32), ref, atol=1e-6, rtol=0)


def test_warp_identity_is_a_plain_resize():
    x = torch.rand(3, 1, 8, 8)
    out = ah.pipeline.warp(x, torch.eye(2, 3).expand(3, 2, 3), 16)
    ref = F.interpolate(x, size=16, mode="bilinear", align_corners=False)
    # grid_sample pads with zeros at the border; the interior equals bilinear interpolation
    torch.testing.assert_close(out[..., 1:-1, 1:-1], ref[..., 1:-1, 1:-1], atol=1e-5, rtol=0)


def test_per_item_and_batch_transform_agree_with_the_same_randomness(digits8):
    x = digits8[0][:5]
    batch = ah.pipeline.augment_batch(x, 32, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    th, noise = ah.pipeline.random_affine(5, generator=g), torch.randn(5, 1, 32, 32, generator=g)
    items = torch.cat([ah.pipeline.warp(x[i:i + 1].float() / 16, th[i:i + 1], 32) for i in range(5)])
    torch.testing.assert_close(batch, (items + 0.05 * noise - 0.3) / 0.4, atol=1e-5, rtol=0)


def test_augmented_digits_items_and_errors(digits8):
    x, y = digits8
    assert x.dtype == torch.uint8 and x.shape[1:] == (1, 8, 8) and int(x.max()) == 16
    ds = ah.pipeline.AugmentedDigits(x, y, size=24, repeat=2)
    assert len(ds) == 2 * len(x)
    img, label = ds[len(x) + 3]
    assert img.shape == (1, 24, 24) and int(label) == int(y[3])
    plain = ah.pipeline.AugmentedDigits(x, y, size=8, augment=False)
    torch.testing.assert_close(plain[0][0], x[0].float() / 16, atol=1e-6, rtol=0)   # identity at same size
    assert pickle.loads(pickle.dumps(ds)).size == 24                                # workers can receive it
    with pytest.raises(ValueError, match="labels"):
        ah.pipeline.AugmentedDigits(x, y[:-1])


def test_digits_uint8_is_the_training_split_of_digits(digits8):
    split = ah.data.digits(images=True)
    torch.testing.assert_close(digits8[0].float() / 16, split.x_train, atol=1 / 32, rtol=0)
    assert torch.equal(digits8[1], split.y_train)


def test_workers_give_the_same_items_as_the_main_process(digits8):
    ds = ah.pipeline.AugmentedDigits(digits8[0][:48], digits8[1][:48], size=16, augment=False)
    a = torch.cat([xb for xb, _ in DataLoader(ds, batch_size=16)])
    b = torch.cat([xb for xb, _ in DataLoader(ds, batch_size=16, num_workers=2)])
    assert torch.equal(a, b)


def test_loader_timing_reports_medians_ranges_and_round_ratios():
    t = ah.pipeline.LoaderTiming([1.0, 0.5, 0.25, 0.4], 100)
    assert t.first_s == 1.0 and t.later_s == [0.5, 0.25, 0.4]
    assert t.items_per_s == pytest.approx(250) and t.items_per_s_range == (pytest.approx(200), pytest.approx(400))
    assert str(t) == "250 (200-400)"
    other = ah.pipeline.LoaderTiming([9.0, 1.0, 1.0, 0.2], 100)
    speed = t.speedup_over(other)                                        # per round: 2, 4, 0.5
    assert isinstance(speed, ah.timing.Spread)
    assert (speed.median, speed.lo, speed.hi) == (pytest.approx(2.0), pytest.approx(0.5), pytest.approx(4.0))
    assert ah.timing.verdict(speed) == "2.00x, no measured difference (0.50-4.00x)"
    assert ah.pipeline.LoaderTiming([0.5], 10).items_per_s == 20           # one epoch: it is the steady state


class _Slow(Dataset):
    def __init__(self, delay: float, n: int = 8):
        self.delay, self.n = delay, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.zeros(2), torch.tensor(0)


TICK = 2.0**-9  # about 2 ms of the fake clock, exact in binary: sums of ticks compare exactly


class _ClockedLoader:
    """A loader on the test's clock: each epoch waits `starts[epoch]` ticks (workers starting) before its first batch,
    then `fetch` ticks per batch of `size` items; each fetch goes into the clock's events under `name`."""

    def __init__(self, clock, name: str, batches: int, fetch: int, size: int = 2, starts: tuple[int, ...] = ()):
        self.clock, self.name, self.batches, self.fetch, self.size = clock, name, batches, fetch, size
        self.starts, self.epoch = starts, 0

    def __iter__(self):
        self.clock.now += TICK * (self.starts[self.epoch] if self.epoch < len(self.starts) else 0)
        self.epoch += 1
        for _ in range(self.batches):
            self.clock.now += TICK * self.fetch
            self.clock.events.append(self.name)
            yield torch.zeros(self.size, 1), torch.zeros(self.size)


def _clocked_tfm(clock, ticks: int):
    """A batch transform that takes `ticks` of the test's clock."""
    def tfm(xb: torch.Tensor) -> torch.Tensor:
        clock.work(TICK * ticks, "tfm")()
        return xb
    return tfm


def test_compare_loaders_times_each_loader_every_round_on_the_clock(clock):
    """Exact epoch and first-batch times, on a fake clock: loader a (3 batches of 2 items, 1 tick each, plus a 1-tick
    batch transform) starts its epochs in 8, 0, 2 ticks; loader b (2 batches of 4, 3 ticks each) in 1, 4, 0. Mutations
    this catches: the rounds not interleaved (all of a's epochs, then b's), no sync before the first batch's or the
    epoch's clock read, items counted as batches, a first-batch time taken at every batch."""
    clock.install(ah.pipeline)
    a = _ClockedLoader(clock, "a", batches=3, fetch=1, size=2, starts=(8, 0, 2))
    b = _ClockedLoader(clock, "b", batches=2, fetch=3, size=4, starts=(1, 4, 0))
    res = ah.pipeline.compare_loaders({"a": a, "b": b}, epochs=3, batch_tfms={"a": _clocked_tfm(clock, 1)})
    assert res["a"].epoch_s == [TICK * t for t in (8 + 6, 0 + 6, 2 + 6)]
    assert res["a"].first_batch_s == [TICK * t for t in (8 + 2, 0 + 2, 2 + 2)]
    assert res["b"].epoch_s == [TICK * t for t in (1 + 6, 4 + 6, 0 + 6)]
    assert res["b"].first_batch_s == [TICK * t for t in (1 + 3, 4 + 3, 0 + 3)]
    assert (res["a"].items, res["b"].items) == (6, 8)
    assert "".join(e for e in clock.events if e in ("a", "b")) == "aaabb" * 3  # one epoch of each in turn
    assert clock.unsynced_reads() == 0


def test_compare_loaders_takes_real_loaders_and_refuses_nothing_to_time():
    fast = DataLoader(TensorDataset(torch.rand(64, 3), torch.zeros(64)), batch_size=16)
    res = ah.pipeline.compare_loaders({"fast": fast}, epochs=2, batch_tfms={"fast": lambda xb: xb + 1})
    assert res["fast"].items == 64 and len(res["fast"].epoch_s) == len(res["fast"].first_batch_s) == 2
    with pytest.raises(ValueError, match="epochs"):
        ah.pipeline.compare_loaders({"fast": fast}, epochs=0)
    with pytest.raises(ValueError, match="no batches"):
        ah.pipeline.compare_loaders({"empty": DataLoader(TensorDataset(torch.rand(3, 1), torch.zeros(3)),
                                                         batch_size=4, drop_last=True)})


def _slow_start(worker_id: int) -> None:
    time.sleep(0.3)


def test_first_batch_shows_worker_start_up():
    """Non-persistent workers start again every epoch: their first batch of a later epoch waits for that."""
    slow_start = DataLoader(_Slow(0.0, 4), batch_size=2, num_workers=1, worker_init_fn=_slow_start)
    res = ah.pipeline.compare_loaders({"restart": slow_start}, epochs=2)["restart"]
    assert min(res.first_batch_s) >= 0.3


def test_np_random_seed_as_worker_init_fn_seeds_nothing_and_a_generator_does():
    def draws(**kw):
        return [float(v) for b in DataLoader(ah.pipeline.NumpyDraws(4), batch_size=2, num_workers=2, **kw) for v in b]

    bad = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        bad.append(draws(worker_init_fn=np.random.seed(1)))        # the erratum: passes None
    assert bad[0] != bad[1]                                        # the draws follow torch's seed, not the 1
    good = [draws(worker_init_fn=ah.pipeline.seed_worker, generator=torch.Generator().manual_seed(1))
            for _ in range(2)]
    assert good[0] == good[1] and len(set(good[0])) == 4           # repeatable, and the two workers differ


def test_seed_worker_seeds_numpy_and_random_from_torch():
    import random

    torch.manual_seed(12345)
    ah.pipeline.seed_worker(0)
    a, r = np.random.random(), random.random()
    np.random.seed(0)
    random.seed(0)
    torch.manual_seed(12345)
    ah.pipeline.seed_worker(0)
    assert (np.random.random(), random.random()) == (a, r)
    np.random.seed(12345)
    assert np.random.random() == a                                 # NumPy got torch's seed


def test_device_batches_cover_every_item_once_in_a_fresh_order():
    x, y = torch.arange(10.0)[:, None], torch.arange(10)
    batches = ah.pipeline.DeviceBatches(x, y, 4)
    torch.manual_seed(0)
    first = list(batches)
    assert [len(xb) for xb, _ in first] == [4, 4, 2]
    assert sorted(torch.cat([yb for _, yb in first]).tolist()) == list(range(10))
    assert all(torch.equal(xb[:, 0].long(), yb) for xb, yb in first)          # inputs stay with their labels
    assert torch.cat([yb for _, yb in first]).tolist() != torch.cat([yb for _, yb in batches]).tolist()


def test_quiet_kineto_drops_only_the_kineto_line(capfd):
    with ah.pipeline.quiet_kineto():
        os.write(2, b"ERROR:2026 DeviceProperties.cpp:47] gpuGetDeviceCount failed with code 35\n")
        os.write(2, b"a real error\n")
    err = capfd.readouterr().err
    assert "a real error" in err and "gpuGetDeviceCount" not in err


def test_profile_steps_ranks_the_matmul_and_writes_a_trace(tmp_path, capfd):
    # 1024: the matmul's n^3 work dwarfs the relu's n^2 even when the other core's load preempts the relu (at 256,
    # a 0.3 ms matmul lost to a preempted relu once under `make test`'s two workers)
    a, b = torch.rand(1024, 1024), torch.rand(1024, 1024)
    prof = ah.pipeline.profile_steps(lambda: (a @ b).relu_(), steps=3, trace=tmp_path / "t" / "trace.json")
    names = [n for n, _, _ in ah.pipeline.top_ops(prof, 3)]
    assert names[0] == "aten::mm"
    assert dict((n, c) for n, _, c in ah.pipeline.top_ops(prof, 50))["aten::mm"] == 3
    assert (tmp_path / "t" / "trace.json").stat().st_size > 100
    assert "gpuGetDeviceCount" not in capfd.readouterr().err


def test_top_ops_and_range_ms_read_named_ranges():
    a = torch.rand(128, 128)

    def step():
        with torch.profiler.record_function("mine"):
            time.sleep(0.02)
            a @ a

    prof = ah.pipeline.profile_steps(step, steps=2)
    assert "mine" not in [n for n, _, _ in ah.pipeline.top_ops(prof, 50, skip=("train_step", "mine"))]
    assert "mine" in [n for n, _, _ in ah.pipeline.top_ops(prof, 50)]
    assert 40 <= ah.pipeline.range_ms(prof, "mine") <= ah.pipeline.range_ms(prof, "train_step")
    assert ah.pipeline.range_ms(prof, "no such range") == 0


def test_data_wait_share_books_fetch_and_transform_as_wait_and_the_step_as_work(clock):
    """Exact on a fake clock: 4 batches of 1 tick's fetch and a 1-tick batch transform (the wait), 6-tick steps (the
    work): a quarter of the loop waits. Mutations this catches: the share divided by the step count instead of the
    total time, the transform booked as work, the wait timed from before the previous step, no sync before either
    clock read, max_steps ignored."""
    clock.install(ah.pipeline)
    steps = []

    def step(xb, yb):
        steps.append(len(xb))
        clock.work(6 * TICK, "step")()

    partly = ah.pipeline.data_wait_share(_ClockedLoader(clock, "data", batches=4, fetch=1), step,
                                         batch_tfm=_clocked_tfm(clock, 1))
    assert (partly.wait_s, partly.step_s, partly.steps, partly.share) == (4 * 2 * TICK, 4 * 6 * TICK, 4, 0.25)
    assert partly.reading() == "partly starved: 25% of each step waits on data."
    assert steps == [2] * 4 and clock.unsynced_reads() == 0
    starved = ah.pipeline.data_wait_share(_ClockedLoader(clock, "data", batches=5, fetch=3),
                                          lambda xb, yb: clock.work(TICK, "step")(), max_steps=3)
    assert (starved.wait_s, starved.step_s, starved.steps, starved.share) == (9 * TICK, 3 * TICK, 3, 0.75)
    assert starved.reading().startswith("starved: 75% of each step waits on data.")
    fed = ah.pipeline.data_wait_share(_ClockedLoader(clock, "data", batches=2, fetch=1),
                                      lambda xb, yb: clock.work(15 * TICK, "step")())
    assert fed.share == 1 / 16 and fed.reading().startswith("fed: only 6% of each step waits on data")
    assert clock.unsynced_reads() == 0
    with pytest.raises(ValueError, match="no batches"):
        ah.pipeline.data_wait_share([], lambda xb, yb: None)


@pytest.mark.parametrize("habit", ah.pipeline.HABITS)
def test_logged_step_habits_train_identically(habit):
    x, y = torch.rand(16, 40), torch.randint(0, 10, (16,))
    ref = ah.models.udl_mlp(2, seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ah.pipeline.logged_step(ref, opt, x, y)()
    model, log = ah.models.udl_mlp(2, seed=0), []
    ah.pipeline.logged_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, habit, log=log)()
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert len(log) == (0 if habit == "print" else 1)
    with pytest.raises(ValueError, match="unknown habit"):
        ah.pipeline.logged_step(model, opt, x, y, "log_every_step")


def test_step_memory_counts_parameters_gradients_and_optimizer_state():
    m = nn.Linear(10, 5)
    x = torch.rand(4, 10)
    assert ah.metrics.param_bytes(m) == 55 * 4
    assert ah.pipeline.step_memory(m, x, optimizer_states=2) == 4 * 55 * 4 + 4 * 10 * 4
    assert ah.pipeline.step_memory(m, x, optimizer_states=0) == 2 * 55 * 4 + 4 * 10 * 4


def test_largest_batch_doubles_then_bisects():
    calls = []
    fits = lambda bs: calls.append(bs) or bs <= 300
    assert ah.pipeline.largest_batch(fits) == 300
    assert len(calls) < 20
    assert ah.pipeline.largest_batch(lambda bs: True, limit=1000) == 1000
    with pytest.raises(ValueError, match="does not fit"):
        ah.pipeline.largest_batch(lambda bs: False)
    with pytest.raises(ValueError, match="start"):
        ah.pipeline.largest_batch(fits, start=0)


def test_memory_fits_against_a_budget_matches_step_memory():
    m = ah.models.cnn2d()
    sample = torch.rand(1, 1, 16, 16)
    budget = ah.pipeline.step_memory(m, torch.rand(50, 1, 16, 16))
    assert ah.pipeline.largest_batch(ah.pipeline.memory_fits(m, sample, budget)) == 50
    with pytest.raises(ValueError, match="budget_bytes"):
        ah.pipeline.memory_fits(m, sample)


class _OomAbove(nn.Module):
    """Raises torch's real out-of-memory error above a batch size, as a GPU would."""

    def __init__(self, limit: int, error: type[BaseException] = torch.OutOfMemoryError, message: str = ""):
        super().__init__()
        self.lin, self.limit, self.error, self.message = nn.Linear(4, 2), limit, error, message

    def forward(self, x):
        if len(x) > self.limit:
            raise self.error(f"{self.message}tried to allocate for batch {len(x)}")
        return self.lin(x)


@pytest.mark.slow
def test_memory_fits_backs_off_on_out_of_memory():
    fits = ah.pipeline.memory_fits(_OomAbove(77), torch.rand(1, 4), budget_bytes=2**40)
    assert ah.pipeline.largest_batch(fits) == 77


@pytest.mark.slow
@pytest.mark.parametrize("error, message", [(RuntimeError, "MPS backend out of memory: "),
                                            (RuntimeError, "DefaultCPUAllocator: can't allocate memory: "),
                                            (MemoryError, "")])
def test_memory_fits_backs_off_on_any_devices_out_of_memory(error, message):
    """Only CUDA's OutOfMemoryError counted: an MPS or CPU out-of-memory error ended the search instead."""
    fits = ah.pipeline.memory_fits(_OomAbove(77, error, message), torch.rand(1, 4), budget_bytes=2**40)
    assert ah.pipeline.largest_batch(fits) == 77
    with pytest.raises(ValueError, match="not memory"):
        ah.pipeline.memory_fits(_OomAbove(0, ValueError, "not memory: "), torch.rand(1, 4), budget_bytes=2**40)(1)


def test_grads_copies_and_fills_missing_gradients_with_zeros():
    m = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    m[1](torch.ones(1, 2)).sum().backward()                   # only the second layer gets gradients
    g = ah.pipeline.grads(m)
    assert [t.shape for t in g] == [p.shape for p in m.parameters()]
    assert torch.equal(g[0], torch.zeros(2, 3)) and torch.equal(g[2], m[1].weight.grad)
    m[1].weight.grad.zero_()
    assert g[2].abs().sum() > 0                               # a copy, not the live gradient


def test_plain_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    x, y = torch.rand(96, 40), torch.randint(0, 10, (96,))
    m = ah.models.udl_mlp(4, seed=0)
    ref = ah.pipeline.full_batch_grads(m, x, y)
    m.zero_grad()
    F.cross_entropy(m(x), y).backward()                       # the reference is torch's own one-batch gradient
    assert ah.metrics.max_abs_diff(ref, [p.grad for p in m.parameters()]) == 0
    assert ah.metrics.max_abs_diff(ref, ah.pipeline.accumulated_grads(m, x, y, 24)) < 1e-6
    assert ah.metrics.max_abs_diff(ref, ah.pipeline.accumulated_grads(m, x, y, 40)) < 1e-6   # unequal last one
    m.zero_grad()                                                             # forgetting to divide by k:
    for xb, yb in zip(x.split(24), y.split(24), strict=True):
        F.cross_entropy(m(xb), yb).backward()
    assert ah.metrics.max_abs_diff([4 * r for r in ref], ah.pipeline.grads(m)) < 1e-5       # k times the gradient


def test_batchnorm_breaks_the_equivalence():
    torch.manual_seed(0)
    x, y = torch.rand(64, 40), torch.randint(0, 10, (64,))
    m = nn.Sequential(nn.Linear(40, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    assert ah.metrics.rel_diff(ah.pipeline.accumulated_grads(m, x, y, 16),
                               ah.pipeline.full_batch_grads(m, x, y)) > 1e-3


def test_accelerate_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    x, y = torch.rand(64, 40), torch.randint(0, 10, (64,))
    m = ah.models.udl_mlp(2, seed=0)
    ref = ah.pipeline.full_batch_grads(m, x, y)
    assert ah.metrics.max_abs_diff(ref, ah.pipeline.accelerate_accumulated_grads(m, x, y, 16)) < 1e-6
    with pytest.raises(ValueError, match="equal"):
        ah.pipeline.accelerate_accumulated_grads(m, x, y, 24)


def test_fastai_n_acc_counts_samples_not_batches():
    torch.manual_seed(0)
    x, y = torch.rand(128, 40), torch.randint(0, 10, (128,))
    m = ah.models.udl_mlp(2, seed=0)
    steps, g = ah.pipeline.fastai_accumulation(m, x, y, bs=32, n_acc=128)     # 4 batches of 32 = 128 samples
    assert steps == 1 and ah.metrics.max_abs_diff(ah.pipeline.full_batch_grads(m, x, y), g) < 1e-6
    steps, g = ah.pipeline.fastai_accumulation(m, x, y, bs=32, n_acc=4)       # "4 batches"? no: 4 samples
    assert steps == 4                                                         # a step every batch
    ref = ah.pipeline.full_batch_grads(m, x[:32], y[:32])
    assert ah.metrics.max_abs_diff([8 * r for r in ref], g) < 1e-5           # and the gradient scaled by bs/n_acc


def test_write_digits_png_lays_out_one_folder_per_label(tmp_path):
    from PIL import Image
    from sklearn.datasets import load_digits

    root = ah.pipeline.write_digits_png(tmp_path / "png", per_class=2)
    files = sorted(root.glob("*/*.png"))
    assert len(files) == 20 and {f.parent.name for f in files} == {str(d) for d in range(10)}
    with Image.open(files[0]) as im:
        assert im.size == (8, 8) and im.mode == "L"
        i = int(files[0].stem)
        assert np.abs(np.asarray(im) / 255 * 16 - load_digits().images[i]).max() < 0.05   # the same pixels
    assert len(list(ah.pipeline.write_digits_png(tmp_path / "all").glob("*/*.png"))) == 1797
