"""Run the whole course with papermill and write a report of what this machine achieved."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

from ..device import PROFILES, format_report, hardware_report, machine_line
from ..results import atomic_write_text, latest_recorded, load_results, read_json, repo_root
from ..timing import hours
from . import CommandError

# Folders of recorded evidence that a run must never write into (results/ and the course runs committed there).
RECORDED = ("results",)

TITLES = {
    "01": "Your hardware, and timing it honestly",
    "02": "Full-batch training and the fast loop",
    "03": "Momentum, Adam and one-cycle",
    "04": "Mixed precision",
    "05": "Feeding the accelerator",
    "06": "Distributed data parallel",
    "07": "TPUs and XLA",
    "08": "Quantization, ONNX and FPGA",
    "09": "Long runs that survive",
    "10": "Deployment toolflows: torchao, OpenVINO, LiteRT, Brevitas to hls4ml",
    "11": "A speedrun on your machine: time to a target loss",
    "12": "On a cluster: Slurm jobs, preemption and requeue",
}


class CourseError(CommandError):
    """Bad arguments to the course runner; the message names the valid choices."""


def notebooks_dir() -> Path:
    """The notebooks/ folder of the checkout (ACCEL_NOTEBOOKS overrides, for tests)."""
    env = os.environ.get("ACCEL_NOTEBOOKS")
    if env:
        return Path(env)
    root = repo_root() or repo_root(Path(__file__).parent)
    if root is None:
        raise CourseError("cannot find the course's notebooks/ folder: run from inside the accel-course checkout")
    return root / "notebooks"


def chapters(folder: Path | None = None) -> dict[str, Path]:
    """The chapter notebooks, keyed by their two-digit number."""
    folder = folder or notebooks_dir()
    return {p.name[:2]: p for p in sorted(folder.glob("[0-9][0-9]_*.ipynb"))}


def default_out() -> Path:
    """build/ in the checkout."""
    return (repo_root() or repo_root(Path(__file__).parent) or Path.cwd()) / "build"


def _select(only: str | list[str] | None, available: dict[str, Path]) -> dict[str, Path]:
    """The chapters named by --only (e.g. '01,3'), checked against those that exist."""
    if not only:
        return dict(available)
    names = only.split(",") if isinstance(only, str) else list(only)
    chosen = {}
    for name in (n.strip() for n in names if n.strip()):
        key = name.zfill(2) if name.isdigit() else name
        if key not in available:
            raise CourseError(f"no chapter {name!r}: choose from {', '.join(available) or 'none found'}")
        chosen[key] = available[key]
    if not chosen:
        raise CourseError(f"--only named no chapter: choose from {', '.join(available)}")
    return chosen


def check_args(profile: str, only: str | list[str] | None, out: Path) -> dict[str, Path]:
    """Validate everything before anything is written; return the chapters to run."""
    if profile not in PROFILES:
        raise CourseError(f"unknown profile {profile!r}: choose one of {', '.join(PROFILES)}")
    if out.exists() and not out.is_dir():
        raise CourseError(f"--out {out} is a file, not a folder: give a folder (it is created if missing)")
    target = out.resolve()  # never into the course's sources or its recorded runs
    root = repo_root(Path(__file__).parent)
    protected = [root / name for name in ("accelhelpers", "notebooks", "tests", ".ci", ".git")] if root else []
    recorded = [root / name for name in RECORDED] if root else []
    if any(target == p.resolve() or p.resolve() in target.parents for p in recorded):
        raise CourseError(f"--out {out} is inside results/, the recorded runs: a run never writes over recorded "
                          "evidence. Use build/ (the default) or a new folder outside the checkout")
    if (root is not None and target == root.resolve()) \
            or any(target == p.resolve() or p.resolve() in target.parents for p in protected) \
            or (target / "notebooks").resolve() == notebooks_dir().resolve():
        raise CourseError(f"--out {out} would write over the course's sources: use build/ (the default) or a "
                          "folder outside accelhelpers/, notebooks/ and tests/")
    return _select(only, chapters())


def parameter_names(nb: Path) -> list[str]:
    """The names assigned in a chapter's cell tagged `parameters` (what papermill can set)."""
    import ast

    cells = [c for c in json.loads(nb.read_text())["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    tree = ast.parse("".join(cells[0]["source"])) if cells else ast.Module(body=[], type_ignores=[])
    return [t.id for stmt in tree.body if isinstance(stmt, ast.Assign) for target in stmt.targets
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]) if isinstance(t, ast.Name)]


