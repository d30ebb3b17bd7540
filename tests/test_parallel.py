"""Data parallel, run from chapter 06's own worker scripts (tests/workers.py writes its `%%writefile` cells out):
hand all-reduce == DDP == one process at world size 1, a two-node launch (each launch bounded by a timeout), DDP
training with checkpoints and the step timing, fastai's distributed path on CPU (the patch), accelerate's launchers,
FSDP2's memory, unused parameters, the all-reduce sweep and the pipeline; the helpers the chapter exports into
accelhelpers/parallel.py; and the device each rank picks (setup_rank)."""

import importlib
import json
import os
import runpy
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from workers import write_workers

import accelhelpers as ah
from accelhelpers import launch, metrics, parallel
from conftest import compat_teardown_abort

ROOT = Path(__file__).resolve().parents[1]

TIMEOUT = 150  # seconds for any launch here; they run concurrently on a possibly busy 2-core machine
SCRIPTS = ("ddp_common", "equivalence", "ddp_data", "ddp_train", "ddp_timing", "batch_sizes", "fastai_train",
           "accelerate_launchers", "fsdp", "amp_ddp", "two_heads", "native_stderr", "unused_parameters",
           "allreduce_sweep", "gpipe", "pipeline_bubble")


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict[str, Path]:
    """Chapter 06's worker scripts, written from its cells into a temporary folder."""
    return write_workers("06", tmp_path_factory.mktemp("workers06"))


def torchrun(script: Path, *args: object, nproc: int = 2) -> launch.Completed:
    """The chapter's launch: `script` on `nproc` ranks, the GPUs hidden unless each rank can have one."""
    return launch.launch(launch.torchrun_cmd(script, *args, nproc=nproc), TIMEOUT, echo=False,
                         env=parallel.rank_env(nproc))


def two_nodes(script: Path, out: Path) -> list:
    """Two torchrun launchers on this machine acting as nodes 0 and 1 of one job (c10d rendezvous on 127.0.0.1):
    the multi-node recipe of chapter 06, run for real."""
    endpoint = f"127.0.0.1:{launch.free_port()}"
    procs = [launch.start(launch.torchrun_cmd(script, out, "--steps", 6, "--batch", 8, nproc=1, nnodes=2,
                                              node_rank=i, rdzv_endpoint=endpoint), env=parallel.rank_env(1))
             for i in (0, 1)]
    return [launch.finish(p, TIMEOUT, echo=False) for p in procs]


TECHNIQUES = {"fsdp": ("--width", 64), "amp_ddp": ("--steps", 20, "--rounds", 3, "--width", 64),
              "unused_parameters": ("--rounds", 3),
              "allreduce_sweep": ("--min-log2", 10, "--max-log2", 16, "--reps", 3), "pipeline_bubble": ("--reps", 2)}


# --- launches with several processes, all started at once (they mostly wait on imports) ---------------------------

