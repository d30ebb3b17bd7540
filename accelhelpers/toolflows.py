"""Deployment toolflows beyond ONNX Runtime: torchao, OpenVINO + NNCF, LiteRT (full-integer int8), and the
quantization-aware FPGA flow Brevitas -> QONNX -> hls4ml. Tools are imported when needed (`deploy.require`);
LiteRT's converter cannot share the course's pinned environment and runs in `.venv-edge` (`make venv-edge`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import os
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import checkpoint, deploy
from .deploy import ToolMissing, require

# ------------------------------------------------------------------------------------------------- torchao
TORCHAO_KINDS = ("int8_dynamic", "int8_weight_only", "int4_weight_only")


def torchao_config(kind: str, group_size: int = 32) -> Any:
    """torchao's config object for `kind`: int8 dynamic activations + int8 weights, int8 weight-only, or int4
    weight-only (packed for the CPU's int4 kernel, one scale per `group_size` weights)."""
    if kind not in TORCHAO_KINDS:
        raise ValueError(f"unknown torchao kind {kind!r}: choose one of {', '.join(TORCHAO_KINDS)}")
    require("torchao")
    try:
        from torchao.quantization import (
            Int4WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
        )
    except ImportError as e:  # a torchao release built for another torch (0.18 with torch 2.9, say)
        from importlib.metadata import version

        raise ToolMissing(f"torchao {version('torchao')} does not work with torch {torch.__version__} ({e}); install "
                          "the torchao release built for your torch (torch 2.9: pip install 'torchao==0.14.1')") from e

    if kind == "int8_dynamic":
        return Int8DynamicActivationInt8WeightConfig()
    if kind == "int8_weight_only":
        return Int8WeightOnlyConfig()
    return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="opaque")


def int4_fits(layer: nn.Module, group_size: int = 32) -> bool:
    """Whether the CPU int4 kernel takes this Linear: outputs a multiple of 16, inputs a multiple of the group."""
    return isinstance(layer, nn.Linear) and layer.out_features % 16 == 0 and layer.in_features % group_size == 0


def torchao_quantize(model: nn.Module, kind: str, group_size: int = 32) -> nn.Module:
    """A quantized copy of `model` made with `torchao.quantization.quantize_` (the original is left as it is);
    int4 quantizes only the Linear layers its CPU kernel takes (`int4_fits`), the rest stay fp32."""
    config = torchao_config(kind, group_size)
    from torchao.quantization import quantize_

    q = copy.deepcopy(model).eval()
    fits = (lambda m, fqn: int4_fits(m, group_size)) if kind == "int4_weight_only" else None
    quantize_(q, config, filter_fn=fits)
    return q


def quantized_layers(model: nn.Module) -> dict[str, str]:
    """Name -> weight tensor class of every Linear (shows which layers a quantizer actually replaced)."""
    return {name: type(m.weight).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}