def parse_parameters(items: list[str], selected: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """`--param NAME=VALUE` (VALUE a Python literal, else a string) for every chosen chapter whose parameters cell
    has NAME: {chapter: {name: value}}. A name no chosen chapter has is bad input, named with the ones they have."""
    import ast

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise CourseError(f"--param {item!r}: write NAME=VALUE, e.g. --param 'MATMUL_SIZES=[16, 32]'")
        if name == "PROFILE":
            raise CourseError("--param PROFILE=...: choose the profile with --profile")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            value = text.strip()
        having = [key for key, nb in selected.items() if name in parameter_names(nb)]
        if not having:
            known = sorted({n for nb in selected.values() for n in parameter_names(nb)} - {"PROFILE"})
            raise CourseError(f"--param {name}: no chosen chapter has that parameter; they have "
                              f"{', '.join(known) or 'none besides PROFILE'}")
        for key in having:
            out.setdefault(key, {})[name] = value
    return out


def _kernel_config() -> Any:
    """The kernel manager's settings for the chapters' kernels: CurveZMQ keys provisioned by the manager
    (jupyter_client's transport_encryption), so the kernel's sockets are encrypted. Without keys, ipykernel warns
    once per kernel that it is 'running over TCP without encryption' (on its stderr, which the runner shares).
    Where jupyter_client or pyzmq cannot encrypt, nothing is changed (and the warning stays true)."""
    import zmq
    from jupyter_client.manager import KernelManager
    from traitlets.config import Config

    if "transport_encryption" in KernelManager.class_traits() and zmq.has("curve"):
        return Config({"KernelManager": {"transport_encryption": "required"}})
    return Config()


def _run_one(key: str, nb: Path, out: Path, profile: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """Execute one chapter with papermill into out/notebooks; never raises for a failing notebook. `parameters`
    are papermill parameters of this chapter beyond PROFILE (or replacing it: the status then names its profile)."""
    import papermill as pm

    results = out / "results"
    (results / f"{key}.json").unlink(missing_ok=True)
    for old in (results / "figures").glob(f"{key}_*.png"):
        old.unlink()
    env = {"ACCEL_PROFILE": profile, "ACCEL_RESULTS_DIR": str(results), "ACCEL_BUILD": str(out)}
    t0 = time.perf_counter()
    status: dict[str, Any] = {"chapter": key, "notebook": nb.name, "ok": True, "error": None}
    if parameters and parameters.get("PROFILE", profile) != profile:
        status["profile"] = parameters["PROFILE"]
    try:
        with mock.patch.dict(os.environ, env):  # the kernel inherits them; restored afterwards
            pm.execute_notebook(str(nb), str(out / "notebooks" / nb.name), cwd=str(nb.parent),
                                parameters={"PROFILE": profile, **(parameters or {})}, progress_bar=False,
                                log_output=False, kernel_name="python3", config=_kernel_config())
    except Exception as e:  # a failing chapter is reported, the others still run
        status["ok"] = False
        status["error"] = f"{getattr(e, 'ename', type(e).__name__)}: {getattr(e, 'evalue', e)}"
    status["seconds"] = round(time.perf_counter() - t0, 1)
    return status


def run(profile: str = "quick", only: str | list[str] | None = None, out: Path | None = None,
        progress: bool = True, parameters: dict[str, dict[str, Any]] | None = None,
        param: list[str] | None = None) -> list[dict[str, Any]]:
    """Execute the chosen chapters into `out` (default build/), record run times and failures in run.json;
    `parameters` ({chapter: {name: value}}) gives a chapter papermill parameters of its own, `param` (the CLI's
    --param NAME=VALUE) to every chosen chapter that has NAME."""
    out = (Path(out) if out else default_out()).resolve()  # the kernels run in notebooks/: no relative paths
    selected = check_args(profile, only, out)
    if param:
        given = parse_parameters(param, selected)
        parameters = {key: {**given.get(key, {}), **(parameters or {}).get(key, {})}
                      for key in {*given, *(parameters or {})}}
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    statuses, interrupted = [], threading.Event()

    def on_ctrl_c(signum: int, frame: Any) -> None:  # remembered: a library may turn the KeyboardInterrupt into
        interrupted.set()                             # an ordinary error, which would read as a failed chapter
        signal.default_int_handler(signum, frame)

    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, on_ctrl_c) if main else None
    try:
        bar = tqdm(selected.items(), desc="course", unit="chapter", disable=not progress)
        for key, nb in bar:
            bar.set_postfix_str(nb.stem)
            statuses.append(_run_one(key, nb, out, profile, (parameters or {}).get(key)))
            if interrupted.is_set():  # Ctrl-C during the chapter: stop here, write nothing
                raise KeyboardInterrupt
    finally:
        if main:
            signal.signal(signal.SIGINT, before)
    previous = _load_run(out).get("chapters", {}) if (out / "run.json").exists() else {}
    previous.update({s["chapter"]: s for s in statuses})
    atomic_write_text(out / "run.json", json.dumps(
        {"profile": profile, "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "hardware": hardware_report(),
         "chapters": dict(sorted(previous.items()))}, indent=1))
    return statuses


def _load_run(out: Path) -> dict[str, Any]:
    """The runner's run.json in `out`."""
    path = out / "run.json"
    if not path.exists():
        raise CourseError(f"no course run found in {out}: run `python -m accelhelpers course run` first")
    return read_json(path, "run `python -m accelhelpers course run` again", CourseError)


def _results(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """The recorded results of a run; a damaged results file is the user's to fix, said in one line."""
    try:
        return load_results(folder)
    except ValueError as e:  # results.load_chapter's only error: a file that is not JSON, named with the fix
        raise CourseError(str(e)) from e


# The headline table of the report: per chapter, the results that say most about this machine, with a label.
# A result a run did not record is left out of the headline (it still shows in the chapter's full table).
HEADLINES: dict[str, list[tuple[str, str]]] = {
    "01": [("fp32_matmul_peak", "fp32 matmul peak"), ("copy_bandwidth", "memory bandwidth, large copy")],
    "02": [("best_speedup_vs_naive", "fastest loop vs the naive loop (model-steps/s)"),
           ("best_fraction_of_peak", "fastest loop, share of the matmul peak of its precision (fp32 or bf16)")],
    "03": [("epochs_to_target_adam_one_cycle_ours", "epochs to the target test accuracy, Adam + one-cycle"),
           ("epochs_to_target_adam_ours", "epochs to the target test accuracy, Adam")],
    "04": [("step_speedup_mixed", "mixed-precision training step vs fp32"),
           ("saved_activation_ratio", "activations saved for backward, mixed vs fp32")],
    "05": [("data_wait_share[per-item, workers=0]", "share of a step waiting on data, per-item loading"),
           ("data_wait_share[device tensors + augment_batch]", "the same with batch transforms on the device")],
    "06": [("ddp_speedup_b64", "2 DDP ranks vs one process on one core, per-rank batch 64 (the training batch)"),
           ("ddp_speedup_b512", "the same, per-rank batch 512"),
           ("ddp_sync_share_b64", "share of a 2-rank DDP step that no_sync saves (all-reduce + bookkeeping)")],
    "07": [("xla_compile_s", "XLA compile of one training step"),
           ("xla_execute_ms", "one execution of that step")],
    "08": [("int8_size_ratio", "model file, fp32 / int8"),
           ("int8_b256_latency_ratio", "MLP: ORT dynamic int8 / fp32 latency, batch 256"),
           ("cnn_int8_b256_latency_ratio", "CNN: ORT dynamic int8 / fp32 latency, batch 256"),
           ("hls_16_6_argmax_agreement", "hls4ml ap_fixed<16,6> agrees with float")],
    "09": [("resume_bit_identical", "run killed mid-way and resumed vs uninterrupted, bit-identical"),
           ("preemption_save_s", "SIGTERM to checkpoint saved (Preemption handler)")],
    "10": [("qat_minus_finetuned_ptq_4bit", "4-bit FPGA model: QAT minus fine-tuned fp32 then PTQ, median over seeds"),
           ("openvino_int8_vs_fp32_b256", "OpenVINO int8 (NNCF) / OpenVINO fp32 latency, batch 256")],
    "11": [("record_speedup", "time to the target loss, baseline / the record (the changes kept), paired over seeds"),
           ("record_time_to_target_s", "the record's training time to the target loss")],
    "12": [("slurm_requeue_bit_identical", "Slurm job requeued mid-run and resumed vs uninterrupted, bit-identical"),
           ("slurm_time_limit_requeue_bit_identical", "Slurm job signalled (USR1) before its time limit, requeued "
            "by itself and resumed vs uninterrupted, bit-identical"),
           ("slurm_killed_rank_job_end_s", "a killed rank: from the kill (SIGKILL) to the job's FAILED state"),
           ("slurm_hung_rank_job_end_s", "a hung rank (SIGSTOP): to the job's FAILED state, ended by a 5-s collective "
            "timeout")],
}


def _fmt(value: Any) -> str:
    """A value for a table: floats to 3 significant digits."""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def _fmt_unit(value: Any, unit: str) -> str:
    """A value with its unit as a learner reads it: ratios as '12.3x', fractions and shares as percentages."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value} {unit}".strip()
    if unit in ("x", "ratio"):
        return f"{value:.3g}×"
    if unit in ("fraction", "share"):
        return f"{value * 100:.3g} %"
    return f"{_fmt(value)} {unit}".strip()


def _fmt_entry(e: dict[str, Any]) -> str:
    """A recorded value with its unit and, where recorded, its range over repeats; a ratio whose range crosses
    1.0 is flagged as no reliable difference."""
    text = _fmt_unit(e["value"], e["unit"])
    if e.get("spread"):
        lo, hi = e["spread"]
        text += f" (range {_fmt_unit(lo, e['unit'])}–{_fmt_unit(hi, e['unit'])}, {e.get('repeats') or '?'} repeats)"
        if e["unit"] in ("x", "ratio") and lo <= 1.0 <= hi:
            text += " — not a reliable difference on this machine"
    return text


def _fmt_value(e: dict[str, Any]) -> str:
    """A recorded value for the full tables (unit in its own column), with its range where recorded."""
    lo_hi = f" (range {_fmt(e['spread'][0])}–{_fmt(e['spread'][1])})" if e.get("spread") else ""
    return _fmt(e["value"]) + lo_hi


def headlines(results: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, str, str]]:
    """(chapter, label, formatted value, note) for each headline result that the run recorded."""
    rows = []
    for key, picks in HEADLINES.items():
        recorded = {e["name"]: e for e in results.get(key, [])}
        for name, label in picks:
            if name in recorded:
                e = recorded[name]
                rows.append((key, label, _fmt_entry(e), e.get("note", "")))
    return rows


def noisy_chapters(results: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Chapters whose recorded noise check (result 'noise', timing.noise_watch) says the machine was too busy."""
    return {key: e["note"] for key, entries in results.items() for e in entries
            if e["name"] == "noise" and str(e.get("note", "")).startswith("TOO NOISY")}


def missing_headlines(out: Path | None = None) -> list[str]:
    """Headline results that a chapter which ran without error did not record (a renamed result, say)."""
    out = Path(out) if out else default_out()
    results = _results(out / "results")
    missing = []
    for key, st in _load_run(out)["chapters"].items():
        recorded = {e["name"] for e in results.get(key, [])}
        missing += [f"{key}: {name}" for name, _ in HEADLINES.get(key, []) if st["ok"] and name not in recorded]
    return missing


def report(out: Path | None = None) -> tuple[Path, Path]:
    """Write report.md and report.html in `out` from run.json, the recorded results and the figures."""
    out = Path(out) if out else default_out()
    run_info = _load_run(out)
    results = _results(out / "results")
    figures = sorted((out / "results" / "figures").glob("*.png"))
    hw = run_info.get("hardware") or hardware_report()
    chs = run_info["chapters"]
    total = sum(st["seconds"] for st in chs.values())
    failed = [k for k, st in chs.items() if not st["ok"]]
    md = [f"# accel-course report\n\n{machine_line(hw)}\n\nProfile **{run_info['profile']}**, finished "
          f"{run_info['finished']}: {len(chs) - len(failed)} of {len(chs)} chapters ran, in {total:.0f} s.\n"]
    if failed:
        md.append("**Failed:** " + ", ".join(f"{k} ({TITLES.get(k, chs[k]['notebook'])})" for k in failed) + "\n")
    for k, verdict in noisy_chapters(results).items():
        md.append(f"**Measured under noise, chapter {k}:** {verdict}. Its timings may not be trusted.\n")
    md += ["## Headline results\n", "| chapter | result | value | note |", "|---|---|---|---|"]
    md += [f"| {k} | {label} | {value} | {note} |" for k, label, value, note in headlines(results)]
    md += ["\n## Chapters\n", "| chapter | title | status | seconds |", "|---|---|---|---|"]
    for key, st in chs.items():
        md.append(f"| {key} | {TITLES.get(key, st['notebook'])} | {'ok' if st['ok'] else 'FAILED'} | "
                  f"{st['seconds']} |")
    md += ["\n## Hardware\n", "```", format_report(hw), "```"]
    for key, st in chs.items():
        md.append(f"\n## {key} · {TITLES.get(key, st['notebook'])}\n")
        if not st["ok"]:
            md.append(f"**Failed:** `{st['error']}`\n")
        entries = results.get(key, [])
        if entries:
            md += ["| result | value | unit | note |", "|---|---|---|---|"]
            md += [f"| {e['name']} | {_fmt_value(e)} | {e['unit']} | {e['note']} |" for e in entries]
        elif st["ok"]:
            md.append("No results recorded.")
        for fig in (f for f in figures if f.name.startswith(f"{key}_")):
            md.append(f"\n![{fig.stem}](results/figures/{fig.name})")
    md_path = out / "report.md"
    atomic_write_text(md_path, "\n".join(md) + "\n")
    html_path = out / "report.html"
    atomic_write_text(html_path, _html(run_info, hw, results, figures))
    return md_path, html_path


def _html(run_info: dict, hw: dict, results: dict, figures: list[Path]) -> str:
    """The report as one HTML page, rendered from templates/report.html.j2 (figures linked from results/figures)."""
    import jinja2

    chapters = [{"key": k, "title": TITLES.get(k, st["notebook"]), "ok": st["ok"], "error": str(st["error"]),
                 "seconds": st["seconds"], "figures": [f for f in figures if f.name.startswith(f"{k}_")],
                 "results": [{**r, "value": _fmt_value(r)} for r in results.get(k, [])]}
                for k, st in run_info["chapters"].items()]
    env = jinja2.Environment(loader=jinja2.PackageLoader("accelhelpers", "templates"), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    return env.get_template("report.html.j2").render(
        machine=machine_line(hw), profile=run_info["profile"], finished=run_info["finished"], chapters=chapters,
        n_ok=sum(c["ok"] for c in chapters), failed=[c for c in chapters if not c["ok"]],
        total_s=sum(c["seconds"] for c in chapters), noisy=list(noisy_chapters(results).items()),
        headlines=headlines(results), hardware=format_report(hw))


# --- the device check: one command that says what an accelerator machine achieved -----------------------------------

# Chapters whose code uses a GPU when there is one; chapter 07 needs XLA (it joins on a TPU host).
GPU_CHAPTERS = ("01", "02", "03", "04", "05", "06", "08", "09", "11")
# Chapters whose full profile is sized for one GPU: on a GPU the device check runs them in it (quick elsewhere).
FULL_ON_GPU = ("11",)


def hardware_slug(hw: dict[str, Any]) -> str:
    """A folder-name label for the hardware, e.g. 'gpu-nvidia-h200' or 'cpu-2core-amd-epyc'."""
    if hw.get("gpu"):
        name, kind = str(hw["gpu"]), "gpu"
    elif hw.get("best_device") == "xla":
        name, kind = f"{hw.get('tpu_chips', '')}chip", "tpu"
    else:
        words = str(hw.get("cpu", "cpu")).replace("(R)", "").replace("(TM)", "").split()
        name, kind = f"{hw.get('cpu_cores', '?')}core " + " ".join(words[:2]), "cpu"
    slug = "-".join("".join(ch if ch.isalnum() else " " for ch in name.lower()).split())
    return f"{kind}-{slug}"


def device_check(out: Path | None = None, record: bool = False, only: str | None = None,
                 param: list[str] | None = None, bench_args: tuple[str, ...] = ()) -> Path:
    """The hardware report, `bench fullbatch` and every chapter that can use this machine's accelerator (quick
    profile; on a GPU, the chapters of FULL_ON_GPU in their full profile) into `out` (default build/device-check);
    with `record`, copied into results/device-check_<hardware>_<date>/, refusing a folder that already exists
    (recorded evidence is never overwritten). `param` (NAME=VALUE) goes to the chapters as in `course run`, and
    `bench_args` to `bench fullbatch` (its --rounds, --round-s: the tests' small check of the machinery)."""
    import shutil
    import subprocess
    import sys

    out = Path(out) if out else default_out() / "device-check"
    hw = hardware_report()
    target = results_root() / f"device-check_{hardware_slug(hw)}_{time.strftime('%Y-%m-%d')}"
    if record and target.exists():
        raise CourseError(f"{target} already holds a recorded device check: move it away or run without --record")
    keys = only or ",".join(k for k in chapters() if k in GPU_CHAPTERS or (k == "07" and hw["best_device"] == "xla"))
    selected = check_args("quick", keys, out)
    if param:
        parse_parameters(param, selected)  # a bad NAME=VALUE stops here, before the benchmark's minutes
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "hardware.json", json.dumps(hw, indent=1))
    print(format_report(hw), flush=True)
    bench = subprocess.run([sys.executable, "-m", "accelhelpers", "bench", "fullbatch", "--json",
                            str(out / "bench_fullbatch.json"), *bench_args], text=True)
    full = {key: {"PROFILE": "full"} for key in FULL_ON_GPU} if hw.get("gpu") else None
    statuses = run("quick", keys, out, parameters=full, param=param)
    report(out)
    if record:
        shutil.copytree(out, target, ignore=shutil.ignore_patterns("notebooks", "ch[0-9][0-9]", "*.onnx", "*.pt"))
        print(f"recorded: {target}")
    failed = [s["chapter"] for s in statuses if not s["ok"]] + (["bench"] if bench.returncode else [])
    if failed:
        raise CourseError(f"the device check ran, but these parts failed: {', '.join(failed)} (see {out})")
    return target if record else out


def results_root() -> Path:
    """results/ in the checkout: recorded runs, each under its hardware and date."""
    return default_out().parent / "results"


# --- the README's chapter map and results tables, written from results/ (never typed) -------------------------

README_BEGIN = "<!-- results:begin (written by `python -m accelhelpers course readme`; do not edit by hand) -->"
README_END = "<!-- results:end -->"
MAP_BEGIN = "<!-- chapters:begin (written by `python -m accelhelpers course readme`; do not edit by hand) -->"
MAP_END = "<!-- chapters:end -->"


def _latest_run(root: Path, pattern: str) -> Path | None:
    """The recorded run of a kind (`course_*`, `device-check_*`) under `root` that finished last; None if none."""
    return latest_recorded(pattern, root)


def chapter_map(root: Path | None = None) -> str:
    """The README's chapter map: every chapter in notebooks/ with its time and first headline in the newest recorded
    course run under results/, and its Colab badge as `course links` writes it (from pyproject.toml)."""
    from .links import badge, repository

    root = root or results_root()
    checkout, folder = root.parent, _latest_run(root, "course_*")
    if folder is None:
        raise CourseError(f"no recorded course run under {root}: the chapter map's times and headlines come from one "
                          "(results/course_<hardware>_<date>/, with run.json and results/)")
    run_info, repo, rel = _load_run(folder), repository(checkout), folder.relative_to(checkout)
    first: dict[str, str] = {}
    for key, label, value, _ in headlines(_results(folder / "results")):
        first.setdefault(key, f"{label}: **{value}**")
    lines = [f"Each chapter's time and headline come from the newest recorded `make course` run ({run_info['profile']} "
             f"profile; {machine_line(run_info.get('hardware') or {})}; finished {run_info['finished']}; "
             f"[`{rel}/`]({rel}/)). Your machine will measure its own.\n",
             f"| # | chapter | time ({run_info['profile']} profile) | headline on that machine | open |",
             "|---|---|---|---|---|"]
    for key, nb in chapters(checkout / "notebooks").items():
        st = run_info["chapters"].get(key)
        seconds = f"{st['seconds']:.0f} s" if st else "–"
        head = ("not in that run" if st is None else first.get(key, "no headline recorded") if st["ok"]
                else f"FAILED: {st['error']}")
        lines.append(f"| {key} | [{TITLES.get(key, nb.stem)}](notebooks/{nb.name}) | {seconds} | {head} | "
                     f"{badge(repo, nb.name, alt='Colab')} |")
    return "\n".join(lines)


def _bench_table(path: Path) -> list[str]:
    """The chapter 02 benchmark table from one `bench fullbatch` JSON (schema 1: one figure a row; 2: medians and
    ranges over interleaved rounds)."""
    d = json.loads(path.read_text())
    hw, peak = d["hardware"], d["peak_gflops"]
    rounds = f"medians of {d['rounds']} interleaved rounds, ranges lowest–highest round" if d.get("rounds") else \
        "one figure a row (an older run: no ranges)"
    lines = [f"**Chapter 02, `python -m accelhelpers bench fullbatch`**, {d['created'][:10]}, {machine_line(hw)}; "
             f"{d['workload']['model']}, full batch {d['workload']['batch']}; all rows in one process, {rounds}; "
             f"JSON: [`{path.relative_to(path.parents[1])}`]({path.relative_to(path.parents[1])})\n",
             f"| loop | model-steps/s | GFLOP/s | of measured fp32 peak ({peak:.1f} GFLOP/s) | vs naive | "
             "udlbook's 1.1 M model-epochs |", "|---|---|---|---|---|---|"]
    for v in d["variants"]:
        rng, ratio_rng, scale = v.get("steps_per_s_range"), v.get("speedup_range"), v["n_models"]
        lines.append(f"| {v['name']}: {v['description']} | {v['model_steps_per_s']:.1f}"
                     + (f" ({rng[0] * scale:.1f}–{rng[1] * scale:.1f})" if rng else "")
                     + f" | {v['gflops']:.1f} | {v['fraction_of_peak'] * 100:.1f} % | {v['speedup_vs_naive']:.3g}×"
                     + (f" ({ratio_rng[0]:.3g}–{ratio_rng[1]:.3g})" if ratio_rng else "")
                     + f" | {hours(v['original_experiment_h'])} |")
    return lines


def _udlbook_table(path: Path) -> list[str]:
    """udlbook's experiment in full (`python -m accelhelpers reproduce udlbook-20.2`): one row per depth."""
    d = json.loads(path.read_text())
    st = d["settings"]
    rel = path.relative_to(path.parents[2])
    flag = "" if st.get("precision", "fp32") == "fp32" else f" --precision {st['precision']}"
    lines = [f"**udlbook's experiment in full, `python -m accelhelpers reproduce udlbook-20.2{flag}`**, started "
             f"{d['started'].replace('T', ' ')}, {machine_line(d['hardware'])}; {st['jobs']} process(es), "
             f"{st['threads'] or 'default'} thread(s) each; wall time **{d['wall_s'] / 60:.0f} min** (interruptions "
             f"included); training error every epoch, test error every {st['test_every']} epochs; JSON: "
             f"[`{rel}`]({rel}), figure: [`{rel.with_suffix('.png')}`]({rel.with_suffix('.png')})\n",
             "| depth | hidden units | parameters | epochs | final training error | lowest training error | "
             "first epoch at 0 % | final test error | training time | steps/s |", "|---" * 10 + "|"]
    for r in d["depths"]:
        zero = f"{r['first_zero_epoch']:,}" if r["first_zero_epoch"] else "never"
        lines.append(f"| {r['depth']} | {r['hidden']} | {r['params']:,} | {r['epochs']:,} | "
                     f"{r['final_train_err']:.2f} % | {r['min_train_err']:.2f} % | {zero} | "
                     f"{r['final_test_err']:.2f} % | {r['train_s'] / 60:.0f} min | {r['steps_per_s']:.0f} |")
    return lines


def _run_table(folder: Path, what: str) -> list[str]:
    """A recorded course run or device check: chapter, seconds, headline results."""
    run_info = _load_run(folder)
    results = _results(folder / "results")
    heads: dict[str, list[str]] = {}
    for key, label, value, _ in headlines(results):
        heads.setdefault(key, []).append(f"{label}: **{value}**")
    chs = run_info["chapters"]
    total = sum(st["seconds"] for st in chs.values())
    lines = [f"**{what}** ({run_info['profile']} profile, finished {run_info['finished']}, "
             f"{machine_line(run_info.get('hardware') or {})}; {total:.0f} s for {len(chs)} chapters; recorded in "
             f"[`{folder.relative_to(folder.parents[1])}/`]({folder.relative_to(folder.parents[1])}/)):\n",
             "| chapter | seconds | headline results |", "|---|---|---|"]
    for key, st in chs.items():
        status = "; ".join(heads.get(key, [])) if st["ok"] else f"FAILED: {st['error']}"
        lines.append(f"| {key} {TITLES.get(key, st['notebook'])} | {st['seconds']:.0f} | {status} |")
    return lines


def _speedrun_table(root: Path) -> list[str]:
    """Chapter 11's best recorded time to the target loss per hardware and profile (a profile is its own task and
    model), from the course runs and device checks recorded under results/; empty when none ran chapter 11."""
    best: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any] | None, Path]] = {}
    for folder in sorted(p for pattern in ("course_*", "device-check_*") for p in root.glob(pattern)
                         if (p / "run.json").exists()):
        run_info = _load_run(folder)
        entries = {e["name"]: e for e in _results(folder / "results").get("11", [])}
        e, status = entries.get("record_time_to_target_s"), run_info["chapters"].get("11", {})
        if e is None or not status.get("ok"):
            continue
        key = (machine_line(run_info.get("hardware") or {}), status.get("profile", run_info["profile"]))
        if key not in best or e["value"] < best[key][0]["value"]:
            best[key] = (e, entries.get("record_speedup"), folder)
    if not best:
        return []
    lines = ["**Chapter 11, the speedrun**: the best recorded time to the target loss per hardware and profile "
             "(training seconds, median over seeds with the range; compiling not included)\n",
             "| hardware | profile | time to target | baseline / record | the record's changes, target | recorded in |",
             "|---|---|---|---|---|---|"]
    for (machine, profile), (e, cum, folder) in sorted(best.items()):
        rel = folder.relative_to(folder.parents[1])
        lines.append(f"| {machine} | {profile} | {_fmt_entry(e)} | {_fmt_entry(cum) if cum else '-'} | {e['note']} | "
                     f"[`{rel}/`]({rel}/) |")
    return lines


