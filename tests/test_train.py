"""train: the fast path follows the naive loop's trajectory; many models = each model alone; fastai runs."""

import numpy as np
import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

import accelhelpers as ah
from accelhelpers import train


@pytest.fixture(scope="module")
def data():
    return ah.data.mnist1d()


def test_fast_path_follows_the_naive_trajectory(data):
    m = ah.models.udl_mlp(4, seed=0)
    naive = train.naive_fullbatch(train.clone(m), data, 300)
    fast = train.FullBatchLoop(train.clone(m), data).run(300)
    np.testing.assert_allclose(fast.loss, naive.loss, rtol=1e-4, atol=1e-5)
    assert naive.loss[-1] < naive.loss[0]  # it did learn something
    # the fast path's train error is measured before each update, the naive one after it
    np.testing.assert_allclose(fast.train_err[1:], naive.train_err[:-1], atol=0.1)
    np.testing.assert_allclose(fast.test_err, naive.test_err, atol=0.1)


@pytest.mark.parametrize("kw", [dict(dataloader=True, host_sync=True, fused=False), dict(host_sync=True)])
def test_every_ablation_switch_gives_the_same_losses(data, kw):
    m = ah.models.udl_mlp(2, seed=1)
    ref = train.FullBatchLoop(train.clone(m), data).run(50)
    other = train.FullBatchLoop(train.clone(m), data, **kw).run(50)
    np.testing.assert_allclose(other.loss, ref.loss, rtol=1e-5, atol=1e-6)


def test_compiled_step_matches_eager(data):
    m = ah.models.udl_mlp(1, seed=2)
    ref = train.FullBatchLoop(train.clone(m), data).run(20)
    comp = train.FullBatchLoop(train.clone(m), data, compile=True).run(20)
    np.testing.assert_allclose(comp.loss, ref.loss, rtol=1e-4, atol=1e-5)


def test_fullgraph_step_follows_the_naive_trajectory_and_trains_the_model_in_place(data):
    m = ah.models.udl_mlp(4, seed=3)
    naive_model = train.clone(m)
    naive = train.naive_fullbatch(naive_model, data, 100)
    padded = train.pad_mlp(train.clone(m))
    fg = train.FullGraphLoop(padded, data).run(100)
    np.testing.assert_allclose(fg.loss, naive.loss, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fg.train_err[1:], naive.train_err[:-1], atol=0.1)
    np.testing.assert_allclose(fg.test_err, naive.test_err, atol=0.1)
    # the model object itself was trained (the loop updates its weights in place), padding units still zero
    torch.testing.assert_close(padded(data.x_test), naive_model(data.x_test), rtol=1e-4, atol=1e-4)
    assert padded[0].weight[63:].abs().max() == 0


