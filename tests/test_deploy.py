"""Tests for accelhelpers.deploy (exported from chapter 08): int8 by hand against ONNX Runtime, ONNX export, ONNX
Runtime's quantizers, fixed point and hls4ml against its NumPy model."""

import contextlib
import io
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch import nn

import accelhelpers as ah

needs_ort = pytest.mark.skipif(not all(ah.tools.have(t) for t in ("onnx", "onnxscript", "onnxruntime")),
                               reason="onnx/onnxscript/onnxruntime not installed")
needs_hls = pytest.mark.skipif(not all(ah.tools.have(t) for t in ("hls4ml", "g++")),
                               reason="hls4ml or g++ not installed")


@pytest.fixture(scope="module")
def blobs():
    """A small separable 3-class problem with 6 features."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 6, generator=g) * 3
    y = torch.arange(600) % 3
    x = centers[y] + torch.randn(600, 6, generator=g) * 0.5
    return x, y


@pytest.fixture(scope="module")
def trained(blobs):
    x, y = blobs
    torch.manual_seed(0)
    return ah.deploy.fit_classifier(ah.models.mlp([6, 16, 16, 3]), x, y, epochs=5, batch_size=64, lr=1e-2, threads=1)


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory, blobs, trained):
    """The trained MLP exported once (the dynamo exporter takes seconds)."""
    return ah.deploy.export_onnx(trained, blobs[0][:2], tmp_path_factory.mktemp("onnx") / "m.onnx")


# ------------------------------------------------------------------------------------------- tools
def test_have_and_require(monkeypatch):
    assert ah.tools.have("g++") == (shutil.which("g++") is not None)
    with pytest.raises(ValueError, match="unknown tool"):
        ah.tools.have("vivado")
    monkeypatch.setattr(ah.tools.shutil, "which", lambda name: None)
    monkeypatch.setattr(ah.tools.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ah.tools.ToolMissing, match=r"hls4ml, g\+\+ .*pip install hls4ml.*apt-get install g\+\+"):
        ah.tools.require("hls4ml", "g++")
    with pytest.raises(ah.tools.ToolMissing, match="pip install onnxruntime"):
        ah.deploy.ort_session("model.onnx")
    with pytest.raises(ah.tools.ToolMissing, match="still runs"):
        ah.deploy.hls_convert(ah.models.mlp([2, 2]), 2, "unused")


# ---------------------------------------------------------------------------------- training, metrics
def test_fit_classifier_learns(blobs, trained):
    x, y = blobs
    assert not trained.training
    threads = torch.get_num_threads()
    ah.deploy.fit_classifier(ah.models.mlp([6, 3]), x, y, epochs=1, threads=1)
    assert torch.get_num_threads() == threads  # restored after training
    assert ah.metrics.accuracy(trained(x).detach(), y) > 0.95
    with pytest.raises(ValueError, match="labels"):
        ah.deploy.fit_classifier(ah.models.mlp([6, 3]), x, y[:10], epochs=1)


@pytest.mark.slow
def test_fit_classifier_is_the_plain_adamw_one_cycle_loop(blobs):
    """train.fit with OneCycleLR as its scheduler takes exactly the steps of the loop written out."""
    x, y = blobs
    torch.manual_seed(0)
    ours = ah.deploy.fit_classifier(ah.models.mlp([6, 8, 3]), x, y, epochs=2, batch_size=50, lr=1e-2, seed=3, threads=1)
    torch.manual_seed(0)
    ref = ah.models.mlp([6, 8, 3])
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 1e-2, total_steps=2 * -(-len(x) // 50))
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        for idx in torch.randperm(len(x), generator=gen).split(50):
            loss = nn.functional.cross_entropy(ref(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    assert ah.metrics.max_abs_diff(ours, ref) == 0.0


# ------------------------------------------------------------------------------------ int8 by hand
def test_qparams_uint8_and_symmetric_int8():
    qp = ah.deploy.qparams(-1.0, 3.0)
    assert (qp.qmin, qp.qmax, qp.zero_point) == (0, 255, 64)
    assert qp.scale == pytest.approx(4 / 255, rel=1e-6)
    qs = ah.deploy.qparams(-0.5, 0.25, signed=True, symmetric=True)
    assert (qs.qmin, qs.qmax, qs.zero_point) == (-127, 127, 0)
    assert qs.scale == pytest.approx(0.5 / 127, rel=1e-6)
    assert ah.deploy.qparams(0.5, 2.0).zero_point == 0  # range widened to include 0
    assert ah.deploy.qparams(0.0, 0.0).scale == 1.0
    with pytest.raises(ValueError, match="x_min <= x_max"):
        ah.deploy.qparams(1.0, 0.0)


def test_calib_batches_are_float32_slices_and_no_rows_name_the_caller():
    batches = ah.deploy.calib_batches(torch.ones(130, 3, dtype=torch.float64), 64, "X")
    assert [len(b) for b in batches] == [64, 64, 2]
    assert all(b.dtype == np.float32 and b.flags.c_contiguous for b in batches)
    with pytest.raises(ValueError, match="NNCF needs calibration rows"):
        ah.deploy.calib_batches(np.zeros((0, 3)), 64, "NNCF")


def test_quantize_dequantize_round_trip():
    x = np.linspace(-1, 3, 101, dtype=np.float32)
    qp = ah.deploy.qparams(-1.0, 3.0)
    q = ah.deploy.quantize(x, qp)
    assert q.dtype == np.uint8
    assert np.abs(ah.deploy.dequantize(q, qp) - x).max() <= qp.scale / 2 + 1e-6
    assert ah.deploy.quantize(np.array([100.0]), qp)[0] == 255  # saturates instead of wrapping
    assert ah.deploy.quantize(np.array([0.3]), ah.deploy.qparams(-1, 1, signed=True, symmetric=True)).dtype == np.int8


def test_int8_linear_int32_accumulation():
    rng = np.random.default_rng(0)
    x, w, b = rng.normal(size=(5, 7)), rng.normal(size=(3, 7)), rng.normal(size=3)
    out = ah.deploy.int8_linear(x, w, b)
    ref = (out["xq"].astype(np.int64) - out["qx"].zero_point) @ out["wq"].astype(np.int64).T
    assert out["acc"].dtype == np.int32 and np.array_equal(out["acc"], ref)
    assert np.abs(out["y"] - (x @ w.T + b)).max() < 0.1
    with pytest.raises(ValueError, match="matching 'in'"):
        ah.deploy.int8_linear(x, w[:, :3])


def test_int8_forward_rejects_other_layers():
    with pytest.raises(TypeError, match="Linear and ReLU"):
        ah.deploy.int8_forward(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), np.zeros((1, 2)))


# ------------------------------------------------------------------------------------- ONNX, ORT
def test_state_dict_and_onnx_bytes(tmp_path):
    model = ah.models.mlp([10, 20, 5])
    n = sum(p.numel() for p in model.parameters())
    assert 4 * n < ah.deploy.state_dict_bytes(model) < 4 * n + 4000
    with pytest.raises(FileNotFoundError, match="export"):
        ah.deploy.onnx_bytes(tmp_path / "none.onnx")
    (tmp_path / "m.onnx").write_bytes(b"12")
    (tmp_path / "m.onnx.data").write_bytes(b"345")
    assert ah.deploy.onnx_bytes(tmp_path / "m.onnx") == 5


# Left to nbval at full size: fp32 parity, int8 ops, int8 by hand == ORT (chapter 08 cells 25, 35, 37); here 16 rows.
@needs_ort
def test_onnx_export_parity_and_int8_by_hand_equals_ort(tmp_path, blobs, trained, onnx_path):
    x, _ = blobs
    path = onnx_path
    sess = ah.deploy.ort_session(path, threads=1)
    xs = x[:16].numpy()
    with torch.no_grad():
        ref = trained(x[:16]).numpy()
    assert np.abs(ah.deploy.ort_run(sess, xs) - ref).max() < 1e-4  # fp32 parity, any batch size (dynamic dim)
    assert ah.deploy.ort_run(sess, xs[:1]).shape == (1, 3)
    dyn = ah.deploy.quantize_onnx_dynamic(path, tmp_path / "dyn.onnx")
    assert ah.deploy.onnx_bytes(dyn) < ah.deploy.onnx_bytes(path)
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= _ops(dyn)  # activations quantized per call
    ort_int8 = ah.deploy.ort_run(ah.deploy.ort_session(dyn, threads=1), xs)
    assert np.array_equal(ah.deploy.int8_forward(trained, xs), ort_int8)  # the arithmetic by hand is ORT's, bit for bit


@pytest.mark.slow
@needs_ort
def test_static_quantization(tmp_path, blobs, onnx_path):
    x, y = blobs
    path = onnx_path
    st = ah.deploy.quantize_onnx_static(path, tmp_path / "st.onnx", x[:200].numpy())
    out = ah.deploy.ort_run(ah.deploy.ort_session(st, threads=1), x.numpy())
    assert ah.metrics.accuracy(out, y) > 0.95
    assert (tmp_path / "st.pre.onnx").exists()  # preprocessed first
    assert {"QuantizeLinear", "DequantizeLinear"} <= _ops(st) and "DynamicQuantizeLinear" not in _ops(st)  # QDQ
    with pytest.raises(ValueError, match="calibration"):
        ah.deploy.quantize_onnx_static(path, tmp_path / "st2.onnx", np.zeros((0, 6), np.float32))


@needs_ort
def test_static_quantization_reads_every_calibration_batch(tmp_path, onnx_path, blobs):
    """The calibration reader hands over every batch: an extreme value in the last one sets the input's range."""
    import onnx
    from onnx import numpy_helper

    calib = blobs[0][:200].numpy().copy()
    calib[199, 0] = 50.0  # batch 64: rows 192-199 are the fourth and last batch
    st = onnx.load(ah.deploy.quantize_onnx_static(onnx_path, tmp_path / "st.onnx", calib, batch=64))
    inits = {t.name: numpy_helper.to_array(t) for t in st.graph.initializer}
    q_in = next(n for n in st.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "x")
    expect = ah.deploy.qparams(float(calib.min()), 50.0)  # MinMax calibration, uint8 activations
    assert float(inits[q_in.input[1]]) == pytest.approx(expect.scale, rel=1e-5)
    assert int(inits[q_in.input[2]]) == expect.zero_point