@pytest.fixture(scope="module")
def jobs(scripts, tmp_path_factory):
    """Start every multi-process job of this file in parallel threads; each result is a Run or the exception."""
    d = tmp_path_factory.mktemp("parallel")
    s = scripts
    specs = {
        "two": lambda: two_nodes(s["equivalence.py"], d / "two"),
        "ddp": lambda: torchrun(s["ddp_train.py"], d / "ddp", "--epochs", 1, "--batch", 100, "--width", 32,
                                "--bench-batches", "100,400", "--rounds", 3, "--steps", 2),
        "fastai": lambda: torchrun(s["fastai_train.py"], d / "fastai", "--epochs", 1, "--batch", 64, "--lr", 0.01),
        # one thread launches the five technique scripts one after the other, as the chapter does
        "techniques": lambda: {name: torchrun(s[f"{name}.py"], d / name, *args, nproc=2)
                               for name, args in TECHNIQUES.items()},
        "accelerate": lambda: launch.launch([sys.executable, str(s["accelerate_launchers.py"]), str(d / "acc")],
                                            TIMEOUT, echo=False, env=parallel.rank_env(2)),
    }
    results: dict = {}

    def run(name, fn):
        for attempt in (1, 2):
            try:
                results[name] = fn()
                return
            except Exception as e:
                results[name] = e
                if attempt == 1 and compat_teardown_abort(str(e)):
                    continue  # the known torch 2.14 exit-time abort: one rerun (see conftest.py)
                return

    threads = [threading.Thread(target=run, args=item) for item in specs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(len(TECHNIQUES) * TIMEOUT + 30)
    return d, results


def _ok(results, name):
    """The job's result, failing the test with its error if it raised."""
    r = results[name]
    if isinstance(r, Exception):
        pytest.fail(f"{name} failed: {r}")
    return r


def test_the_chapter_writes_every_worker_script(scripts):
    assert sorted(p.stem for p in scripts.values()) == sorted(SCRIPTS)
    for path in scripts.values():
        compile(path.read_text(), str(path), "exec")  # each is a whole, valid script


# Left to nbval: 2 ranks of batch b == 1 process of batch 2b, hand all-reduce == DDP, the control (chapter 06 cell 25).


@pytest.mark.slow
def test_two_torchrun_nodes_rendezvous_on_localhost_and_train_together(jobs):
    d, results = jobs
    runs = _ok(results, "two")
    assert [r.returncode for r in runs] == [0, 0]
    both = runs[0].output + runs[1].output
    assert "[rank0] local batch" in both and "[rank1] local batch" in both
    if parallel.rank_device(1) == "cpu":
        assert "[rank0] 2 ranks, backend gloo, on the CPU\n" in both
        assert "local batch 8 of global 16, 6 steps done on cpu" in both
    assert both.count("ranks, backend") == 1  # setup_rank: rank 0 alone announces, on either node
    two = parallel.load_weights(d / "two" / "ddp.pt")
    assert metrics.max_abs_diff(two, parallel.reference(6, 8, world=2)) < 1e-5


@pytest.mark.slow
def test_ddp_training_checkpoints_reloads_and_times_every_way(jobs):
    d, results = jobs
    run = _ok(results, "ddp")
    assert "[rank0] epoch 1: test accuracy" in run.output and "[rank1] epoch" not in run.output  # rank 0 logs
    res = json.loads((d / "ddp" / "ddp.json").read_text())
    assert res["world"] == 2 and [r["rank"] for r in res["ranks"]] == [0, 1]
    assert all(r["checkpoint_reloads_equal"] for r in res["ranks"]) and len({r["accuracy"] for r in res["ranks"]}) == 1
    assert [p.name for p in (d / "ddp" / "ckpt").iterdir() if p.suffix == ".pt"] == ["last.pt"]
    assert res["grad_bytes"] == 4 * res["params"] and res["grad_bytes"] <= res["first_bucket_bytes"]
    cpu = res["device"] == "cpu"
    assert res["backend"] == ("gloo" if cpu else "nccl")
    for b in ("100", "400"):
        t = res["bench"][b]
        assert set(t) == ({"ddp", "no_sync", "solo", "solo_all"} if cpu else {"ddp", "no_sync", "solo"})
        assert all(len(v) == 3 and min(v) > 0 for v in t.values())  # 3 rounds, the warm-up dropped
    s = parallel.scaling_summary(res)
    assert s["batch"] == 100 and s["rounds"] == 3 and s["speedup"]["median"] > 0
    assert s["speedup"]["range"][0] <= s["speedup"]["median"] <= s["speedup"]["range"][1]
    assert ("speedup_all_cores" in s) == cpu and s["sync_share"]["median"] < 1


@pytest.mark.slow
def test_fastai_path_trains_on_two_cpu_processes_with_the_patch(jobs):
    d, results = jobs
    run = _ok(results, "fastai")
    assert "[0, " not in run.output  # no per-epoch list printed by every rank
    res = json.loads((d / "fastai" / "fastai.json").read_text())
    assert res["world"] == 2 and res["ranks_equal"] and res["accuracy"] > 0.2
    # bs = 64 * num_distrib() is per process: the global batch is 64 * N * N
    assert res["num_distrib"] == 2 and res["rank_batch"] == 128 and res["global_batch"] == 64 * 2 * 2
    if not torch.cuda.is_available():
        assert res["setup_distrib"].startswith(("RuntimeError", "AssertionError"))  # torch.cuda.set_device, CPU rank


@pytest.mark.slow
def test_fsdp_amp_unused_parameters_allreduce_and_pipeline_on_two_ranks(jobs):
    d, results = jobs
    runs = _ok(results, "techniques")
    assert set(runs) == set(TECHNIQUES) and all(r.returncode == 0 for r in runs.values())
    fs = json.loads((d / "fsdp" / "fsdp.json").read_text())
    assert fs["fsdp"]["param_bytes"] < 0.6 * fs["ddp"]["param_bytes"]  # each rank holds ~1/2
    assert fs["fsdp"]["loss_after_step"] == pytest.approx(fs["ddp"]["loss_after_step"], rel=1e-4)
    assert fs["sharded"]["type"] == "DTensor" and fs["sharded"]["shape"] == [64, 64]
    assert fs["sharded"]["local_shape"] == [32, 64] and "Shard(dim=0)" in fs["sharded"]["placements"]
    amp = json.loads((d / "amp_ddp" / "amp.json").read_text())
    policy = ah.precision.policy_for(parallel.rank_device(2))  # chapter 04's choice, as amp_ddp.py makes it
    assert amp["dtype"] == str(policy.dtype).removeprefix("torch.")
    assert amp["amp"]["grad_dtype"] == amp["fp32"]["grad_dtype"] == "float32"  # autocast leaves weights fp32
    assert amp["amp"]["scaler_enabled"] == (amp["dtype"] == "float16")
    assert {k: len(v) for k, v in amp["seconds"].items()} == {"fp32": 3, "amp": 3}
    un = json.loads((d / "unused_parameters" / "unused.json").read_text())
    assert "find_unused_parameters=True" in un["default"]
    assert un["find_unused_parameters"] == un["static_graph"] == "trained 3 steps"
    assert set(un["seconds"]) == {"default", "find_unused_parameters", "static_graph"}
    # DDP's C++ warning about the flag on a model without unused parameters: captured as data, not printed
    assert any("did not find any unused parameters" in w for w in un["ddp_warnings"])
    assert "reducer.cpp" not in runs["unused_parameters"].output
    ar = json.loads((d / "allreduce_sweep" / "allreduce.json").read_text())
    assert ar["world"] == 2 and sorted(map(int, ar["seconds"])) == [2**k for k in range(10, 17)]
    assert all(t > 0 for t in ar["seconds"].values())
    assert all(lo <= ar["seconds"][n] <= hi for n, (lo, hi) in ar["range"].items())
    pipe = json.loads((d / "pipeline_bubble" / "pipeline.json").read_text())
    assert len(pipe) == 2 and pipe[0]["4"]["bubble"] == pytest.approx(1 / 5)
    assert all(0 <= r[m]["idle"] < 1 for r in pipe for m in r)
    assert all(len(r[m]["step_s"]) == 2 and min(r[m]["step_s"]) > 0 for r in pipe for m in r)  # --reps 2


@pytest.mark.slow
def test_accelerate_notebook_and_debug_launchers_use_two_cpu_processes(jobs):
    d, results = jobs
    run = _ok(results, "accelerate")
    for tag in ("notebook_launcher", "debug_launcher"):
        res = json.loads((d / "acc" / f"{tag}.json").read_text())
        assert res == {"processes": 2, "type": "DistributedType.MULTI_CPU"}
        assert run.output.count(f"[{tag}] 2 processes") == 1  # the first process reports, once


@pytest.mark.slow
def test_pipeline_refuses_other_than_two_ranks(scripts, tmp_path):
    with pytest.raises(RuntimeError, match="launch it on 2 ranks, not 1"):
        torchrun(scripts["pipeline_bubble.py"], tmp_path, nproc=1)


# --- one-process group in this process: the scripts and helpers at world size 1 -----------------------------------

@pytest.fixture
def group1(monkeypatch):
    """Environment for a 1-process gloo group here; torch threads and the group restored after."""
    threads = torch.get_num_threads()
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launch.free_port()), "USE_TORCH_XLA": "0"}.items():
        monkeypatch.setenv(k, v)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)


