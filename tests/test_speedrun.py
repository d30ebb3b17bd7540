"""Chapter 11's speedrun (accelhelpers.speedrun, exported from notebooks/11_speedrun.ipynb): the synthetic language and
its exact floor, the GPT (shapes, causality, SDPA == attention written out, weight tying), the FLOP count by hand and
against torch's counter, MFU, the row machinery (a new row needs no other edit), training to a target (and a target
that cannot be reached), the chapter's own DDP worker, and the README's table of recorded times to target."""

import json
import math
from dataclasses import asdict

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
    # 2000 tokens/s x 1536 FLOPs per token = 3.072 MFLOP/s, over 2 ranks x 1.536 MFLOP/s = 1.0
    assert sr.mfu(2000.0, 1536, 1.536e-3, world=2) == pytest.approx(1.0)
    assert sr.mfu(2000.0, 1536, 3.072e-3) == pytest.approx(1.0)


@pytest.mark.parametrize(("name", "fp32", "half"), [
    ("Tesla T4", 8.1e3, ("fp16", 65e3)), ("NVIDIA A100-SXM4-40GB", 19.5e3, ("bf16", 312e3)),
    ("NVIDIA H100 80GB HBM3", 67e3, ("bf16", 989e3)), ("NVIDIA H100 PCIe", 51e3, ("bf16", 756e3)),
    ("NVIDIA L4", 30.3e3, ("bf16", 121e3)), ("Tesla P100-PCIE-16GB", 9.3e3, ("fp16", 18.7e3))])
def test_datasheet_peaks_by_the_names_cuda_reports(name, fp32, half):
    peaks = sr.datasheet_peaks(name)
    assert peaks["fp32"] == pytest.approx(fp32) and peaks[half[0]] == pytest.approx(half[1])


def test_no_datasheet_peak_for_a_cpu_or_an_unknown_gpu():
    assert sr.datasheet_peaks(None) is None and sr.datasheet_peaks("NVIDIA GeForce RTX 4090") is None
    assert "bf16" not in sr.datasheet_peaks("Tesla T4")  # a T4 has no bf16 tensor cores


def test_rows_plan_skip_and_refuse_bad_switches():
    rows = [sr.Row("SDPA", {"attention": "sdpa"}), sr.Row("flash", {"backend": "flash"}),
            sr.Row("DDP", {"world": 4}), sr.Row("graphs", {"compile": "reduce-overhead"}),
            sr.Row("mine", {"lr_scale": 2.0})]
    planned = sr.plan(rows, ah.device.Hardware("cpu"), devices=2)
    assert [p.skipped for p in planned] == [
        None, "skipped: needs CUDA (a GPU's SDPA backend)", "skipped: needs 4 devices, 2 here",
        "skipped: needs CUDA (CUDA graphs)", None]
    assert [p.world for p in planned if p.skipped is None] == [1, 1]
    on_gpu = sr.plan(rows, ah.device.Hardware("cuda", capability=(8, 0), gpus=4), devices=4)
    assert [p.skipped for p in on_gpu] == [None] * 5 and [p.world for p in on_gpu] == [1, 1, 4, 4, 4]
    with pytest.raises(ValueError, match="changes colour: a row can change attention, backend, precision"):
        sr.Row("x", {"colour": "red"})
    with pytest.raises(ValueError, match=r"precision='fp8' \(use one of 'fp32', 'mixed'\)"):
        sr.Row("x", {"precision": "fp8"})
    with pytest.raises(ValueError, match="batch_scale=0"):
        sr.Row("x", {"batch_scale": 0})
    with pytest.raises(ValueError, match="backend='flash' needs attention='sdpa'"):
        sr.Recipe(backend="flash")


def stub_run(seconds):
    """run(trainer, seed) whose time to target is seconds(recipe, seed), 100 steps, always reached."""
    return lambda tr, seed: sr.TargetRun(seed, True, 100, seconds(tr.recipe, seed), 1.0, 100 * 32, 1)


def test_a_change_is_kept_only_where_it_is_faster_on_every_seed_and_the_next_builds_on_the_stack(stub_trainer):
    def seconds(r, seed):  # SDPA helps on every seed; mixed helps on all but seed 2; fused helps everywhere
        t = 10.0 * (0.8 if r.attention == "sdpa" else 1) * (0.7 if r.optimizer == "fused" else 1)
        return t * (0.9 if r.precision == "mixed" and seed != 2 else 1.05 if r.precision == "mixed" else 1)

    rows = [sr.Row("SDPA", {"attention": "sdpa"}), sr.Row("mixed", {"precision": "mixed"}),
            sr.Row("flash", {"backend": "flash"}), sr.Row("fused", {"optimizer": "fused"})]
    seen = []
    final, trials = sr.keep_what_helps(rows, stub_trainer(sr.Recipe()), stub_trainer, [0, 1, 2, 3, 4],
                                       stub_run(seconds), ah.device.Hardware("cpu"), 1, report=seen.append)
    assert [t.kept for t in trials] == [True, False, False, True] and seen == trials
    assert final.recipe == sr.Recipe(attention="sdpa", optimizer="fused")  # mixed and the skipped flash not carried
    assert [r.seconds for r in trials[3].stack_runs] == [8.0] * 5  # the stack run again beside the candidate
    assert trials[2].skipped == "skipped: needs CUDA (a GPU's SDPA backend)" and trials[2].recipe is None
    assert trials[3].recipe == sr.Recipe(attention="sdpa", optimizer="fused")
    assert trials[0].ratios() == pytest.approx([1.25] * 5) and [r.seed for r in trials[1].runs] == [0, 1, 2, 3, 4]
    assert sr.decision(trials[0]).startswith("kept: time to target 1.25x faster (1.25-1.25x) over 5 seeds")
    assert "dropped: time to target 1.11x, no measured difference (0.95-1.11x)" in sr.decision(trials[1])
    assert sr.decision(trials[1]).endswith("steps to target 100 -> 100")