# ------------------------------------------------------------------------------------------ OpenVINO + NNCF
def openvino_compile(model: Any, threads: int = 1, batch: int | None = None) -> Any:
    """Compile an ONNX path or an OpenVINO model for the CPU with `threads` inference threads, in fp32 arithmetic
    (not bf16 or f16 where the CPU has them); `batch` fixes the batch dimension (the plugin then plans once)."""
    require("openvino")
    import openvino as ov

    core = ov.Core()
    source = core.read_model(str(model)) if isinstance(model, str | Path) else model.clone()
    if batch is not None:
        shape = source.input(0).get_partial_shape()
        shape[0] = batch
        source.reshape({source.input(0): shape})
    return core.compile_model(source, "CPU", {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"})


def openvino_run(compiled: Any, x: Any) -> np.ndarray:
    """Run a one-input compiled OpenVINO model on float32 rows; returns its first output."""
    return np.asarray(compiled(np.ascontiguousarray(np.asarray(x, dtype=np.float32)), share_inputs=True)[0])


def nncf_quantize(onnx_path: str | Path, calib_x: Any, batch: int = 64) -> Any:
    """NNCF post-training int8 quantization of the ONNX model read by OpenVINO: activation ranges calibrated on
    `calib_x` (FakeQuantize nodes the CPU plugin runs as int8 kernels); returns the OpenVINO model."""
    require("openvino", "nncf")
    import nncf
    import openvino as ov

    batches = deploy.calib_batches(calib_x, batch, "NNCF")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return nncf.quantize(ov.Core().read_model(str(onnx_path)), nncf.Dataset(batches), subset_size=len(batches))


def openvino_save(model: Any, path: str | Path) -> int:
    """Save an OpenVINO model as IR (<path>.xml + <path>.bin) and return the bytes of both files."""
    require("openvino")
    import openvino as ov

    path = Path(path).with_suffix(".xml")
    path.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(path), compress_to_fp16=False)
    return path.stat().st_size + path.with_suffix(".bin").stat().st_size


def openvino_kernels(compiled: Any) -> dict[str, list[str]]:
    """The CPU plugin's executed graph: layer type -> runtime precisions (shows whether int8 kernels run)."""
    kernels: dict[str, set[str]] = {}
    for op in compiled.get_runtime_model().get_ops():
        info = op.get_rt_info()
        kernels.setdefault(info["layerType"].astype(str), set()).add(info["runtimePrecision"].astype(str))
    return {k: sorted(v) for k, v in sorted(kernels.items())}


# ------------------------------------------------------------------------------ LiteRT (full-integer int8)
def _litert_convert_here(model: nn.Module, calib_x: np.ndarray, path: Path) -> None:
    """litert-torch's PT2E route in this process: export, calibrate int8 (weights per channel, activations per
    tensor, static), convert to a .tflite whose every op between the input and output quantizers is int8."""
    import litert_torch
    from litert_torch.quantize.pt2e_quantizer import PT2EQuantizer, get_symmetric_quantization_config
    from litert_torch.quantize.quant_config import QuantConfig
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    example = (torch.from_numpy(calib_x[:1]),)
    quantizer = PT2EQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=False))
    batch = ({0: torch.export.Dim("batch")},)  # calibrate in batches of 64, convert with a batch of 1
    two = (torch.from_numpy(calib_x[:2]),)  # a batch of 1 would specialize the dynamic dimension
    graph = prepare_pt2e(torch.export.export(model.eval(), two, dynamic_shapes=batch).module(), quantizer)
    with torch.no_grad():
        for b in deploy.calib_batches(calib_x, 64, "LiteRT"):
            graph(torch.from_numpy(b))
    graph = convert_pt2e(graph, fold_quantize=False)
    edge = litert_torch.convert(graph, example, quant_config=QuantConfig(pt2e_quantizer=quantizer))
    path.parent.mkdir(parents=True, exist_ok=True)
    edge.export(str(path))


def fingerprint(model: nn.Module, *arrays: Any) -> str:
    """SHA-256 (`checkpoint.digest`) of a model's parameters and buffers and of some arrays, shapes and dtypes
    included: names what a converted file was made from."""
    return checkpoint.digest([model.state_dict(), *(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)])


def litert_convert_int8(model: nn.Module, calib_x: Any, path: str | Path, timeout: float = 600) -> Path:
    """Convert `model` to a full-integer int8 .tflite with litert-torch: in this process when litert_torch imports
    here, else in `.venv-edge` (a subprocess that loads the pickled model and the calibration rows). A file already
    converted from the same weights and calibration rows (its `.sha256` beside it) is kept."""
    path, x = Path(path), np.ascontiguousarray(np.asarray(calib_x, dtype=np.float32))
    if converted_from(path, model, x):
        return path
    stamp = path.with_suffix(".sha256")
    stamp.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    if importlib.util.find_spec("litert_torch") is not None:
        _litert_convert_here(model, x, path)
    else:
        exe = deploy.edge_python()
        if exe is None:
            require("litert_torch")
        path.parent.mkdir(parents=True, exist_ok=True)
        model_file, calib_file = path.with_suffix(".model.pt"), path.with_suffix(".calib.npy")
        torch.save(model.eval(), model_file)
        np.save(calib_file, x)
        cmd = [str(exe), "-m", "accelhelpers.toolflows", "litert", str(model_file), str(calib_file), str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        if done.returncode != 0 or not path.exists():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"litert-torch conversion in {exe} failed (exit {done.returncode}):\n{tail}")
    stamp.write_text(fingerprint(model, x))
    return path


