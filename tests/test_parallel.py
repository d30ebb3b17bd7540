"""Data parallel: hand all-reduce == DDP == one process with the global batch, torchrun and two-node launches (each
bounded by a timeout), fastai's distributed path on CPU (the patch), accelerate's launchers, FSDP2 memory."""

import json
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from accelhelpers import launch, metrics, parallel
from conftest import compat_teardown_abort

ROOT = Path(__file__).resolve().parents[1]

TIMEOUT = 150  # seconds for any launch here; they run concurrently on a possibly busy 2-core machine


def two_nodes(out: Path) -> list:
    """Two torchrun launchers on this machine acting as nodes 0 and 1 of one job (c10d rendezvous on 127.0.0.1):
    the multi-node recipe of chapter 06, run for real."""
    endpoint = f"127.0.0.1:{launch.free_port()}"
    procs = [launch.start(launch.torchrun_cmd("accelhelpers.parallel", "equivalence", out, "--steps", 6, "--batch", 8,
                                              nproc=1, nnodes=2, node_rank=i, rdzv_endpoint=endpoint))
             for i in (0, 1)]
    return [launch.finish(p, TIMEOUT, echo=False) for p in procs]


# --- launches with several processes, all started at once (they mostly wait on imports) ---------------------------

@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Start every multi-process job of this file in parallel threads; each result is a Run or the exception."""
    d = tmp_path_factory.mktemp("parallel")
    specs = {
        "eq": lambda: parallel.torchrun("equivalence", d / "eq", "--steps", "6", "--batch", "8", timeout_s=TIMEOUT,
                                 echo=False),
        "two": lambda: two_nodes(d / "two"),
        "fastai": lambda: parallel.torchrun("fastai_train", d / "fastai", "--epochs", "1", "--batch", "64",
                                            "--lr", "0.01", timeout_s=TIMEOUT, echo=False),
        "techniques": lambda: parallel.torchrun("techniques", d / "tech", "--steps", "20", "--rounds", "2",
                                                "--width", "64", timeout_s=TIMEOUT, echo=False),
        "accelerate": lambda: launch.launch([sys.executable, "-m", "accelhelpers.parallel", "accelerate_launchers",
                                             str(d / "acc")], timeout_s=TIMEOUT, echo=False),
    }
    results: dict = {}

    def run(name, fn):
        for attempt in (1, 2):
            try:
                results[name] = fn()
                return
            except Exception as e:  # noqa: BLE001  (reported by the test that needs it)
                results[name] = e
                if attempt == 1 and compat_teardown_abort(str(e)):
                    continue  # the known torch 2.14 exit-time abort: one rerun (see conftest.py)
                return

    threads = [threading.Thread(target=run, args=item) for item in specs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 30)
    return d, results


def _ok(results, name):
    """The job's result, failing the test with its error if it raised."""
    r = results[name]
    if isinstance(r, Exception):
        pytest.fail(f"{name} failed: {r}")
    return r


def test_two_ranks_of_batch_b_equal_one_process_of_batch_2b(jobs):
    d, results = jobs
    run = _ok(results, "eq")
    assert "[rank0]" in run.output and "[rank1]" in run.output  # both ranks' logs streamed back
    manual, ddp = parallel.load_weights(d / "eq" / "manual.pt"), parallel.load_weights(d / "eq" / "ddp.pt")
    ref = parallel.reference(6, 8, world=2)
    assert metrics.max_abs_diff(manual, ddp) < 1e-6
    assert metrics.max_abs_diff(ddp, ref) < 1e-5
    # the check can fail: one process with the per-rank batch alone is a different training run
    assert metrics.max_abs_diff(ddp, parallel.reference(6, 8, world=1)) > 1e-3


def test_two_torchrun_nodes_rendezvous_on_localhost_and_train_together(jobs):
    d, results = jobs
    runs = _ok(results, "two")
    assert [r.returncode for r in runs] == [0, 0]
    assert "[rank0]" in runs[0].output + runs[1].output and "[rank1]" in runs[0].output + runs[1].output
    two = parallel.load_weights(d / "two" / "ddp.pt")
    assert metrics.max_abs_diff(two, parallel.reference(6, 8, world=2)) < 1e-5


def test_fastai_guide_path_trains_on_two_cpu_processes_with_the_patch(jobs):
    d, results = jobs
    _ok(results, "fastai")
    res = json.loads((d / "fastai" / "fastai.json").read_text())
    assert res["world"] == 2 and res["ranks_equal"] and res["accuracy"] > 0.2
    # the guide's bs = 64 * num_distrib() is per process: the global batch is 64 * N * N
    assert res["num_distrib"] == 2 and res["rank_batch"] == 128 and res["global_batch"] == 64 * 2 * 2
    if not torch.cuda.is_available():
        assert res["setup_distrib"].startswith("RuntimeError")  # torch.cuda.set_device on a CPU rank