def test_a_failing_or_unreached_candidate_is_dropped_and_the_others_go_on(stub_trainer):
    def build(recipe):
        if recipe.optimizer == "fused":
            raise RuntimeError("fused AdamW is not here\nsecond line")
        return stub_trainer(recipe)

    def run(tr, seed):
        reached = tr.recipe.lr_scale == 1.0
        return sr.TargetRun(seed, reached, 100, 5.0 if tr.recipe.compile else 10.0, 1.0, 3200, 1)

    rows = [sr.Row("fused", {"optimizer": "fused"}), sr.Row("lr x9", {"lr_scale": 9.0}),
            sr.Row("compile", {"compile": "default"})]
    cpu = ah.device.Hardware("cpu")
    final, trials = sr.keep_what_helps(rows, stub_trainer(sr.Recipe()), build, [0, 1], run, cpu, 1)
    assert sr.decision(trials[0]) == "failed: RuntimeError: fused AdamW is not here"
    assert sr.decision(trials[1]) == "dropped: reached the target on 0 of 2 seeds"
    assert trials[2].kept and final.recipe == sr.Recipe(compile="default")


def test_paired_runs_alternate_the_order_seed_by_seed(stub_trainer):
    order = []

    def run(tr, seed):
        order.append((tr.recipe.attention, seed))
        return sr.TargetRun(seed, True, 1, 1.0, 1.0)

    stack, cand = stub_trainer(sr.Recipe()), stub_trainer(sr.Recipe(attention="sdpa"))
    sr.paired_runs(stack, cand, [0, 1, 2], run)
    assert order == [("plain", 0), ("sdpa", 0), ("sdpa", 1), ("plain", 1), ("plain", 2), ("sdpa", 2)]


def test_next_check_comes_sooner_near_the_target():
    assert sr.next_check(10, 2.0, 1.0, every=10, near=0.1, near_every=2) == 20  # far: every 10 steps
    assert sr.next_check(20, 1.09, 1.0, every=10, near=0.1, near_every=2) == 22  # within 0.1: every 2
    assert sr.next_check(20, 1.11, 1.0, every=10, near=0.1, near_every=2) == 30


@pytest.mark.slow
def test_train_to_an_easy_target_and_not_to_an_impossible_one(lang, data):
    train, val = data
    floor = sr.bayes_loss(lang, val)
    tr = sr.Trainer(sr.Recipe(attention="sdpa"), TINY, sr.Hyper(batch=32, lr=1e-2, warmup=5), train, "cpu")
    target = math.log(TINY.vocab) - 0.7  # reached after the first check at 8 steps
    easy = sr.run_to_target(tr, 0, val, target, every=8, max_seconds=30)
    assert easy.reached and easy.loss <= target and easy.seconds > 0 and easy.steps % 8 == 0
    assert easy.resolution == 8 and easy.tokens == easy.steps * 32 * TINY.context
    again = sr.run_to_target(tr, 0, val, target, every=8, max_seconds=30)
    assert (again.steps, again.loss) == (easy.steps, easy.loss)  # same seed: same start, same batches
    every = sr.run_to_target(tr, 0, val, target, every=1, max_seconds=30)
    near = sr.run_to_target(tr, 0, val, target, every=8, max_seconds=30, near=10.0, near_every=1)
    assert near.steps == every.steps <= easy.steps and near.resolution == 1  # the first step below, found again
    impossible = sr.run_to_target(tr, 1, val, floor - 0.1, every=5, max_seconds=0.5)
    assert not impossible.reached and impossible.loss > floor - 0.1 and impossible.seconds >= 0.5
    with pytest.raises(ValueError, match="every, near_every >= 1 and max_seconds > 0"):
        sr.run_to_target(tr, 0, val, 1.0, every=0, max_seconds=1)
    with pytest.raises(RuntimeError, match="world=2 runs in 2 ranks that torchrun started"):
        sr.Trainer(sr.Recipe(world=2), TINY, sr.Hyper(), train, "cpu")