@pytest.fixture
def worker(scripts, monkeypatch):
    """Import one of the chapter's worker scripts as a module (their folder on sys.path, forgotten afterwards)."""
    monkeypatch.syspath_prepend(str(next(iter(scripts.values())).parent))
    yield importlib.import_module
    for name in SCRIPTS:
        sys.modules.pop(name, None)


def test_allreduce_gradients_averages_and_needs_a_group(group1):
    model = nn.Linear(3, 1)
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="no process group"):
        parallel.allreduce_gradients(model)
    ah.parallel.init_distributed("gloo", 30)
    before = model.weight.grad.clone()
    parallel.allreduce_gradients(model)
    assert torch.equal(model.weight.grad, before)  # world size 1: the average is the gradient itself


def test_equivalence_script_at_world_1_matches_reference(group1, scripts, monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(scripts["equivalence.py"].parent))
    monkeypatch.setattr(sys, "argv", ["equivalence.py", str(tmp_path), "--steps", "4", "--batch", "6"])
    try:
        runpy.run_path(str(scripts["equivalence.py"]), run_name="__main__")
    finally:
        sys.modules.pop("ddp_common", None)
    if not torch.cuda.is_available():
        assert "[rank0] 1 rank, backend gloo, on the CPU\n" in capsys.readouterr().out
    ref = parallel.reference(4, 6, world=1)
    assert metrics.max_abs_diff(parallel.load_weights(tmp_path / "ddp.pt"), ref) < 1e-6
    assert metrics.max_abs_diff(parallel.load_weights(tmp_path / "manual.pt"), ref) < 1e-6


