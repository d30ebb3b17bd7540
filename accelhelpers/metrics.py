"""The numbers read off a model: accuracy and error, parameter and activation bytes, peak memory, and how far two
results are apart. Every chapter reads these the same way, so each is written once, here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn


def accuracy(logits: Any, y: Any) -> float:
    """Fraction of rows whose arg-max equals the label (torch tensors or NumPy arrays)."""
    torch_in = isinstance(logits, torch.Tensor)
    pred = logits.detach().argmax(-1) if torch_in else np.asarray(logits).argmax(axis=-1)
    y = torch.as_tensor(y, device=pred.device) if torch_in else np.asarray(y)
    if tuple(pred.shape) != tuple(y.shape):
        raise ValueError(f"logits give {tuple(pred.shape)} predictions but the labels have shape {tuple(y.shape)}")
    return (pred == y).float().mean().item() if torch_in else float((pred == y).mean())


def model_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of `model` on (x, y) in eval mode without gradients; the model's train/eval mode is restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return accuracy(model(x), y)
    finally:
        model.train(was_training)


def error_percent(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """% of rows whose argmax is not the label, as a 0-d tensor on the logits' device (no host sync, so it can
    live inside a compiled graph)."""
    return (logits.argmax(-1) != y).float().mean(-1) * 100


def param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters held by this process (for FSDP2's sharded DTensors, the local shard)."""
    local = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in local)


def saved_bytes(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while `fn()` runs, counted with saved-tensor
    hooks on any device; storages of `exclude` (e.g. the parameters, which exist anyway) are skipped."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()  # its output (and the graph) is dropped at once
    return sum(seen.values())


def activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for the backward pass of `model(x)`, parameters not counted: what grows with the batch."""
    return saved_bytes(lambda: model(x), exclude=model.parameters())


def peak_memory(fn: Callable[[], Any], device: torch.device | str) -> int | None:
    """Peak CUDA memory (bytes, above what was allocated before) while `fn()` runs; None on other devices, whose
    allocators keep no such statistic (use `saved_bytes` there)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    fn()
    torch.cuda.synchronize(dev)
    return int(torch.cuda.max_memory_allocated(dev) - base)


def _named(a: Any) -> dict[str, torch.Tensor] | list[torch.Tensor]:
    """A model's or state dict's tensors by name (DDP's `module.` prefix dropped), or a tensor, array or sequence
    of them as a list; every tensor as float64 on the CPU."""
    as64 = lambda t: torch.as_tensor(t).detach().to("cpu", torch.float64)
    if isinstance(a, nn.Module):
        a = a.state_dict()
    if isinstance(a, Mapping):
        return {k.removeprefix("module."): as64(v) for k, v in a.items()}
    if isinstance(a, torch.Tensor | np.ndarray) or np.isscalar(a):
        a = [a]
    return [as64(t) for t in a]


def _pairs(a: Any, b: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Matching tensors of two results (by name for models and state dicts); a clear error when they differ."""
    na, nb = _named(a), _named(b)
    if isinstance(na, dict) and isinstance(nb, dict):
        if na.keys() != nb.keys():
            raise ValueError(f"the models differ in parameters: {sorted(na.keys() ^ nb.keys())[:5]}")
        ta, tb = list(na.values()), [nb[k] for k in na]
    else:
        ta, tb = list(na.values() if isinstance(na, dict) else na), list(nb.values() if isinstance(nb, dict) else nb)
    if not ta or len(ta) != len(tb) or any(x.shape != y.shape for x, y in zip(ta, tb, strict=True)):
        raise ValueError(f"the results to compare do not match: {[tuple(t.shape) for t in ta]} vs "
                         f"{[tuple(t.shape) for t in tb]}")
    return list(zip(ta, tb, strict=True))


def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between two results (tensors, arrays, sequences, models or state dicts)."""
    return max((float((x - y).abs().max()) for x, y in _pairs(a, b) if x.numel()), default=0.0)


def rel_diff(a: Any, b: Any) -> float:
    """Norm of the difference over the norm of `b`, all tensors flattened together: a scale-free closeness."""
    pairs = _pairs(a, b)
    fa, fb = torch.cat([x.flatten() for x, _ in pairs]), torch.cat([y.flatten() for _, y in pairs])
    return float((fa - fb).norm() / fb.norm().clamp_min(1e-300))


def agreement(a: Any, b: Any) -> dict[str, float]:
    """How close two models' outputs [N, classes] are: max abs difference and the fraction of equal argmaxes."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"outputs to compare have different shapes {a.shape} and {b.shape}")
    return {"max_abs_diff": float(np.abs(a - b).max()), "argmax_agreement": float((a.argmax(1) == b.argmax(1)).mean())}
