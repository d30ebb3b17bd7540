"""Tests for accelhelpers.pipeline: augmentation, loaders, profiling, starvation, syncs, batch size, accumulation."""

import pickle
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import accelhelpers as ah
from accelhelpers import pipeline as P


@pytest.fixture(scope="module")
def digits8():
    return P.digits_uint8()


def test_random_affine_is_a_bounded_rotation_zoom_shift():
    g = torch.Generator().manual_seed(0)
    th = P.random_affine(500, max_deg=15, max_shift=0.1, max_zoom=0.1, generator=g)
    assert th.shape == (500, 2, 3)
    lin = th[:, :, :2]
    det = torch.linalg.det(lin)                       # 1 / zoom^2 with zoom in [0.9, 1.1]
    assert det.min() >= 1 / 1.1**2 - 1e-5 and det.max() <= 1 / 0.9**2 + 1e-5
    assert th[:, :, 2].abs().max() <= 0.1
    assert torch.equal(P.random_affine(0), torch.empty(0, 2, 3))
    with pytest.raises(ValueError, match="n >= 0"):
        P.random_affine(-1)


def test_affine_grid_matches_torch():
    th = P.random_affine(7, generator=torch.Generator().manual_seed(1))
    ref = F.affine_grid(th, [7, 1, 32, 32], align_corners=False)
    torch.testing.assert_close(P.affine_grid(th, 32), ref, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="theta"):
        P.affine_grid(torch.zeros(2, 3), 32)


