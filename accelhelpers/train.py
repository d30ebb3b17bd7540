"""The training loops chapter 02 compares: the naive reference, a configurable loop for the ablation,
many models trained at once, and fastai's Learner on the same full-batch workload."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .data import Split
from .device import sync
from .internals import dynamo_explain, mark_static_address, quiet_dynamo_logs
from .metrics import accuracy, error_percent
from .session import progress as _progress


@dataclass
class History:
    """Per-epoch % error on the training and test sets (one row per model for many-model runs)."""

    train_err: np.ndarray
    test_err: np.ndarray
    loss: np.ndarray = field(default_factory=lambda: np.zeros(0))


def _check(data: Split, epochs: int, lr: float) -> None:
    """Refuse arguments that would make a run meaningless."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, got {epochs}")
    if not lr > 0:
        raise ValueError(f"the learning rate must be positive, got {lr}")
    if data.x_train.ndim != 2 or len(data.x_train) != len(data.y_train):
        raise ValueError(f"expected x_train [N, features] with N labels, got {tuple(data.x_train.shape)} "
                         f"and {tuple(data.y_train.shape)}")


def udlbook_loop(model: nn.Module, data: Split, epochs: int, lr: float = 0.0025) -> History:
    """udlbook's loop as written (notebook 20.2): a DataLoader over a TensorDataset with batch_size = the whole set
    (it collates 4000 items per step, in order), SGD, and each epoch's training error taken from the step's own
    forward pass (before its update) and copied into NumPy (a host sync). No test error (NaN)."""
    _check(data, epochs, lr)
    loss_function = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data_loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=len(data.x_train))
    errors_train, losses = np.zeros(epochs), []
    for epoch in range(epochs):
        for x_batch, y_batch in data_loader:
            optimizer.zero_grad()
            pred = model(x_batch)
            loss = loss_function(pred, y_batch)
            loss.backward()
            optimizer.step()
        _, predicted_train_class = torch.max(pred.data, 1)
        errors_train[epoch] = 100 - 100 * (predicted_train_class == y_batch).float().sum() / len(y_batch)
        losses.append(loss.detach())
    return History(errors_train, np.full(epochs, np.nan), torch.stack(losses).numpy())


def naive_fullbatch(model: nn.Module, data: Split, epochs: int, lr: float = 0.0025) -> History:
    """udlbook's loop plus what many notebooks add (not udlbook): a shuffling DataLoader and, every epoch, a
    forward pass over the whole training set and one over the test set, errors copied into NumPy (a host sync)."""
    _check(data, epochs, lr)
    loss_function = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data_loader = DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=len(data.x_train),
                             shuffle=True)
    errors_train, errors_test, losses = np.zeros(epochs), np.zeros(epochs), np.zeros(epochs)
    for epoch in range(epochs):
        for x_batch, y_batch in data_loader:
            optimizer.zero_grad()
            pred = model(x_batch)
            loss = loss_function(pred, y_batch)
            loss.backward()
            optimizer.step()
        pred_train = model(data.x_train)
        pred_test = model(data.x_test)
        _, predicted_train_class = torch.max(pred_train.data, 1)
        _, predicted_test_class = torch.max(pred_test.data, 1)
        errors_train[epoch] = 100 - 100 * (predicted_train_class == data.y_train).float().sum() / len(data.y_train)
        errors_test[epoch] = 100 - 100 * (predicted_test_class == data.y_test).float().sum() / len(data.y_test)
        losses[epoch] = loss.item()
    return History(errors_train, errors_test, losses)


def _mlp_linears(model: nn.Module, who: str) -> list[nn.Linear]:
    """The Linear layers of a Sequential ReLU MLP (Linear, ReLU, Linear, ..., Linear), or a clear error."""
    linears = [m for m in model if isinstance(m, nn.Linear)] if isinstance(model, nn.Sequential) else []
    kinds = [type(m) for m in model] if isinstance(model, nn.Sequential) else []
    if not linears or kinds != [nn.Linear, nn.ReLU] * (len(linears) - 1) + [nn.Linear]:
        raise ValueError(f"{who} needs an nn.Sequential of Linear layers with a ReLU between each pair")
    return linears


