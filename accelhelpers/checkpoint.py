"""Crash-safe checkpoints: atomic save, verified load, exact resume (model, optimizer, scheduler, scaler, RNGs).

A checkpoint is one `torch.save` file of plain state dicts, the RNG states and a SHA-256 digest of it all, written
atomically (`results.atomic_write`) and loaded with `torch.load(weights_only=True)`, which never runs its code.
"""

from __future__ import annotations

import hashlib
import random
import re
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import nn

from .internals import compiled_original
from .results import atomic_write

FORMAT = "accelhelpers.checkpoint/1"
SUFFIXES = (".pt", ".pth", ".ckpt")
_STEP_NAME = re.compile(r"^step_(\d+)\.pt$")
_serialize = torch.save  # one indirection, so tests can crash a save half-way


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or not a checkpoint; the message names the file."""


class CheckpointWarning(UserWarning):
    """A bad checkpoint was skipped and an older good one was loaded instead."""


def checkpoint_path(folder: str | Path, step: int) -> Path:
    """The conventional file name for the checkpoint of `step` in `folder` (step_00000123.pt), sortable by name."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return Path(folder) / f"step_{step:08d}.pt"


def rng_state() -> dict[str, Any]:
    """The Python, NumPy, torch CPU and CUDA random states, in types `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state(legacy=False)
    np_state["state"] = {"key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                         "pos": int(np_state["state"]["pos"])}
    cuda = [s.cpu() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
    return {"python": random.getstate(), "numpy": np_state, "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states saved by `rng_state` (CUDA ones only where the same number of GPUs is present)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = dict(state["numpy"])
    np_state["state"] = {"key": np_state["state"]["key"].numpy().astype(np.uint32), "pos": np_state["state"]["pos"]}
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DistributedDataParallel/DataParallel and `torch.compile` wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif compiled_original(model) is not None:
            model = compiled_original(model)
        else:
            return model


def digest(obj: Any) -> str:
    """SHA-256 of a nested state (dict/list/tuple of tensors and plain values), independent of device."""
    h = hashlib.sha256()
    _feed(h, obj, "checkpoint")
    return h.hexdigest()


def _feed(h: Any, obj: Any, where: str) -> None:
    """Add one value to the running hash, recursing into containers in their order; refuse values that
    `torch.load(weights_only=True)` could not read back (so a save never writes a trap)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k, v in obj.items():
            _feed(h, k, f"{where} key")
            _feed(h, v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
        for i, v in enumerate(obj):
            _feed(h, v, f"{where}[{i}]")
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    else:
        raise TypeError(f"{where} is a {type(obj).__name__}, which a safe (weights_only) load cannot read: "
                        "use numbers, strings, tensors, and lists/tuples/dicts of them (e.g. torch.from_numpy(a))")


def atomic_save(obj: Any, path: str | Path, write: Callable[[Any, BinaryIO], Any] | None = None) -> Path:
    """`write(obj, file)` (default `torch.save`) through `results.atomic_write`: a temporary file in the same
    folder, fsync, `os.replace`: the file at `path` is the old one or the new one, never a part."""
    return atomic_write(path, lambda f: (write or _serialize)(obj, f))


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, scaler: Any = None, step: int = 0, extra: Any = None,
                    keep: int | None = None) -> Path:
    """Atomically save everything needed to resume exactly; `keep=n` then deletes all but the newest n
    step_*.pt files in the folder."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be None or an int >= 1, got {keep!r}")
    state = {"format": FORMAT, "step": step, "torch": str(torch.__version__),
             "model": unwrap(model).state_dict(),
             "optimizer": optimizer.state_dict() if optimizer is not None else None,
             "scheduler": scheduler.state_dict() if scheduler is not None else None,
             "scaler": scaler.state_dict() if scaler is not None else None,
             "rng": rng_state(), "extra": extra}
    state["sha256"] = digest(state)  # raises TypeError before anything is written if a value is not plain
    path = atomic_save(state, path)
    if keep is not None:
        numbered = sorted(p for p in path.parent.iterdir() if _STEP_NAME.match(p.name))
        for old in numbered[:-keep]:
            if old != path:
                old.unlink(missing_ok=True)
    return path


def read_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and verify one checkpoint file safely (weights_only); CheckpointError names a bad file."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder: pass a checkpoint file, e.g. latest_good_checkpoint({str(path)!r})")
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        why = next((line.strip() for line in str(e).splitlines() if "WeightsUnpickler" in line), str(e)[:200])
        raise CheckpointError(f"checkpoint {path} is unreadable (truncated, corrupt, or holding objects a safe "
                              f"load refuses: {type(e).__name__}: {why}); use an older checkpoint") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an accelhelpers checkpoint (no '{FORMAT}' format tag): "
                              "write it with save_checkpoint")
    stored = state.pop("sha256", None)
    if stored != digest(state):
        raise CheckpointError(f"checkpoint {path} is corrupt: its contents do not match the SHA-256 digest "
                              "saved with them; use an older checkpoint")
    return state


def _files(folder: Path) -> list[Path]:
    """The checkpoint files in `folder` (not the temporaries of a save in progress; none if it is no folder)."""
    return [p for p in folder.iterdir() if p.suffix in SUFFIXES and not p.name.startswith(".") and p.is_file()] \
        if folder.is_dir() else []


def latest_good_checkpoint(folder: str | Path, exclude: Iterable[str | Path] = ()) -> Path | None:
    """The newest checkpoint file in `folder` that loads and verifies (None if there is none): what to resume."""
    skip = {Path(p).resolve() for p in exclude}
    files = [p for p in _files(Path(folder)) if p.resolve() not in skip]
    for p in sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True):
        try:
            read_checkpoint(p)
        except CheckpointError:
            continue
        return p
    return None


FALLBACKS = ("damaged", "always", "never")


def _read_or_fall_back(path: Path, fallback: str, map_location: str | torch.device) -> tuple[Path, dict[str, Any]]:
    """Read `path`; a damaged file (or, with fallback='always', a missing one) gives the newest good checkpoint
    in the same folder instead, with a CheckpointWarning naming the file loaded."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {', '.join(map(repr, FALLBACKS))}, got {fallback!r}")
    missing = not path.exists()
    try:
        return path, read_checkpoint(path, map_location)
    except CheckpointError as e:
        error, folder = e, path.parent
        if missing:  # one line naming the checkpoints that are there
            names = sorted(p.name for p in _files(folder))
            error = CheckpointError(f"{e}; checkpoints in {folder}: {', '.join(names)} (pass one of them, or "
                                    "fallback='always' to load the newest good one)" if names else
                                    f"{e}; no checkpoint in {folder} yet")
        if fallback == "never" or path.is_dir() or (missing and fallback != "always"):
            raise error from e
        other = latest_good_checkpoint(path.parent, exclude=[path])
        if other is None:
            raise CheckpointError(f"{e}; no other good checkpoint in {path.parent}") from e
        state = read_checkpoint(other, map_location)
        warnings.warn(f"{e}; loaded {other} (step {state['step']}) instead", CheckpointWarning, stacklevel=3)
        return other, state


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None, scaler: Any = None, *, fallback: str = "damaged", restore_rng: bool = True,
                    map_location: str | torch.device = "cpu") -> int:
    """Restore model, optimizer, scheduler, scaler and RNG states from `path` and return the saved step. A missing
    file is an error listing the checkpoints there; a damaged one loads the newest good one in the same folder with
    a warning naming it (fallback='never' raises instead, fallback='always' also replaces a missing file)."""
    path, state = _read_or_fall_back(Path(path), fallback, map_location)
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None and state[name] is None:
            raise CheckpointError(f"checkpoint {path} holds no {name} state: pass {name}=None or save it with one")
    unwrap(model).load_state_dict(state["model"])
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is not None:
            obj.load_state_dict(state[name])
    if restore_rng:
        set_rng_state(state["rng"])
    return int(state["step"])