def _ops(path):
    import onnx

    return {n.op_type for n in onnx.load(str(path)).graph.node}


# ------------------------------------------------------------------------------------ fixed point
def test_parse_fixed():
    assert ah.deploy.parse_fixed("ap_fixed<16,6>") == (16, 6)
    assert ah.deploy.parse_fixed("fixed<8, 3, RND, SAT>") == (8, 3)
    with pytest.raises(ValueError, match="fixed-point type"):
        ah.deploy.parse_fixed("float")


def test_to_fixed_truncates_and_wraps():
    got = ah.deploy.to_fixed([0.3, -0.3, 7.99, 8.0, -8.0], "ap_fixed<8,4>")  # LSB 1/16, range [-8, 8)
    assert np.array_equal(got, [0.25, -0.3125, 7.9375, -8.0, -8.0])
    assert np.array_equal(ah.deploy.to_fixed([0.3], "ap_fixed<8,4,AP_TRN,AP_WRAP>"), [0.25])
    with pytest.raises(ValueError, match="AP_TRN/AP_WRAP"):
        ah.deploy.to_fixed([0.3], "ap_fixed<8,4,AP_RND,AP_SAT>")


def test_as_written_moves_a_value_just_below_a_grid_point_as_hls4mls_decimal_text_does():
    # ap_fixed<4,1>: grid 1/8, written with 3 decimals; 0.1249999 is written "0.125" and truncates to 0.125, not 0
    t = torch.tensor([0.1249999, 0.3, -0.2])  # float32 parameters, as a model holds them
    written = ah.deploy._as_written(t, "ap_fixed<4,1>")
    assert written[0] == 0.125 and written[1:].tolist() == t[1:].double().tolist()  # only values near a grid point
    assert ah.deploy.to_fixed(written, "ap_fixed<4,1>")[0] == 0.125
    assert ah.deploy.to_fixed(t.numpy(), "ap_fixed<4,1>")[0] == 0.0  # the float itself truncates one step lower