def test_mnist1d_loader_splits_the_data_between_ranks(group1, worker):
    ah.parallel.init_distributed("gloo", 30)
    loader, data = worker("ddp_data").mnist1d_loader(batch=50)
    loader.sampler.set_epoch(0)
    first = list(loader.sampler)
    assert list(loader.sampler) == first  # no set_epoch: the same order again
    loader.sampler.set_epoch(1)
    assert len(first) == len(data.x_train) and list(loader.sampler) != first


def test_time_on_ranks_runs_alone_functions_on_rank_0_with_their_threads(group1, worker):
    ah.parallel.init_distributed("gloo", 30)
    common = worker("ddp_common")
    seen = []
    times = common.time_on_ranks({"a": lambda: seen.append(("a", torch.get_num_threads())),
                                  "b": lambda: seen.append(("b", torch.get_num_threads()))}, rounds=2, steps=3,
                                 device="cpu", alone=("b",), threads={"b": 2})
    assert {k: len(v) for k, v in times.items()} == {"a": 2, "b": 2}  # the warm-up round and the barriers dropped
    assert seen.count(("a", torch.get_num_threads())) == 9 and seen.count(("b", 2)) == 9  # 3 rounds x 3 calls
    assert common.slowest(times) == times  # one rank: its own times


def test_fsdp_vs_ddp_shards_nothing_at_world_1_and_matches_ddp(group1, worker):
    ah.parallel.init_distributed("gloo", 30)
    res = worker("fsdp").fsdp_vs_ddp(16, torch.device("cpu"))
    full = metrics.param_bytes(ah.models.mlp([16, 16, 16, 1]))
    assert res["ddp"]["param_bytes"] == res["fsdp"]["param_bytes"] == full == 4 * (2 * 16 * 16 + 16 + 16 + 16 + 1)
    assert res["fsdp"]["loss_after_step"] == pytest.approx(res["ddp"]["loss_after_step"], rel=1e-5)
    assert res["sharded"]["local_shape"] == res["sharded"]["shape"] == [16, 16]


