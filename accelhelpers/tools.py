"""The optional tools of chapters 08 and 10 (ONNX, ONNX Runtime, hls4ml and its compiler, torchao, OpenVINO, NNCF,
Brevitas, QONNX, LiteRT), each with its install line: whether one is installed, without importing it (`have`), and
one error naming every missing one (`require` raises `ToolMissing`), so a chapter skips a section and runs the rest."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from . import results

EDGE_VENV = ".venv-edge"
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
    base = Path(root) if root else results.repo_root()
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