def test_int_bits():
    assert [ah.deploy.int_bits(v) for v in (0, 0.5, 0.99, 1.0, 3.9, 4.0)] == [1, 1, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="non-negative"):
        ah.deploy.int_bits(-1)


def test_layer_ranges(trained, blobs):
    x, _ = blobs
    rows = ah.deploy.layer_ranges(trained, x)
    assert [r["kind"] for r in rows] == ["Input", "Linear", "ReLU", "Linear", "ReLU", "Linear"]
    lin = trained[0]
    assert rows[1]["w_absmax"] == pytest.approx(float(torch.cat([lin.weight.flatten(), lin.bias]).detach().abs().max()))
    with torch.no_grad():
        assert rows[-1]["out_absmax"] == pytest.approx(float(trained(x).abs().max()))
    for r in rows:
        assert 2.0 ** (r["out_int_bits"] - 1) > r["out_absmax"]


def test_multipliers():
    rows = ah.deploy.multipliers(ah.models.mlp([40, 64, 10]), reuse_factor=4)
    assert rows == [{"layer": "0", "products": 2560, "multipliers": 640},
                    {"layer": "2", "products": 640, "multipliers": 160}]
    with pytest.raises(ValueError, match="reuse_factor"):
        ah.deploy.multipliers(ah.models.mlp([2, 2]), 0)