def test_fastai_broadcast_fails_on_cpu_unpatched_and_works_patched(group1):
    import fastai.distributed as fd
    original = fd.DistributedDL._broadcast
    try:
        if not torch.cuda.is_available():
            with pytest.raises((RuntimeError, AssertionError), match="NVIDIA|CUDA|Torch not compiled"):
                original(None, [3, 1, 2], 0)
        ah.parallel.init_distributed("gloo", 30)
        assert parallel.patch_fastai_for_cpu() is True and parallel.patch_fastai_for_cpu() is False
        assert fd.DistributedDL._broadcast(None, [3, 1, 2], 0) == [3, 1, 2]
    finally:
        fd.DistributedDL._broadcast = original


def test_amp_step_keeps_fp32_weights_and_two_heads_leaves_one_head_unused(worker):
    amp_step, two_heads = worker("amp_ddp").amp_step, worker("two_heads").TwoHeads
    model = ah.models.mlp([40, 16, 10])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x, y = torch.randn(8, 40), torch.randint(0, 10, (8,))
    loss = amp_step(model, opt, scaler, x, y, torch.bfloat16)
    assert loss.dtype == torch.float32 and next(model.parameters()).grad.dtype == torch.float32
    heads = two_heads(8)
    heads(x, "a").sum().backward()
    assert heads.heads["b"].weight.grad is None and heads.heads["a"].weight.grad is not None


def test_native_stderr_catches_what_c_code_writes_to_fd_2(worker, tmp_path, capfd):
    native_stderr = worker("native_stderr").native_stderr
    with native_stderr(tmp_path / "err.txt"):
        os.write(2, b"[W reducer.cpp:1] Warning: caught here. More text\n")
    os.write(2, b"after\n")
    assert (tmp_path / "err.txt").read_text() == "[W reducer.cpp:1] Warning: caught here. More text\n"
    assert capfd.readouterr().err == "after\n"  # file descriptor 2 is back


# --- the exported helpers, without processes ----------------------------------------------------------------------

def test_scaling_summary_from_per_round_times_by_hand():
    res = {"world": 2, "batch": 10, "bench": {"10": {"ddp": [2.0, 4.0], "no_sync": [1.0, 1.0], "solo": [1.0, 1.0],
                                                      "solo_all": [1.0, 2.0]}}}
    s = parallel.scaling_summary(res)
    # per round: speed-up 2 * solo / ddp = 1.0, 0.5; against all cores solo_all / ddp = 0.5, 0.5; share 1/2, 3/4
    assert s["speedup"] == {"median": 0.75, "range": (0.5, 1.0)}
    assert s["speedup_all_cores"] == {"median": 0.5, "range": (0.5, 0.5)}
    assert s["sync_share"] == {"median": 0.625, "range": (0.5, 0.75)}
    assert s["samples_per_s"] == {"median": 7.5, "range": (5.0, 10.0)} and s["rounds"] == 2  # 20 rows / 2 or 4 s
    gpu = {**res, "bench": {"10": {k: v for k, v in res["bench"]["10"].items() if k != "solo_all"}}}
    assert "speedup_all_cores" not in parallel.scaling_summary(gpu, 10)
    with pytest.raises(ValueError, match="no timing for per-rank batch 7: ddp_train.py timed 10"):
        parallel.scaling_summary(res, 7)
    with pytest.raises(ValueError, match="no results"):
        parallel.scaling_summary({})


def test_bandwidth_definitions_and_the_ring_model():
    alg, bus = parallel.bus_bandwidth(8e6, 0.01, world=4)
    assert alg == pytest.approx(8e8) and bus == pytest.approx(8e8 * 2 * 3 / 4)  # nccl-tests' busbw factor
    assert parallel.bus_bandwidth(1e6, 1e-3, world=2) == (pytest.approx(1e9), pytest.approx(1e9))  # 2 ranks: equal
    assert parallel.ring_allreduce_seconds(1e9, 2, 1e9) == pytest.approx(1.0)
    # by hand, 8 ranks: 2 * 7 steps, each sending 1/8 of the message: 14/8 of it over each link, plus the latency
    assert parallel.ring_allreduce_seconds(1e9, 8, 1e9, latency=0.5) == pytest.approx(2 * 7 / 8 + 0.5)


