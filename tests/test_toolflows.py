"""accelhelpers.toolflows (exported from chapter 10's cells) against the runtimes' own references: torchao vs fp32
PyTorch, OpenVINO vs ONNX Runtime on the same file and inputs, LiteRT's int8 I/O arithmetic and the chapter's own
converter script, Brevitas -> QONNX -> hls4ml bit for bit, QAT's fine-tuning control; and the messages for a missing
tool or bad input."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import accelhelpers as ah
from accelhelpers import toolflows
from tests.workers import write_workers


def _mlp(sizes=(40, 64, 32, 10), seed=0):
    torch.manual_seed(seed)
    return ah.models.mlp(list(sizes)).eval()


def _x(rows=64, cols=40, seed=1):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _needs(*tools):
    missing = [t for t in tools if importlib.util.find_spec(t) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


# ------------------------------------------------------------------------------------------ missing tools
def test_unknown_tool_names_the_known_ones():
    with pytest.raises(ValueError, match="torchao"):
        ah.tools.have("tensorflow")


def test_a_missing_tool_raises_with_its_exact_install_line(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ah.tools.ToolMissing, match=r"missing openvino, nncf — openvino: pip install openvino; "
                                                     r"nncf: pip install nncf\. The rest of the chapter still runs"):
        ah.tools.require("openvino", "nncf")


def test_litert_torch_missing_points_at_the_separate_environment(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(ah.tools, "edge_python", lambda root=None: None)
    assert not ah.tools.have("litert_torch")
    with pytest.raises(ah.tools.ToolMissing, match="make venv-edge"):
        toolflows.litert_convert_int8(_mlp(), _x().numpy(), tmp_path / "m.tflite", tmp_path / "litert_convert.py")


def test_litert_python_is_this_one_where_litert_torch_imports_else_the_edge_environment(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "litert_torch" else real(name))
    assert toolflows.litert_python() == Path(sys.executable)
    exe = tmp_path / ".venv-edge" / "bin" / "python"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "litert_torch" else real(name))
    monkeypatch.setattr(ah.tools, "edge_python", lambda root=None: exe)
    assert toolflows.litert_python() == exe


def test_litert_conversion_refuses_bad_calibration_rows_and_a_missing_script(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="calibration rows"):
        toolflows.litert_convert_int8(_mlp(), np.zeros((1, 40), np.float32), tmp_path / "m.tflite", tmp_path / "s.py")
    monkeypatch.setattr(toolflows, "litert_python", lambda: Path(sys.executable))
    with pytest.raises(FileNotFoundError, match="%%writefile"):
        toolflows.litert_convert_int8(_mlp(), _x().numpy(), tmp_path / "m.tflite", tmp_path / "absent.py")


def test_edge_python_is_none_without_the_environment_and_found_with_it(tmp_path):
    assert ah.tools.edge_python(tmp_path) is None
    exe = tmp_path / ".venv-edge" / "bin" / "python"
    exe.parent.mkdir(parents=True)
    exe.touch()
    assert ah.tools.edge_python(tmp_path) == exe


def test_the_chapters_converter_script_explains_its_usage(tmp_path):
    script = write_workers("10", tmp_path)["litert_convert.py"]
    done = subprocess.run([sys.executable, str(script), "model.pt2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "usage: python litert_convert.py MODEL.pt2 CALIB.npy OUT.tflite"


def test_fingerprint_names_shapes_and_dtypes_and_takes_bf16_weights():
    x = _x().numpy()
    assert toolflows.fingerprint(_mlp(), x) != toolflows.fingerprint(_mlp(), x.reshape(32, 80))  # the same bytes
    assert toolflows.fingerprint(_mlp().to(torch.bfloat16), x) != toolflows.fingerprint(_mlp(), x)


def test_fingerprint_follows_the_weights_and_the_calibration_rows(tmp_path):
    m, x = _mlp(), _x().numpy()
    key = toolflows.fingerprint(m, x)
    assert key == toolflows.fingerprint(_mlp(), x.copy())
    assert key != toolflows.fingerprint(m, x[:10])
    with torch.no_grad():
        m[0].weight[0, 0] += 1e-3
    assert key != toolflows.fingerprint(m, x)
    assert not toolflows.converted_from(tmp_path / "none.tflite", m, x)


# ------------------------------------------------------------------------------------------------ torchao
@pytest.mark.slow
@_needs("torchao")
@pytest.mark.parametrize("kind, tol", [("int8_dynamic", 0.15), ("int8_weight_only", 0.1)])
def test_torchao_int8_stays_close_to_fp32_and_leaves_the_original_alone(kind, tol):
    m, x = _mlp(), _x()
    q = toolflows.torchao_quantize(m, kind)
    with torch.no_grad():
        ref, out = m(x), q(x)
    assert (out - ref).abs().max().item() < tol
    assert set(toolflows.quantized_layers(m).values()) == {"Parameter"}
    assert "Parameter" not in set(toolflows.quantized_layers(q).values())


@pytest.mark.slow
@_needs("torchao")
def test_torchao_int4_quantizes_only_the_layers_its_cpu_kernel_takes():
    m = _mlp((40, 64, 32, 10))
    q = toolflows.torchao_quantize(m, "int4_weight_only", group_size=32)
    kinds = toolflows.quantized_layers(q)
    assert kinds["0"] == "Parameter"        # 40 inputs: not a multiple of the group
    assert kinds["2"] != "Parameter"        # 64 -> 32: taken
    assert kinds["4"] == "Parameter"        # 10 outputs: not a multiple of 16
    assert [toolflows.int4_fits(layer) for layer in m if isinstance(layer, nn.Linear)] == [False, True, False]


@_needs("torchao")
def test_a_torchao_built_for_another_torch_is_reported_as_missing_with_the_matching_release(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # what an ImportError at import looks like
    with pytest.raises(ah.tools.ToolMissing, match=r"does not work with torch .*torchao==0\.14\.1"):
        toolflows.torchao_config("int8_dynamic")


def test_torchao_unknown_kind():
    with pytest.raises(ValueError, match="int8_dynamic"):
        toolflows.torchao_config("int2")


# ---------------------------------------------------------------------------------------- OpenVINO + NNCF
@pytest.fixture(scope="module")
def onnx_mlp(tmp_path_factory):
    if any(importlib.util.find_spec(t) is None for t in ("onnx", "onnxscript", "onnxruntime")):
        pytest.skip("ONNX tools not installed")
    m = _mlp()
    return m, ah.deploy.export_onnx(m, _x(2), tmp_path_factory.mktemp("onnx") / "mlp.onnx")


@pytest.mark.slow
@_needs("openvino")
def test_openvino_fp32_equals_onnx_runtime_on_the_same_file_and_inputs(onnx_mlp):
    _, path = onnx_mlp
    x = _x(300).numpy()
    y_ov = toolflows.openvino_run(toolflows.openvino_compile(path), x)
    y_ort = ah.deploy.ort_run(ah.deploy.ort_session(path), x)
    assert y_ov.shape == y_ort.shape == (300, 10)
    np.testing.assert_allclose(y_ov, y_ort, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@_needs("openvino", "nncf")
def test_nncf_int8_runs_int8_kernels_and_keeps_the_argmax(onnx_mlp, tmp_path):
    m, path = onnx_mlp
    x = _x(500, seed=3).numpy()
    model = toolflows.nncf_quantize(path, x[:256])
    compiled = toolflows.openvino_compile(model)
    with torch.no_grad():
        ref = m(torch.from_numpy(x)).numpy()
    assert ah.metrics.agreement(toolflows.openvino_run(compiled, x), ref)["argmax_agreement"] >= 0.9
    kernels = toolflows.openvino_kernels(compiled)
    assert "FakeQuantize" in kernels or any("i8" in p or "u8" in p for ps in kernels.values() for p in ps)
    size = toolflows.openvino_save(model, tmp_path / "int8")
    assert size == (tmp_path / "int8.xml").stat().st_size + (tmp_path / "int8.bin").stat().st_size


@pytest.mark.slow
@_needs("openvino", "nncf")
def test_nncf_quantize_hands_rich_its_jupyter_setting_back(onnx_mlp):
    import rich

    console = rich.get_console()
    before = console.is_jupyter
    try:
        console.is_jupyter = True  # as in a notebook: NNCF's bar would be a widget
        toolflows.nncf_quantize(onnx_mlp[1], _x(128, seed=4).numpy())
        assert console.is_jupyter is True
    finally:
        console.is_jupyter = before


@_needs("openvino", "nncf")
def test_nncf_needs_calibration_rows(onnx_mlp):
    with pytest.raises(ValueError, match="calibration"):
        toolflows.nncf_quantize(onnx_mlp[1], np.zeros((0, 40), np.float32))


# ------------------------------------------------------------------------------------------------- LiteRT
class _FakeInterpreter:
    """The slice of LiteRT's Interpreter that litert_run uses: int8 in, int8 out, output = input * 2 (as int8)."""

    def __init__(self, shape, in_q=(0.05, 3), out_q=(0.1, -2)):
        self.shape, self.in_q, self.out_q, self.resized = list(shape), in_q, out_q, []

    def get_input_details(self):
        return [{"index": 0, "shape": np.array(self.shape), "dtype": np.int8, "quantization": self.in_q}]

    def get_output_details(self):
        return [{"index": 1, "shape": np.array(self.shape), "dtype": np.int8, "quantization": self.out_q}]

    def resize_tensor_input(self, index, shape):
        self.resized.append(tuple(shape))
        self.shape = list(shape)

    def allocate_tensors(self):
        pass

    def set_tensor(self, index, value):
        self.value = value

    def invoke(self):
        pass

    def get_tensor(self, index):
        return self.value


