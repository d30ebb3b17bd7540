"""metrics: one accuracy, bytes, peak memory and comparisons, checked against torch references."""

import numpy as np
import pytest
import torch
from torch import nn

import accelhelpers as ah


def test_accuracy_takes_torch_and_numpy_and_refuses_mismatched_labels():
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [5.0, -1.0], [0.1, 0.2]])
    y = torch.tensor([0, 1, 1, 1])
    assert ah.metrics.accuracy(logits, y) == 0.75
    assert ah.metrics.accuracy(logits.numpy(), y.numpy()) == 0.75
    with pytest.raises(ValueError, match="predictions"):
        ah.metrics.accuracy(logits, y[:3])


def test_model_accuracy_restores_the_mode_and_needs_no_grad():
    model = nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5))
    x, y = torch.randn(64, 4), torch.randint(0, 3, (64,))
    model.train()
    acc = ah.metrics.model_accuracy(model, x, y)
    assert model.training
    with torch.no_grad():
        model.eval()
        assert acc == (model(x).argmax(1) == y).float().mean().item()


def test_error_percent_is_a_tensor_and_matches_accuracy():
    logits, y = torch.randn(100, 10), torch.randint(0, 10, (100,))
    err = ah.metrics.error_percent(logits, y)
    assert isinstance(err, torch.Tensor) and err.ndim == 0
    assert err.item() == pytest.approx(100 * (1 - ah.metrics.accuracy(logits, y)))


def test_param_and_activation_bytes():
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    assert ah.metrics.param_bytes(model) == 4 * (10 * 20 + 20 + 20 * 5 + 5)
    small = ah.metrics.activation_bytes(model, torch.randn(8, 10))
    big = ah.metrics.activation_bytes(model, torch.randn(64, 10))
    assert 0 < small < big and big / small == pytest.approx(8, rel=0.01)


def test_saved_bytes_skips_excluded_storages():
    w = torch.randn(100, 100, requires_grad=True)
    x = torch.randn(100, 100, requires_grad=True)
    both = ah.metrics.saved_bytes(lambda: (x @ w).sum())
    assert both == 2 * 100 * 100 * 4
    assert ah.metrics.saved_bytes(lambda: (x @ w).sum(), exclude=[w]) == 100 * 100 * 4


def test_peak_memory_is_none_off_cuda():
    assert ah.metrics.peak_memory(lambda: torch.ones(10), "cpu") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's peak needs a CUDA device")
def test_peak_memory_is_the_cuda_peak_of_the_call_alone():
    """A 4 MiB temporary, freed before the call returns, counts; what was allocated before the call (8 MiB held) and
    an earlier, higher peak (16 MiB, freed) do not. Mutations this catches: not subtracting what was allocated
    before, not resetting the peak first, or reading `memory_allocated` (after the free) instead of the peak."""
    dev = torch.device("cuda")
    _held = torch.empty(2 * 2**20, device=dev)               # 8 MiB of float32, held through the call
    torch.empty(4 * 2**20, device=dev)                       # an earlier peak: 16 MiB more, freed at once
    peak = ah.metrics.peak_memory(lambda: torch.empty(2**20, device=dev).fill_(1.0), dev)
    assert peak == 4 * 2**20
    assert peak == torch.cuda.max_memory_allocated(dev) - torch.cuda.memory_allocated(dev)


def test_differences_between_models_state_dicts_and_tensor_lists():
    a, b = nn.Linear(3, 2), nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert ah.metrics.max_abs_diff(a, b) == 0.0
    with torch.no_grad():
        b.bias[0] += 0.5
    assert ah.metrics.max_abs_diff(a, b) == pytest.approx(0.5)
    ddp_style = {f"module.{k}": v for k, v in b.state_dict().items()}
    assert ah.metrics.max_abs_diff(a.state_dict(), ddp_style) == pytest.approx(0.5)
    ref = [torch.tensor([3.0, 4.0])]
    assert ah.metrics.rel_diff([torch.tensor([3.0, 4.5])], ref) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="do not match"):
        ah.metrics.max_abs_diff([torch.ones(2)], [torch.ones(3)])
    with pytest.raises(ValueError, match="differ in parameters"):
        ah.metrics.max_abs_diff(a, nn.Linear(3, 3, bias=False))


def test_agreement():
    a = np.array([[1.0, 0.0], [0.0, 1.0]])
    b = np.array([[0.9, 0.0], [1.0, 0.5]])
    assert ah.metrics.agreement(a, b) == {"max_abs_diff": 1.0, "argmax_agreement": 0.5}
    with pytest.raises(ValueError, match="shapes"):
        ah.metrics.agreement(a, b[:1])
