"""Deployment: int8 quantization from scratch, ONNX export and ONNX Runtime (fp32, int8), hls4ml fixed point.

Optional tools (onnx, onnxscript, onnxruntime, hls4ml, g++) are imported only when a function needs them;
a missing one raises `ToolMissing` saying what to install.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import re
import shutil
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .session import threads as torch_threads
from .train import fit

EDGE_VENV = ".venv-edge"
# torch.fx's tracer (hls4ml's PyTorch front end) patches nn.Module for the whole process while it traces: two traces
# at once in hls_sweep's threads broke each other (KeyError '_0_weight', TraceError), so one trace at a time.
_FX_TRACE = threading.Lock()
INSTALL_HINTS: dict[str, str] = {  # every optional tool of chapters 08 and 10, with its install line
    "onnx": "pip install onnx",
    "onnxscript": "pip install onnxscript (torch.onnx.export's dynamo exporter needs it)",
    "onnxruntime": "pip install onnxruntime",
    "hls4ml": "pip install hls4ml",
    "g++": "install a C++ compiler: apt-get install g++ (Debian/Ubuntu), xcode-select --install (macOS), "
           "or conda install -c conda-forge cxx-compiler",
    "torchao": "pip install 'torchao>=0.14,<0.15' (0.14 is the release built for torch 2.9)",
    "openvino": "pip install openvino",
    "nncf": "pip install nncf",
    "brevitas": "pip install brevitas onnxoptimizer",
    "onnxoptimizer": "pip install onnxoptimizer (Brevitas' QONNX export needs it)",
    "qonnx": "pip install qonnx",
    "ai_edge_litert": "pip install ai-edge-litert",
    "litert_torch": "make venv-edge (litert-torch needs its own environment: it pins typing_extensions and "
                    "pydantic below the course's and needs torchao >= 0.17)",
}


class ToolMissing(RuntimeError):
    """A deployment tool (Python package or compiler) is not installed."""


def edge_python(root: str | Path | None = None) -> Path | None:
    """The Python of `.venv-edge` (made by `make venv-edge`) in the checkout, or None when it does not exist."""
    from .results import repo_root

    base = Path(root) if root else repo_root()
    exe = (base / EDGE_VENV / "bin" / "python") if base else None
    return exe if exe is not None and exe.exists() else None


def have(tool: str) -> bool:
    """True when `tool` (a Python package name, or 'g++') is available here, without importing it
    (litert_torch: also when `.venv-edge` exists, where chapter 10 runs it)."""
    if tool not in INSTALL_HINTS:
        raise ValueError(f"unknown tool {tool!r}: choose one of {', '.join(INSTALL_HINTS)}")
    if tool == "g++":
        return shutil.which("g++") is not None
    if tool == "litert_torch" and edge_python() is not None:
        return True
    return importlib.util.find_spec(tool) is not None


def require(*tools: str) -> None:
    """Raise ToolMissing naming every missing tool and how to install it (so a notebook can skip a section)."""
    missing = [t for t in tools if not have(t)]
    if missing:
        hints = "; ".join(f"{t}: {INSTALL_HINTS[t]}" for t in missing)
        raise ToolMissing(f"missing {', '.join(missing)} — {hints}. The rest of the chapter still runs.")


# ---------------------------------------------------------------------------------------------- training
def fit_classifier(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, batch_size: int = 128,
                   lr: float = 3e-3, seed: int = 0, threads: int | None = None,
                   progress: str | bool = False) -> nn.Module:
    """Train a classifier with AdamW and torch's OneCycleLR on shuffled minibatches (`train.fit`); returns it in
    eval mode. `threads` sets torch's CPU threads while training (tiny models are often fastest on one);
    `progress` shows a bar over the epochs (a string labels it)."""
    if epochs < 1 or batch_size < 1 or len(x) != len(y):
        raise ValueError(f"need epochs >= 1, batch_size >= 1 and as many labels as rows (got {len(x)} and {len(y)})")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * math.ceil(len(x) / batch_size))
    with torch_threads(threads):
        fit(model, (x, y), opt, epochs, batch_size, seed=seed, scheduler=sched, progress=progress)
    return model.eval()


# ------------------------------------------------------------------------------ linear quantization by hand
@dataclass(frozen=True)
class QParams:
    """Affine quantization r = scale * (q - zero_point), with q in [qmin, qmax]."""

    scale: float
    zero_point: int
    qmin: int
    qmax: int


def qparams(x_min: float, x_max: float, signed: bool = False, symmetric: bool = False,
            float32_math: bool = False) -> QParams:
    """8-bit scale and zero-point for [x_min, x_max] (widened to include 0), as ONNX Runtime computes them: in
    float64 for weights (its Python quantizer), in float32 with `float32_math` (its C++ DynamicQuantizeLinear)."""
    if x_min > x_max:
        raise ValueError(f"need x_min <= x_max, got [{x_min}, {x_max}]")
    qmin, qmax = (-128, 127) if signed else (0, 255)
    if signed and symmetric:
        qmin = -qmax  # int8 symmetric uses [-127, 127] so that zero_point is exactly 0
    lo, hi = min(float(x_min), 0.0), max(float(x_max), 0.0)
    if symmetric:
        lo, hi = -max(-lo, hi), max(-lo, hi)
    if float32_math:
        scale = (np.float32(hi) - np.float32(lo)) / np.float32(qmax - qmin)
    else:
        scale = np.float32((hi - lo) / (qmax - qmin))
    if scale == 0:
        return QParams(1.0, 0, qmin, qmax)
    zp = round((qmin + qmax) / 2) if symmetric else int(np.clip(np.round(qmin - lo / scale), qmin, qmax))
    return QParams(float(scale), int(zp), qmin, qmax)


def quantize(x: Any, qp: QParams) -> np.ndarray:
    """Integers q = clip(round_half_even(x / scale) + zero_point) as int8 (signed) or uint8."""
    q = np.clip(np.round(np.asarray(x, dtype=np.float32) / np.float32(qp.scale)) + qp.zero_point, qp.qmin, qp.qmax)
    return q.astype(np.int8 if qp.qmin < 0 else np.uint8)


def dequantize(q: Any, qp: QParams) -> np.ndarray:
    """Back to float: scale * (q - zero_point)."""
    return (np.float32(qp.scale) * (np.asarray(q, dtype=np.int32) - qp.zero_point)).astype(np.float32)


def int8_linear(x: Any, weight: Any, bias: Any | None = None) -> dict[str, Any]:
    """y = x @ W.T + b the way ONNX Runtime's dynamic int8 MatMul does it: uint8 activations (range of this
    batch), int8 symmetric weights, int32 accumulation, one float rescale; returns y and the intermediates."""
    x, w = np.asarray(x, dtype=np.float32), np.asarray(weight, dtype=np.float32)
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"need x [batch, in] and weight [out, in] with matching 'in', got {x.shape} and {w.shape}")
    qx = qparams(x.min(), x.max(), signed=False, float32_math=True)
    qw = qparams(w.min(), w.max(), signed=True, symmetric=True)
    xq, wq = quantize(x, qx), quantize(w, qw)
    acc = (xq.astype(np.int32) - qx.zero_point) @ (wq.astype(np.int32) - qw.zero_point).T  # int32 accumulate
    y = acc.astype(np.float32) * np.float32(np.float32(qx.scale) * np.float32(qw.scale))
    if bias is not None:
        y = y + np.asarray(bias, dtype=np.float32)
    return {"y": y, "acc": acc, "xq": xq, "wq": wq, "qx": qx, "qw": qw}


def int8_forward(model: nn.Sequential, x: Any) -> np.ndarray:
    """Run a Linear/ReLU Sequential with `int8_linear` layer by layer (what the int8 hardware computes)."""
    h = np.asarray(x, dtype=np.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            b = None if layer.bias is None else layer.bias.detach().numpy()
            h = int8_linear(h, layer.weight.detach().numpy(), b)["y"]
        elif isinstance(layer, nn.ReLU):
            h = np.maximum(h, 0)
        else:
            raise TypeError(f"int8_forward handles Linear and ReLU layers only, not {type(layer).__name__}")
    return h


# ------------------------------------------------------------------------------------------ size, ONNX, ORT
def state_dict_bytes(model: nn.Module) -> int:
    """Bytes of the model's state_dict as torch.save writes it (what a checkpoint of the weights costs)."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.tell()


