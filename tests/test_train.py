"""train: the one minibatch loop (fit) matches the loop written out, its hooks and policies, bad input."""

import numpy as np
import pytest
import torch

import accelhelpers as ah


@pytest.fixture(scope="module")
def data():
    return ah.data.mnist1d()


def _manual_fit(model, data, opt, epochs, bs, seed):
    """The loop fit replaces, written out: the reference it must match step for step."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(data.x_train), generator=gen)
        for i in range(0, len(perm), bs):
            idx = perm[i:i + bs]
            loss = torch.nn.functional.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model


@pytest.mark.slow
def test_fit_matches_the_loop_written_out_and_records_each_epoch(data):
    a = ah.models.mlp([40, 32, 10])
    b = ah.fullbatch.clone(a)
    hist = ah.train.fit(a, data, torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9), epochs=2, bs=100, seed=3)
    _manual_fit(b, data, torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9), 2, 100, 3)
    assert ah.metrics.max_abs_diff(a, b) == 0.0
    assert len(hist.acc) == len(hist.loss) == len(hist.seconds) == 2
    assert hist.final == pytest.approx(ah.metrics.model_accuracy(a, data.x_test, data.y_test))
    assert hist.seconds[1] > hist.seconds[0] > 0
    assert hist.to_target(0.0) == (1, hist.seconds[0]) and hist.to_target(2.0) == (None, None)


def test_fit_hooks_drop_last_and_a_bf16_policy(data):
    model = ah.models.mlp([40, 16, 10])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    seen = []
    x, y = data.x_train[:250], data.y_train[:250]
    hist = ah.train.fit(model, (x, y), opt, epochs=2, bs=100, drop_last=True, on_step=seen.append, scheduler=sched)
    assert seen == [0, 1, 2, 3] and sched.last_epoch == 4 and hist.acc == [] and len(hist.seconds) == 2
    policy = ah.precision.policy_for("cpu", prefer="bf16")
    hist = ah.train.fit(model, data, opt, epochs=1, bs=256, policy=policy)
    assert 0 < hist.final <= 1 and np.isfinite(hist.loss[-1])


def test_fit_refuses_bad_arguments(data):
    model = ah.models.mlp([40, 10])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="bs >= 1"):
        ah.train.fit(model, data, opt, epochs=1, bs=0)
    with pytest.raises(ValueError, match="one label per row"):
        ah.train.fit(model, (data.x_train, data.y_train[:5]), opt, epochs=1)


def test_fit_runs_the_step_it_is_given(data):
    """Chapter 04 passes its own minibatch_step cell to fit, so an edit of that cell reaches the accuracy runs
    (review 04-T1: fit always ran the package's copy)."""
    calls = []

    def step(model, opt, x, y, policy, scaler):
        calls.append(len(x))
        return ah.precision.minibatch_step(model, opt, x, y, policy, scaler)

    a = ah.models.mlp([40, 16, 10])
    b = ah.fullbatch.clone(a)
    ah.train.fit(a, data, torch.optim.SGD(a.parameters(), lr=0.05), epochs=1, bs=1000, seed=1, step=step)
    ah.train.fit(b, data, torch.optim.SGD(b.parameters(), lr=0.05), epochs=1, bs=1000, seed=1)
    n = len(data.x_train)
    assert calls == [1000] * (n // 1000) + ([n % 1000] if n % 1000 else [])
    assert ah.metrics.max_abs_diff(a, b) == 0.0