def test_litert_run_quantizes_the_input_and_dequantizes_the_output_with_their_own_parameters():
    x = np.array([[0.0, 1.0, -1.0, 100.0], [0.04, -0.06, 0.5, -100.0]], np.float32)
    fake = _FakeInterpreter((1, 4))
    y = ah.toolflows.litert_run(fake, x)
    assert fake.resized == [(2, 4)]
    q = np.clip(np.round(x / 0.05) + 3, -128, 127).astype(np.int8)
    np.testing.assert_array_equal(fake.value, q)
    np.testing.assert_allclose(y, (q.astype(np.float32) + 2) * np.float32(0.1))


def test_native_stderr_is_silenced_in_the_block_and_restored_after(capfd):
    with toolflows.native_stderr_silenced():
        os.write(2, b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


@pytest.mark.slow
@pytest.mark.skipif(not (importlib.util.find_spec("ai_edge_litert") and ah.tools.have("litert_torch")),
                    reason="needs ai-edge-litert and litert-torch (here or in .venv-edge: make venv-edge)")
def test_the_chapters_script_converts_to_a_full_integer_model_that_keeps_the_argmax(tmp_path, capfd):
    m, x = _mlp(), _x(256, seed=6).numpy()
    script = write_workers("10", tmp_path / "workers")["litert_convert.py"]
    path = toolflows.litert_convert_int8(m, x, tmp_path / "m.tflite", script)
    assert toolflows.converted_from(path, m, x)
    ops = toolflows.litert_ops(path)
    assert ops["FULLY_CONNECTED"] == ["int8"]
    interp = toolflows.litert_interpreter(path)
    assert interp.get_input_details()[0]["dtype"] == np.int8
    y = toolflows.litert_run(interp, x)
    with torch.no_grad():
        ref = m(torch.from_numpy(x)).numpy()
    assert ah.metrics.agreement(y, ref)["argmax_agreement"] >= 0.9
    assert "XNNPACK" not in capfd.readouterr().err
    stamp = path.with_suffix(".sha256").read_text()
    assert toolflows.litert_convert_int8(m, x, path, tmp_path / "gone.py") == path  # current: kept, not re-run
    assert path.with_suffix(".sha256").read_text() == stamp


@_needs("ai_edge_litert")
def test_litert_interpreter_reports_a_bad_file(tmp_path):
    bad = tmp_path / "bad.tflite"
    bad.write_bytes(b"not a flatbuffer")
    with pytest.raises(ValueError):
        toolflows.litert_interpreter(bad)


# ------------------------------------------------------------------------------ Brevitas -> QONNX -> hls4ml
def test_brevitas_mlp_refuses_bad_sizes():
    with pytest.raises(ValueError, match="bits >= 2"):
        toolflows.brevitas_mlp([40], 4)


@_needs("brevitas")
def test_brevitas_ptq_checks_the_shapes():
    with pytest.raises(ValueError, match="differ"):
        toolflows.brevitas_ptq(_mlp((40, 8, 10)), [40, 16, 10], 4, _x(8))


@_needs("brevitas")
def test_brevitas_ptq_holds_the_fp32_weights_on_a_power_of_two_grid():
    m = _mlp((40, 16, 10))
    q = toolflows.brevitas_ptq(m, [40, 16, 10], 4, _x(256))
    layer = q[1]
    w = layer.quant_weight()
    scale = float(w.scale.detach())
    assert np.log2(scale) == round(np.log2(scale))                       # power of two: ap_fixed holds it
    ints = (w.value / w.scale).detach().numpy()
    assert np.array_equal(ints, np.round(ints)) and ints.min() >= -8 and ints.max() <= 7   # 4-bit signed
    assert torch.equal(layer.weight, m[0].weight)                        # fp32 weights copied, quantized on the fly


@pytest.mark.slow
@_needs("brevitas", "onnxoptimizer", "qonnx", "hls4ml")
@pytest.mark.skipif(not ah.tools.have("g++"), reason="g++ not installed")
def test_hls4ml_firmware_from_qonnx_equals_the_brevitas_model_bit_for_bit(tmp_path):
    sizes = [40, 8, 10]
    q = toolflows.brevitas_ptq(_mlp(sizes), sizes, 4, _x(256))
    path = toolflows.export_qonnx(q, _x(1), tmp_path / "q.onnx")
    hm = toolflows.hls_from_qonnx(toolflows.qonnx_for_hls4ml(path), tmp_path / "hls")
    x = _x(200, seed=5).numpy()
    np.testing.assert_array_equal(ah.deploy.hls_predict(hm, x), toolflows.brevitas_logits(q, x))
    assert any("fixed<4," in t for t in toolflows.hls_typedefs(hm))


@_needs("brevitas")
def test_finetune_trains_a_copy_repeatably_and_leaves_the_original_alone():
    m, x, y = _mlp((40, 16, 10)), _x(256), torch.arange(256) % 10
    before = {k: v.clone() for k, v in m.state_dict().items()}
    a = toolflows.finetune(m, x, y, epochs=2, seed=3)
    b = toolflows.finetune(m, x, y, epochs=2, seed=3)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())       # original untouched
    assert not a.training and all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    assert not torch.equal(a[0].weight, m[0].weight)                                # trained
    c = toolflows.finetune(m, x, y, epochs=2, seed=4)
    assert not torch.equal(a[0].weight, c[0].weight)                                # the seed orders the batches


@_needs("brevitas")
def test_qat_and_its_control_differ_only_in_the_quantizers_during_training():
    """QAT = finetune(PTQ model); control = PTQ(finetune(fp32 model)): same function, epochs and seed. Both end as
    Brevitas models on the power-of-two grid; they differ, and the control's weights are the fine-tuned fp32 ones."""
    sizes, x, y = [40, 16, 10], _x(256), torch.arange(256) % 10
    fp32 = _mlp(sizes)
    ptq = toolflows.brevitas_ptq(fp32, sizes, 4, x)
    qat = toolflows.finetune(ptq, x, y, epochs=2, seed=1)
    tuned = toolflows.finetune(fp32, x, y, epochs=2, seed=1)
    control = toolflows.brevitas_ptq(tuned, sizes, 4, x)
    assert torch.equal(control[1].weight, tuned[0].weight)
    assert not torch.equal(qat[1].weight, control[1].weight)
    for model in (qat, control):
        w = model[1].quant_weight()
        ints = (w.value / w.scale).detach().numpy()
        assert np.array_equal(ints, np.round(ints)) and ints.min() >= -8 and ints.max() <= 7
    assert toolflows.brevitas_logits(qat, x).shape == toolflows.brevitas_logits(control, x).shape == (256, 10)
