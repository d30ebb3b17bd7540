"""Faults a long training run meets: non-finite losses (agreed across DDP ranks), out-of-memory (classified,
memory released, batch size backed off), dead or stuck peers (a clear error within a timeout, not a hang) and
preemption (SIGTERM turned into a flag the loop checks, so it saves and exits at a step boundary).

Chapter 09 teaches every piece in its cells: each has one definition, exported from its cell into `longrun`; this
module names them for the rest of the package (chapter 05's batch-size finder, chapter 06's workers, the commands).
"""

from .longrun import (  # taught in chapter 09: one definition each, exported from its cells
    NonFiniteError,
    PeerFailure,
    Preemption,
    bad_ranks,
    check_finite,
    finish_distributed,
    free_memory,
    init_distributed,
    is_finite,
    oom_kind,
    peer_guard,
    with_batch_backoff,
)

__all__ = ["NonFiniteError", "PeerFailure", "Preemption", "bad_ranks", "check_finite", "finish_distributed",
           "free_memory", "init_distributed", "is_finite", "oom_kind", "peer_guard", "with_batch_backoff"]
