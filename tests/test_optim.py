"""accelhelpers.optim (exported from chapter 03): callback optimizers against torch.optim and fastai, EWMA against
pandas, one-cycle against fastai's recorded schedule, the LR finder against fastai's lr_find, and the sweep and
experiment helpers against ah.train.fit."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import accelhelpers as ah

STEPS = 60


@pytest.fixture(scope="module")
def digits():
    return ah.data.digits()


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _model(seed=0):
    torch.manual_seed(seed)
    return ah.models.mlp([64, 32, 32, 10])


def _max_diff_after_training(split, make_ours, make_ref, steps=STEPS):
    """Largest parameter difference after `steps` identical batches; fails if nothing moved."""
    batches = [(split.x_train[lo:lo + 64], split.y_train[lo:lo + 64])
               for lo in ((i * 64) % (len(split.x_train) - 64) for i in range(steps))]
    moved = ah.optim.max_param_gap(_model, make_ours, lambda p: torch.optim.SGD(p, lr=1e-12), batches)
    assert moved > 1e-3, "the optimizer did not move the parameters: the comparison would be empty"
    return ah.optim.max_param_gap(_model, make_ours, make_ref, batches)


def test_max_param_gap_needs_identical_models(digits):
    batches = [(digits.x_train[:64], digits.y_train[:64])]
    ours_sgd = lambda p: ah.optim.sgd(p, 0.1)
    assert ah.optim.max_param_gap(_model, ours_sgd, ours_sgd, batches) == 0.0
    own = ah.optim.max_param_gap(_model, lambda p: ah.optim.adam(p, 1e-2), lambda p: torch.optim.Adam(p, 1e-2),
                                 batches * 3, same_grads=False)
    assert own < 1e-5                                                     # few steps: no room for chaos yet
    seeds = iter(range(10))
    with pytest.raises(ValueError, match="differently initialised"):
        ah.optim.max_param_gap(lambda: _model(next(seeds)), ours_sgd, ours_sgd, batches)


@pytest.mark.slow
@pytest.mark.parametrize("name,ours,ref", [
    ("sgd", lambda p: ah.optim.sgd(p, 0.1), lambda p: torch.optim.SGD(p, 0.1)),
    ("momentum+l2", lambda p: ah.optim.sgd(p, 0.05, mom=0.9, wd=1e-3),
     lambda p: torch.optim.SGD(p, 0.05, momentum=0.9, weight_decay=1e-3)),
    ("rmsprop", lambda p: ah.optim.rmsprop(p, 1e-3, wd=1e-3),
     lambda p: torch.optim.RMSprop(p, 1e-3, weight_decay=1e-3)),
    ("adam+l2", lambda p: ah.optim.adam(p, 3e-3, wd=1e-2, decouple_wd=False),
     lambda p: torch.optim.Adam(p, 3e-3, weight_decay=1e-2)),
    ("adamw", lambda p: ah.optim.adam(p, 3e-3, wd=0.1), lambda p: torch.optim.AdamW(p, 3e-3, weight_decay=0.1)),
])
def test_matches_torch_optim(digits, name, ours, ref):
    assert _max_diff_after_training(digits, ours, ref) < 1e-5, name


@pytest.mark.parametrize("name", ["sgd_mom_wd", "rmsprop_mom", "adam_defaults"])
def test_matches_fastai_optimizer(digits, name):
    from fastai import optimizer as F

    ours, ref = {
        "sgd_mom_wd": (lambda p: ah.optim.sgd(p, 0.05, mom=0.9, wd=1e-2, decouple_wd=True),
                       lambda p: F.SGD(p, 0.05, mom=0.9, wd=1e-2)),
        "rmsprop_mom": (lambda p: ah.optim.rmsprop(p, 1e-3, mom=0.9), lambda p: F.RMSProp(p, 1e-3, mom=0.9)),
        "adam_defaults": (lambda p: ah.optim.adam(p, 3e-3, sqr_mom=0.99, eps=1e-5, wd=0.01),
                          lambda p: F.Adam(p, 3e-3)),  # fastai's defaults: sqr_mom .99, eps 1e-5, wd .01 decoupled
    }[name]
    assert _max_diff_after_training(digits, ours, ref) < 1e-5, name


def test_adam_without_bias_correction_differs(digits):
    """The test can fail: dropping the step count (no bias correction) changes the trajectory."""
    cbs = [ah.optim.average_grad, ah.optim.average_sqr_grad, ah.optim.rmsprop_step]
    no_debias = lambda p: ah.optim.CallbackOptimizer(p, cbs, lr=3e-3, mom=0.9, sqr_mom=0.999, eps=1e-8)
    assert _max_diff_after_training(digits, no_debias, lambda p: torch.optim.Adam(p, 3e-3), steps=5) > 1e-3


def test_step_callbacks_directly():
    p, g = torch.ones(3), torch.full((3,), 2.0)
    assert torch.equal(ah.optim.l2_penalty(p=p, grad=g, wd=0.5)["grad"], torch.full((3,), 2.5))
    assert ah.optim.l2_penalty(p=p, grad=g, wd=0.0) == {}
    q = torch.ones(3)
    ah.optim.decoupled_wd(p=q, lr=0.1, wd=0.5)
    assert torch.allclose(q, torch.full((3,), 0.95))
    avg = ah.optim.average_grad(grad=g, mom=0.9)["grad_avg"]
    assert torch.equal(avg, g)                                             # undampened: first average = grad
    assert torch.allclose(ah.optim.average_grad(grad=g, mom=0.9, dampen=True)["grad_avg"], 0.1 * g)
    assert torch.allclose(ah.optim.average_sqr_grad(grad=g, sqr_mom=0.99)["sqr_avg"], 0.01 * g * g)
    assert ah.optim.count_steps() == {"step": 1} and ah.optim.count_steps(step=4) == {"step": 5}
    r = torch.zeros(3)
    ah.optim.sgd_step(p=r, grad=g, lr=0.5)
    assert torch.equal(r, -torch.ones(3))
    ah.optim.momentum_step(p=r, lr=1.0, grad_avg=torch.ones(3))
    assert torch.equal(r, -2 * torch.ones(3))
    s = torch.zeros(3)
    ah.optim.rmsprop_step(p=s, grad=g, lr=1.0, sqr_avg=g * g, eps=0.0)
    assert torch.allclose(s, -torch.ones(3))
    t = torch.zeros(3)  # after one Adam step the update is lr * sign(grad) (up to eps)
    ah.optim.adam_step(p=t, lr=0.1, mom=0.9, sqr_mom=0.999, eps=0.0, step=1, grad_avg=0.1 * g, sqr_avg=0.001 * g * g)
    assert torch.allclose(t, torch.full((3,), -0.1))


def test_bad_hyperparameters_are_explained():
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="learning rate must be a positive"):
        ah.optim.sgd(params, lr=0)
    with pytest.raises(ValueError, match=r"mom must be in \[0, 1\)"):
        ah.optim.sgd(params, lr=0.1, mom=1.0)
    with pytest.raises(ValueError, match="eps > 0"):
        ah.optim.adam(params, eps=0)
    with pytest.raises(ValueError, match="at least one step callback"):
        ah.optim.CallbackOptimizer(params, [], lr=0.1)


def test_set_hypers_drives_the_step():
    p = nn.Parameter(torch.zeros(1))
    opt = ah.optim.sgd([p], lr=0.1)
    ah.optim.set_hypers(opt, lr=1.0)
    p.grad = torch.ones(1)
    opt.step()
    assert p.item() == -1.0 and opt.param_groups[0]["lr"] == 1.0


def test_skips_parameters_without_grad_and_state_dict_roundtrip():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = ah.optim.adam([a, b], lr=0.1)
    a.grad = torch.ones(2)
    opt.step()
    assert torch.equal(b, torch.ones(2)) and opt.state[a]["step"] == 1 and b not in opt.state
    opt2 = ah.optim.adam([a, b], lr=0.1)
    opt2.load_state_dict(opt.state_dict())
    assert torch.equal(opt2.state[a]["grad_avg"], opt.state[a]["grad_avg"])


def test_ewma_matches_pandas_and_closed_form():
    pd = pytest.importorskip("pandas")
    x = np.random.default_rng(0).normal(size=50)
    for beta in (0.5, 0.9, 0.99):
        debiased = pd.Series(x).ewm(alpha=1 - beta, adjust=True).mean().to_numpy()
        assert np.allclose(ah.optim.ewma(x, beta), debiased)
        t = np.arange(1, 51)
        biased = [(1 - beta) * sum(beta ** (k - i) * x[i - 1] for i in range(1, k + 1)) for k in t]
        assert np.allclose(ah.optim.ewma(x, beta, debias=False), biased)
    assert np.allclose(ah.optim.ewma(np.ones(5), 0.9), 1.0)                       # debiased: no pull towards 0
    assert ah.optim.ewma(np.ones(5), 0.9, debias=False)[0] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="beta must be in"):
        ah.optim.ewma(x, 1.0)


def test_cos_anneal_endpoints():
    assert ah.optim.cos_anneal(1.0, 3.0, 0.0) == pytest.approx(1.0)
    assert ah.optim.cos_anneal(1.0, 3.0, 1.0) == pytest.approx(3.0)
    assert ah.optim.cos_anneal(1.0, 3.0, 0.5) == pytest.approx(2.0)


def _tiny_learner(split, bs=64, opt_func=None, n=512, seed=0):
    from fastai.learner import Learner
    from fastai.optimizer import SGD

    small = ah.data.Split(split.x_train[:n], split.y_train[:n], split.x_test[:128], split.y_test[:128])
    ah.session.seed_everything(seed)
    dls = ah.data.fastai_dls(small, bs=bs, shuffle=False)
    return Learner(dls, _model(seed), loss_func=nn.CrossEntropyLoss(), opt_func=opt_func or SGD), small


@pytest.mark.parametrize("kw", [{}, {"pct_start": 0.3, "div": 10.0, "div_final": 1e4, "moms": (0.9, 0.8, 0.9)}])
def test_one_cycle_reproduces_fastai_recorded_schedule(digits, kw):
    from fastai.optimizer import Adam

    learn, _ = _tiny_learner(digits, opt_func=Adam)
    with learn.no_bar(), learn.no_logging():
        learn.fit_one_cycle(3, 1e-2, **kw)
    rec_lr, rec_mom = np.array(learn.recorder.hps["lr"]), np.array(learn.recorder.hps["mom"])
    lrs, moms = ah.optim.one_cycle(len(rec_lr), 1e-2, **kw)
    assert len(rec_lr) == 3 * 8
    np.testing.assert_allclose(lrs, rec_lr, rtol=1e-5)
    np.testing.assert_allclose(moms, rec_mom, rtol=1e-5)


def test_one_cycle_shape_and_errors():
    lrs, moms = ah.optim.one_cycle(100, 1.0)
    assert lrs[0] == pytest.approx(1 / 25) and lrs.max() == pytest.approx(1.0) and int(lrs.argmax()) == 25
    assert lrs[-1] < 1e-3 and moms.min() == pytest.approx(0.85)
    with pytest.raises(ValueError, match="pct_start"):
        ah.optim.one_cycle(100, 1.0, pct_start=1.0)


def test_lr_find_matches_fastai_lr_find(digits):
    learn, small = _tiny_learner(digits, n=640)
    assert learn.path != Path(".") and not str(learn.path).startswith(str(Path.cwd()))
    with learn.no_bar(), learn.no_logging():
        fa = learn.lr_find(start_lr=1e-4, end_lr=10, num_it=40, show_plot=False)
    fa_lrs, fa_losses = np.array(learn.recorder.lrs), np.array([float(v) for v in learn.recorder.losses])
    model = _model(0)
    before = [p.detach().clone() for p in model.parameters()]
    batches = [(small.x_train[i:i + 64], small.y_train[i:i + 64]) for i in range(0, 640, 64)]
    res = ah.optim.lr_find(model, nn.CrossEntropyLoss(), batches, ah.optim.sgd(model.parameters(), lr=1e-3),
                    start_lr=1e-4, end_lr=10, num_it=40)
    n = min(len(fa_lrs), len(res.lrs))
    assert n >= 30
    np.testing.assert_allclose(res.lrs[:n], fa_lrs[:n], rtol=1e-6)
    np.testing.assert_allclose(res.losses[:n], fa_losses[:n], rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))   # weights restored
    assert abs(math.log10(res.suggestion / fa.valley)) < 0.5                     # same valley, within a factor 3
    with pytest.raises(ValueError, match="start_lr < end_lr"):
        ah.optim.lr_find(model, nn.CrossEntropyLoss(), batches, ah.optim.sgd(model.parameters(), lr=1e-3),
                         start_lr=1.0, end_lr=0.1)


def test_lr_suggestions_match_fastai_minimum_and_steep():
    from fastai.callback.schedule import minimum, steep, valley

    lrs = np.logspace(-6, 1, 80)
    losses = 2.3 - 1.5 / (1 + np.exp(-3 * (np.log10(lrs) + 3))) + np.exp(np.log10(lrs) - 0.2)
    ours = ah.optim.lr_suggestions(lrs, losses, skip_start=0, skip_end=0)
    t_lrs, t_losses = torch.tensor(lrs), torch.tensor(losses)
    assert ours["minimum"] == pytest.approx(minimum(t_lrs, t_losses, 80)[0])
    assert ours["steep"] == pytest.approx(steep(t_lrs, t_losses, 80)[0])
    assert lrs[0] < ours["valley"] < ours["minimum"] * 10
    assert abs(math.log10(ours["valley"] / valley(t_lrs, t_losses, 80)[0])) < 0.5
    diverged = np.concatenate([losses[:30], [np.inf] * 10])
    assert ah.optim.lr_suggestions(lrs[:40], diverged, skip_start=0, skip_end=0)["minimum"] <= lrs[29] / 10
    with pytest.raises(ValueError, match="finite points"):
        ah.optim.lr_suggestions(lrs[:12], losses[:12])


def test_one_cycle_on_step_drives_train_fit(digits):
    def run(one_cycle_lr=None):
        model = _model(1)
        opt = ah.optim.adam(model.parameters(), lr=3e-3)
        steps = 3 * math.ceil(len(digits.x_train) / 128)
        hook = ah.optim.one_cycle_on_step(opt, steps, one_cycle_lr) if one_cycle_lr else None
        return ah.train.fit(model, digits, opt, epochs=3, bs=128, seed=5, on_step=hook), opt

    (h1, _), (h2, _) = run(), run()
    assert len(h1.acc) == 3 and h1.acc == h2.acc and h1.acc[-1] > 0.75
    h3, opt = run(one_cycle_lr=1e-2)
    lrs, moms = ah.optim.one_cycle(3 * math.ceil(len(digits.x_train) / 128), 1e-2)
    assert opt.param_groups[0]["lr"] == pytest.approx(lrs[-1]) and opt.param_groups[0]["mom"] == pytest.approx(moms[-1])
    assert h3.acc[-1] > 0.75
    with pytest.raises(ValueError, match="pct_start"):
        ah.optim.one_cycle_on_step(opt, 10, 1e-2, pct_start=0)


def test_to_target_stats():
    h1 = ah.train.FitHistory([0.5, 0.8, 0.9], seconds=[1.0, 2.0, 3.0])
    h2 = ah.train.FitHistory([0.85, 0.9, 0.95], seconds=[1.5, 3.0, 4.5])
    h3 = ah.train.FitHistory([0.1, 0.2, 0.3], seconds=[1.0, 2.0, 3.0])
    assert h1.to_target(0.8) == (2, 2.0) and h3.to_target(0.8) == (None, None)
    s = ah.optim.to_target_stats([h1, h2, h3], 0.8)
    assert s["reached"] == 2 and s["runs"] == 3
    assert s["epochs"] == ah.timing.Spread(1.5, 1.0, 2.0)              # median, lowest, highest over h1 and h2
    assert s["seconds"] == (1.75, 1.5, 2.0) and s["seconds"].median == 1.75
    assert s["final_acc"] == (0.9, 0.3, 0.95)                           # every run counts for the final accuracy
    none = ah.optim.to_target_stats([h3], 0.8)
    assert none["reached"] == 0 and none["epochs"] is None and none["seconds"] is None
    assert none["final_acc"] == (0.3, 0.3, 0.3)


def test_holdout_carves_validation_from_training_rows(digits):
    tune = ah.optim.holdout(digits, 300, seed=1)
    n = len(digits.x_train)
    assert len(tune.x_test) == 300 and len(tune.x_train) == n - 300
    rows = lambda x: {tuple(r.tolist()) for r in x}
    train, valid = rows(tune.x_train), rows(tune.x_test)
    assert train | valid == rows(digits.x_train) and not train & valid       # a partition of the training rows
    for a, b in ((tune.x_test, tune.y_test), (tune.x_train, tune.y_train)):  # each row keeps its label
        idx = [next(i for i in range(n) if torch.equal(digits.x_train[i], r)) for r in a[:20]]
        assert torch.equal(digits.y_train[idx], b[:20])
    assert torch.equal(ah.optim.holdout(digits, 300, seed=1).x_test, tune.x_test)
    assert not torch.equal(ah.optim.holdout(digits, 300, seed=2).x_test, tune.x_test)
    with pytest.raises(ValueError, match="n_valid must be between"):
        ah.optim.holdout(digits, n)


def test_train_recipe_is_train_fit_with_the_recipe(digits):
    make_sgd = lambda p, lr: torch.optim.SGD(p, lr, momentum=0.9)
    ours = ah.optim.train_recipe(make_sgd, 0.05, _model(2), digits, 2, 128, seed=3)
    model = _model(2)
    ref = ah.train.fit(model, digits, torch.optim.SGD(model.parameters(), 0.05, momentum=0.9), 2, 128, seed=3)
    assert ours.acc == ref.acc and ours.loss == ref.loss
    cycled = ah.optim.train_recipe(lambda p, lr: ah.optim.adam(p, lr), 1e-2, _model(2), digits, 2, 128, seed=3,
                                   cycle=True)
    model = _model(2)
    opt = ah.optim.adam(model.parameters(), 1e-2)
    hook = ah.optim.one_cycle_on_step(opt, 2 * math.ceil(len(digits.x_train) / 128), 1e-2)
    assert cycled.acc == ah.train.fit(model, digits, opt, 2, 128, seed=3, on_step=hook).acc


def test_lr_sweep_and_best_lr(digits):
    tune = ah.optim.holdout(digits, 300)
    make = lambda p, lr: ah.optim.sgd(p, lr, mom=0.9)
    scores = ah.optim.lr_sweep(make, [1e-5, 0.1], _model, tune, 2, 64, seeds=[0, 1])
    assert list(scores) == [1e-5, 0.1] and all(len(v) == 2 for v in scores.values())
    assert scores[0.1][1] == ah.optim.train_recipe(make, 0.1, _model(1), tune, 2, 64, seed=1).final
    assert min(scores[0.1]) > 0.8 > max(scores[1e-5])                   # a rate that trains beats one that cannot
    assert ah.optim.best_lr(scores) == 0.1
    assert ah.optim.best_lr({0.3: [0.5, 0.9, 0.9], 0.1: [0.8, 0.8, 0.8]}) == 0.3   # the median decides, not the mean
    assert ah.optim.best_lr({0.3: [0.7, 0.9], 0.1: [0.9, 0.7]}) == 0.1             # a tie: the smaller rate


def test_fastai_history(digits):
    from fastai.learner import Learner
    from fastai.metrics import accuracy
    from fastai.optimizer import Adam

    dls = ah.data.fastai_dls(digits, bs=100, seed=0)
    learn = Learner(dls, _model(3), loss_func=nn.CrossEntropyLoss(), opt_func=Adam, metrics=accuracy)
    hist = ah.optim.fastai_history(learn, 3, 1e-2, one_cycle=True)
    assert isinstance(hist, ah.train.FitHistory)
    assert len(hist.acc) == len(hist.loss) == len(hist.seconds) == 3 and hist.acc[-1] > 0.75
    assert hist.acc[-1] == pytest.approx(ah.metrics.model_accuracy(learn.model, digits.x_test, digits.y_test),
                                         abs=1e-6)
    with pytest.raises(ValueError, match="metrics=accuracy"):
        ah.optim.fastai_history(Learner(dls, _model(3), loss_func=nn.CrossEntropyLoss()), 1, 1e-3)
