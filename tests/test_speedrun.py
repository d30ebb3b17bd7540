"""Chapter 11's speedrun (accelhelpers.speedrun, exported from notebooks/11_speedrun.ipynb): the synthetic language and
its exact floor, the GPT (shapes, causality, SDPA == attention written out, weight tying), the FLOP count by hand and
against torch's counter, MFU, the row machinery (a new row needs no other edit), training to a target (and a target
that cannot be reached), the chapter's own DDP worker, and the README's table of recorded times to target."""

import json
import math
from dataclasses import asdict, replace

import numpy as np
import pytest
import torch

import accelhelpers as ah
from tests.workers import write_workers

sr = ah.speedrun
TINY = sr.GPTConfig(vocab=8, context=16, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def lang():
    return sr.make_language(vocab=8, topics=2, successors=2, seed=0)


@pytest.fixture(scope="module")
def data(lang):
    return sr.sample(lang, 2000, TINY.context, seed=1), sr.sample(lang, 128, TINY.context, seed=2)


def test_the_data_is_the_same_on_every_machine():
    """PCG64 uniforms and inverse CDFs only: the chapter's quick-profile data hash to the value its notebook prints."""
    lang = sr.make_language(16, 4, 3, seed=0)
    tokens = sr.sample(lang, 20_000, 32, seed=1)
    assert tokens.shape == (20_000, 33) and tokens.dtype == torch.int64
    assert sr.fingerprint(tokens) == "f4c6fa9544ac5591"
    assert torch.equal(tokens, sr.sample(lang, 20_000, 32, seed=1))
    assert not torch.equal(tokens[:100], sr.sample(lang, 100, 32, seed=2))
    np.testing.assert_allclose(lang.transitions.sum(2), 1.0, atol=1e-12)
    np.testing.assert_allclose(lang.start.sum(1), 1.0, atol=1e-12)
    stationary = np.einsum("kv,kvw->kw", lang.start, lang.transitions)  # start @ P == start
    np.testing.assert_allclose(stationary, lang.start, atol=1e-12)


def test_the_floor_is_the_entropy_rate_and_context_lowers_it():
    """One topic: the Bayes predictor is the chain itself, so its loss equals the previous-token predictor's and, on
    many tokens, the chain's entropy rate sum_v pi(v) H(P[v]). Several topics: reading the context beats one token."""
    one = sr.make_language(vocab=6, topics=1, successors=2, seed=3)
    tokens = sr.sample(one, 4000, 40, seed=4)
    p, pi = one.transitions[0], one.start[0]
    entropy_rate = -(pi[:, None] * p * np.log(p)).sum()
    assert sr.bayes_loss(one, tokens) == pytest.approx(sr.previous_token_loss(one, tokens), abs=1e-9)
    assert sr.bayes_loss(one, tokens) == pytest.approx(entropy_rate, abs=0.01)
    many = sr.make_language(vocab=16, topics=4, successors=3, seed=0)
    val = sr.sample(many, 512, 32, seed=2)
    floor, prev = sr.bayes_loss(many, val), sr.previous_token_loss(many, val)
    per_position = sr.bayes_loss(many, val, per_position=True)
    assert floor < prev - 0.5 < math.log(16)
    assert per_position.shape == (32,) and per_position.mean() == pytest.approx(floor)
    assert per_position[0] == pytest.approx(prev, abs=0.1) and per_position[-1] < per_position[0] - 0.5
    target = floor + 0.5 * (prev - floor)  # the chapter's target arithmetic
    assert floor < target < prev


def test_model_shapes_causality_sdpa_and_weight_tying(data):
    torch.manual_seed(0)
    model = sr.GPT(TINY)
    x = data[1][:4, :-1]
    assert model(x).shape == (4, TINY.context, TINY.vocab)
    assert model(x, data[1][:4, 1:]).shape == ()
    assert model.lm_head.weight is model.wte.weight
    assert "lm_head.weight" not in dict(model.named_parameters())  # one tensor, counted once
    with torch.no_grad():
        plain, sdpa = model.set_attention("plain")(x), model.set_attention("sdpa")(x)
        assert torch.allclose(plain, sdpa, atol=1e-5)
        for kind in ("plain", "sdpa"):
            model.set_attention(kind)
            edited = x.clone()
            edited[:, 10] = (edited[:, 10] + 1) % TINY.vocab  # a future token for positions 0..9
            before, after = model(x), model(edited)
            assert torch.equal(before[:, :10], after[:, :10]), kind
            assert not torch.equal(before[:, 10:], after[:, 10:]), kind
    with pytest.raises(ValueError, match="longer than the model's context of 16"):
        model(data[1][:1])
    with pytest.raises(ValueError, match="attention 'flash' is not one of plain, sdpa"):
        model.set_attention("flash")
    with pytest.raises(ValueError, match="n_embd divisible by n_head"):
        sr.GPTConfig(n_embd=10, n_head=4)


def test_flops_per_token_by_hand_and_by_torchs_counter():
    """vocab 8, context 4, 1 layer, width 4. Multiply-adds per token: c_attn 4x12 = 48, attention's c_proj 4x4 = 16,
    c_fc 4x16 = 64, the MLP's c_proj 16x4 = 64, the tied output layer 4x8 = 32: 224; attention: q.k over 4
    positions of width 4 = 16, and the weighted sum of v = 16: 32. Forward 2 x 256 = 512 FLOPs, training 3 x 512."""
    cfg = sr.GPTConfig(vocab=8, context=4, n_layer=1, n_head=2, n_embd=4)
    assert sr.flops_per_token(cfg, training=False) == 512
    assert sr.flops_per_token(cfg) == 1536
    from torch.utils.flop_counter import FlopCounterMode

    model = sr.GPT(TINY).set_attention("plain")
    x = torch.randint(0, TINY.vocab, (3, TINY.context + 1))
    with FlopCounterMode(display=False) as counter:
        model(x[:, :-1], x[:, 1:]).backward()
    assert counter.get_total_flops() == sr.flops_per_token(TINY) * 3 * TINY.context


def test_mfu_is_flops_per_second_over_the_ranks_peak():
    res = sr.RowResult("r", "-", sr.Recipe(world=2), tokens_per_s=[1000.0, 2000.0, 3000.0])
    # 2000 tokens/s x 1536 FLOPs per token = 3.072 MFLOP/s, over 2 ranks x 1.536 MFLOP/s = 1.0
    assert sr.mfu(res, 1536, {"fp32": 1.536e-3}) == pytest.approx((1.0, 0.5, 1.5))
    assert sr.mfu(replace(res, dtype="bf16"), 1536, {"fp32": 1.0, "bf16": 3.072e-3}) == pytest.approx((0.5, 0.25, 0.75))
    assert sr.mfu(sr.RowResult("skipped", "-", skipped="skipped: needs CUDA"), 1536, {"fp32": 1.0}) is None


def test_rows_stack_skip_and_refuse_bad_switches():
    rows = [sr.Row("baseline"), sr.Row("SDPA", {"attention": "sdpa"}), sr.Row("flash", {"backend": "flash"}),
            sr.Row("DDP", {"world": 4}), sr.Row("graphs", {"compile": "reduce-overhead"}),
            sr.Row("mine", {"lr_scale": 2.0})]
    planned = sr.plan(rows, ah.device.Hardware("cpu"), devices=2)
    assert [p.skipped for p in planned] == [
        None, None, "skipped: needs CUDA (a GPU's SDPA backend)", "skipped: needs 4 devices, 2 here",
        "skipped: needs CUDA (CUDA graphs)", None]
    assert planned[-1].recipe == sr.Recipe(attention="sdpa", lr_scale=2.0)  # skipped changes are not passed on
    on_gpu = sr.plan(rows, ah.device.Hardware("cuda", capability=(8, 0), gpus=4), devices=4)
    assert on_gpu[-1].recipe == sr.Recipe(attention="sdpa", backend="flash", world=4, compile="reduce-overhead",
                                          lr_scale=2.0)
    with pytest.raises(ValueError, match="changes colour: a row can change attention, backend, precision"):
        sr.Row("x", {"colour": "red"})
    with pytest.raises(ValueError, match=r"precision='fp8' \(use one of 'fp32', 'mixed'\)"):
        sr.Row("x", {"precision": "fp8"})
    with pytest.raises(ValueError, match="batch_scale=0"):
        sr.Row("x", {"batch_scale": 0})
    with pytest.raises(ValueError, match="backend='flash' needs attention='sdpa'"):
        sr.Recipe(backend="flash")


@pytest.mark.slow
def test_train_to_an_easy_target_and_not_to_an_impossible_one(lang, data):
    train, val = data
    floor = sr.bayes_loss(lang, val)
    tr = sr.Trainer(sr.Recipe(attention="sdpa"), TINY, sr.Hyper(batch=32, lr=1e-2, warmup=5), train, "cpu")
    easy = sr.run_to_target(tr, 0, val, math.log(TINY.vocab) - 0.3, every=5, max_seconds=30)
    assert easy.reached and easy.steps % 5 == 0 and easy.loss <= math.log(TINY.vocab) - 0.3 and easy.seconds > 0
    again = sr.run_to_target(tr, 0, val, math.log(TINY.vocab) - 0.3, every=5, max_seconds=30)
    assert (again.steps, again.loss) == (easy.steps, easy.loss)  # same seed: same start, same batches
    impossible = sr.run_to_target(tr, 1, val, floor - 0.1, every=5, max_seconds=0.5)
    assert not impossible.reached and impossible.loss > floor - 0.1 and impossible.seconds >= 0.5
    with pytest.raises(ValueError, match="every >= 1 and max_seconds > 0"):
        sr.run_to_target(tr, 0, val, 1.0, every=0, max_seconds=1)
    with pytest.raises(RuntimeError, match="world=2 runs in 2 ranks that torchrun started"):
        sr.Trainer(sr.Recipe(world=2), TINY, sr.Hyper(), train, "cpu")


@pytest.mark.slow
def test_a_new_row_is_measured_and_tabled_without_other_edits(data):
    """The exercise: append a Row; plan, Trainer, warm_up, step_memory, run_to_target and table take it as it is."""
    train, val = data
    rows = [sr.Row("baseline"), sr.Row("mixed", {"precision": "mixed"}), sr.Row("fused", {"optimizer": "fused"}),
            sr.Row("flash", {"backend": "flash"})]
    rows.append(sr.Row("lr x2", {"lr_scale": 2.0}))  # the learner's row
    results = []
    for p in sr.plan(rows, ah.device.Hardware("cpu"), devices=1):
        res = sr.RowResult(p.row.name, p.row.describe(), p.recipe, skipped=p.skipped)
        if p.recipe is not None:
            tr = sr.Trainer(p.recipe, TINY, sr.Hyper(batch=16, lr=1e-2, warmup=5), train, "cpu")
            sr.warm_up(tr, steps=1)
            res.dtype, res.peak_bytes = tr.policy.name, sr.step_memory(tr)
            res.tokens_per_s = [tr.batch * TINY.context / 0.01] * 3
            res.runs = [sr.run_to_target(tr, seed, val, math.log(TINY.vocab) - 0.2, 5, 30) for seed in (0, 1)]
        results.append(res)
    text = sr.table(results, sr.flops_per_token(TINY), {"fp32": 50.0, "bf16": 100.0})
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows) and lines[-1].startswith("lr x2")
    assert "skipped: needs CUDA" in lines[-2] and "baseline" in lines[2]
    assert results[-1].recipe == sr.Recipe(precision="mixed", optimizer="fused", lr_scale=2.0)
    assert results[-1].peak_bytes > 0 and all(r.reached for r in results[-1].runs)
    assert sr.paired(results[0], results[0]) == (1.0, 1.0, 1.0)
    assert sr.says((1.5, 1.2, 1.8)).endswith("faster on every seed")
    assert sr.says((0.9, 0.8, 1.1)).endswith("no reliable difference")


