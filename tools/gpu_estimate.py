"""Each chapter's full-profile time on a Colab T4 and an A100, estimated from its smoke run's FLOPs, bytes and kernels.

A Colab learner starts the full profile (the default on a GPU); this says roughly how long each chapter will take.
It is an estimate, not a measurement (no GPU ran it), made this way:

1. Every chapter runs its smoke profile here on the CPU (the full profile's code paths, a few steps of each), with a
   TorchDispatchMode counting, cell by cell, every aten op the notebook's own process runs: its FLOPs (torch's
   `flop_counter` formulas), the bytes it reads and writes (inputs and outputs; a view moves none) and its dtype,
   and the seconds spent inside the ops.
2. Each op is priced on each GPU by the roofline: max(FLOPs / peak FLOP/s for its dtype, bytes / memory bandwidth,
   one kernel launch), with the datasheet peaks of `GPUS` below.
3. What is not a torch op in this process (Python, data loading, ONNX Runtime, hls4ml's C++, worker processes,
   waiting on Slurm) takes on the GPU runtime what it took here, once: Colab's GPU runtimes have a host CPU like this
   one.
4. A cell's ops are scaled from the smoke to the full profile by the setup cell's picks the cell uses (directly or
   through functions defined in earlier cells): by the largest full / smoke ratio among them (its longest loop:
   epochs, steps, rounds, seeds, sizes). A cell that uses a time budget (MIN_TIME, ROUND_S, MAX_SECONDS, STEP_S)
   runs for its budget on any hardware: its whole measured time is scaled that way, and not priced by the roofline.

Left out, so the figures are a floor: the Python between a loop's ops is counted once, not per step (the launch
floor stands in for the host's per-op cost; a loop with much Python per step, fastai's callbacks, takes longer);
loops nested over several counts (seeds x epochs) take only the longest's ratio, since the product of every count
a cell reaches through its functions overcounts wildly; compilation
(torch.compile falls back to eager under the counting mode; each compiled function costs Colab's host tens of
seconds), sizes whose work grows faster than linearly (a width counts once, a matmul's FLOPs grow as its square), and
the workers' GPU work (priced at its CPU time here, an overestimate that partly offsets). Chapter 07 needs a TPU
runtime and is not estimated.

Usage: python tools/gpu_estimate.py [--only 01,02] [--readme]   (writes results/gpu_estimate.json; --readme rewrites
the README's table from it)
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torch.utils.flop_counter import flop_registry  # noqa: E402

from tools import nbexport  # noqa: E402

# Datasheet peaks. T4: NVIDIA T4 Tensor Core GPU datasheet (FP32 8.1 TFLOPS, mixed-precision FP16 65 TFLOPS, 320 GB/s
# GDDR6; it has no bf16 units, so the course's policy runs fp16 there). A100: NVIDIA A100 Tensor Core GPU datasheet,
# the 40 GB SXM4 that Colab rents (FP32 19.5 TFLOPS without TF32, BF16/FP16 Tensor Core 312 TFLOPS, 1,555 GB/s).
# Launch: the time one CUDA kernel launch occupies the host, 4-6 us measured in "pegainfer (3): From Launch Overhead
# to CUDA Graph" (RTX 5070 Ti, CUDA 13); 5 us is used for both GPUs.
GPUS = {
    "T4": {"fp32": 8.1e12, "half": 65e12, "bandwidth": 320e9, "launch": 5e-6},
    "A100": {"fp32": 19.5e12, "half": 312e12, "bandwidth": 1555e9, "launch": 5e-6},
}
BUDGET_WORDS = ("TIME", "ROUND_S", "SECONDS", "STEP_S")
SKIP = {"07": "needs a TPU runtime (on a GPU runtime it stops at its first XLA cell)"}
OUT = ROOT / "results" / "gpu_estimate.json"
README_BEGIN, README_END = "<!-- gpu-estimate:begin -->", "<!-- gpu-estimate:end -->"

# Injected before the chapter's first cell: counts each cell's ops (Count below), priced on each GPU as they run.
COUNTER = r"""
import sys as _sys, time as _t, json as _j
_sys.path.insert(0, __ROOT__)
from tools.gpu_estimate import Count as _Count, counting_overhead as _overhead
_MODE_S = _overhead()
_C = _Count(); _CELLS = []; _T0 = [0.0]

def _pre(info):
    _C.reset(); _T0[0] = _t.perf_counter(); _C.__enter__()

def _post(result):
    try:
        _C.__exit__(None, None, None)
    except Exception:
        pass
    _CELLS.append({"wall": _t.perf_counter() - _T0[0] - _C.mode_s - _C.ops * _MODE_S, **_C.record()})