def test_fit_ring_model_recovers_latency_and_bandwidth_and_refuses_bad_input():
    sizes = [2.0**k for k in range(10, 25)]
    times = [parallel.ring_allreduce_seconds(s, 4, 2e9, 3e-4) for s in sizes]
    latency, bandwidth = parallel.fit_ring_model(sizes, times, 4)
    assert latency == pytest.approx(3e-4) and bandwidth == pytest.approx(2e9)
    no_latency = [parallel.ring_allreduce_seconds(s, 2, 1e9) * (1.3 if i == 0 else 1) for i, s in enumerate(sizes)]
    assert parallel.fit_ring_model(sizes, no_latency, 2)[0] >= 0  # a negative fitted latency is set to 0
    for bad in (([1.0], [1.0], 2), (sizes, times, 1), (sizes, times[:-1], 2), (sizes, [0.0] * len(sizes), 2)):
        with pytest.raises(ValueError, match="fit_ring_model needs"):
            parallel.fit_ring_model(*bad)
    with pytest.raises(ValueError, match="do not grow"):
        parallel.fit_ring_model([1e3, 1e6], [2e-3, 1e-3], 2)


def test_spawn_hello_is_importable_by_name(capsys):
    import pickle
    assert pickle.loads(pickle.dumps(parallel.spawn_hello)) is parallel.spawn_hello  # what mp.spawn's children do
    parallel.spawn_hello(1, 2)
    assert "spawned process 1 of 2" in capsys.readouterr().out


def test_shard_and_toy_data():
    x, y = parallel.toy_data(3, 8, d_in=4)
    assert x.shape == (3, 8, 4) and y.shape == (3, 8, 1) and torch.equal(parallel.toy_data(3, 8, d_in=4)[0], x)
    assert torch.equal(torch.cat([parallel.shard(x, r, 2) for r in range(2)], dim=1), x)
    with pytest.raises(ValueError, match="divisible"):
        parallel.shard(x, 0, 3)
    assert metrics.max_abs_diff(parallel.toy_model(), parallel.toy_model()) == 0.0  # seeded


def test_sgd_train_calls_the_sync_hook_every_step():
    x, y = parallel.toy_data(2, 4)
    calls = []
    parallel.sgd_train(parallel.toy_model(), x, y, sync=lambda m: calls.append(m))
    assert len(calls) == 2


def test_train_mnist1d_learns_and_refuses_bad_input():
    assert parallel.train_mnist1d(batch=100, lr=0.05, epochs=2, warmup_epochs=0.5, width=32) > 0.2
    with pytest.raises(ValueError, match="lr > 0"):
        parallel.train_mnist1d(batch=32, lr=0.0, epochs=1)


# --- which device and backend a rank picks ------------------------------------------------------------------------

def _gpus(monkeypatch, n, per_task=False):
    """Make this machine look like one whose process sees `n` CUDA GPUs (it has none)."""
    hw = ah.device.Hardware("cuda" if n else "cpu", "NVIDIA A100-SXM4-80GB" if n else None, (8, 0) if n else None,
                            80.0 if n else None, n, per_task)
    monkeypatch.setattr(ah.device.Hardware, "here", classmethod(lambda cls, device=None: hw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)


def test_ranks_use_gpus_only_with_one_gpu_each(monkeypatch):
    """nccl refuses two ranks on one GPU ("Duplicate GPU detected"): one Colab GPU and two ranks means CPU ranks
    with gloo and the GPU hidden from them. (The GPUs are faked: this machine has none.)"""
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)
    _gpus(monkeypatch, 1)
    assert parallel.rank_device(2) == "cpu" and parallel.rank_env(2) == {"CUDA_VISIBLE_DEVICES": ""}
    assert parallel.rank_device(1) == "cuda" and parallel.rank_env(1) == {}
    _gpus(monkeypatch, 1, per_task=True)  # a notebook in a task Slurm bound one GPU: its own ranks still share it
    assert parallel.rank_device(2) == "cpu"
    _gpus(monkeypatch, 2)
    assert parallel.rank_device(2) == "cuda"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parallel.rank_device() == "cpu"  # inside a launched rank: WORLD_SIZE ranks


