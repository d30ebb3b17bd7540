"""Checkpoints (chapter 09): atomic save, safe verified load, exact resume in a fresh process (the chapter's
train.py and variants.py), a process killed mid-save (kill_mid_save.py), corruption."""

import pickle
import random
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import accelhelpers as ah
from tests import longrun_jobs as jobs


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """The chapter's scripts, as its %%writefile cells write them."""
    return jobs.workers(tmp_path_factory.mktemp("workers09"))


def tiny(seed: int = 0):
    """A small model, optimizer, scheduler and scaler with a few steps of state in them."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 6)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    return model, opt, sched, scaler


def same(a, b) -> bool:
    """Bit-for-bit equality of two nested states."""
    return ah.longrun.digest(a) == ah.longrun.digest(b)


def test_checkpoint_path_sorts_by_name_and_rejects_bad_steps(tmp_path):
    assert ah.longrun.checkpoint_path(tmp_path, 12).name == "step_00000012.pt"
    assert ah.longrun.checkpoint_path(tmp_path, 9).name < ah.longrun.checkpoint_path(tmp_path, 10).name
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            ah.longrun.checkpoint_path(tmp_path, bad)


def test_rng_state_round_trip_restores_python_numpy_and_torch():
    state = ah.longrun.rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3), torch.randint(0, 9, (4,)))
    ah.longrun.set_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3), torch.randint(0, 9, (4,)))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2]) and torch.equal(first[3], again[3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rng_states_survive_a_checkpoint(tmp_path):
    model = nn.Linear(2, 2).cuda()
    ah.longrun.save_checkpoint(tmp_path / "g.pt", model)
    first = torch.rand(4, device="cuda")
    ah.longrun.load_checkpoint(tmp_path / "g.pt", model)
    assert torch.equal(torch.rand(4, device="cuda"), first)


def test_digest_is_bit_exact_and_independent_of_container_copies():
    sd = nn.Linear(3, 2).state_dict()
    copy = {k: v.clone() for k, v in sd.items()}
    assert ah.longrun.digest(sd) == ah.longrun.digest(copy) and len(ah.longrun.digest(sd)) == 64
    copy["bias"][0] = torch.nextafter(copy["bias"][0], torch.tensor(1.0))  # one ulp
    assert ah.longrun.digest(sd) != ah.longrun.digest(copy)
    assert ah.longrun.digest([1, 2]) != ah.longrun.digest((1, 2))
    assert ah.longrun.digest({"a": 1}) != ah.longrun.digest({"a": 1.0})


@pytest.mark.slow
def test_unwrap_removes_data_parallel_and_compile_wrappers():
    model = nn.Linear(3, 2)
    assert ah.longrun.unwrap(nn.DataParallel(model)) is model
    assert ah.longrun.unwrap(torch.compile(model)) is model
    assert ah.longrun.unwrap(model) is model


@pytest.mark.slow
def test_save_and_load_restore_every_state_and_the_step(tmp_path):
    model, opt, sched, scaler = tiny()
    path = ah.longrun.save_checkpoint(tmp_path / "a.pt", model, opt, sched, scaler, step=3, extra={"epoch": 1})
    expected = [model.state_dict(), opt.state_dict(), sched.state_dict(), scaler.state_dict()]
    draws = torch.rand(5)
    m2, o2, s2, sc2 = tiny(seed=1)
    assert not same(m2.state_dict(), expected[0])
    assert ah.longrun.load_checkpoint(path, m2, o2, s2, sc2) == 3
    assert [same(a, b) for a, b in zip([m2.state_dict(), o2.state_dict(), s2.state_dict(), sc2.state_dict()],
                                       expected, strict=True)] == [True] * 4
    assert torch.equal(torch.rand(5), draws)  # the RNG continues where the save left it
    assert ah.longrun.read_checkpoint(path)["extra"] == {"epoch": 1}


def test_a_wrapped_model_saves_plain_keys(tmp_path):
    model = nn.Linear(3, 2)
    ah.longrun.save_checkpoint(tmp_path / "w.pt", nn.DataParallel(model))
    assert set(ah.longrun.read_checkpoint(tmp_path / "w.pt")["model"]) == {"weight", "bias"}


def test_bad_arguments_to_save_are_named(tmp_path):
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ah.longrun.save_checkpoint(tmp_path / "x.pt", model.state_dict())
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        ah.longrun.save_checkpoint(tmp_path / "x.pt", model, step=-2)
    with pytest.raises(ValueError, match="keep must be None or an int >= 1"):
        ah.longrun.save_checkpoint(tmp_path / "x.pt", model, keep=0)
    with pytest.raises(TypeError, match=r"checkpoint\['extra'\]\['mean'\] is a ndarray.*torch.from_numpy"):
        ah.longrun.save_checkpoint(tmp_path / "x.pt", model, extra={"mean": np.zeros(3)})
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_atomic_save_replaces_whole_files_and_cleans_its_temporaries(tmp_path):
    target = tmp_path / "deep" / "f.pt"
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / ".f.pt.stale.tmp").write_bytes(b"left by a killed save")
    ah.longrun.atomic_save({"a": torch.ones(2)}, target)
    ah.longrun.atomic_save({"a": torch.zeros(2)}, target)
    assert torch.equal(torch.load(target, weights_only=True)["a"], torch.zeros(2))
    assert [p.name for p in target.parent.iterdir()] == ["f.pt"]


def test_an_error_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = nn.Linear(4, 4)
    path = ah.longrun.save_checkpoint(tmp_path / "c.pt", model, step=1)

    def disk_full(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)  # what atomic_save calls
    with pytest.raises(OSError, match="No space left"):
        ah.longrun.save_checkpoint(path, model, step=2)
    assert ah.longrun.read_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


@pytest.mark.slow
def test_exact_resume_in_a_fresh_process_is_bit_identical(tmp_path, workers):
    """24 steps straight == killed after 13, resumed in a new process from step 8 with every state; resumed without
    one of the RNG states it is not (the test can fail: RNG states matter)."""
    args = ("--steps", 24, "--every", 8)
    procs = [jobs.start(workers["train.py"], tmp_path / "straight", *args),
             jobs.start(workers["train.py"], tmp_path / "cut", *args, "--die-at", 13)]
    assert [jobs.finish(p, 180)[0] for p in procs] == [0, -signal.SIGKILL]
    ckpt = ah.longrun.latest_good_checkpoint(tmp_path / "cut" / "ckpt")
    code, out = jobs.finish(jobs.start(workers["variants.py"], tmp_path / "v", "--ckpt", ckpt, "--steps", 24), 300)
    assert code == 0, out[-2000:]
    straight = ah.longrun.read_checkpoint(tmp_path / "straight" / "final.pt")
    resumed = ah.longrun.read_checkpoint(tmp_path / "v" / "final_all.pt")
    for key in ("model", "optimizer", "scheduler"):
        assert same(straight[key], resumed[key]), key
    assert resumed["step"] == 24 and ah.longrun.read_checkpoint(ckpt)["step"] == 8
    for rng in ("python", "numpy", "torch"):
        assert not same(straight["model"], ah.longrun.read_checkpoint(tmp_path / "v" / f"final_{rng}.pt")["model"])


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.5, 1.0], ids=["mid-write", "before-rename"])
def test_a_process_killed_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, fraction, workers):
    """SIGKILLed half-way through writing the temporary file, or with it complete but not yet renamed."""
    code, out = jobs.finish(jobs.start(workers["kill_mid_save.py"], tmp_path, "--way", "atomic", "--fraction",
                                       fraction), 180)
    assert code == -signal.SIGKILL, out[-2000:]
    temporaries = list(tmp_path.glob(".model.pt.*.tmp"))
    assert len(temporaries) == 1 and temporaries[0].stat().st_size > 0  # the killed save got that far
    assert ah.longrun.read_checkpoint(tmp_path / "model.pt")["step"] == 0
    assert ah.longrun.latest_good_checkpoint(tmp_path) == tmp_path / "model.pt"
    model = nn.Linear(64, 64)  # kill_mid_save.py's model
    assert ah.longrun.load_checkpoint(tmp_path / "model.pt", model) == 0
    ah.longrun.save_checkpoint(tmp_path / "model.pt", model, step=3)  # the next save sweeps the leftover away
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def _corrupt(path: Path, how: str, inside: torch.Tensor | None = None) -> None:
    """Damage a checkpoint file the ways disks and killed copies do ('flipped': one bit inside `inside`'s data)."""
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "empty":
        data = bytearray()
    elif how == "flipped":  # one bit in the weights: torch.load alone does not notice
        at = data.find(inside.detach().numpy().tobytes()[:64])
        assert at >= 0
        data[at + 33] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "empty", "flipped"])