@pytest.mark.slow
def test_the_chapters_ddp_worker_trains_a_row_on_two_ranks(tmp_path, lang, data):
    """The %%writefile cell of chapter 11, launched as the chapter launches it: two gloo ranks rebuild the data,
    time the row against the row above, and train to the target seed by seed, every rank deciding alike."""
    train, val = data
    floor, prev = sr.bayes_loss(lang, val), sr.previous_token_loss(lang, val)
    above = sr.Recipe(attention="sdpa")
    spec = {"language": {"vocab": 8, "topics": 2, "successors": 2, "seed": 0}, "n_train": 2000, "n_val": 128,
            "train_seed": 1, "val_seed": 2, "fingerprint": sr.fingerprint(train), "cfg": asdict(TINY),
            "hyper": asdict(sr.Hyper(batch=32, lr=1e-2, warmup=5)), "threads": 1, "target": math.log(8) - 0.3,
            "seeds": [0, 1], "every": 5, "max_seconds": 30.0, "rounds": 3, "min_time": 0.01,
            "above": {"name": "SDPA", "recipe": asdict(above)},
            "rows": [{"name": "DDP", "recipe": asdict(replace(above, world=2))}]}
    assert floor < spec["target"] < math.log(8) and prev < math.log(8)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    worker = write_workers("11", tmp_path / "workers")["speedrun_ddp.py"]
    cmd = ah.launch.torchrun_cmd(worker, tmp_path / "spec.json", tmp_path / "out.json", nproc=2)
    run = ah.launch.launch(cmd, 240, echo=False, env=ah.parallel.rank_env(2))
    assert run.returncode == 0 and "the notebook's exactly: True" in run.output
    out = json.loads((tmp_path / "out.json").read_text())
    row = out["rows"]["DDP"]
    assert out["world"] == 2 and out["backend"] == "gloo"
    assert len(row["tokens_per_s"]) == len(row["reference"]) == 3 and row["compile_s"] is None
    assert [r["seed"] for r in row["runs"]] == [0, 1] and all(r["reached"] for r in row["runs"])