def test_fixed_forward_close_to_float_at_high_precision(trained, blobs):
    x, _ = blobs
    with torch.no_grad():
        ref = trained(x).numpy()
    assert np.abs(ah.deploy.fixed_forward(trained, x.numpy(), "ap_fixed<32,12>") - ref).max() < 1e-3
    assert np.abs(ah.deploy.fixed_forward(trained, x.numpy(), "ap_fixed<8,3>") - ref).max() > 1e-2
    with pytest.raises(TypeError, match="Linear and ReLU"):
        ah.deploy.fixed_forward(nn.Sequential(nn.Tanh()), np.zeros((1, 2)))


@needs_hls
def test_hls_config_overrides():
    cfg = ah.deploy.hls_config(ah.models.mlp([4, 8, 3]), 4, "ap_fixed<12,5>", reuse_factor=2,
                               per_layer={"0": "ap_fixed<12,2>"})
    assert cfg["LayerName"]["_0"]["Precision"]["weight"] == "ap_fixed<12,2>"
    assert cfg["LayerName"]["_0"]["Precision"]["result"] == "auto"  # accumulator width stays lossless
    assert cfg["LayerName"]["_0"]["ReuseFactor"] == 2
    with pytest.raises(KeyError, match="no layer '7'"):
        ah.deploy.hls_config(ah.models.mlp([4, 8, 3]), 4, per_layer={"7": "ap_fixed<8,2>"})
    with pytest.raises(ValueError, match="fixed-point"):
        ah.deploy.hls_config(ah.models.mlp([4, 8, 3]), 4, "float32")


# Left to nbval: hls4ml == the NumPy firmware model, bit for bit (chapter 08 cells 76, 82); its project (cells 88, 90).
def test_hls_sweep_refuses_no_precisions_and_unmatched_overrides(trained, blobs, tmp_path):
    xs = blobs[0][:4].numpy()
    with pytest.raises(ValueError, match="at least one"):
        ah.deploy.hls_sweep(trained, 6, xs, [], tmp_path)
    with pytest.raises(ValueError, match="per-layer"):
        ah.deploy.hls_sweep(trained, 6, xs, ["ap_fixed<8,3>"], tmp_path, per_layer=[None, None])


@pytest.mark.slow
@needs_hls
def test_hls_conversions_in_threads_do_not_break_each_others_trace(tmp_path):
    # torch.fx patches nn.Module process-wide while it traces; unserialized, about 1 conversion in 20 failed here
    import sys
    import threading

    model, start = ah.models.mlp([6, 16, 16, 3]), threading.Barrier(2)

    def convert(folder):
        start.wait()  # both threads trace at the same moment, as hls_sweep's first two projects do
        return ah.deploy.hls_convert(model, 6, folder, compile=False, quiet=False)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often, as they do when one of them writes a file
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # once, around the threads, as hls_sweep does
            for r in range(40):
                with ThreadPoolExecutor(2) as pool:
                    assert all(pool.map(convert, [tmp_path / f"r{r}a", tmp_path / f"r{r}b"]))
    finally:
        sys.setswitchinterval(switch)