get_ipython().events.register("pre_run_cell", _pre)
get_ipython().events.register("post_run_cell", _post)
"""


class Count(TorchDispatchMode):
    """Counts the aten ops run under it: how many, the seconds inside them, their FLOPs (torch's flop_counter
    formulas) and bytes (inputs and outputs; a view moves none), and prices each on every GPU of `gpus` by the
    roofline: max(FLOPs / the peak for its dtype, bytes / bandwidth, one launch)."""

    def __init__(self, gpus: dict[str, dict[str, float]] | None = None) -> None:
        super().__init__()
        self.gpus = gpus or GPUS
        self.reset()

    def reset(self) -> None:
        self.ops, self.op_s, self.mode_s, self.flops, self.bytes = 0, 0.0, 0.0, 0.0, 0.0
        self.gpu_s = dict.fromkeys(self.gpus, 0.0)

    def record(self) -> dict:
        return {"ops": self.ops, "op_s": self.op_s, "mode_s": self.mode_s, "flops": self.flops, "bytes": self.bytes,
                "gpu_s": dict(self.gpu_s)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(x.is_meta or type(x).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
               or not all(isinstance(d, int) for d in x.shape)
               for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)):
            return func(*args, **kwargs)  # tracing (fake, meta, symbolic shapes): nothing runs on a device
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        t1 = time.perf_counter()
        self.op_s += t1 - t0
        self.ops += 1
        try:
            return self._price(func, args, kwargs, out)
        finally:
            self.mode_s += time.perf_counter() - t1  # the counting's own time, taken off the cell's

    def _price(self, func, args, kwargs, out):
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view (or an in-place op's returned self): no new bytes beyond its inputs
        tensors = [x for x in tree_flatten((args, kwargs, out))[0] if isinstance(x, torch.Tensor)]
        nbytes = sum(x.numel() * x.element_size() for x in tensors)
        flops = 0.0
        if func._overloadpacket in flop_registry:
            try:
                flops = float(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
            except Exception:  # a formula that cannot read these arguments: counted as no FLOPs
                flops = 0.0
        if type(nbytes) is not int or type(flops) is not float:  # a symbolic size slipped through: not a real kernel
            return out
        half = any(x.dtype in (torch.float16, torch.bfloat16) for x in tensors)
        self.flops += flops
        self.bytes += nbytes
        for name, g in self.gpus.items():
            self.gpu_s[name] += max(flops / g["half" if half else "fp32"], nbytes / g["bandwidth"], g["launch"])
        return out


def counting_overhead(n: int = 3000) -> float:
    """Seconds the counting adds to each op beyond what Count.mode_s records (the call into the Python mode and back),
    from a tiny op timed with and without it, best of 3: taken off each cell's wall time with mode_s."""
    x = torch.ones(4)

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x.add(1)
        return time.perf_counter() - t0

    plain = min(loop() for _ in range(3))
    runs = []
    for _ in range(3):
        with Count() as c:
            runs.append((loop(), c.mode_s / n))
    counted, inside = min(runs)
    return max(0.0, (counted - plain) / n - inside)


DUMP = r'''
_Path = __import__("pathlib").Path
_Path(__OUT__).write_text(_j.dumps({"mode_s": _MODE_S, "cells": _CELLS}, default=lambda o: 0.0))
'''


def python_of(source: str) -> str:
    """The Python a cell runs: nbexport's reading, plus the body of a %%time/%%timeit/%%capture cell."""
    first, _, body = source.partition("\n")
    if first.split()[:1] in (["%%time"], ["%%timeit"], ["%%capture"]):
        return body
    return nbexport.python_of(source)


def code_trees(nb: dict) -> list[ast.Module]:
    """Each code cell's Python, parsed (an empty module for a cell that does not parse)."""
    trees = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            try:
                trees.append(ast.parse(python_of("".join(cell["source"]))))
            except SyntaxError:
                trees.append(ast.Module(body=[], type_ignores=[]))
    return trees


def picks(nb: dict) -> dict[str, dict]:
    """{NAME: {"ratio": full/smoke, "budget": bool}} of every `NAME = S.pick(...)` in the chapter."""
    found = {}
    for tree in code_trees(nb):
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "pick"
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                continue
            kw = {k.arg: k.value for k in node.value.keywords}
            full, smoke = value(kw.get("full")), value(kw.get("smoke", kw.get("full")))
            found[node.targets[0].id] = {
                "ratio": ratio(full, smoke),
                "budget": any(w in node.targets[0].id for w in BUDGET_WORDS),
            }
    return found


def value(node):
    """A pick's value where it is a literal or simple arithmetic of literals (else None)."""
    if node is None:
        return None
    try:
        return eval(
            compile(ast.Expression(node), "<pick>", "eval"),
            {"__builtins__": {"range": range, "list": list, "max": max}},
        )
    except Exception:
        return None


def ratio(full, smoke) -> float:
    size = lambda v: len(v) if isinstance(v, list | tuple) else v
    f, s = size(full), size(smoke)
    if (
        isinstance(f, bool)
        or isinstance(s, bool)
        or not isinstance(f, int | float)
        or not isinstance(s, int | float)
        or s <= 0
        or f <= 0
    ):
        return 1.0
    return f / s