def test_the_readme_shows_the_best_recorded_time_to_target_per_hardware(tmp_path):
    root = tmp_path / "results"

    def recorded(name, hardware, seconds, profile="quick", ok=True):
        folder = root / name
        (folder / "results").mkdir(parents=True)
        chapter = {"chapter": "11", "notebook": "11_speedrun.ipynb", "ok": ok, "error": None, "seconds": 80.0}
        if profile != "quick":
            chapter["profile"] = profile
        (folder / "run.json").write_text(json.dumps({"profile": "quick", "finished": name[-10:], "hardware": hardware,
                                                     "chapters": {"11": chapter}}))
        (folder / "results" / "11.json").write_text(json.dumps([
            {"name": "best_time_to_target_s", "value": seconds, "unit": "s", "note": f"row {seconds}; {profile}",
             "spread": [seconds * 0.9, seconds * 1.1], "repeats": 2},
            {"name": "cumulative_speedup", "value": 1.5, "unit": "x", "note": "", "spread": [1.2, 1.8], "repeats": 2}]))

    cpu = {"cpu": "AMD EPYC", "cpu_cores": 2, "torch": "2.9.0", "best_device": "cpu"}
    gpu = {**cpu, "gpu": "NVIDIA H200", "gpu_memory_gb": 139.8, "best_device": "cuda"}
    assert ah.commands.course._speedrun_table(root) == []
    recorded("course_cpu_2026-12-01", cpu, 3.0)
    recorded("course_cpu_2026-12-02", cpu, 2.5)
    recorded("course_cpu_2026-12-03", cpu, 1.0, ok=False)  # a failed chapter records nothing the README shows
    recorded("device-check_gpu_2026-12-02", gpu, 0.8, profile="full")
    lines = ah.commands.course._speedrun_table(root)
    rows = [line for line in lines if line.startswith("| AMD") or line.startswith("| NVIDIA")]
    assert len(rows) == 2
    assert "| quick | 2.5 s (range 2.25 s–2.75 s, 2 repeats) | 1.5× (range 1.2×–1.8×, 2 repeats) | row 2.5; quick |" \
        in rows[0] and "course_cpu_2026-12-02/" in rows[0]
    assert rows[1].startswith("| NVIDIA H200 (139.8 GiB)") and "| full | 0.8 s" in rows[1]
    assert "\n".join(lines) in ah.commands.course.readme_tables(root)