@pytest.mark.slow
def test_a_new_row_is_tried_and_tabled_without_other_edits(data):
    """The exercise: append a Row; keep_what_helps, Trainer, warm_up, step_memory, run_to_target and table take it."""
    train, val = data
    rows = [sr.Row("mixed", {"precision": "mixed"}), sr.Row("flash", {"backend": "flash"})]
    rows.append(sr.Row("lr x2", {"lr_scale": 2.0}))  # the learner's row

    def build(recipe):
        return sr.Trainer(recipe, TINY, sr.Hyper(batch=16, lr=1e-2, warmup=5), train, "cpu")

    def run(tr, seed):
        return sr.run_to_target(tr, seed, val, math.log(TINY.vocab) - 0.2, 5, 30)

    base = build(sr.Recipe())
    final, trials = sr.keep_what_helps(rows, base, build, [0, 1], run, ah.device.Hardware("cpu"), 1)
    record = sr.Trial("the record", "-", final.recipe)
    record.stack_runs, record.runs = sr.paired_runs(base, final, [0, 1], run)
    lines = sr.table(trials, record, sr.flops_per_token(TINY), {"fp32": 50.0, "bf16": 100.0}).splitlines()
    assert len(lines) == 2 + 1 + len(rows) + 1 and lines[-2].startswith("lr x2") and lines[2].startswith("baseline")
    assert "skipped: needs CUDA" in lines[-3] and lines[-1].startswith("the record")
    assert trials[-1].recipe.lr_scale == 2.0 and trials[-1].recipe.backend is None  # the skipped flash not carried
    assert trials[0].peak_bytes > 0 and all(r.reached for r in trials[-1].runs)


@pytest.mark.slow
def test_the_chapters_ddp_worker_carries_on_from_the_stack_on_two_ranks(tmp_path, lang, data):
    """The %%writefile cell of chapter 11, launched as the chapter launches it: two gloo ranks rebuild the data, try
    the DDP candidate on the notebook's stack seed by seed (the one-process stack on rank 0), every rank deciding
    alike, and run the record when the stack ends on several ranks."""
    train, val = data
    floor, prev = sr.bayes_loss(lang, val), sr.previous_token_loss(lang, val)
    spec = {"language": {"vocab": 8, "topics": 2, "successors": 2, "seed": 0}, "n_train": 2000, "n_val": 128,
            "train_seed": 1, "val_seed": 2, "fingerprint": sr.fingerprint(train), "cfg": asdict(TINY),
            "hyper": asdict(sr.Hyper(batch=32, lr=1e-2, warmup=5)), "threads": 1, "target": math.log(8) - 0.3,
            "seeds": [0, 1], "every": 5, "near": 0.1, "near_every": 1, "max_seconds": 30.0, "devices": 2,
            "baseline": asdict(sr.Recipe()), "stack": asdict(sr.Recipe(attention="sdpa")),
            "rows": [{"name": "DDP", "change": {"world": 2}},
                     {"name": "graphs", "change": {"compile": "max-autotune"}}]}
    assert floor < spec["target"] < math.log(8) and prev < math.log(8)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    worker = write_workers("11", tmp_path / "workers")["speedrun_ddp.py"]
    cmd = ah.launch.torchrun_cmd(worker, tmp_path / "spec.json", tmp_path / "out.json", nproc=2)
    run = ah.launch.launch(cmd, 240, echo=False, env=ah.parallel.rank_env(2))
    assert run.returncode == 0 and "the notebook's exactly: True" in run.output
    out = json.loads((tmp_path / "out.json").read_text())
    ddp, graphs = (sr.Trial.from_dict(t) for t in out["trials"])
    assert out["world"] == 2 and out["backend"] == "gloo" and graphs.skipped == "skipped: needs CUDA (CUDA graphs)"
    assert ddp.recipe == sr.Recipe(attention="sdpa", world=2) and ddp.compile_s is None
    assert [r.seed for r in ddp.runs] == [r.seed for r in ddp.stack_runs] == [0, 1] and ddp.ran
    assert out["stack"] == asdict(ddp.recipe if ddp.kept else sr.Recipe(attention="sdpa"))
    if ddp.kept:  # the record needs the ranks: the worker runs it
        record = sr.Trial.from_dict(out["record"])
        assert record.recipe == sr.Recipe(**out["stack"]) and len(record.ratios()) == 2
    else:  # a one-process stack's record is the notebook's to run
        assert out["record"] is None


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
            {"name": "record_time_to_target_s", "value": seconds, "unit": "s", "note": f"row {seconds}; {profile}",
             "spread": [seconds * 0.9, seconds * 1.1], "repeats": 5},
            {"name": "record_speedup", "value": 1.5, "unit": "x", "note": "", "spread": [1.2, 1.8], "repeats": 5}]))

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
    assert "| quick | 2.5 s (range 2.25 s–2.75 s, 5 repeats) | 1.5× (range 1.2×–1.8×, 5 repeats) | row 2.5; quick |" \
        in rows[0] and "course_cpu_2026-12-02/" in rows[0]
    assert rows[1].startswith("| NVIDIA H200 (139.8 GiB)") and "| full | 0.8 s" in rows[1]
    assert "\n".join(lines) in ah.commands.course.readme_tables(root)
