"""Models: udlbook's equal-parameter MLPs for MNIST-1D and small CNNs."""

from __future__ import annotations

import numbers

import torch
from torch import nn

# udlbook 20.2: hidden widths chosen so that every depth has about 15 200 parameters.
UDL_HIDDEN: dict[int, int] = {1: 298, 2: 100, 3: 75, 4: 63}


def he_init(module: nn.Module) -> None:
    """He-uniform weights and zero biases for every Linear/Conv layer (what udlbook's notebooks use)."""
    if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)):
        nn.init.kaiming_uniform_(module.weight, nonlinearity="relu")
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def mlp(sizes: list[int]) -> nn.Sequential:
    """A ReLU MLP with the given layer sizes (input, hidden..., output), He-initialised."""
    if len(sizes) < 2 or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s <= 0 for s in sizes):
        raise ValueError(f"mlp needs at least two positive layer sizes, got {sizes} (each an int)")
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).apply(he_init)


def udl_sizes(depth: int, n_in: int = 40, n_out: int = 10) -> list[int]:
    """Layer sizes of udlbook's MLP with `depth` hidden layers (1 to 4)."""
    if depth not in UDL_HIDDEN:
        raise ValueError(f"udlbook's experiment has depths {sorted(UDL_HIDDEN)}, not {depth!r}")
    return [n_in] + [UDL_HIDDEN[depth]] * depth + [n_out]


def udl_mlp(depth: int, n_in: int = 40, n_out: int = 10, seed: int | None = None) -> nn.Sequential:
    """udlbook's equal-parameter MLP with `depth` hidden layers; `seed` makes the init reproducible."""
    sizes = udl_sizes(depth, n_in, n_out)
    if seed is None:
        return mlp(sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return mlp(sizes)


def _check_positive(**sizes: int) -> None:
    """Refuse non-positive or non-integer layer sizes, naming the argument."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def count_params(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def cnn1d(n_classes: int = 10, channels: int = 32, length: int = 40) -> nn.Sequential:
    """A small 1-D CNN for MNIST-1D; input [batch, length] (its first layer adds the channel axis)."""
    _check_positive(n_classes=n_classes, channels=channels, length=length)
    return nn.Sequential(
        nn.Unflatten(1, (1, length)),
        nn.Conv1d(1, channels, 5, padding=2), nn.ReLU(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv1d(channels, channels, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(channels * ((length + 3) // 4), n_classes),
    ).apply(he_init)


def cnn2d(n_classes: int = 10, channels: int = 16) -> nn.Sequential:
    """A small 2-D CNN for 8x8 `digits` images (input [batch, 1, 8, 8])."""
    _check_positive(n_classes=n_classes, channels=channels)
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * channels, n_classes),
    ).apply(he_init)