def test_accel_device_cpu_means_cpu_ranks(monkeypatch):
    monkeypatch.setenv("ACCEL_DEVICE", "cpu")
    assert ah.device.Hardware.here().kind == "cpu" and parallel.rank_device(1) == "cpu"


def test_no_gpu_means_cpu_ranks_and_nothing_hidden(monkeypatch):
    """A machine without a GPU (faked here, so the test means the same on a GPU machine): every rank on the CPU,
    and CUDA_VISIBLE_DEVICES left alone, as there is nothing to hide."""
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)
    _gpus(monkeypatch, 0)
    assert [parallel.rank_device(n) for n in (1, 2)] == ["cpu", "cpu"]
    assert parallel.rank_env(1) == parallel.rank_env(2) == {}


@pytest.fixture
def fake_group(monkeypatch):
    """setup_rank's choice without a process group: init_distributed records the backend it is asked for."""
    asked = []
    monkeypatch.setattr(ah.parallel, "init_distributed", lambda backend, timeout_s: asked.append(backend) or (0, 2))
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)
    for k, v in {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    return asked


def test_setup_rank_without_cuda_joins_with_gloo_on_the_cpu(fake_group, monkeypatch, capsys):
    _gpus(monkeypatch, 0)
    assert parallel.setup_rank(5.0) == (0, 2, torch.device("cpu"))
    assert fake_group == ["gloo"] and capsys.readouterr().out == "[rank0] 2 ranks, backend gloo, on the CPU\n"
    parallel.setup_rank(5.0, announce=False)
    assert capsys.readouterr().out == ""


def test_setup_rank_announces_on_rank_0_only(fake_group, monkeypatch, capsys):
    _gpus(monkeypatch, 0)
    monkeypatch.setattr(ah.parallel, "init_distributed", lambda backend, timeout_s: (1, 2))  # this process: rank 1
    assert parallel.setup_rank(5.0) == (1, 2, torch.device("cpu"))
    assert capsys.readouterr().out == ""


def test_setup_rank_takes_gpu_local_rank_with_nccl_when_each_rank_has_one(fake_group, monkeypatch, capsys):
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    _gpus(monkeypatch, 2)
    assert parallel.setup_rank(5.0) == (0, 2, torch.device("cuda", 1))  # LOCAL_RANK 1: the second GPU
    assert fake_group == ["nccl"] and chosen == [torch.device("cuda", 1)]
    assert capsys.readouterr().out == "[rank0] 2 ranks, backend nccl, one GPU per rank\n"
    _gpus(monkeypatch, 1, per_task=True)  # Slurm --gpus-per-task=1: the task sees its own GPU only, as cuda:0
    assert parallel.setup_rank(5.0, announce=False)[2] == torch.device("cuda", 0) and fake_group[-1] == "nccl"
    _gpus(monkeypatch, 1)  # two ranks, one GPU: both on the CPU
    assert parallel.setup_rank(5.0, announce=False)[2] == torch.device("cpu") and fake_group[-1] == "gloo"


def test_chapter_06_broadcast_cell_runs_where_cuda_works(monkeypatch, capsys):
    """On a GPU `.cuda()` succeeds and `dist.broadcast` raises ValueError (no process group): the chapter's cell
    must print that, not stop *Run all*. `.cuda()` is made to succeed here (no GPU on this machine)."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "06_distributed_data_parallel.ipynb", as_version=4)
    cell = next(c.source for c in nb.cells if "fd.DistributedDL._broadcast(None" in c.source)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    exec(cell, {"inspect": __import__("inspect")})
    out = capsys.readouterr().out
    assert "on this machine: ValueError: Default process group has not been initialized" in out