def pad_mlp(model: nn.Sequential, multiple: int = 16) -> nn.Sequential:
    """A copy of a ReLU MLP whose hidden widths are rounded up to a multiple of `multiple` (the vector width:
    16 fp32 lanes in AVX-512) with zero weights and biases. The extra units output relu(0) = 0 and receive zero
    gradients, so they stay zero and the padded model computes and learns exactly what the original does."""
    linears = _mlp_linears(model, "pad_mlp")
    sizes = [linears[0].in_features] + [-(-lin.out_features // multiple) * multiple for lin in linears[:-1]]
    sizes.append(linears[-1].out_features)
    layers: list[nn.Module] = []
    for i, lin in enumerate(linears):
        new = nn.Linear(sizes[i], sizes[i + 1]).to(lin.weight.device)
        with torch.no_grad():
            new.weight.zero_()
            new.bias.zero_()
            new.weight[: lin.out_features, : lin.in_features] = lin.weight
            new.bias[: lin.out_features] = lin.bias
        layers += [new] + ([nn.ReLU()] if i < len(linears) - 1 else [])
    return nn.Sequential(*layers)


class FullBatchLoop:
    """One full-batch training loop with each speed-up as a switch, so the ablation changes one thing at a time.

    dataloader: go through a DataLoader over a TensorDataset (True) or use the device tensors directly.
    host_sync: read the metrics into NumPy every epoch (True) or keep them on the device and read once.
    fused: zero_grad(set_to_none=True) and a foreach SGD (vs. zeroing in place and a per-parameter loop).
    compile: torch.compile the whole step (inductor on CPU; mode='reduce-overhead', CUDA graphs, on GPU).
    Train error comes from the step's own forward pass (before the update); test error from a no-grad pass.
    """

    def __init__(self, model: nn.Module, data: Split, lr: float = 0.0025, *, dataloader: bool = False,
                 host_sync: bool = False, fused: bool = True, compile: bool = False) -> None:
        _check(data, 1, lr)
        self.model, self.data, self.host_sync, self.fused = model, data, host_sync, fused
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=fused)
        self.loader = (DataLoader(TensorDataset(data.x_train, data.y_train), batch_size=len(data.x_train))
                       if dataloader else None)
        step = self._step
        if compile:
            quiet_dynamo_logs()
            step = torch.compile(step, **compile_options(data.device))
        self.step = step

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward, backward, update; returns (loss, train error %, test error %) as device tensors."""
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        return loss.detach(), error_percent(logits.detach(), y), self._update(loss, set_to_none=self.fused)

    def _update(self, loss: torch.Tensor, set_to_none: bool = True) -> torch.Tensor:
        """Backward and SGD update from `loss`, then the test error % of the updated model (a device tensor)."""
        self.opt.zero_grad(set_to_none=set_to_none)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            return error_percent(self.model(self.data.x_test), self.data.y_test)

    def run(self, epochs: int, progress: str | bool = False) -> History:
        """Train for `epochs` full-batch steps and return the per-epoch errors (`progress`: a bar, or its label)."""
        _check(self.data, epochs, 1.0)
        rows = []  # per epoch, (loss, train error, test error): floats with host_sync, else device tensors
        for _ in _progress(range(epochs), progress, unit="epoch"):
            x, y = next(iter(self.loader)) if self.loader is not None else (self.data.x_train, self.data.y_train)
            loss, tr, te = self.step(x, y)
            rows.append([loss.item(), tr.item(), te.item()] if self.host_sync else torch.stack([loss, tr, te]))
        host = np.array(rows).T if self.host_sync else torch.stack(rows, -1).cpu().numpy()  # one read of the run
        return History(host[1], host[2], host[0])


def _mlp_forward_t(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A ReLU MLP from its (weight, bias) tensors, with the logits laid out [classes, batch]: the softmax then
    reduces along memory that is contiguous across the batch, which vectorizes (10 classes per row do not)."""
    h = x
    for i in range(0, len(params) - 2, 2):
        h = torch.relu(torch.addmm(params[i + 1], h, params[i].T))
    return torch.addmm(params[-1][:, None], params[-2], h.T)


def _loss_t(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy from [classes, batch] logits (logsumexp minus the label's logit); aux: the logits."""
    logits_t = _mlp_forward_t(params, x)
    return (torch.logsumexp(logits_t, 0) - logits_t.gather(0, y[None])[0]).mean(), logits_t


def _fullgraph_train_step(lr: float, params: list[torch.Tensor], x: torch.Tensor,
                          y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward, backward (torch.func) and SGD update in place; returns (loss, train error % of this forward)."""
    grads, (loss, logits_t) = torch.func.grad_and_value(_loss_t, has_aux=True)(params, x, y)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(lr * g)
    return loss.detach(), error_percent(logits_t.detach().T, y)


def _fullgraph_test_err(params: list[torch.Tensor], x_test: torch.Tensor, y_test: torch.Tensor) -> torch.Tensor:
    """% test error of the MLP given by `params` (a no-grad forward pass)."""
    with torch.no_grad():
        return error_percent(_mlp_forward_t(params, x_test).T, y_test)


def _fullgraph_step(lr: float, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor,
                    y_test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward, backward (torch.func), SGD update in place and both metrics: one pure function, one graph."""
    loss, train_err = _fullgraph_train_step(lr, params, x, y)
    return loss, train_err, _fullgraph_test_err(params, x_test, y_test)


class FullGraphLoop(FullBatchLoop):
    """The fast path's last step: the whole training step as one pure function of the weight tensors, compiled
    with fullgraph=True. `loss.backward()` and `optimizer.step()` split a compiled step into several graphs
    with Python between them; `torch.func.grad_and_value` puts forward, backward, update and metrics into one.
    The logits are computed transposed ([classes, batch]) so the softmax vectorizes. Same SGD, same model:
    the weights are updated in place, so `model` holds the trained weights afterwards.

    test_every: measure the test error after every k-th step only (the others record NaN); k = 1 keeps it in
    the step's graph, k > 1 compiles a training-only step and a separate test pass (udlbook records only the
    training error, which the step's own forward pass gives for free). compile=False runs the same functions
    eagerly (for tests)."""

    def __init__(self, model: nn.Sequential, data: Split, lr: float = 0.0025, *, test_every: int = 1,
                 compile: bool = True) -> None:
        _check(data, 1, lr)
        if isinstance(test_every, bool) or not isinstance(test_every, int) or test_every < 1:
            raise ValueError(f"test_every must be an int >= 1, got {test_every!r}")
        linears = _mlp_linears(model, "FullGraphLoop")
        self.model, self.data, self.host_sync, self.fused, self.loader = model, data, False, True, None
        self.test_every = test_every
        # Detached views share the parameters' storage: updating them in place trains `model` itself.
        self.params = [t.detach() for lin in linears for t in (lin.weight, lin.bias)]
        self._step = lambda x, y: _fullgraph_step(lr, self.params, x, y, data.x_test, data.y_test)
        wrap = lambda f: f  # noqa: E731
        if compile:  # fullgraph=True; with CUDA graphs the weights keep their addresses, so mark them static
            quiet_dynamo_logs()
            for p in self.params if data.device.type == "cuda" else []:
                mark_static_address(p)
            wrap = partial(torch.compile, fullgraph=True, **compile_options(data.device))
        if test_every == 1:
            compiled = wrap(partial(_fullgraph_step, lr))
            self.step = lambda x, y: compiled(self.params, x, y, data.x_test, data.y_test)
        else:
            train_step, test_err = wrap(partial(_fullgraph_train_step, lr)), wrap(_fullgraph_test_err)
            self.train_step = lambda x, y: train_step(self.params, x, y)
            self.test_error = lambda: test_err(self.params, data.x_test, data.y_test)

    def run(self, epochs: int, progress: str | bool = False) -> History:
        """Train for `epochs` full-batch steps; the test error after every `test_every`-th step (NaN elsewhere)."""
        if self.test_every == 1:
            return super().run(epochs, progress)
        _check(self.data, epochs, 1.0)
        x, y = self.data.x_train, self.data.y_train
        nan = torch.tensor(float("nan"), device=self.data.device)
        rows = []
        for epoch in _progress(range(epochs), progress, unit="epoch"):
            loss, tr = self.train_step(x, y)
            rows.append(torch.stack([loss, tr, self.test_error() if (epoch + 1) % self.test_every == 0 else nan]))
        host = torch.stack(rows, 1).cpu().numpy()
        return History(host[1], host[2], host[0])


def compile_options(device: torch.device) -> dict[str, Any]:
    """torch.compile's arguments for `device`: CUDA graphs on a GPU; on a CPU, the thread count now in force
    written into the generated code. Inductor's cache (torch 2.9) does not key on the thread count, so without
    it a graph first compiled at 2 threads is reused at 1 and still forks 2 OpenMP threads every step."""
    if device.type == "cuda":
        return {"mode": "reduce-overhead"}
    return {"options": {"cpp.threads": torch.get_num_threads()}} if device.type == "cpu" else {}


@dataclass
class GraphReport:
    """What torch.compile's tracer (Dynamo) makes of one training step."""

    graphs: int
    graph_breaks: int
    reasons: list[str]  # one line per distinct reason for a break: Dynamo's explanation when it gives one


def graph_breaks(loop: FullBatchLoop) -> GraphReport:
    """Trace one step of `loop` with Dynamo's explain (nothing is compiled or trained) and count the graphs
    and graph breaks: each break is a place where compiled code stops and Python runs in between."""
    quiet_dynamo_logs()
    with torch.no_grad():
        saved = [p.detach().clone() for p in loop.model.parameters()]
    try:
        ex = dynamo_explain(loop._step, loop.data.x_train, loop.data.y_train)
    finally:  # tracing runs the step once: put the weights back
        with torch.no_grad():
            for p, s in zip(loop.model.parameters(), saved):
                p.copy_(s)
    reasons = []
    for b in ex.break_reasons:
        lines = [ln.strip() for ln in str(b.reason).splitlines() if ln.strip()]
        why = [ln.removeprefix("Explanation:").strip() for ln in lines if ln.startswith("Explanation:")]
        reasons.append((why or lines or ["?"])[0])
    return GraphReport(ex.graph_count, ex.graph_break_count, reasons)


class ManyMLP(nn.Module):
    """K independent ReLU MLPs of the same shape evaluated as batched matmuls: weights [K, in, out].

    The first layer of all K models is one matmul against the shared input; later layers are `baddbmm`.
    """

    def __init__(self, models: list[nn.Sequential]) -> None:
        super().__init__()
        linears = [[m for m in model if isinstance(m, nn.Linear)] for model in models]
        if not linears or any(len(ls) != len(linears[0]) for ls in linears):
            raise ValueError("ManyMLP needs at least one model, all of the same depth")
        self.k = len(models)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.stack([ls[i].weight.detach().T.contiguous() for ls in linears]))
            for i in range(len(linears[0])))
        self.biases = nn.ParameterList(
            nn.Parameter(torch.stack([ls[i].bias.detach() for ls in linears]).unsqueeze(1))
            for i in range(len(linears[0])))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, in] -> logits [K, B, out]."""
        w0, b0 = self.weights[0], self.biases[0]
        k, n_in, n_out = w0.shape
        h = (x @ w0.permute(1, 0, 2).reshape(n_in, k * n_out)).reshape(len(x), k, n_out).transpose(0, 1) + b0
        for w, b in zip(self.weights[1:], self.biases[1:]):
            h = torch.baddbmm(b, torch.relu(h), w)
        return h


class ManyModelsLoop(FullBatchLoop):
    """Full-batch SGD of K models at once (a ManyMLP): each model's loss is its own mean cross-entropy, so
    the summed loss gives every model exactly the gradient it would get alone."""

    def __init__(self, models: list[nn.Sequential], data: Split, lr: float = 0.0025, *,
                 compile: bool = False) -> None:
        self.many = ManyMLP(models).to(data.device)
        super().__init__(self.many, data, lr, compile=compile)

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step for all K models; returns per-model (loss, train error %, test error %)."""
        logits = self.many(x)  # [K, B, C]
        k, b, c = logits.shape
        losses = F.cross_entropy(logits.reshape(k * b, c), y.repeat(k), reduction="none").view(k, b).mean(1)
        test_err = self._update(losses.sum())  # the models share no weights: one backward serves all K
        return losses.detach(), error_percent(logits.detach(), y), test_err


def fastai_learner(model: nn.Module, data: Split, lr: float = 0.0025):
    """A fastai Learner on the same full-batch workload: one batch of the whole set, plain SGD, no momentum."""
    import fastai.callback.progress  # noqa: F401  (adds Learner.no_bar and the progress bar)
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.optimizer import SGD

    train = TensorDataset(data.x_train, data.y_train)
    valid = TensorDataset(data.x_test, data.y_test)
    dls = DataLoaders.from_dsets(train, valid, bs=len(data.x_train), shuffle=True, device=data.device)
    return Learner(dls, model, loss_func=nn.CrossEntropyLoss(), opt_func=partial(SGD, mom=0.0, wd=0.0), lr=lr)


def clone(model: nn.Module) -> nn.Module:
    """An independent copy (same initial weights) for a fair side-by-side run."""
    return copy.deepcopy(model)


# ---------------------------------------------------------------------------------------------------------------
# The one minibatch loop every other chapter uses


@dataclass
class FitHistory:
    """Per-epoch test accuracy and loss, and cumulative training seconds (evaluation excluded), of one `fit`."""

    acc: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def final(self) -> float:
        """The last epoch's test accuracy (nan when `fit` did not evaluate)."""
        return self.acc[-1] if self.acc else float("nan")

    def to_target(self, target: float) -> tuple[int | None, float | None]:
        """(epochs, seconds) until the test accuracy first reached `target`; (None, None) if it never did."""
        for i, a in enumerate(self.acc):
            if a >= target:
                return i + 1, self.seconds[i]
        return None, None


def fit(model: nn.Module, split: Split | tuple[torch.Tensor, torch.Tensor], opt: torch.optim.Optimizer, epochs: int,
        bs: int = 64, *, seed: int = 0, policy: Any = None, on_step: Callable[[int], None] | None = None,
        scheduler: Any = None, drop_last: bool = False, progress: str | bool = False) -> FitHistory:
    """Minibatch training with cross-entropy: each epoch a fresh permutation from a CPU generator seeded by `seed`,
    batches of `bs` (the last one short unless `drop_last`). `policy` (precision.Policy) adds autocast and, for
    fp16, a GradScaler; `on_step(it)` runs before step `it` (e.g. to set one-cycle hyper-parameters);
    `scheduler.step()` after each optimizer step. With a Split, the test accuracy and loss after every epoch."""
    x, y = (split.x_train, split.y_train) if isinstance(split, Split) else split
    if epochs < 1 or bs < 1 or len(x) != len(y):
        raise ValueError(f"fit needs epochs >= 1, bs >= 1 and one label per row, got {epochs=}, {bs=}, "
                         f"{len(x)} rows and {len(y)} labels")
    scaler = policy.grad_scaler() if policy is not None else None
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hist, elapsed, it = FitHistory(), 0.0, 0
    model.train()
    for _ in _progress(range(epochs), progress, unit="epoch"):
        sync(x.device)
        t0 = time.perf_counter()
        for idx in torch.randperm(len(x), generator=gen).to(x.device).split(bs):
            if drop_last and len(idx) < bs:
                break
            if on_step is not None:
                on_step(it)
            minibatch_step(model, opt, x[idx], y[idx], policy, scaler)
            if scheduler is not None:
                scheduler.step()
            it += 1
        sync(x.device)
        elapsed += time.perf_counter() - t0
        hist.seconds.append(elapsed)
        if isinstance(split, Split):  # test accuracy and loss, under the policy's autocast
            model.eval()
            with torch.no_grad(), (policy.autocast() if policy is not None else nullcontext()):
                logits = model(split.x_test).float()
            model.train()
            hist.acc.append(accuracy(logits, split.y_test))
            hist.loss.append(F.cross_entropy(logits, split.y_test).item())
    return hist


def minibatch_step(model: nn.Module, opt: torch.optim.Optimizer, xb: torch.Tensor, yb: torch.Tensor, policy: Any,
                   scaler: Any) -> torch.Tensor:
    """One optimizer step; under a policy, the mixed-precision recipe of chapter 04 (autocast, scaled loss).
    Returns the loss."""
    with policy.autocast() if policy is not None else nullcontext():  # the policy's low-precision forward pass
        loss = F.cross_entropy(model(xb), yb)
    opt.zero_grad(set_to_none=True)
    if policy is None:
        loss.backward()
        opt.step()
        return loss
    scaler.scale(loss).backward()      # fp16: scale the loss so small gradients do not flush to zero
    scaler.step(opt)                   # unscale; skip the step if a gradient overflowed
    scaler.update()                    # grow or shrink the scale for the next step
    return loss
