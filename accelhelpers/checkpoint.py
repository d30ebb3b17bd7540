"""Crash-safe checkpoints: atomic save, verified load, exact resume (model, optimizer, scheduler, scaler, RNGs).

A checkpoint is one `torch.save` file of plain state dicts, the RNG states and a SHA-256 digest of it all, written
atomically and loaded with `torch.load(weights_only=True)`, which never runs its code. Chapter 09 teaches every
piece in its cells: each has one definition, exported from its cell into `longrun`; this module names them for the
rest of the package (chapter 06's workers, the commands) and for later chapters.
"""

from .longrun import (  # taught in chapter 09: one definition each, exported from its cells
    FALLBACKS,
    FORMAT,
    SUFFIXES,
    CheckpointError,
    CheckpointWarning,
    atomic_save,
    atomic_write,
    checkpoint_path,
    digest,
    latest_good_checkpoint,
    load_checkpoint,
    read_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    unwrap,
)

__all__ = ["FALLBACKS", "FORMAT", "SUFFIXES", "CheckpointError", "CheckpointWarning", "atomic_save", "atomic_write",
           "checkpoint_path", "digest", "latest_good_checkpoint", "load_checkpoint", "read_checkpoint", "rng_state",
           "save_checkpoint", "set_rng_state", "unwrap"]