def converted_from(path: str | Path, model: nn.Module, calib_x: Any) -> bool:
    """Whether the file at `path` was converted from exactly these weights and calibration rows (its `.sha256`)."""
    path = Path(path)
    stamp = path.with_suffix(".sha256")
    x = np.ascontiguousarray(np.asarray(calib_x, dtype=np.float32))
    return path.exists() and stamp.exists() and stamp.read_text() == fingerprint(model, x)


def litert_interpreter(path: str | Path, threads: int = 1) -> Any:
    """A LiteRT interpreter (ai-edge-litert) for the .tflite at `path`, using `threads` CPU threads."""
    require("ai_edge_litert")
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(path), num_threads=threads)
    interp.allocate_tensors()
    return interp


def _qparams(tensor: dict[str, Any]) -> deploy.QParams:
    """A LiteRT tensor's scale and zero-point, with the range of its integer type (int8 or uint8)."""
    info = np.iinfo(tensor["dtype"])
    return deploy.QParams(*tensor["quantization"], int(info.min), int(info.max))


def litert_run(interp: Any, x: Any) -> np.ndarray:
    """Run a one-input LiteRT model on float32 rows, resizing its batch dimension when it changes; an int8 input or
    output is quantized or dequantized (`deploy.quantize`, int8 or uint8) with the tensor's own scale and zero-point."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    if tuple(inp["shape"]) != x.shape:
        interp.resize_tensor_input(inp["index"], x.shape)
        interp.allocate_tensors()
        inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    if inp["dtype"] != np.float32:
        x = deploy.quantize(x, _qparams(inp))
    interp.set_tensor(inp["index"], x)
    interp.invoke()
    y = interp.get_tensor(out["index"])
    if out["dtype"] != np.float32:
        y = deploy.dequantize(y, _qparams(out))
    return np.asarray(y, dtype=np.float32)


def litert_ops(path: str | Path) -> dict[str, list[str]]:
    """Op name -> dtypes of its outputs in a .tflite (shows that the ops between the quantizers are int8)."""
    require("ai_edge_litert")
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    # without the default XNNPACK delegate, so that the file's own ops are listed
    interp = Interpreter(model_path=str(path),
                         experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    interp.allocate_tensors()
    tensors = {t["index"]: t["dtype"].__name__ for t in interp.get_tensor_details()}
    ops: dict[str, set[str]] = {}
    for op in interp._get_ops_details():  # the interpreter's public API has no op list; this is LiteRT's own
        ops.setdefault(op["op_name"], set()).update(tensors[i] for i in op["outputs"] if i in tensors)
    return {k: sorted(v) for k, v in sorted(ops.items())}


# ----------------------------------------------------------------- Brevitas -> QONNX -> hls4ml (FPGA, QAT)
def brevitas_mlp(sizes: Sequence[int], bits: int) -> nn.Sequential:
    """A Brevitas MLP quantized to `bits` everywhere with power-of-two (fixed-point) scales, so that hls4ml's
    ap_fixed types hold every value exactly: input and ReLU outputs at `bits`, weights at `bits` (per tensor),
    biases int16 at the scale of their accumulator; the logits stay unquantized."""
    if len(sizes) < 2 or bits < 2:
        raise ValueError(f"need at least an input and an output size and bits >= 2, got {list(sizes)} and {bits}")
    require("brevitas")
    import brevitas.nn as qnn
    from brevitas.quant import (
        Int8ActPerTensorFixedPoint,
        Int8WeightPerTensorFixedPoint,
        Int16Bias,
        Uint8ActPerTensorFixedPoint,
    )

    layers: list[nn.Module] = [qnn.QuantIdentity(act_quant=Int8ActPerTensorFixedPoint, bit_width=bits,
                                                 return_quant_tensor=True)]
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(qnn.QuantLinear(n_in, n_out, bias=True, weight_quant=Int8WeightPerTensorFixedPoint,
                                      weight_bit_width=bits, bias_quant=Int16Bias, return_quant_tensor=False))
        if i < len(sizes) - 2:
            layers.append(qnn.QuantReLU(act_quant=Uint8ActPerTensorFixedPoint, bit_width=bits,
                                        return_quant_tensor=True))
    return nn.Sequential(*layers)


def brevitas_ptq(fp32: nn.Module, sizes: Sequence[int], bits: int, calib_x: torch.Tensor,
                 batch: int = 256) -> nn.Sequential:
    """Post-training quantization with the same quantizers as QAT: a `brevitas_mlp` holding the fp32 weights,
    activation scales calibrated on `calib_x` (Brevitas' calibration mode), no training."""
    from brevitas.graph.calibrate import calibration_mode

    q = brevitas_mlp(sizes, bits)
    a = [m for m in fp32.modules() if isinstance(m, nn.Linear)]
    b = [m for m in q.modules() if isinstance(m, nn.Linear)]  # Brevitas' QuantLinear is a Linear
    if [(m.in_features, m.out_features) for m in a] != [(m.in_features, m.out_features) for m in b]:
        raise ValueError(f"the fp32 model's Linear layers differ in number or shape from sizes {list(sizes)}")
    with torch.no_grad():
        for s, d in zip(a, b):
            d.weight.copy_(s.weight)
            if s.bias is not None:
                d.bias.copy_(s.bias)
    with torch.no_grad(), calibration_mode(q):
        for i in range(0, len(calib_x), batch):
            q(calib_x[i:i + batch])
    return q.eval()


def brevitas_logits(model: nn.Module, x: Any) -> np.ndarray:
    """A Brevitas model's float outputs on `x` as NumPy (its fake-quantized forward, in eval mode)."""
    with torch.no_grad():
        y = model.eval()(torch.as_tensor(np.asarray(x, dtype=np.float32)))
    return getattr(y, "value", y).numpy()


def export_qonnx(model: nn.Module, example: torch.Tensor, path: str | Path) -> Path:
    """Export a Brevitas model to QONNX (ONNX with `Quant` nodes that carry scale, zero-point and bit width)."""
    require("brevitas", "onnxoptimizer")
    from brevitas.export import export_qonnx as _export

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        _export(model.eval(), input_t=example, export_path=str(path))
    return path


def qonnx_for_hls4ml(path: str | Path) -> Any:
    """Load a QONNX file and apply the clean-ups hls4ml expects (shape inference, constant folding, channels last,
    Gemm -> MatMul); returns qonnx's ModelWrapper."""
    require("qonnx")
    from qonnx.core.modelwrapper import ModelWrapper
    from qonnx.transformation.channels_last import ConvertToChannelsLastAndClean
    from qonnx.transformation.gemm_to_matmul import GemmToMatMul
    from qonnx.util.cleanup import cleanup_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GemmToMatMul warns that it was written for Gemm's opset 9
        model = cleanup_model(ModelWrapper(str(path)))
        model = model.transform(ConvertToChannelsLastAndClean()).transform(GemmToMatMul())
        return cleanup_model(model)


def hls_from_qonnx(model: Any, out_dir: str | Path) -> Any:
    """Convert a cleaned QONNX model to an hls4ml Vitis project (io_parallel) and build its bit-accurate emulation
    with g++; the Quant nodes set each tensor's ap_fixed type, anything they do not cover gets fixed<32,16>."""
    require("hls4ml", "qonnx", "g++")
    import hls4ml

    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # hls4ml narrates the topology
        warnings.simplefilter("ignore")
        cfg = hls4ml.utils.config.config_from_onnx_model(model, granularity="name", backend="Vitis",
                                                         default_precision="fixed<32,16>",
                                                         default_reuse_factor=1)
        hm = hls4ml.converters.convert_from_onnx_model(model, output_dir=str(out_dir), io_type="io_parallel",
                                                       backend="Vitis", hls_config=cfg)
        hm.compile()
    return hm


def hls_typedefs(hm: Any) -> list[str]:
    """The `typedef ap_...` lines of a written hls4ml project's firmware/defines.h: every type the circuit uses."""
    defines = Path(hm.config.get_output_dir()) / "firmware" / "defines.h"
    if not defines.exists():
        raise FileNotFoundError(f"no {defines}: write or compile the hls4ml project first")
    return [line.strip() for line in defines.read_text().splitlines() if line.startswith("typedef ap_")]


def _main(argv: Sequence[str]) -> int:
    """`python -m accelhelpers.toolflows litert MODEL.pt CALIB.npy OUT.tflite`: the conversion `.venv-edge` runs."""
    if len(argv) != 4 or argv[0] != "litert":
        print("usage: python -m accelhelpers.toolflows litert MODEL.pt CALIB.npy OUT.tflite", file=sys.stderr)
        return 2
    model = torch.load(argv[1], weights_only=False)
    _litert_convert_here(model, np.load(argv[2]), Path(argv[3]))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