def onnx_bytes(path: str | Path) -> int:
    """Bytes on disk of an ONNX model, its external-data file (<name>.data) included if there is one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no ONNX file at {path}; export the model first")
    extra = path.with_name(path.name + ".data")
    return path.stat().st_size + (extra.stat().st_size if extra.exists() else 0)


def export_onnx(model: nn.Module, example: torch.Tensor, path: str | Path) -> Path:
    """Export with today's exporter (torch.export + onnxscript, `dynamo=True`), batch dimension dynamic, weights
    inside the one file, then run `onnx.checker` on it."""
    require("onnx", "onnxscript")
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter narrates its steps
        torch.onnx.export(model.eval(), (example,), path, dynamo=True, external_data=False,
                          input_names=["x"], output_names=["logits"],
                          dynamic_shapes=({0: torch.export.Dim("batch")},))
    onnx.checker.check_model(str(path), full_check=True)
    return path


def ort_session(path: str | Path, threads: int | None = None) -> Any:
    """An ONNX Runtime CPU session using `threads` intra-op threads (default: torch's thread count)."""
    require("onnxruntime")
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or torch.get_num_threads()
    opts.log_severity_level = 3  # errors only
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def ort_run(session: Any, x: Any) -> np.ndarray:
    """Run a one-input session on float32 rows."""
    name = session.get_inputs()[0].name
    return session.run(None, {name: np.ascontiguousarray(np.asarray(x, dtype=np.float32))})[0]


def _preprocess(src: str | Path, dst: str | Path) -> str:
    """ONNX Runtime's recommended step before quantizing (`quant_pre_process`: shape inference and graph
    optimization, which also repairs stale shapes the quantizer fails on), written next to `dst` as .pre.onnx."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = Path(dst).with_name(Path(dst).stem + ".pre.onnx")
    quant_pre_process(str(src), str(pre))
    return str(pre)


def quantize_onnx_dynamic(src: str | Path, dst: str | Path) -> Path:
    """ONNX Runtime dynamic int8: int8 weights stored, activations quantized per call from their range."""
    require("onnxruntime")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(_preprocess(src, dst), str(dst), weight_type=QuantType.QInt8)
    return Path(dst)


def calib_batches(calib_x: Any, batch: int, who: str) -> list[np.ndarray]:
    """Calibration rows as contiguous float32 batches of `batch` rows; no rows at all: ValueError naming `who`."""
    x = np.ascontiguousarray(np.asarray(calib_x, dtype=np.float32))
    if len(x) == 0:
        raise ValueError(f"{who} needs calibration rows (a few hundred training inputs)")
    return [x[i:i + batch] for i in range(0, len(x), batch)]


def quantize_onnx_static(src: str | Path, dst: str | Path, calib_x: Any, batch: int = 64) -> Path:
    """ONNX Runtime static int8 in QDQ format: activation ranges fixed beforehand on calibration data."""
    require("onnxruntime")
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    batches = iter([{"x": b} for b in calib_batches(calib_x, batch, "static quantization")])
    reader = type("Reader", (CalibrationDataReader,), {"get_next": lambda self: next(batches, None)})()
    quantize_static(_preprocess(src, dst), str(dst), reader, quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return Path(dst)


# --------------------------------------------------------------------------------------- fixed point, hls4ml
def parse_fixed(precision: str) -> tuple[int, int]:
    """(W, I) of 'ap_fixed<W,I>' or 'fixed<W,I>': W total bits, I integer bits (sign included)."""
    m = re.fullmatch(r"\s*(?:ap_)?fixed<\s*(\d+)\s*,\s*(-?\d+)\s*(?:,[^>]*)?>\s*", precision)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"{precision!r} is not a fixed-point type such as 'ap_fixed<16,6>'")
    return int(m.group(1)), int(m.group(2))


def to_fixed(x: Any, precision: str) -> np.ndarray:
    """Values as ap_fixed<W,I> holds them with its defaults: truncation towards -inf (AP_TRN), wrap-around
    on overflow (AP_WRAP). Exact in float64 for W <= 52."""
    width, integer = parse_fixed(precision)
    fields = [f.strip().upper().removeprefix("AP_") for f in precision.split(">")[0].split(",")[2:]]
    modes = {f for f in fields if not f.isdigit()}  # a trailing number is the saturation-bit count
    if modes - {"TRN", "WRAP"}:
        raise ValueError(f"to_fixed models the default AP_TRN/AP_WRAP modes only, not {precision!r}")
    frac = width - integer
    q = np.floor(np.asarray(x, dtype=np.float64) * 2.0**frac)
    q = np.mod(q + 2.0 ** (width - 1), 2.0**width) - 2.0 ** (width - 1)
    return q / 2.0**frac


def int_bits(max_abs: float) -> int:
    """Integer bits (sign included) an ap_fixed needs so that values up to `max_abs` in size do not wrap."""
    if max_abs < 0 or not math.isfinite(max_abs):
        raise ValueError(f"max_abs must be a finite non-negative number, got {max_abs}")
    return 1 if max_abs == 0 else max(1, math.floor(math.log2(max_abs)) + 2)


def layer_ranges(model: nn.Sequential, x: torch.Tensor) -> list[dict[str, Any]]:
    """Per layer of a Sequential: parameter range (weights and bias) and output range on `x`, with the integer
    bits each needs."""
    rows, h = [{"layer": "input", "kind": "Input", "w_absmax": None, "out_absmax": float(x.abs().max())}], x
    with torch.no_grad():
        for i, layer in enumerate(model):
            h = layer(h)
            params = [p.detach().abs().max() for p in layer.parameters()]  # weight and bias share a type
            rows.append({"layer": str(i), "kind": type(layer).__name__,
                         "w_absmax": float(max(params)) if params else None, "out_absmax": float(h.abs().max())})
    for r in rows:
        r["w_int_bits"] = None if r["w_absmax"] is None else int_bits(r["w_absmax"])
        r["out_int_bits"] = int_bits(r["out_absmax"])
    return rows


def _as_written(t: torch.Tensor, precision: str) -> np.ndarray:
    """Parameters as hls4ml writes them to its weight files (decimal text with F = W - I decimals), up to changes
    that truncation to ap_fixed<W,I> erases: only values near a grid point are formatted, the rest kept (fast)."""
    width, integer = parse_fixed(precision)
    frac, dec = width - integer, max(0, width - integer)
    v = t.detach().float().numpy().astype(np.float64).ravel()
    scaled = v * 2.0**frac
    near = np.abs(scaled - np.round(scaled)) * 2.0**-frac < 10.0**-dec  # decimal rounding may cross a grid point
    v[near] = np.char.mod(f"%.{dec}f", v[near]).astype(np.float64)
    return v.reshape(tuple(t.shape))


def fixed_forward(model: nn.Sequential, x: Any, precision: str = "ap_fixed<16,6>",
                  per_layer: dict[str, str] | None = None) -> np.ndarray:
    """Bit-accurate NumPy model of what hls4ml's io_parallel Dense/ReLU firmware computes: input, weights, biases
    and ReLU outputs in ap_fixed (per_layer overrides by layer index or 'input'), exact wide accumulators."""
    per_layer = per_layer or {}
    h = to_fixed(np.asarray(x, dtype=np.float32), per_layer.get("input", precision))
    for i, layer in enumerate(model):
        p = per_layer.get(str(i), precision)
        if isinstance(layer, nn.Linear):
            w = to_fixed(_as_written(layer.weight, p), p)
            b = 0.0 if layer.bias is None else to_fixed(_as_written(layer.bias, p), p)
            h = h @ w.T + b
        elif isinstance(layer, nn.ReLU):
            h = to_fixed(np.maximum(h, 0), p)
        else:
            raise TypeError(f"fixed_forward handles Linear and ReLU layers only, not {type(layer).__name__}")
    return h.astype(np.float32)


def multipliers(model: nn.Module, reuse_factor: int = 1) -> list[dict[str, int]]:
    """Multipliers a fully parallel (io_parallel) design instantiates per Linear layer: in*out / reuse_factor,
    each used reuse_factor times per inference (so a new input every reuse_factor clock cycles)."""
    if reuse_factor < 1:
        raise ValueError(f"reuse_factor must be >= 1, got {reuse_factor}")
    return [{"layer": name, "products": m.in_features * m.out_features,
             "multipliers": math.ceil(m.in_features * m.out_features / reuse_factor)}
            for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def hls_config(model: nn.Module, n_features: int, precision: str = "ap_fixed<16,6>", reuse_factor: int = 1,
               per_layer: dict[str, str] | None = None) -> dict[str, Any]:
    """hls4ml's per-layer config for a PyTorch model, with one precision everywhere and optional overrides
    (layer index or 'input' -> precision of that layer's weights/bias or result); accumulators stay 'auto'."""
    require("hls4ml")
    import hls4ml

    parse_fixed(precision)
    cfg = hls4ml.utils.config_from_pytorch_model(model, input_shape=(n_features,), granularity="name",
                                                 default_precision=precision, default_reuse_factor=reuse_factor,
                                                 backend="Vitis")
    for key, p in (per_layer or {}).items():
        name = "input_1" if key == "input" else f"_{key}"
        layer = cfg["LayerName"].get(name)
        if layer is None:
            raise KeyError(f"no layer {key!r} in the hls4ml config (layers: {', '.join(cfg['LayerName'])})")
        parse_fixed(p)
        fields = ("weight", "bias") if "weight" in layer["Precision"] else ("result",)  # Dense result stays auto
        layer["Precision"].update(dict.fromkeys(fields, p))
    return cfg


def hls_convert(model: nn.Module, n_features: int, out_dir: str | Path, precision: str = "ap_fixed<16,6>",
                reuse_factor: int = 1, per_layer: dict[str, str] | None = None, compile: bool = True,
                quiet: bool = True) -> Any:
    """Convert a PyTorch model to an hls4ml Vitis HLS project (io_parallel) written to `out_dir`; with `compile`,
    build its C++ with g++ into a library so that `.predict` runs the bit-accurate fixed-point emulation."""
    require("hls4ml", *(("g++",) if compile else ()))
    import hls4ml

    # hls4ml prints the topology and 'Writing HLS project'; redirecting stdout is process-wide, so not in threads
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        with _FX_TRACE:
            cfg = hls_config(model, n_features, precision, reuse_factor, per_layer)
            hm = hls4ml.converters.convert_from_pytorch_model(model, hls_config=cfg, output_dir=str(out_dir),
                                                              backend="Vitis", io_type="io_parallel")
        if compile:
            hm.compile()  # writes the project, then g++ builds it into a shared library
        else:
            hm.write()
    return hm


def hls_predict(hm: Any, x: Any) -> np.ndarray:
    """Outputs of a compiled hls4ml model (the C++ fixed-point emulation) as float32 [batch, outputs]."""
    return np.asarray(hm.predict(np.ascontiguousarray(np.asarray(x, dtype=np.float32))), dtype=np.float32)


def hls_sweep(model: nn.Module, n_features: int, x: Any, precisions: Sequence[str], out_root: str | Path,
              per_layer: Sequence[dict[str, str] | None] | None = None, workers: int = 2) -> list[np.ndarray]:
    """Compile one hls4ml project per precision under `out_root` (in parallel: each g++ build is its own process)
    and return each one's predictions on `x`."""
    if not precisions:
        raise ValueError("give at least one precision such as 'ap_fixed<16,6>'")
    per_layer = list(per_layer) if per_layer is not None else [None] * len(precisions)
    if len(per_layer) != len(precisions):
        raise ValueError(f"{len(precisions)} precisions but {len(per_layer)} per-layer overrides")
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    dirs = [Path(out_root) / f"p{i}_{re.sub(r'[^0-9]+', '_', p).strip('_')}" for i, p in enumerate(precisions)]
    with contextlib.redirect_stdout(io.StringIO()), ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(hls_convert, model, n_features, d, p, per_layer=o, quiet=False)  # g++ frees the GIL
                   for d, p, o in zip(dirs, precisions, per_layer, strict=True)]
        return [hls_predict(f.result(), x) for f in futures]