def test_techniques_fsdp_amp_unused_parameters_allreduce_and_pipeline_on_two_ranks(jobs):
    d, results = jobs
    _ok(results, "techniques")
    res = json.loads((d / "tech" / "techniques.json").read_text())
    amp = res["amp"]
    assert amp["dtype"] == ("float16" if parallel.rank_device(2) == "cuda" else "bfloat16")
    assert amp["amp"]["grad_dtype"] == amp["fp32"]["grad_dtype"] == "float32"  # autocast leaves weights fp32
    assert amp["amp"]["scaler_enabled"] == (amp["dtype"] == "float16")
    assert res["fsdp"]["fsdp"]["param_bytes"] < 0.6 * res["fsdp"]["ddp"]["param_bytes"]  # each rank holds ~1/2
    assert res["fsdp"]["fsdp"]["loss_after_step"] == pytest.approx(res["fsdp"]["ddp"]["loss_after_step"], rel=1e-4)
    assert "find_unused_parameters=True" in res["unused"]["default"]
    assert res["unused"]["find_unused_parameters"] == res["unused"]["static_graph"] == "trained 3 steps"
    assert set(res["unused"]["step_ms"]) == {"default", "find_unused_parameters", "static_graph"}
    assert len(res["allreduce"]["seconds"]) == 8 and all(t > 0 for t in res["allreduce"]["seconds"].values())
    assert len(res["pipeline"]) == 2 and res["pipeline"][0]["4"]["theory"] == pytest.approx(1 / 5)
    assert all(0 <= r[m]["bubble"] < 1 for r in res["pipeline"] for m in r)


def test_accelerate_notebook_and_debug_launchers_use_two_cpu_processes(jobs):
    d, results = jobs
    _ok(results, "accelerate")
    for tag in ("notebook_launcher", "debug_launcher"):
        res = json.loads((d / "acc" / f"{tag}.json").read_text())
        assert res == {"processes": 2, "type": "DistributedType.MULTI_CPU"}


# --- one-process group in this process: the workers and helpers at world size 1 ----------------------------------

@pytest.fixture
def group1(monkeypatch):
    """Environment for init_distributed to form a 1-process gloo group here; torch threads restored after."""
    threads = torch.get_num_threads()
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(launch.free_port()), "USE_TORCH_XLA": "0"}.items():
        monkeypatch.setenv(k, v)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)


def test_allreduce_gradients_averages_and_needs_a_group(group1):
    model = nn.Linear(3, 1)
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="no process group"):
        parallel.allreduce_gradients(model)
    from accelhelpers.faults import init_distributed
    init_distributed("gloo", 30)
    before = model.weight.grad.clone()
    parallel.allreduce_gradients(model)
    assert torch.equal(model.weight.grad, before)  # world size 1: the average is the gradient itself


def test_equivalence_worker_at_world_1_matches_reference(group1, tmp_path):
    parallel.main(["equivalence", str(tmp_path), "--steps", "4", "--batch", "6"])
    ref = parallel.reference(4, 6, world=1)
    assert metrics.max_abs_diff(parallel.load_weights(tmp_path / "ddp.pt"), ref) < 1e-6
    assert metrics.max_abs_diff(parallel.load_weights(tmp_path / "manual.pt"), ref) < 1e-6


def test_ddp_train_worker_checkpoints_reloads_and_times(group1, tmp_path):
    parallel.main(["ddp_train", str(tmp_path), "--epochs", "1", "--batch", "100", "--width", "32", "--steps", "3",
            "--bench-batches", "100,400"])
    res = json.loads((tmp_path / "ddp_world1.json").read_text())
    assert res[0]["checkpoint_reloads_equal"] and res[0]["accuracy"] > 0.15
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.suffix == ".pt"] == ["step_00000001.pt"]
    s = parallel.scaling_summary(res)
    assert s["world"] == 1 and s["samples_per_s"] == pytest.approx(100 / res[0]["bench"]["100"]["step_s"])
    assert 0 <= s["comm_share"] < 1
    assert parallel.scaling_summary(res, 400)["samples_per_s"] == pytest.approx(400 / res[0]["bench"]["400"]["step_s"])
    with pytest.raises(ValueError, match="no timing for per-rank batch 7"):
        parallel.scaling_summary(res, 7)
    with pytest.raises(ValueError, match="no results"):
        parallel.scaling_summary([])