def test_a_damaged_checkpoint_is_named_and_the_previous_good_one_is_used(tmp_path, how):
    model = nn.Linear(64, 64)
    ah.longrun.save_checkpoint(ah.longrun.checkpoint_path(tmp_path, 1), model, step=1)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1)
    bad = ah.longrun.save_checkpoint(ah.longrun.checkpoint_path(tmp_path, 2), model, step=2)
    _corrupt(bad, how, model.weight)
    with pytest.raises(ah.longrun.CheckpointError, match=re.escape(str(bad))):
        ah.longrun.read_checkpoint(bad)
    with pytest.raises(ah.longrun.CheckpointError, match=re.escape(str(bad))):
        ah.longrun.load_checkpoint(bad, model, fallback="never")
    older = ah.longrun.checkpoint_path(tmp_path, 1)
    loaded = rf"{re.escape(str(bad))}.*; loaded {re.escape(str(older))} \(step 1\) instead"
    with pytest.warns(ah.longrun.CheckpointWarning, match=loaded):
        assert ah.longrun.load_checkpoint(bad, model) == 1
    assert same(model.state_dict(), good)
    assert ah.longrun.latest_good_checkpoint(tmp_path) == ah.longrun.checkpoint_path(tmp_path, 1)
    ah.longrun.checkpoint_path(tmp_path, 1).unlink()
    with pytest.raises(ah.longrun.CheckpointError, match="no other good checkpoint"):
        ah.longrun.load_checkpoint(bad, model)


