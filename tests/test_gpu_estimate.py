"""tools/gpu_estimate.py: the counting mode prices each op by the roofline, the setup cell's picks scale each cell,
and the README's table is the recorded estimate."""

import json

import pytest
import torch

from tools import gpu_estimate as ge

# A GPU whose three limits are easy to read: 1 GFLOP/s fp32, 2 GFLOP/s half, 1 GB/s, a 1 ms launch.
TOY = {"toy": {"fp32": 1e9, "half": 2e9, "bandwidth": 1e9, "launch": 1e-3}}


def test_a_matmul_is_counted_and_priced_by_the_roofline():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with ge.Count(TOY) as c:
        a @ b
    flops, nbytes = 2 * 64 * 32 * 16, (64 * 32 + 32 * 16 + 64 * 16) * 4
    assert (c.ops, c.flops, c.bytes) == (1, flops, nbytes)
    assert c.gpu_s["toy"] == pytest.approx(max(flops / 1e9, nbytes / 1e9, 1e-3))  # 65.5 us of FLOPs < the launch
    big = torch.randn(256, 256)
    with ge.Count(TOY) as c:
        big @ big
    assert c.gpu_s["toy"] == pytest.approx(2 * 256**3 / 1e9)  # FLOP-bound: 33.6 ms


def test_half_precision_ops_use_the_half_peak_and_copies_the_bandwidth():
    big = torch.randn(256, 256, dtype=torch.bfloat16)
    with ge.Count(TOY) as c:
        big @ big
    assert c.gpu_s["toy"] == pytest.approx(2 * 256**3 / 2e9)
    x = torch.randn(1_000_000)
    with ge.Count(TOY) as c:
        x.clone()
    assert c.flops == 0 and c.gpu_s["toy"] == pytest.approx(8e6 / 1e9)  # 4 MB read + 4 MB written


def test_parameters_count_and_traced_fake_tensors_do_not():
    layer, x = torch.nn.Linear(32, 16), torch.randn(64, 32)
    with ge.Count(TOY) as c:
        layer(x).sum().backward()
    assert c.flops == 2 * (2 * 64 * 32 * 16)  # the forward and the weight's gradient (x needs none)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.randn(256, 256)
    with ge.Count(TOY) as c:
        fake @ fake  # what torch.export traces runs on no device
    assert c.ops == 0 and c.gpu_s["toy"] == 0


def test_a_view_costs_no_kernel():
    a = torch.randn(64, 32)
    with ge.Count(TOY) as c:
        a.t()
    assert c.ops == 1 and c.bytes == 0 and c.gpu_s["toy"] == 0


NB = {"cells": [
    {"cell_type": "code", "source": "EPOCHS = S.pick(EPOCHS, quick=2, full=20, smoke=1)\n"
                                    "SEEDS = S.pick(SEEDS, quick=[0], full=[0, 1, 2, 3], smoke=[0, 1])\n"
                                    "WIDTH = S.pick(WIDTH, quick=8, full=64)\n"
                                    "MIN_TIME = S.pick(MIN_TIME, quick=0.1, full=0.5, smoke=0.01)"},
    {"cell_type": "markdown", "source": "A function that uses EPOCHS:"},
    {"cell_type": "code", "source": "def train(seed):\n    return [seed] * EPOCHS"},
    {"cell_type": "code", "source": "%%time\nfor s in SEEDS:\n    train(s)"},
    {"cell_type": "code", "source": "bench(MIN_TIME, WIDTH)"},
    {"cell_type": "code", "source": "plot()"},
]}


def test_each_cell_is_scaled_by_the_picks_it_uses_through_earlier_functions():
    picks = ge.picks(NB)
    assert {k: v["ratio"] for k, v in picks.items()} == {"EPOCHS": 20, "SEEDS": 2, "WIDTH": 1, "MIN_TIME": 50}
    assert [k for k, v in picks.items() if v["budget"]] == ["MIN_TIME"]
    used = ge.names_by_cell(NB)
    assert {"EPOCHS", "SEEDS", "train"} <= used[2] and "SEEDS" not in used[1]


def test_a_work_cell_is_priced_and_a_budget_cell_keeps_its_time(tmp_path):
    path = tmp_path / "99_toy.ipynb"
    path.write_text(json.dumps(NB))
    rec = lambda wall, op_s, gpu: {"wall": wall, "op_s": op_s, "ops": 1, "flops": 0, "bytes": 0,
                                   "gpu_s": {"T4": gpu, "A100": gpu / 2}}
    counted = {"cells": [rec(9e9, 0, 0), rec(0, 0, 0), rec(0, 0, 0), rec(3.0, 2.0, 0.1), rec(1.0, 0.9, 0.5),
                         rec(0.2, 0, 0)]}
    est = ge.estimate(path, counted)
    # the training cell: host 1 s once + GPU 0.1 s x 20 (its longest loop, the epochs; the seeds' x2 is left out);
    # the benchmark: 1 s x 50 (its budget); the plot: 0.2 s as measured
    assert est["full_s"]["T4"] == pytest.approx(1.0 + 0.1 * 20 + 50 + 0.2)
    assert est["full_s"]["A100"] == pytest.approx(1.0 + 0.05 * 20 + 50 + 0.2)
    assert est["parts"]["budget"] == pytest.approx(50)
    assert est["smoke_s_here"] == pytest.approx(4.2)


def test_the_readme_table_is_the_recorded_estimate():
    data = json.loads(ge.OUT.read_text())
    readme = (ge.ROOT / "README.md").read_text()
    inside = readme.split(ge.README_BEGIN, 1)[1].split(ge.README_END, 1)[0].strip()
    assert inside == ge.table(data), "README's GPU estimate is stale: python tools/gpu_estimate.py --readme"
    skipped = {k for k, row in data["chapters"].items() if "skipped" in row}
    assert sorted(data["chapters"]) == sorted(p.name[:2] for p in ge.nbexport.chapters()) and skipped == {"07"}