def names_by_cell(nb: dict) -> list[set[str]]:
    """The names each code cell uses, with those used inside functions and classes defined in earlier cells."""
    defined: dict[str, set[str]] = {}
    out = []
    for tree in code_trees(nb):
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined[node.name] = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        seen: set[str] = set()
        todo = list(used)
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo += list(defined.get(name, ()))
        out.append(seen)
    return out


def run_counted(path: Path, out: Path, timeout: int) -> dict:
    """Run the chapter's smoke profile with the counter; the per-cell records."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(COUNTER.replace("__ROOT__", repr(str(ROOT)))))
    nb.cells.append(nbformat.v4.new_code_cell(DUMP.replace("__OUT__", repr(str(out)))))
    # as the course runner runs a chapter: its results and build files under build/gpu_estimate, not results/
    os.environ.update(
        ACCEL_PROFILE="smoke",
        TQDM_DISABLE="1",
        ACCEL_RESULTS_DIR=str(out.parent / "results"),
        ACCEL_BUILD=str(out.parent),
    )
    from accelhelpers.commands.course import _kernel_config

    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        config=_kernel_config(),
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    return json.loads(out.read_text())


def estimate(path: Path, counted: dict) -> dict:
    nb = json.loads(path.read_text())
    pk = picks(nb)
    cells = counted["cells"][1:]  # the counter's own cell off (the dump cell records nothing: it ends the run)
    used = names_by_cell(nb)
    assert len(cells) == len(used), (path.name, len(cells), len(used))
    est = dict.fromkeys(GPUS, 0.0)
    parts = {"budget": 0.0, "host": 0.0, **{f"device_{g}": 0.0 for g in GPUS}}
    for rec, names in zip(cells, used):
        mine = [pk[n] for n in names if n in pk]
        scale = max([p["ratio"] for p in mine], default=1.0)  # its longest loop: a floor where loops nest
        if any(p["budget"] for p in mine):
            for g in GPUS:
                est[g] += rec["wall"] * scale
            parts["budget"] += rec["wall"] * scale
            continue
        host = max(0.0, rec["wall"] - rec["op_s"])  # once: set-up, plotting and Python between ops, not scaled
        parts["host"] += host
        for g in GPUS:
            est[g] += host + rec["gpu_s"][g] * scale
            parts[f"device_{g}"] += rec["gpu_s"][g] * scale
    return {
        "smoke_s_here": sum(c["wall"] for c in cells),
        "full_s": est,
        "parts": parts,
        "flops_smoke": sum(c["flops"] for c in cells),
        "ops_smoke": sum(c["ops"] for c in cells),
    }


def minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 600 else f"{s / 60:.1f} min"


def table(data: dict) -> str:
    lines = [
        "| chapter | smoke run here | full profile on a T4 | on an A100 (40 GB) | of which time budgets |",
        "|---|---|---|---|---|",
    ]
    for key, row in sorted(data["chapters"].items()):
        if "skipped" in row:
            lines.append(f"| {key} | | {row['skipped']} | | |")
            continue
        lines.append(
            f"| {key} | {row['smoke_s_here']:.0f} s | {minutes(row['full_s']['T4'])} | "
            f"{minutes(row['full_s']['A100'])} | {minutes(row['parts']['budget'])} |"
        )
    return "\n".join(lines)


def write_readme(data: dict) -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, _, rest = text.partition(README_BEGIN)
    _, _, tail = rest.partition(README_END)
    readme.write_text(f"{head}{README_BEGIN}\n{table(data)}\n{README_END}{tail}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None)
    p.add_argument("--readme", action="store_true", help="only rewrite the README's table from the recorded JSON")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--reuse", action="store_true", help="price a chapter's saved counts again (build/gpu_estimate/)")
    args = p.parse_args()
    if args.readme:
        write_readme(json.loads(OUT.read_text()))
        return 0
    data = json.loads(OUT.read_text()) if OUT.exists() else {"chapters": {}}
    data["method"] = __doc__.split("\n\n", 2)[1].strip()
    data["gpus"] = GPUS
    data["host"] = _host()
    work = ROOT / "build" / "gpu_estimate"
    work.mkdir(parents=True, exist_ok=True)
    keys = {k.strip().zfill(2) for k in args.only.split(",")} if args.only else None
    for path in nbexport.chapters():
        key = path.name[:2]
        if keys and key not in keys:
            continue
        if key in SKIP:
            data["chapters"][key] = {"skipped": SKIP[key]}
            continue
        t0 = time.perf_counter()
        saved = work / f"{key}.json"
        if args.reuse and saved.exists() and saved.stat().st_mtime > path.stat().st_mtime:
            counted = json.loads(saved.read_text())
        else:
            counted = run_counted(path, saved, args.timeout)
        data["chapters"][key] = estimate(path, counted)
        row = data["chapters"][key]
        print(
            f"{key}: {time.perf_counter() - t0:.0f} s counted; full profile ~{minutes(row['full_s']['T4'])} on a T4, "
            f"~{minutes(row['full_s']['A100'])} on an A100",
            flush=True,
        )
        OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
    return 0


def _host() -> str:
    import platform

    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{cpu}, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