def readme_tables(root: Path | None = None) -> str:
    """The README's results section body, from the newest recorded runs of each kind under results/."""
    root = root or results_root()
    parts: list[list[str]] = []
    benches = sorted(root.glob("bench_fullbatch_*.json"), key=lambda p: json.loads(p.read_text())["created"])
    if benches:
        parts.append(_bench_table(benches[-1]))
    from ..udlbook import EXPERIMENT, ResultError, recorded

    try:
        full, bf16 = recorded(root.parent), recorded(root.parent, precision="bf16")
    except ResultError as e:  # a damaged recorded run is the user's to fix, said in one line (as in _results)
        raise CourseError(str(e)) from e
    for run in (full, bf16):
        if run:
            parts.append(_udlbook_table(run[1] / f"{EXPERIMENT}.json"))
    for pattern, what in (("course_*", "The whole course, `make course`"),
                          ("device-check_*", "The device check, `make device-check`")):
        latest = _latest_run(root, pattern)
        if latest:
            parts.append(_run_table(latest, what))
    speedrun = _speedrun_table(root)
    if speedrun:
        parts.append(speedrun)
    return "\n\n".join("\n".join(p) for p in parts)


def write_readme(readme: Path | None = None, check: bool = False) -> bool:
    """Write the chapter map and the results tables between the README's markers; with `check`, only say whether
    they are current."""
    readme = readme or results_root().parent / "README.md"
    text = new = readme.read_text()
    for what, begin, end, body in (("chapter-map", MAP_BEGIN, MAP_END, chapter_map),
                                   ("results", README_BEGIN, README_END, readme_tables)):
        if begin not in new or end not in new:
            raise CourseError(f"{readme} has no {what} markers: put {begin!r} and {end!r} where the tables go")
        head, rest = new.split(begin, 1)
        new = f"{head}{begin}\n{body()}\n{end}{rest.split(end, 1)[1]}"
    if check:
        return new == text
    atomic_write_text(readme, new)
    return True
