"""results and session: recording named measurements and figures where the report finds them."""

import json
from pathlib import Path

import matplotlib
import pytest

import accelhelpers as ah
from accelhelpers import results

matplotlib.use("Agg")


def test_record_writes_and_replaces(tmp_path):
    results.set_chapter("99")
    assert ah.results.record("speed", 3.5, "steps/s", "a note") == 3.5
    ah.results.record("speed", 4.0, "steps/s")
    ah.results.record("acc", float("nan"), "%")
    entries = json.loads((tmp_path / "results" / "99.json").read_text())
    assert [e["name"] for e in entries] == ["speed", "acc"]
    assert entries[0]["value"] == 4.0 and entries[1]["value"] == "nan"
    assert results.load_results(tmp_path / "results")["99"][0]["unit"] == "steps/s"


def test_record_accepts_tensors(tmp_path):
    import torch

    results.set_chapter("98")
    ah.results.record("t", torch.tensor(2.5))
    assert json.loads((tmp_path / "results" / "98.json").read_text())[0]["value"] == 2.5


def test_bad_names():
    with pytest.raises(ValueError):
        ah.results.record("", 1)
    with pytest.raises(ValueError):
        results.set_chapter(" ")


def test_corrupt_results_file_is_named(tmp_path):
    results.set_chapter("97")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "97.json").write_text("{")
    with pytest.raises(ValueError, match="97.json is not valid JSON .*: delete it and re-run the chapter"):
        ah.results.record("x", 1)


def test_read_json_names_the_file_and_the_fix_in_the_callers_error(tmp_path):
    class BadInput(ValueError):
        pass

    (tmp_path / "ok.json").write_text('{"a": [1, 2]}')
    assert results.read_json(tmp_path / "ok.json", "unused") == {"a": [1, 2]}
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(BadInput, match=r"bad.json is not valid JSON \(.*\): run it again$"):
        results.read_json(tmp_path / "bad.json", "run it again", BadInput)


def test_save_figure(tmp_path):
    import matplotlib.pyplot as plt

    results.set_chapter("96")
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    path = ah.results.save_figure(fig, "line")
    assert path == tmp_path / "results" / "figures" / "96_line.png" and path.stat().st_size > 0


def test_atomic_write_streams_removes_stale_temporaries_and_keeps_the_old_file_on_error(tmp_path):
    from accelhelpers.longrun import atomic_write

    target = tmp_path / "out.bin"
    stale = tmp_path / ".out.bin.abc123.tmp"
    stale.write_bytes(b"left by a killed writer")
    atomic_write(target, lambda f: f.write(b"first"))
    assert target.read_bytes() == b"first" and not stale.exists()

    def broken(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, broken)
    assert target.read_bytes() == b"first" and list(tmp_path.iterdir()) == [target]


def test_record_keeps_the_range():
    results.set_chapter("99")
    ah.results.record("ratio", 1.2, "x", "n", spread=(0.9, 1.5), repeats=5)
    entry = json.loads((ah.results.results_dir() / "99.json").read_text())[0]
    assert entry["spread"] == [0.9, 1.5] and entry["repeats"] == 5
    with pytest.raises(ValueError, match="spread must be"):
        ah.results.record("bad", 1.0, "x", spread=(2.0, 1.0))


def test_a_chapter_s_recorded_time_comes_from_the_newest_quick_course_run(tmp_path):
    """What every chapter's setup cell prints under its hardware report: its time in the newest recorded course run
    (by when it finished, not by folder name), nothing when that run was another profile or the chapter failed."""
    def recorded(name, finished, profile="quick", **chapters):
        (tmp_path / name).mkdir()
        run = {"profile": profile, "finished": finished, "hardware": {"cpu": "X"},
               "chapters": {k: {"ok": s is not None, "seconds": s or 0} for k, s in chapters.items()}}
        (tmp_path / name / "run.json").write_text(json.dumps(run))

    recorded("course_b_2026-12-01", "2026-12-01 10:00:00", **{"01": 40.0, "02": 120.0})
    recorded("course_a_2026-12-02", "2026-12-02 10:00:00", **{"01": 41.5, "02": None})
    recorded("device-check_a_2026-12-03", "2026-12-03 10:00:00", **{"01": 9.0})
    seconds, hw, folder = ah.results.recorded_seconds("01", tmp_path)
    assert (seconds, hw, folder.name) == (41.5, {"cpu": "X"}, "course_a_2026-12-02")
    assert ah.results.recorded_seconds("02", tmp_path) is None  # failed in the newest run
    assert ah.results.recorded_seconds("03", tmp_path) is None
    recorded("course_c_2026-12-04", "2026-12-04 10:00:00", profile="full", **{"01": 400.0})
    assert ah.results.recorded_seconds("01", tmp_path) is None  # the newest run was not the quick profile
    assert ah.results.recorded_seconds("01", tmp_path / "none") is None


def test_fresh_dir_empties_the_folder_and_names_it_from_here_inside_a_checkout(tmp_path, monkeypatch):
    outside = ah.results.fresh_dir("ch99", "workers")  # ACCEL_BUILD (the tests' tmp folder) is outside any checkout
    (outside / "stale.py").write_text("left by an earlier run")
    again = ah.results.fresh_dir("ch99", "workers")
    assert again == outside and again.is_absolute() and list(again.iterdir()) == []
    checkout = tmp_path / "course"
    (checkout / "accelhelpers").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text("")
    (checkout / "notebooks").mkdir()
    monkeypatch.setenv("ACCEL_BUILD", str(checkout / "build"))
    monkeypatch.chdir(checkout / "notebooks")  # where a chapter's kernel runs
    shown = ah.results.fresh_dir("ch99", "workers")
    assert shown == Path("../build/ch99/workers") and shown.is_dir()
    assert shown.resolve() == (checkout / "build" / "ch99" / "workers").resolve()
