"""Command line: `python -m accelhelpers env | bench fullbatch | reproduce udlbook-20.2 | course run | report`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    from . import __version__
    from .device import PROFILES

    p = argparse.ArgumentParser(prog="python -m accelhelpers", description="accel-course helpers")
    p.add_argument("--version", action="version", version=f"accelhelpers {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    env = sub.add_parser("env", help="print the hardware report")
    env.add_argument("--json", action="store_true", help="print it as JSON")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="which", required=True)
    fb = bsub.add_parser("fullbatch", help="chapter 02: naive loop vs fastai vs the fast paths, side by side")
    fb.add_argument("--min-steps", type=int, default=20, help="fewest steps a variant runs per round (default 20)")
    fb.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    fb.add_argument("--models", type=int, default=None, help="models in the many-models row (default 8)")
    fb.add_argument("--rounds", type=int, default=5, help="interleaved rounds; rows report the median (default 5)")
    fb.add_argument("--round-s", type=float, default=1.0, help="seconds per variant and round (default 1)")

    rp = sub.add_parser("reproduce", help="run a published experiment in full, resumable (udlbook-20.2)")
    rp.add_argument("experiment", choices=["udlbook-20.2"], help="udlbook-20.2: figure 20.2, four depths")
    rp.add_argument("--out", type=Path, default=Path("build/udlbook-20.2"), help="output folder (default: %(default)s)")
    rp.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    rp.add_argument("--jobs", type=int, default=1, help="worker processes, one thread each (default 1: this one)")
    rp.add_argument("--threads", type=int, default=None,
                    help="torch threads per process (default: torch's, 1 with --jobs)")
    rp.add_argument("--depths", type=_depths, default=None, help="comma-separated depths to train here "
                    "(default 1,2,3,4)")
    rp.add_argument("--epochs-scale", type=float, default=1.0, help="fraction of udlbook's epochs (tests, demos)")
    rp.add_argument("--test-every", type=int, default=100, help="measure the test error every k epochs (default 100)")
    rp.add_argument("--checkpoint-every", type=float, default=180.0, help="seconds between checkpoints (default 180)")
    rp.add_argument("--no-compile", action="store_true", help="run the fast path's functions eagerly (tests)")
    rp.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="fp32 (udlbook's arithmetic), or bf16 autocast with fp32 weights (default fp32)")
    rp.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)

    course = sub.add_parser("course", help="run the course and report")
    csub = course.add_subparsers(dest="action", required=True)
    run = csub.add_parser("run", help="execute the chapters with papermill into build/")
    run.add_argument("--profile", default="quick", choices=PROFILES,
                     help="quick (CPU, minutes), full (original sizes) or smoke (the full profile's code paths, a few "
                          "steps of each: does it run?); default quick")
    run.add_argument("--only", default=None, help="comma-separated chapter numbers, e.g. 01,03")
    run.add_argument("--out", type=Path, default=None, help="output folder (default: build/)")
    run.add_argument("--no-report", action="store_true", help="do not write the report afterwards")
    run.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                     help="set a papermill parameter in every chosen chapter that has it, e.g. "
                          "'MATMUL_SIZES=[16, 32]' (a Python literal; repeatable)")
    dc = csub.add_parser("device-check", help="hardware report, bench fullbatch and the chapters that can use "
                         "this machine's accelerator, in one command")
    dc.add_argument("--out", type=Path, default=None, help="output folder (default: build/device-check/)")
    dc.add_argument("--record", action="store_true", help="also copy it into results/device-check_<hardware>_<date>/")
    dc.add_argument("--only", default=None, help="comma-separated chapter numbers (default: all that can use it)")
    dc.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="a papermill parameter for the chapters, as in `course run` (repeatable)")
    dc.add_argument("--bench-rounds", type=int, default=None, help="bench fullbatch's --rounds (default its own)")
    dc.add_argument("--bench-round-s", type=float, default=None, help="bench fullbatch's --round-s (default its own)")
    rd = csub.add_parser("readme", help="write the README's chapter map and results tables from results/")
    rd.add_argument("--check", action="store_true", help="only check that the README's tables are current")
    lk = csub.add_parser("links", help="write the chapters' Colab badges and setup cells (and the README's badges) "
                         "from pyproject.toml's [project.urls] Repository and the package version")
    lk.add_argument("--check", action="store_true", help="only check that they agree; write nothing")
    rep = csub.add_parser("report", help="write report.html and report.md from the last run")
    rep.add_argument("--out", type=Path, default=None, help="the run's folder (default: build/)")
    return p


def _depths(text: str) -> list[int]:
    """--depths: comma-separated whole numbers (which depths exist is the command's to check)."""
    try:
        return [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of depths such as 1,2") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status: 0, 1 for a failed run, 2 for bad input (one line saying what to do),
    130 when interrupted. Any other exception is a bug in the package and leaves with its traceback."""
    from .commands import CommandError
    from .device import DeviceUnavailable

    args = _parser().parse_args(argv)
    try:
        if args.cmd == "env":
            from .device import format_report, hardware_report

            print(json.dumps(hardware_report(), indent=1) if args.json else format_report())
            return 0
        if args.cmd == "bench":
            from .commands.bench import main as bench_main

            return bench_main(args)
        if args.cmd == "reproduce":
            from .commands.reproduce import main as reproduce_main

            return reproduce_main(args)
        from .commands import course

        if args.action == "links":
            from .commands import links

            changed = links.sync(check=args.check)
            if not changed:
                print(f"badges and setup cells: current ({links.release()})")
                return 0
            if args.check:
                print(f"differ from pyproject.toml: {', '.join(changed)}: run `make links`", file=sys.stderr)
                return 1
            print(f"written: {', '.join(changed)}")
            return 0
        if args.action == "readme":
            if course.write_readme(check=args.check):
                print("README.md: chapter map and results tables "
                      + ("are current" if args.check else "written from results/"))
                return 0
            print("README.md: the chapter map or results tables differ from results/: run "
                  "`python -m accelhelpers course readme`", file=sys.stderr)
            return 1
        if args.action == "device-check":
            bench = [f"--{flag}={value}" for flag, value in (("rounds", args.bench_rounds),
                                                              ("round-s", args.bench_round_s)) if value is not None]
            print(f"device check: {course.device_check(args.out, args.record, args.only, args.param, tuple(bench))}")
            return 0
        if args.action == "run":
            statuses = course.run(args.profile, args.only, args.out, param=args.param)
            for s in statuses:
                mark = "ok " if s["ok"] else "FAILED"
                print(f"{mark:6} {s['chapter']} {s['notebook']} ({s['seconds']} s)"
                      + (f": {s['error']}" if s["error"] else ""))
            if not args.no_report:
                md, html = course.report(args.out)
                print(f"report: {html}")
                _note_missing_headlines(course, args.out)
            failed = [s["notebook"] for s in statuses if not s["ok"]]
            if failed:
                print(f"error: {len(failed)} chapter(s) failed: {', '.join(failed)}", file=sys.stderr)
                return 1
            return 0
        md, html = course.report(args.out)
        print(f"report: {html}\nreport: {md}")
        _note_missing_headlines(course, args.out)
        return 0
    except (CommandError, DeviceUnavailable) as e:  # bad input or a device that is not here: one clear line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: run.json and the report were left as they were", file=sys.stderr)
        return 130


def _note_missing_headlines(course: Any, out: Path | None) -> None:
    """Say which headline results a chapter that ran did not record (they are left out of the headline table)."""
    for m in course.missing_headlines(out):
        print(f"note: headline result not recorded, chapter {m} (HEADLINES in accelhelpers/commands/course.py)",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