def test_a_missing_file_is_an_error_listing_the_checkpoints_that_exist(tmp_path):
    """A wrong path never loads another file silently: one line names the files there; fallback='always' asks."""
    model = nn.Linear(2, 2)
    with pytest.raises(ah.longrun.CheckpointError, match=r"nope.pt does not exist; no checkpoint in .* yet"):
        ah.longrun.load_checkpoint(tmp_path / "nope.pt", model)
    ah.longrun.save_checkpoint(tmp_path / "old.pt", model, step=3)
    ah.longrun.save_checkpoint(ah.longrun.checkpoint_path(tmp_path, 4), model, step=4)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ah.longrun.CheckpointError) as e:
        ah.longrun.load_checkpoint(tmp_path / "nope.pt", model)
    assert "\n" not in str(e.value)
    assert re.search(r"nope.pt does not exist; checkpoints in .*: old.pt, step_00000004.pt \(pass one of them",
                     str(e.value))
    assert same(model.state_dict(), changed)  # nothing was loaded
    loaded = r"nope.pt does not exist.*; loaded .*step_00000004.pt \(step 4\)"
    with pytest.warns(ah.longrun.CheckpointWarning, match=loaded):
        assert ah.longrun.load_checkpoint(tmp_path / "nope.pt", model, fallback="always") == 4
    assert same(model.state_dict(), before)
    with pytest.raises(ah.longrun.CheckpointError, match="is a folder"):
        ah.longrun.load_checkpoint(tmp_path, model)
    with pytest.raises(ValueError, match=r"fallback must be one of 'damaged', 'always', 'never', got True"):
        ah.longrun.load_checkpoint(tmp_path / "old.pt", model, fallback=True)