def test_fsdp_vs_ddp_shards_nothing_at_world_1_and_matches_ddp(group1):
    from accelhelpers.faults import init_distributed
    init_distributed("gloo", 30)
    res = parallel.fsdp_vs_ddp(16)
    full = metrics.param_bytes(parallel.mlp([16, 16, 16, 1]))
    assert res["ddp"]["param_bytes"] == res["fsdp"]["param_bytes"] == full == 4 * (2 * 16 * 16 + 16 + 16 + 16 + 1)
    assert res["fsdp"]["loss_after_step"] == pytest.approx(res["ddp"]["loss_after_step"], rel=1e-5)


def test_fastai_broadcast_fails_on_cpu_unpatched_and_works_patched(group1):
    import fastai.distributed as fd
    original = fd.DistributedDL._broadcast
    try:
        if not torch.cuda.is_available():
            with pytest.raises((RuntimeError, AssertionError), match="NVIDIA|CUDA|Torch not compiled"):
                original(None, [3, 1, 2], 0)
        from accelhelpers.faults import init_distributed
        init_distributed("gloo", 30)
        assert parallel.patch_fastai_for_cpu() is True and parallel.patch_fastai_for_cpu() is False
        assert fd.DistributedDL._broadcast(None, [3, 1, 2], 0) == [3, 1, 2]
    finally:
        fd.DistributedDL._broadcast = original


# --- helpers without processes ------------------------------------------------------------------------------------

def test_bandwidth_definitions_and_the_ring_model():
    alg, bus = parallel.bus_bandwidth(8e6, 0.01, world=4)
    assert alg == pytest.approx(8e8) and bus == pytest.approx(8e8 * 2 * 3 / 4)  # nccl-tests' busbw factor
    assert parallel.bus_bandwidth(1e6, 1e-3, world=2) == (pytest.approx(1e9), pytest.approx(1e9))  # 2 ranks: equal
    assert parallel.ring_allreduce_seconds(1e9, 2, 1e9) == pytest.approx(1.0)
    assert parallel.ring_allreduce_seconds(1e9, 8, 1e9, latency=0.5) == pytest.approx(2 * 7 / 8 + 0.5)


def test_amp_step_keeps_fp32_weights_and_two_heads_leaves_one_head_unused():
    model = parallel.mlp([40, 16, 10])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x, y = torch.randn(8, 40), torch.randint(0, 10, (8,))
    loss = parallel.amp_step(model, opt, scaler, x, y, torch.bfloat16)
    assert loss.dtype == torch.float32 and next(model.parameters()).grad.dtype == torch.float32
    heads = parallel.TwoHeads(8)
    heads(x, "a").sum().backward()
    assert heads.heads["b"].weight.grad is None and heads.heads["a"].weight.grad is not None


def test_spawn_hello_is_importable_by_name(capsys):
    import pickle
    assert pickle.loads(pickle.dumps(parallel.spawn_hello)) is parallel.spawn_hello  # what mp.spawn's children do
    parallel.spawn_hello(1, 2)
    assert "spawned process 1 of 2" in capsys.readouterr().out


def test_torchrun_refuses_an_unknown_worker():
    with pytest.raises(ValueError, match="unknown worker 'nope'"):
        parallel.torchrun("nope")


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


def test_mnist1d_loader_splits_the_data_between_ranks(group1):
    from accelhelpers.faults import init_distributed
    init_distributed("gloo", 30)
    loader, data = parallel.mnist1d_loader(batch=50)
    loader.sampler.set_epoch(0)
    first = list(loader.sampler)
    loader.sampler.set_epoch(1)
    assert len(first) == len(data.x_train) and list(loader.sampler) != first



def test_ranks_use_gpus_only_with_one_gpu_each(monkeypatch):
    """nccl refuses two ranks on one GPU ("Duplicate GPU detected"): one Colab GPU and two ranks means CPU ranks
    with gloo and the GPU hidden from them. (The GPU counts are faked: this machine has none.)"""
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert parallel.rank_device(2) == "cpu" and parallel.rank_env(2) == {"CUDA_VISIBLE_DEVICES": ""}
    assert parallel.rank_device(1) == "cuda" and parallel.rank_env(1) == {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert parallel.rank_device(2) == "cuda"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parallel.rank_device() == "cpu"  # inside a launched rank: WORLD_SIZE ranks
    monkeypatch.setenv("ACCEL_DEVICE", "cpu")
    assert parallel.rank_device(1) == "cpu"


def test_no_gpu_means_cpu_ranks_and_nothing_hidden(monkeypatch):
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)
    if not torch.cuda.is_available():
        assert parallel.rank_device(2) == "cpu" and parallel.rank_env(2) == {}


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
