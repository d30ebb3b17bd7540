"""fullbatch (chapter 02's exported cells): the fast path follows the naive loop's trajectory; many models = each
model alone; fastai's Learner trains the same workload; the ablation's benchmark and its command."""

import numpy as np
import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

import accelhelpers as ah


@pytest.fixture(scope="module")
def data():
    return ah.data.mnist1d()


# Left to nbval: fast path and model 0 of 2 vs udlbook's loop, loss over 60 steps (chapter 02 cell 69); here, fewer.
CHECK_STEPS = 6


def test_fast_path_follows_the_naive_trajectory(data):
    m = ah.models.udl_mlp(4, seed=0)
    naive = ah.fullbatch.naive_fullbatch(ah.fullbatch.clone(m), data, CHECK_STEPS)
    fast = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data).run(CHECK_STEPS)
    np.testing.assert_allclose(fast.loss, naive.loss, rtol=1e-4, atol=1e-5)
    assert naive.loss[-1] < naive.loss[0]  # it did learn something
    # the fast path's train error is measured before each update, the naive one after it
    np.testing.assert_allclose(fast.train_err[1:], naive.train_err[:-1], atol=0.1)
    np.testing.assert_allclose(fast.test_err, naive.test_err, atol=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(dataloader=True, host_sync=True, fused=False), dict(host_sync=True)])
def test_every_ablation_switch_gives_the_same_losses(data, kw):
    m = ah.models.udl_mlp(2, seed=1)
    ref = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data).run(50)
    other = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data, **kw).run(50)
    np.testing.assert_allclose(other.loss, ref.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compiled_step_matches_eager(data):
    m = ah.models.udl_mlp(1, seed=2)
    ref = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data).run(20)
    comp = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data, compile=True).run(20)
    np.testing.assert_allclose(comp.loss, ref.loss, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_fullgraph_step_follows_the_naive_trajectory_and_trains_the_model_in_place(data):
    m = ah.models.udl_mlp(4, seed=3)
    naive_model = ah.fullbatch.clone(m)
    naive = ah.fullbatch.naive_fullbatch(naive_model, data, 100)
    padded = ah.fullbatch.pad_mlp(ah.fullbatch.clone(m))
    fg = ah.fullbatch.FullGraphLoop(padded, data).run(100)
    np.testing.assert_allclose(fg.loss, naive.loss, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fg.train_err[1:], naive.train_err[:-1], atol=0.1)
    np.testing.assert_allclose(fg.test_err, naive.test_err, atol=0.1)
    # the model object itself was trained (the loop updates its weights in place), padding units still zero
    torch.testing.assert_close(padded(data.x_test), naive_model(data.x_test), rtol=1e-4, atol=1e-4)
    assert padded[0].weight[63:].abs().max() == 0


def test_udlbooks_loop_takes_the_training_error_from_the_steps_own_forward_pass(data):
    m = ah.models.udl_mlp(3, seed=4)
    udl = ah.fullbatch.udlbook_loop(ah.fullbatch.clone(m), data, CHECK_STEPS)
    # the fast loop also measures before each update, and does not shuffle
    fast = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data).run(CHECK_STEPS)
    np.testing.assert_allclose(udl.loss, fast.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(udl.train_err, fast.train_err, atol=0.05)
    assert np.isnan(udl.test_err).all() and udl.train_err.shape == (CHECK_STEPS,)
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        ah.fullbatch.udlbook_loop(m, data, 0)


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, True])
def test_fullgraph_test_every_k_changes_only_when_the_test_error_is_measured(data, compile):
    m = ah.fullbatch.pad_mlp(ah.models.udl_mlp(4, seed=6))
    every = ah.fullbatch.FullGraphLoop(ah.fullbatch.clone(m), data, compile=compile).run(30)
    k = ah.fullbatch.FullGraphLoop(ah.fullbatch.clone(m), data, test_every=10, compile=compile).run(30)
    np.testing.assert_allclose(k.loss, every.loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(k.train_err, every.train_err, atol=1e-4)
    np.testing.assert_allclose(k.test_err[9::10], every.test_err[9::10], atol=1e-4)
    assert np.isnan(np.delete(k.test_err, [9, 19, 29])).all()
    with pytest.raises(ValueError, match="test_every must be an int >= 1"):
        ah.fullbatch.FullGraphLoop(m, data, test_every=0)


def test_fullgraph_loop_refuses_a_model_it_cannot_write_as_one_function(data):
    tanh_mlp = torch.nn.Sequential(torch.nn.Linear(40, 10), torch.nn.Tanh(), torch.nn.Linear(10, 10))
    with pytest.raises(ValueError, match="FullGraphLoop needs an nn.Sequential"):
        ah.fullbatch.FullGraphLoop(tanh_mlp, data)


@pytest.mark.slow
def test_graph_breaks_counts_what_dynamo_makes_of_each_step_and_trains_nothing(data):
    usual = ah.fullbatch.FullBatchLoop(ah.fullbatch.pad_mlp(ah.models.udl_mlp(2, seed=5)), data)
    before = [p.detach().clone() for p in usual.model.parameters()]
    rep = ah.fullbatch.graph_breaks(usual)
    assert rep.graph_breaks >= 1 and rep.graphs == rep.graph_breaks + 1
    assert any("zero_grad" in r for r in rep.reasons)
    assert all(torch.equal(a, b) for a, b in zip(before, usual.model.parameters()))
    padded = ah.fullbatch.pad_mlp(ah.models.udl_mlp(2, seed=5))
    one = ah.fullbatch.graph_breaks(ah.fullbatch.FullGraphLoop(padded, data))
    assert (one.graphs, one.graph_breaks, one.reasons) == (1, 0, [])


def test_many_mlp_matches_vmap_over_the_individual_models(data):
    models = [ah.models.udl_mlp(3, seed=i) for i in range(5)]
    many = ah.fullbatch.ManyMLP(models)
    params, buffers = stack_module_state(models)
    base = ah.fullbatch.clone(models[0]).to("meta")
    ref = vmap(lambda p, b, x: functional_call(base, (p, b), (x,)), in_dims=(0, 0, None))(params, buffers,
                                                                                           data.x_test)
    torch.testing.assert_close(many(data.x_test), ref, rtol=1e-5, atol=1e-5)


def test_many_models_train_exactly_as_each_alone(data):
    models = [ah.models.udl_mlp(4, seed=i) for i in range(3)]
    together = ah.fullbatch.ManyModelsLoop([ah.fullbatch.clone(m) for m in models], data).run(CHECK_STEPS)
    assert together.train_err.shape == (3, CHECK_STEPS)
    for i, m in enumerate(models):  # every model of the batch, not model 0 alone
        alone = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data).run(CHECK_STEPS)
        np.testing.assert_allclose(together.loss[i], alone.loss, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(together.train_err[i], alone.train_err, atol=0.05)


@pytest.mark.slow
def test_fastai_learner_runs_the_same_workload(data):
    """The fastai row trains what the fast loop trains: from the same weights, 3 epochs of fastai's fit (one shuffled
    batch of all 4000 rows, SGD without momentum or weight decay) end where 3 full-batch SGD steps do."""
    m = ah.models.udl_mlp(4, seed=0)
    learn = ah.fullbatch.fastai_learner(ah.fullbatch.clone(m), data)
    with learn.no_bar(), learn.no_logging():
        learn.fit(3, 0.0025)  # udlbook's learning rate, the chapter's LR
    fast = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data, 0.0025)
    fast.run(3)
    assert ah.metrics.max_abs_diff(fast.model, m) > 1e-4  # the weights moved: the comparison below can fail
    assert ah.metrics.max_abs_diff(learn.model, fast.model) < 1e-6  # a shuffled batch sums in another order