def test_udlbooks_loop_takes_the_training_error_from_the_steps_own_forward_pass(data):
    m = ah.models.udl_mlp(3, seed=4)
    udl = train.udlbook_loop(train.clone(m), data, 60)
    fast = train.FullBatchLoop(train.clone(m), data).run(60)  # also measures before each update, no shuffle
    np.testing.assert_allclose(udl.loss, fast.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(udl.train_err, fast.train_err, atol=0.05)
    assert np.isnan(udl.test_err).all() and udl.train_err.shape == (60,)
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        train.udlbook_loop(m, data, 0)


@pytest.mark.parametrize("compile", [False, True])
def test_fullgraph_test_every_k_changes_only_when_the_test_error_is_measured(data, compile):
    m = train.pad_mlp(ah.models.udl_mlp(4, seed=6))
    every = train.FullGraphLoop(train.clone(m), data, compile=compile).run(30)
    k = train.FullGraphLoop(train.clone(m), data, test_every=10, compile=compile).run(30)
    np.testing.assert_allclose(k.loss, every.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(k.train_err, every.train_err, atol=1e-4)
    np.testing.assert_allclose(k.test_err[9::10], every.test_err[9::10], atol=1e-4)
    assert np.isnan(np.delete(k.test_err, [9, 19, 29])).all()
    with pytest.raises(ValueError, match="test_every must be an int >= 1"):
        train.FullGraphLoop(m, data, test_every=0)


def test_fullgraph_loop_refuses_a_model_it_cannot_write_as_one_function(data):
    with pytest.raises(ValueError, match="FullGraphLoop needs an nn.Sequential"):
        train.FullGraphLoop(torch.nn.Sequential(torch.nn.Linear(40, 10), torch.nn.Tanh(), torch.nn.Linear(10, 10)),
                            data)


def test_graph_breaks_counts_what_dynamo_makes_of_each_step_and_trains_nothing(data):
    usual = train.FullBatchLoop(train.pad_mlp(ah.models.udl_mlp(2, seed=5)), data)
    before = [p.detach().clone() for p in usual.model.parameters()]
    rep = train.graph_breaks(usual)
    assert rep.graph_breaks >= 1 and rep.graphs == rep.graph_breaks + 1
    assert any("zero_grad" in r for r in rep.reasons)
    assert all(torch.equal(a, b) for a, b in zip(before, usual.model.parameters()))
    one = train.graph_breaks(train.FullGraphLoop(train.pad_mlp(ah.models.udl_mlp(2, seed=5)), data))
    assert (one.graphs, one.graph_breaks, one.reasons) == (1, 0, [])


def test_many_mlp_matches_vmap_over_the_individual_models(data):
    models = [ah.models.udl_mlp(3, seed=i) for i in range(5)]
    many = train.ManyMLP(models)
    params, buffers = stack_module_state(models)
    base = train.clone(models[0]).to("meta")
    ref = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers,
                                                                                           data.x_test)
    torch.testing.assert_close(many(data.x_test), ref, rtol=1e-5, atol=1e-5)


def test_many_models_train_exactly_as_each_alone(data):
    models = [ah.models.udl_mlp(4, seed=i) for i in range(3)]
    together = train.ManyModelsLoop([train.clone(m) for m in models], data).run(40)
    assert together.train_err.shape == (3, 40)
    for i, m in enumerate(models):
        alone = train.FullBatchLoop(train.clone(m), data).run(40)
        np.testing.assert_allclose(together.loss[i], alone.loss, rtol=1e-4, atol=1e-5)


def test_fastai_learner_runs_the_same_workload(data):
    learn = train.fastai_learner(ah.models.udl_mlp(4, seed=0), data)
    assert learn.dls.train.bs == 4000
    with learn.no_bar(), learn.no_logging():
        learn.fit(3, 0.0025)
    assert len(learn.recorder.losses) == 3


def test_bad_input(data):
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        train.naive_fullbatch(ah.models.udl_mlp(1), data, 0)
    with pytest.raises(ValueError, match="learning rate must be positive"):
        train.FullBatchLoop(ah.models.udl_mlp(1), data, lr=0)
    with pytest.raises(ValueError, match="same depth"):
        train.ManyMLP([ah.models.udl_mlp(1), ah.models.udl_mlp(2)])
    bad = ah.data.Split(data.x_train[:, :, None], data.y_train, data.x_test, data.y_test)
    with pytest.raises(ValueError, match="expected x_train"):
        train.FullBatchLoop(ah.models.udl_mlp(1), bad)


def test_padding_to_the_vector_width_changes_nothing_but_speed(data):
    m = ah.models.udl_mlp(4, seed=5)
    p = train.pad_mlp(m)
    assert [lin.out_features for lin in p if isinstance(lin, torch.nn.Linear)] == [64, 64, 64, 64, 10]
    torch.testing.assert_close(p(data.x_test), m(data.x_test))
    a = train.FullBatchLoop(train.clone(m), data).run(100)
    loop = train.FullBatchLoop(p, data)
    b = loop.run(100)
    np.testing.assert_allclose(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    first = p[0]
    assert torch.all(first.weight[63:] == 0) and torch.all(first.bias[63:] == 0)  # padded units stayed zero
    with pytest.raises(ValueError, match="Sequential of Linear"):
        train.pad_mlp(torch.nn.Sequential(torch.nn.ReLU()))


def test_bench_runs_every_variant_and_writes_the_schema(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "accelhelpers", "bench", "fullbatch", "--steps", "2", "--models", "2",
                        "--rounds", "2", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["schema"] == "accel-course/bench-fullbatch/2" and res["rounds"] == 2
    names = [v["name"] for v in res["variants"]]
    assert names == ["naive", "naive+eval", "fastai", "tensors", "no_sync", "fast", "padded", "compiled", "fullgraph",
                     "test/100", "many"]
    for v in res["variants"]:
        assert v["model_steps_per_s"] == pytest.approx(v["steps_per_s"] * v["n_models"])
        flops = res["workload"]["train_flops_per_model_step"]
        assert v["gflops"] == pytest.approx(v["model_steps_per_s"] * flops / 1e9)
        assert v["fraction_of_peak"] == pytest.approx(v["gflops"] / res["peak_gflops"])
        lo, hi = v["steps_per_s_range"]
        assert lo <= v["steps_per_s"] <= hi and v["speedup_range"][0] <= v["speedup_vs_naive"] <= v["speedup_range"][1]
        assert v["timed_steps"] == 2 * 2
    assert res["variants"][0]["speedup_vs_naive"] == 1.0 and res["variants"][0]["speedup_range"] == [1.0, 1.0]
    assert "naive" in r.stdout and "vs naive" in r.stdout and "medians of 2 interleaved rounds" in r.stdout
    for args, msg in ((["--steps", "0"], "--steps must be at least 1"), (["--rounds", "0"], "--rounds must be at"),
                      (["--round-s", "0"], "--round-s must be positive")):
        bad = subprocess.run([sys.executable, "-m", "accelhelpers", "bench", "fullbatch", *args],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and msg in bad.stderr


def test_bench_rows_are_medians_and_ratios_are_per_round():
    from accelhelpers import bench

    v = bench.Variant("x", "d", 2, lambda: None)
    row = bench._row(v, 0.0, 10, [10.0, 30.0, 20.0], [5.0, 10.0, 20.0], flops=1_000_000_000, peak=100.0)
    assert row["steps_per_s"] == 20.0 and row["steps_per_s_range"] == (10.0, 30.0)
    assert row["model_steps_per_s"] == 40.0 and row["gflops"] == 40.0 and row["fraction_of_peak"] == 0.4
    assert row["speedup_vs_naive"] == 4.0 and row["speedup_range"] == (2.0, 6.0)  # ratios 4, 6, 2 round by round
    assert list(row) == ["name", "description", "n_models", "steps_per_s", "steps_per_s_range", "model_steps_per_s",
                         "gflops", "fraction_of_peak", "speedup_vs_naive", "speedup_range", "original_experiment_h",
                         "warmup_s", "timed_steps"]  # the JSON schema's keys, in order


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


def test_fit_matches_the_loop_written_out_and_records_each_epoch(data):
    a = ah.models.mlp([40, 32, 10])
    b = train.clone(a)
    hist = train.fit(a, data, torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9), epochs=2, bs=100, seed=3)
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
    hist = train.fit(model, (x, y), opt, epochs=2, bs=100, drop_last=True, on_step=seen.append, scheduler=sched)
    assert seen == [0, 1, 2, 3] and sched.last_epoch == 4 and hist.acc == [] and len(hist.seconds) == 2
    policy = ah.precision.policy_for("cpu", prefer="bf16")
    hist = train.fit(model, data, opt, epochs=1, bs=256, policy=policy)
    assert 0 < hist.final <= 1 and np.isfinite(hist.loss[-1])


def test_minibatch_step_is_one_plain_sgd_step_and_its_fp16_recipe_skips_an_overflow(data):
    import torch.nn.functional as F

    a, x, y = ah.models.mlp([40, 16, 10]), data.x_train[:64], data.y_train[:64]
    b = train.clone(a)
    loss = train.minibatch_step(a, torch.optim.SGD(a.parameters(), lr=0.1), x, y, None, None)
    assert loss.item() == F.cross_entropy(b(x), y).item()  # the loss before the update
    F.cross_entropy(b(x), y).backward()
    torch.optim.SGD(b.parameters(), lr=0.1).step()
    assert ah.metrics.max_abs_diff(a, b) == 0.0
    policy = ah.precision.Policy("cpu", torch.float16, True, "test")
    scaler = policy.grad_scaler(init_scale=2.0**40)  # fp16 gradients overflow at this scale: step skipped
    before = [p.detach().clone() for p in a.parameters()]
    train.minibatch_step(a, torch.optim.SGD(a.parameters(), lr=0.1), x, y, policy, scaler)
    assert scaler.get_scale() == 2.0**39 and all(torch.equal(p, q) for p, q in zip(a.parameters(), before))


def test_fit_refuses_bad_arguments(data):
    model = ah.models.mlp([40, 10])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="bs >= 1"):
        train.fit(model, data, opt, epochs=1, bs=0)
    with pytest.raises(ValueError, match="one label per row"):
        train.fit(model, (data.x_train, data.y_train[:5]), opt, epochs=1)


def test_compile_options_write_the_current_thread_count_into_cpu_code():
    with ah.session.threads(1):
        assert train.compile_options(torch.device("cpu")) == {"options": {"cpp.threads": 1}}
    assert train.compile_options(torch.device("cuda")) == {"mode": "reduce-overhead"}