class _Evil:
    """Unpickling this would run code (create a file) if the loader trusted pickles."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_loading_never_unpickles_code_and_refuses_foreign_files(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"format": ah.longrun.FORMAT, "model": {}, "payload": _Evil(marker)}, evil)
    with pytest.raises(ah.longrun.CheckpointError, match=r"evil.pt is unreadable.*WeightsUnpickler"):
        ah.longrun.read_checkpoint(evil)
    assert not marker.exists()
    plain = tmp_path / "plain.pt"
    torch.save(nn.Linear(2, 2).state_dict(), plain)
    with pytest.raises(ah.longrun.CheckpointError, match="plain.pt is not an accelhelpers checkpoint"):
        ah.longrun.read_checkpoint(plain)
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(ah.longrun.CheckpointError, match="text.pt is unreadable"):
        ah.longrun.read_checkpoint(tmp_path / "text.pt")
    with pytest.raises(pickle.UnpicklingError):  # the reason: torch.load refuses it too
        torch.load(evil, weights_only=True)


def test_load_refuses_states_the_file_does_not_hold_and_wrong_models(tmp_path):
    model, opt, _, _ = tiny()
    ah.longrun.save_checkpoint(tmp_path / "m.pt", model)
    with pytest.raises(ah.longrun.CheckpointError, match="holds no optimizer state"):
        ah.longrun.load_checkpoint(tmp_path / "m.pt", model, opt)
    with pytest.raises(RuntimeError, match="size mismatch"):
        ah.longrun.load_checkpoint(tmp_path / "m.pt", nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 3)))


def test_keep_prunes_old_step_files_only(tmp_path):
    model = nn.Linear(2, 2)
    (tmp_path / "notes.pt").write_bytes(b"not ours")
    for step in range(1, 6):
        ah.longrun.save_checkpoint(ah.longrun.checkpoint_path(tmp_path, step), model, step=step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.pt", "step_00000004.pt", "step_00000005.pt"]


def test_latest_good_checkpoint_picks_the_newest_that_verifies(tmp_path):
    assert ah.longrun.latest_good_checkpoint(tmp_path / "missing") is None
    assert ah.longrun.latest_good_checkpoint(tmp_path) is None
    model = nn.Linear(2, 2)
    for step in (1, 2, 3):
        ah.longrun.save_checkpoint(ah.longrun.checkpoint_path(tmp_path, step), model, step=step)
    _corrupt(ah.longrun.checkpoint_path(tmp_path, 3), "truncated")
    assert ah.longrun.latest_good_checkpoint(tmp_path) == ah.longrun.checkpoint_path(tmp_path, 2)
    assert ah.longrun.latest_good_checkpoint(tmp_path, exclude=[ah.longrun.checkpoint_path(tmp_path, 2)]) == \
        ah.longrun.checkpoint_path(tmp_path, 1)


_plain = st.recursive(st.none() | st.booleans() | st.integers(-2**62, 2**62) | st.floats(allow_nan=False)
                      | st.text(max_size=8),
                      lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids,
                                                                                max_size=3),
                      max_leaves=8)

@settings(max_examples=40, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=_plain)
def test_property_any_plain_extra_round_trips(tmp_path, extra):
    ah.longrun.save_checkpoint(tmp_path / "p.pt", nn.Linear(2, 2), step=1, extra=extra)
    assert ah.longrun.read_checkpoint(tmp_path / "p.pt")["extra"] == extra

@settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_property_a_flipped_bit_anywhere_is_caught_or_harmless(tmp_path, where, bit):
    """Never silently different: any one-bit flip either raises CheckpointError or loads the same content."""
    path = tmp_path / "c.pt"
    if not path.exists():
        ah.longrun.save_checkpoint(path, nn.Linear(8, 8), step=7, extra={"note": "x"})
    original = path.read_bytes()
    data = bytearray(original)
    data[int(where * len(data))] ^= 1 << bit
    path.write_bytes(bytes(data))
    try:
        state = ah.longrun.read_checkpoint(path)
    except ah.longrun.CheckpointError:
        state = None
    finally:
        path.write_bytes(original)
    if state is not None:
        assert same(state, dict(ah.longrun.read_checkpoint(path).items()))


def test_atomic_save_writes_any_format_through_the_temporary_file(tmp_path):
    seen = []

    def write_text(obj, f):
        seen.extend(p.name for p in tmp_path.iterdir())
        f.write(obj.encode())

    ah.longrun.atomic_save("plain text", tmp_path / "notes.txt", write=write_text)
    assert (tmp_path / "notes.txt").read_text() == "plain text"
    assert len(seen) == 1 and seen[0].startswith(".notes.txt.") and seen[0].endswith(".tmp")