def test_bad_input(data):
    with pytest.raises(ValueError, match="epochs must be at least 1"):
        ah.fullbatch.naive_fullbatch(ah.models.udl_mlp(1), data, 0)
    with pytest.raises(ValueError, match="learning rate must be positive"):
        ah.fullbatch.FullBatchLoop(ah.models.udl_mlp(1), data, lr=0)
    with pytest.raises(ValueError, match="same depth"):
        ah.fullbatch.ManyMLP([ah.models.udl_mlp(1), ah.models.udl_mlp(2)])
    bad = ah.data.Split(data.x_train[:, :, None], data.y_train, data.x_test, data.y_test)
    with pytest.raises(ValueError, match="expected x_train"):
        ah.fullbatch.FullBatchLoop(ah.models.udl_mlp(1), bad)


@pytest.mark.slow
def test_padding_to_the_vector_width_changes_nothing_but_speed(data):
    m = ah.models.udl_mlp(4, seed=5)
    p = ah.fullbatch.pad_mlp(m)
    assert [lin.out_features for lin in p if isinstance(lin, torch.nn.Linear)] == [64, 64, 64, 64, 10]
    torch.testing.assert_close(p(data.x_test), m(data.x_test))
    a = ah.fullbatch.FullBatchLoop(ah.fullbatch.clone(m), data).run(100)
    loop = ah.fullbatch.FullBatchLoop(p, data)
    b = loop.run(100)
    np.testing.assert_allclose(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    first = p[0]
    assert torch.all(first.weight[63:] == 0) and torch.all(first.bias[63:] == 0)  # padded units stayed zero
    with pytest.raises(ValueError, match="Sequential of Linear"):
        ah.fullbatch.pad_mlp(torch.nn.Sequential(torch.nn.ReLU()))


@pytest.mark.slow
def test_bench_runs_every_variant_and_writes_the_schema(tmp_path, cli_here):
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "accelhelpers", "bench", "fullbatch", "--min-steps", "2", "--round-s",
                        "0.001", "--models", "2", "--rounds", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["schema"] == "accel-course/bench-fullbatch/3" and res["rounds"] == 2 and res["threads"] >= 1
    names = [v["name"] for v in res["variants"]]
    assert names == ["naive", "naive+eval", "fastai", "tensors", "no_sync", "fast", "padded", "compiled", "fullgraph",
                     "test/100", "bf16", "many"]
    assert res["peak_gflops_bf16"] > 0 and res["variants"][names.index("bf16")]["precision"] == "bf16"
    for v in res["variants"]:
        assert v["model_steps_per_s"] == pytest.approx(v["steps_per_s"] * v["n_models"])
        flops = res["workload"]["train_flops_per_model_step"]
        assert v["gflops"] == pytest.approx(v["model_steps_per_s"] * flops / 1e9)
        peak = res["peak_gflops_bf16"] if v["precision"] == "bf16" else res["peak_gflops"]
        assert v["fraction_of_peak"] == pytest.approx(v["gflops"] / peak)
        lo, hi = v["steps_per_s_range"]
        assert lo <= v["steps_per_s"] <= hi and v["speedup_range"][0] <= v["speedup_vs_naive"] <= v["speedup_range"][1]
        # --min-steps 2, unless a step timed at warm-up was so slow that 2 might pass a second (a busy machine can
        # make any row's warm-up that slow, so each row is only held to 1; the fast rows below to 2)
        assert v["steps_per_round"] >= 1 and type(v["full_collections"]) is int  # the schema's count of gc passes
    assert max(v["steps_per_round"] for v in res["variants"]) >= 2, "--min-steps 2 was applied to no row"
    assert res["variants"][0]["speedup_vs_naive"] == 1.0 and res["variants"][0]["speedup_range"] == [1.0, 1.0]
    assert "naive" in r.stdout and "vs naive" in r.stdout and "medians of 2 interleaved rounds" in r.stdout
    for args, msg in ((["--min-steps", "0"], "--min-steps must be at least 1"),  # bad input, in this process
                      (["--rounds", "0"], "--rounds must be at"),
                      (["--round-s", "0"], "--round-s must be positive")):
        bad = cli_here("bench", "fullbatch", *args)
        assert bad.returncode == 2 and msg in bad.stderr


@pytest.mark.slow
def test_ablation_rows_are_medians_with_enough_steps_and_ratios_per_round(data):
    res = ah.fullbatch.run_fullbatch(data, n_models=2, compile=False, rounds=3, round_s=0.001, min_steps=3,
                                     peak_gflops=100.0, progress=False)
    rows = {v["name"]: v for v in res["variants"]}
    assert list(rows) == ["naive", "naive+eval", "fastai", "tensors", "no_sync", "fast", "padded", "many"]
    # never a round of one or two steps, unless each step takes long enough (> 1/3 s) to be timed alone. The rows
    # checked run 10 steps/s or more, so a calibration slowed 3x by load elsewhere still counts at least 3; fastai's
    # row runs near 3 steps/s here, where a slow calibration rightly picks 2 (a threshold of 3.5 failed in CI).
    assert all(v["steps_per_round"] >= 3 for v in rows.values() if v["steps_per_s"] > 10)
    # and most rows do get 3 or more: their steps take well under 1/3 s even on a loaded host (CI, 2026-12-03: under
    # the other worker's jobs every row ran below 10 steps/s, so the check above covered none)
    assert sum(v["steps_per_round"] >= 3 for v in rows.values()) >= 4
    assert rows["naive"]["speedup_vs_naive"] == 1.0 and rows["naive"]["speedup_range"] == (1.0, 1.0)
    assert rows["many"]["model_steps_per_s"] == pytest.approx(2 * rows["many"]["steps_per_s"])
    assert res["peak_gflops"] == 100.0
    assert rows["fast"]["fraction_of_peak"] == pytest.approx(rows["fast"]["gflops"] / 100)
    table = ah.fullbatch.table(res)
    assert "medians of 3 interleaved rounds" in table and f"{res['threads']} thread(s)" in table