def test_warp_identity_is_a_plain_resize():
    x = torch.rand(3, 1, 8, 8)
    out = P.warp(x, torch.eye(2, 3).expand(3, 2, 3), 16)
    ref = F.interpolate(x, size=16, mode="bilinear", align_corners=False)
    # grid_sample pads with zeros at the border; the interior equals bilinear interpolation
    torch.testing.assert_close(out[..., 1:-1, 1:-1], ref[..., 1:-1, 1:-1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="theta"):
        P.warp(x, torch.eye(2, 3)[None], 16)


def test_per_item_and_batch_transform_agree_with_the_same_randomness(digits8):
    x = digits8[0][:5]
    batch = P.augment_batch(x, 32, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    th, noise = P.random_affine(5, generator=g), torch.randn(5, 1, 32, 32, generator=g)
    items = torch.cat([P.warp(x[i:i + 1].float() / 16, th[i:i + 1], 32) for i in range(5)])
    torch.testing.assert_close(batch, (items + 0.05 * noise - 0.3) / 0.4, atol=1e-5, rtol=0)


def test_augmented_digits_items_and_errors(digits8):
    x, y = digits8
    assert x.dtype == torch.uint8 and x.shape[1:] == (1, 8, 8) and int(x.max()) == 16
    ds = P.AugmentedDigits(x, y, size=24, repeat=2)
    assert len(ds) == 2 * len(x)
    img, label = ds[len(x) + 3]
    assert img.shape == (1, 24, 24) and int(label) == int(y[3])
    plain = P.AugmentedDigits(x, y, size=8, augment=False)
    torch.testing.assert_close(plain[0][0], x[0].float() / 16, atol=1e-6, rtol=0)   # identity at same size
    assert pickle.loads(pickle.dumps(ds)).size == 24                                # workers can receive it
    with pytest.raises(ValueError, match="labels"):
        P.AugmentedDigits(x, y[:-1])


def test_workers_give_the_same_items_as_the_main_process(digits8):
    ds = P.AugmentedDigits(digits8[0][:48], digits8[1][:48], size=16, augment=False)
    a = torch.cat([xb for xb, _ in DataLoader(ds, batch_size=16)])
    b = torch.cat([xb for xb, _ in DataLoader(ds, batch_size=16, num_workers=2)])
    assert torch.equal(a, b)


def test_loader_timing_and_empty_loaders():
    fixed = P.LoaderTiming([1.0, 0.5, 0.25, 0.4], 100)
    assert fixed.best_items_per_s == 400 and fixed.first_s == 1.0
    with pytest.raises(ValueError, match="no batches"):
        P.compare_loaders({"empty": DataLoader(TensorDataset(torch.rand(3, 1), torch.zeros(3)), batch_size=4,
                                               drop_last=True)})


def test_profile_steps_ranks_the_matmul_and_writes_a_trace(tmp_path):
    a, b = torch.rand(256, 256), torch.rand(256, 256)
    prof = P.profile_steps(lambda: (a @ b).relu_(), steps=3, trace=tmp_path / "t" / "trace.json")
    names = [n for n, _, _ in P.top_ops(prof, 3)]
    assert names[0] == "aten::mm"
    assert dict((n, c) for n, _, c in P.top_ops(prof, 50))["aten::mm"] == 3
    assert (tmp_path / "t" / "trace.json").stat().st_size > 100
    with pytest.raises(ValueError, match="steps"):
        P.profile_steps(lambda: None, steps=0)


class _Slow(Dataset):
    def __init__(self, delay: float):
        self.delay = delay

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        time.sleep(self.delay)
        return torch.zeros(2), torch.tensor(0)


def test_data_wait_share_tells_starved_from_fed():
    starved = P.data_wait_share(DataLoader(_Slow(0.01), batch_size=2), lambda xb, yb: None)
    assert starved.steps == 4 and starved.share > 0.9 and starved.verdict().startswith("starved")
    fed = P.data_wait_share(DataLoader(_Slow(0.0), batch_size=2), lambda xb, yb: time.sleep(0.05), max_steps=3)
    assert fed.steps == 3 and fed.share < 0.2 and not fed.verdict().startswith("starved")
    with pytest.raises(ValueError, match="no batches"):
        P.data_wait_share([], lambda xb, yb: None)


@pytest.mark.parametrize("habit", P.HABITS)
def test_train_step_habits_train_identically(habit):
    x, y = torch.rand(16, 40), torch.randint(0, 10, (16,))
    ref = ah.models.udl_mlp(2, seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    P.train_step(ref, opt, x, y)()
    model, log = ah.models.udl_mlp(2, seed=0), []
    P.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, habit, log=log)()
    for p, q in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert len(log) == (0 if habit == "print" else 1)
    with pytest.raises(ValueError, match="unknown habit"):
        P.train_step(model, opt, x, y, "log_every_step")


def test_step_memory_counts_parameters_gradients_and_optimizer_state():
    m = nn.Linear(10, 5)
    x = torch.rand(4, 10)
    assert ah.metrics.param_bytes(m) == 55 * 4
    assert P.step_memory(m, x, optimizer_states=2) == 4 * 55 * 4 + 4 * 10 * 4
    assert P.step_memory(m, x, optimizer_states=0) == 2 * 55 * 4 + 4 * 10 * 4
    with pytest.raises(ValueError, match="optimizer_states"):
        P.step_memory(m, x, optimizer_states=-1)


def test_largest_batch_doubles_then_bisects():
    calls = []
    fits = lambda bs: calls.append(bs) or bs <= 300
    assert P.largest_batch(fits) == 300
    assert len(calls) < 20
    assert P.largest_batch(lambda bs: True, limit=1000) == 1000
    with pytest.raises(ValueError, match="does not fit"):
        P.largest_batch(lambda bs: False)
    with pytest.raises(ValueError, match="start"):
        P.largest_batch(fits, start=0)


def test_memory_fits_against_a_budget_matches_step_memory():
    m = ah.models.cnn2d()
    sample = torch.rand(1, 1, 16, 16)
    budget = P.step_memory(m, torch.rand(50, 1, 16, 16))
    assert P.largest_batch(P.memory_fits(m, sample, budget)) == 50
    with pytest.raises(ValueError, match="budget_bytes"):
        P.memory_fits(m, sample)


class _OomAbove(nn.Module):
    """Raises torch's real out-of-memory error above a batch size, as a GPU would."""

    def __init__(self, limit: int, error: type[BaseException] = torch.OutOfMemoryError, message: str = ""):
        super().__init__()
        self.lin, self.limit, self.error, self.message = nn.Linear(4, 2), limit, error, message

    def forward(self, x):
        if len(x) > self.limit:
            raise self.error(f"{self.message}tried to allocate for batch {len(x)}")
        return self.lin(x)


def test_memory_fits_backs_off_on_out_of_memory():
    fits = P.memory_fits(_OomAbove(77), torch.rand(1, 4), budget_bytes=2**40)
    assert P.largest_batch(fits) == 77


@pytest.mark.parametrize("error, message", [(RuntimeError, "MPS backend out of memory: "),
                                            (RuntimeError, "DefaultCPUAllocator: can't allocate memory: "),
                                            (MemoryError, "")])
def test_memory_fits_backs_off_on_any_devices_out_of_memory(error, message):
    """Only CUDA's OutOfMemoryError counted: an MPS or CPU out-of-memory error ended the search instead."""
    fits = P.memory_fits(_OomAbove(77, error, message), torch.rand(1, 4), budget_bytes=2**40)
    assert P.largest_batch(fits) == 77
    with pytest.raises(ValueError, match="not memory"):
        P.memory_fits(_OomAbove(0, ValueError, "not memory: "), torch.rand(1, 4), budget_bytes=2**40)(1)


def test_plain_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    x, y = torch.rand(96, 40), torch.randint(0, 10, (96,))
    m = ah.models.udl_mlp(4, seed=0)
    ref = P.full_batch_grads(m, x, y)
    assert ah.metrics.max_abs_diff(ref, P.accumulated_grads(m, x, y, 24)) < 1e-6
    assert ah.metrics.max_abs_diff(ref, P.accumulated_grads(m, x, y, 40)) < 1e-6      # unequal last micro-batch
    m.zero_grad()                                                             # forgetting to divide by k:
    for xb, yb in zip(x.split(24), y.split(24), strict=True):
        F.cross_entropy(m(xb), yb).backward()
    assert ah.metrics.max_abs_diff([4 * r for r in ref], P.grads(m)) < 1e-5          # k times the gradient
    with pytest.raises(ValueError, match="micro_bs"):
        P.accumulated_grads(m, x, y, 0)


def test_batchnorm_breaks_the_equivalence():
    torch.manual_seed(0)
    x, y = torch.rand(64, 40), torch.randint(0, 10, (64,))
    m = nn.Sequential(nn.Linear(40, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    assert ah.metrics.rel_diff(P.accumulated_grads(m, x, y, 16), P.full_batch_grads(m, x, y)) > 1e-3


def test_accelerate_accumulation_equals_one_big_batch():
    torch.manual_seed(0)
    x, y = torch.rand(64, 40), torch.randint(0, 10, (64,))
    m = ah.models.udl_mlp(2, seed=0)
    ref = P.full_batch_grads(m, x, y)
    assert ah.metrics.max_abs_diff(ref, P.accelerate_accumulated_grads(m, x, y, 16)) < 1e-6
    with pytest.raises(ValueError, match="equal"):
        P.accelerate_accumulated_grads(m, x, y, 24)


def test_fastai_n_acc_counts_samples_not_batches():
    torch.manual_seed(0)
    x, y = torch.rand(128, 40), torch.randint(0, 10, (128,))
    m = ah.models.udl_mlp(2, seed=0)
    steps, g = P.fastai_accumulation(m, x, y, bs=32, n_acc=128)         # 4 batches of 32 = 128 samples
    assert steps == 1 and ah.metrics.max_abs_diff(P.full_batch_grads(m, x, y), g) < 1e-6
    steps, g = P.fastai_accumulation(m, x, y, bs=32, n_acc=4)           # "4 batches"? no: 4 samples
    assert steps == 4                                                   # a step every batch: nothing accumulated
    ref = P.full_batch_grads(m, x[:32], y[:32])
    assert ah.metrics.max_abs_diff([8 * r for r in ref], g) < 1e-5   # and the gradient is scaled by bs/n_acc
    with pytest.raises(ValueError, match="n_acc"):
        P.fastai_accumulation(m, x, y, bs=32, n_acc=0)


def test_compare_loaders_times_each_loader_every_round():
    fast = DataLoader(TensorDataset(torch.rand(64, 3), torch.zeros(64)), batch_size=16)
    slow = DataLoader(_Slow(0.002), batch_size=2)
    res = P.compare_loaders({"fast": fast, "slow": slow}, epochs=2, batch_tfms={"fast": lambda xb: xb + 1})
    assert [len(r.epoch_s) for r in res.values()] == [2, 2]
    assert res["fast"].items == 64 and res["slow"].items == 8
    assert res["slow"].best_items_per_s < res["fast"].best_items_per_s and res["fast"].first_s > 0
    with pytest.raises(ValueError, match="epochs"):
        P.compare_loaders({"fast": fast}, epochs=0)


def test_np_random_seed_as_worker_init_fn_seeds_nothing_and_a_generator_does():
    def draws(**kw):
        return [float(v) for b in DataLoader(P.NumpyDraws(4), batch_size=2, num_workers=2, **kw) for v in b]

    bad = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        bad.append(draws(worker_init_fn=__import__("numpy").random.seed(1)))   # the erratum: passes None
    assert bad[0] != bad[1]                                    # the draws follow torch's seed, not the 1
    good = [draws(worker_init_fn=P.seed_worker, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    assert good[0] == good[1] and len(set(good[0])) == 4       # repeatable, and the two workers differ
    with pytest.raises(ValueError, match="n >= 1"):
        P.NumpyDraws(0)


def test_write_digits_png_lays_out_one_folder_per_label(tmp_path):
    from PIL import Image

    root = P.write_digits_png(tmp_path / "png", per_class=2)
    files = sorted(root.glob("*/*.png"))
    assert len(files) == 20 and {f.parent.name for f in files} == {str(d) for d in range(10)}
    with Image.open(files[0]) as im:
        assert im.size == (8, 8) and im.mode == "L"
    assert len(list(P.write_digits_png(tmp_path / "all").glob("*/*.png"))) == 1797
    with pytest.raises(ValueError, match="per_class"):
        P.write_digits_png(tmp_path, per_class=0)
