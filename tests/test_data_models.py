"""data and models: MNIST-1D offline and cached, digits, udlbook's equal-parameter MLPs."""

import pytest
import torch

import accelhelpers as ah
from accelhelpers import models


@pytest.mark.slow
def test_mnist1d_shapes_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCEL_CACHE", str(tmp_path))
    d = ah.data.mnist1d()
    assert d.x_train.shape == (4000, 40) and d.x_test.shape == (1000, 40)
    assert d.y_train.dtype == torch.long and set(d.y_train.unique().tolist()) == set(range(10))
    assert (tmp_path / "mnist1d_seed42.npz").exists()
    again = ah.data.mnist1d()
    assert torch.equal(again.x_train, d.x_train)


@pytest.mark.slow
def test_corrupt_cache_is_regenerated(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCEL_CACHE", str(tmp_path))
    good = ah.data.mnist1d()
    (tmp_path / "mnist1d_seed42.npz").write_bytes(b"not an npz")
    assert torch.equal(ah.data.mnist1d().x_train, good.x_train)


def test_digits_split():
    d = ah.data.digits()
    assert d.x_train.shape[1] == 64 and len(d.x_train) + len(d.x_test) == 1797
    assert 0 <= float(d.x_train.min()) and float(d.x_train.max()) <= 1
    img = ah.data.digits(images=True)
    assert img.x_train.shape[1:] == (1, 8, 8)
    with pytest.raises(ValueError, match="test_size"):
        ah.data.digits(test_size=1.5)


def test_split_to_device_and_repr():
    d = ah.data.digits().to("cpu")
    assert d.device.type == "cpu" and "train=" in repr(d)


@pytest.mark.parametrize("depth,params", [(1, 15208), (2, 15210), (3, 15235), (4, 15319)])
def test_udl_parameter_counts(depth, params):
    assert ah.models.count_params(ah.models.udl_mlp(depth)) == params


def test_udl_init_is_he_uniform_zero_bias_and_seeded():
    m = ah.models.udl_mlp(4, seed=1)
    lin = [mod for mod in m if isinstance(mod, torch.nn.Linear)]
    assert all(torch.all(mod.bias == 0) for mod in lin)
    bound = (6 / 40) ** 0.5  # He-uniform: U(-sqrt(6/fan_in), +sqrt(6/fan_in))
    assert float(lin[0].weight.detach().abs().max()) <= bound
    assert float(lin[0].weight.detach().abs().max()) > 0.9 * bound
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), ah.models.udl_mlp(4, seed=1).parameters()))


def test_bad_depth_and_sizes():
    with pytest.raises(ValueError, match="depths \\[1, 2, 3, 4\\]"):
        ah.models.udl_mlp(5)
    with pytest.raises(ValueError, match="positive"):
        models.mlp([40, 0, 10])


def test_cnns_run():
    assert models.cnn1d()(torch.randn(3, 40)).shape == (3, 10)
    assert models.cnn2d()(torch.randn(3, 1, 8, 8)).shape == (3, 10)


def test_cnn1d_takes_batch_by_length_as_its_docstring_says():
    import torch

    from accelhelpers.models import cnn1d

    model = cnn1d(channels=4)
    assert tuple(model(torch.zeros(3, 40)).shape) == (3, 10)
    with pytest.raises(RuntimeError):  # a channel axis is not what it takes
        model(torch.zeros(3, 1, 40))


@pytest.mark.slow
def test_fastai_patches_add_the_learner_methods_the_chapters_call():
    from accelhelpers import data

    data.fastai_patches()
    from fastai.learner import Learner

    assert all(hasattr(Learner, m) for m in ("no_bar", "fit_one_cycle", "lr_find"))
